"""``streamrl bench report``: every study's results as one Markdown page with its plots.

Reads ``benchmarks/results/NAME.json`` (the tables each study printed are saved in it) and
``NAME.png``, copies both next to the page (where a study's later seeds find its runs), and writes
``docs/benchmarks.md``. A study with no
results file keeps its section from the page as it was (each section states the date it ran), so the
studies can be rerun one at a time. The page opens with the headline table (``benchmarks/headlines.py``): the
figures asked for first, each beside a baseline from the same invocation. ``--out docs/benchmarks`` rebuilds the
page from the published results alone.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

from benchmarks import headlines
from benchmarks.common import console

TITLES = {"queue": "Replay stream", "partition": "Micro-batch partitioning", "generate": "Generation",
          "learner": "Learner", "weight_push": "Weight push", "e2e": "End to end: async vs sync",
          "e2e_smollm2": "End to end on SmolLM2-135M: async vs sync",
          "ablation": "Ablations on the agentic workload",
          "counterfactual": "Off-policy corrections on one recorded run's data", "trl": "Against TRL", "simulate": "Simulated fleets",
          "soak": "Soak: memory over a long run", "agent": "Agents through the gateway",
          "nodes": "One node or two on Ray", "lora": "LoRA against full fine-tuning",
          "trl_async": "Against TRL's AsyncGRPOTrainer", "trl_async_lora": "Against TRL's AsyncGRPOTrainer, LoRA",
          "trl_tune": "TRL's AsyncGRPOTrainer: its settings here", "engines": "The real-model recipe on each engine",
          "stress": "Stale data on purpose: the auto staleness bound under stress",
          "coverage": "Who the bound trains: a long-tail workload",
          "cores": "Where the cores go: the learner's threads on shared cores",
          "weight_push_verification": "Weight push: what verifying it costs",
          "weight_push_fleet": "Weight push: how much of the fleet pauses"}
MODULES = {"queue": "replay_stream", "trl": "against_trl", "e2e_smollm2": "e2e"}  # a study's module, where not its own name
COMMANDS = {"e2e_smollm2": "e2e --real-model", "trl_async": "trl --trl-trainer async", "trl_async_lora": "trl --trl-trainer async --lora",
            "weight_push_verification": "weight-push --study verification", "weight_push_fleet": "weight-push --study fleet"}


def about(name: str) -> str:
    """What a study measures and how: its module's docstring, in Markdown, without the usage line."""
    if name == "trl_async_lora":  # the async study's text, with what changes for an adapter
        return (about("trl_async") + "\nHere both sides train `configs/smollm2-lora.yaml`'s adapter (rank 16, every "
                "linear layer, its learning rate): streamrl pushes it into its vLLM server's LoRA slots, TRL loads "
                "each version through vLLM's LoRA routes (`trl-policy-vN`).\n")
    if name == "e2e_smollm2":  # the toy study's method (its section above), on the real model's workloads
        real = next(p for p in about("e2e").split("\n\n") if p.startswith("With `--real-model`"))
        return "The end-to-end study of the section above. " + real + "\n"
    if name.startswith("weight_push_"):  # a study of the weight-push module: its paragraph of the docstring
        study = name.removeprefix("weight_push_")
        return next(p for p in about("weight_push").split("\n\n") if f"`--study {study}`" in p).strip() + "\n"
    path = Path(__file__).parent / f"{MODULES.get(name, name)}.py"
    text = ast.get_docstring(ast.parse(path.read_text())) or ""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("python -m benchmarks")]
    return "\n".join(lines).strip().replace("``", "`") + "\n"


def markdown_table(table: dict) -> str:
    head = "| " + " | ".join(table["columns"]) + " |\n|" + "---|" * len(table["columns"]) + "\n"
    return f"*{table['title']}*\n\n" + head + "".join("| " + " | ".join(row) + " |\n" for row in table["rows"])


def heading(name: str) -> str:
    return f"## {TITLES[name]} (`streamrl bench {COMMANDS.get(name, name.replace('_', '-'))}`)"


def previous(page: Path) -> dict[str, str]:
    """The page as it was: each study's section by name."""
    text = page.read_text() if page.is_file() else ""
    chunks = ["## " + c for c in text.split("\n## ")[1:]]
    return {name: c.rstrip("\n") + "\n" for name in TITLES for c in chunks if c.startswith(heading(name) + "\n")}


def studies(results: Path, plots: Path, kept: dict[str, str]) -> dict[str, dict]:
    """Each study's results for the headline table: its new results, else its published copy beside the page,
    else the tables of its section as the page has it."""
    found = {}
    for name in TITLES:
        for path in (results / f"{name}.json", plots / f"{name}.json"):
            if path.is_file():
                found[name] = json.loads(path.read_text())
                break
        else:
            if name in kept:
                found[name] = headlines.from_section(kept[name])
    return found


def copy(source: Path, target: Path) -> None:
    """``shutil.copy``, but nothing to do where the results are the published copies (``--out docs/benchmarks``)."""
    if source.resolve() != target.resolve():
        shutil.copy(source, target)


def build(results: Path, page: Path) -> Path:
    rerun = [name for name in TITLES if (results / f"{name}.json").is_file()]
    if not rerun:
        raise FileNotFoundError(f"no study results in {results}: run `streamrl bench NAME` first")
    kept = previous(page)
    plots = page.parent / "benchmarks"
    plots.mkdir(parents=True, exist_ok=True)
    machine = json.loads((results / f"{rerun[0]}.json").read_text())["machine"]
    parts = ["# Benchmarks\n",
             f"Measured on {machine['platform']}, {machine['cpu_count']} CPU cores, torch {machine['torch']} "
             f"({'CUDA' if machine['cuda'] else 'no GPU'}). Every figure stands beside a baseline measured in the "
             "same run on the same machine; figures are medians of the repeats each table names. "
             "Regenerate with `streamrl bench NAME` for each study, then `streamrl bench report`. Each study's "
             "runs, figure by figure, are in `docs/benchmarks/NAME.json`, beside its plot.\n"]
    if table := headlines.markdown(studies(results, plots, kept)):
        parts.append(table)
    for name in TITLES:
        if name not in rerun:
            if name in kept:
                parts.append(kept[name])
            continue
        data = json.loads((results / f"{name}.json").read_text())
        copy(results / f"{name}.json", plots / f"{name}.json")  # the runs themselves, for later seeds to join
        parts.append(heading(name) + "\n")
        m = data["machine"]
        parts.append(f"Run {m['time']} on {m['cpu_count']} CPU cores" + (f" ({m['cpu']})" if "cpu" in m else "")
                     + (" (quick setting: fewer repeats and sizes)" if data.get("quick") else "") + ".\n")
        parts.append(about(name))
        parts.extend(markdown_table(t) for t in data.get("tables", []))
        for png in sorted(results.glob(f"{name}*.png")):  # the study's plot, then any extra ones (NAME_x.png)
            if png.stem != name and (not png.stem.startswith(name + "_") or png.stem in TITLES):
                continue
            copy(png, plots / png.name)
            parts.append(f"![{TITLES[name]}](benchmarks/{png.name})\n")
    page.write_text("\n".join(parts))
    console.print(f"wrote {page} ({len(rerun)} studies from {results}, {len(kept.keys() - set(rerun))} kept from the page)")
    return page


def main(quick: bool = False, out: Path = Path("benchmarks/results")) -> Path:
    return build(out, Path("docs/benchmarks.md"))


if __name__ == "__main__":
    from benchmarks.common import cli

    cli(main, __doc__)
