"""The configuration and command-line references are generated from the code, complete, and committed as generated."""

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from streamrl.config import Config
from streamrl.config.reference import _default, _section_of, markdown
from streamrl.config.rules import RULES

REFERENCE = Path(__file__).parent.parent / "docs" / "reference"
COMMITTED = REFERENCE / "config.md"


def sections(defaults: BaseModel, path: str = ""):
    """(dotted name, the section as the default config holds it) for every section below ``defaults``; an
    optional section unset by default (``learner.lora``) as its class makes it."""
    for key, field in type(defaults).model_fields.items():
        value = getattr(defaults, key)
        if value is None and (section := _section_of(field.annotation)) is not None:
            value = section()
        if isinstance(value, BaseModel):
            yield f"{path}{key}", value
            yield from sections(value, f"{path}{key}.")


def test_the_committed_reference_is_what_the_code_generates():
    assert COMMITTED.read_text() == markdown(), "regenerate: make docs"


def test_the_committed_cli_reference_is_what_typer_generates(tmp_path):
    out = tmp_path / "cli.md"
    subprocess.run([sys.executable, "-m", "typer", "streamrl.cli", "utils", "docs", "--name", "streamrl",
                    "--title", "Command-line reference", "--output", str(out)], check=True, capture_output=True)
    assert (REFERENCE / "cli.md").read_text() == out.read_text(), "regenerate: make docs"


def test_the_command_prints_the_reference_and_refuses_a_config():
    run = [sys.executable, "-m", "streamrl", "config", "--markdown"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == markdown()
    refused = subprocess.run([*run, "configs/quickstart.yaml"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no config" in refused.stderr


def test_every_setting_section_and_rule_is_explained():
    undocumented = [f"{name}.{key}" for name, section in sections(Config())
                    for key, f in type(section).model_fields.items()
                    if not f.description and not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))]
    undocumented += [f"{key}" for key, f in Config.model_fields.items() if not f.description
                     and not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))]
    assert not undocumented
    assert all(section.__doc__ and section.__doc__ != BaseModel.__doc__ for _, section in sections(Config()))
    assert RULES and all(rule.__doc__ for rule in RULES)  # each rule's line on the page


def test_every_setting_appears_with_its_default():
    page = markdown()
    for name, defaults in [("", Config()), *sections(Config())]:
        table = page.split(f"## `{name}`\n" if name else "## Top level\n")[1].split("\n## ")[0]
        for key, field in type(defaults).model_fields.items():
            if _section_of(field.annotation) is None and not isinstance(value := getattr(defaults, key), BaseModel):
                row = next(line for line in table.splitlines() if line.startswith(f"| `{key}` |"))
                assert f"| {_default(value)} |" in row, row
    assert '| `tis_cap` | number, > 0 | `2.0` |' in page  # type, bound and default as pydantic has them
    assert '| `max_staleness` | integer (≥ 0) \\| `"auto"` | `2` |' in page  # a bound inside a union
    assert page.split("## `ray.router`")[1].split("\n## ")[0].count("| `cpus` | number, ≥ 0 | `0.1` |") == 1  # as ray makes it
    assert '| `engine` | `"hf"` \\| `"vllm"` \\| `"sglang"` | `"hf"` |' in page
