"""The layout's walls: the rollout side, the serving side and the learner never import each other, and the
product never imports its tooling (docs/architecture.md, "The folders are the data path")."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "streamrl"
SIDES = ("streamrl.rollout", "streamrl.inference", "streamrl.learner")


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def _side(module: str) -> str | None:
    return next((side for side in SIDES if module == side or module.startswith(side + ".")), None)


@pytest.mark.parametrize("side", SIDES)
def test_a_side_imports_no_other_side(side):
    folder = PACKAGE / side.removeprefix("streamrl.")
    crossings = [f"{path.relative_to(PACKAGE.parent)} imports {name}"
                 for path in sorted(folder.rglob("*.py")) for name in _imports(path)
                 if _side(name) not in (None, side)]
    assert folder.is_dir() and not crossings


def test_the_product_imports_no_tooling():
    for path in sorted(PACKAGE.rglob("*.py")):
        assert not [n for n in _imports(path) if n.split(".")[0] in ("benchmarks", "tests")], path
    loaded = subprocess.run([sys.executable, "-c", "import sys, streamrl.cli; print(*sys.modules, sep='\\n')"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert "streamrl.cli" in loaded and not [m for m in loaded if m.split(".")[0] in ("benchmarks", "tests")]
