"""The parts are coupled only through the bottom layer: checked statically, no exceptions.

Three kinds of top-level module in ``horizonrl/``:
- the bottom layer (``core/``, ``protocol/``): imports only itself, and neither torch nor vllm;
- the parts (actors, learner, buffer, envs, coordinator, launcher): each imports the bottom layer and
  itself, never another part;
- the programs (the command line, the demo, the benchmarks, chaos, the tiny-model builder): they wire
  parts together, so they may import anything.
Every top-level module must be one of these, so a new module cannot slip past the rule.
"""

import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "horizonrl"

BOTTOM = {"core", "protocol"}
PARTS = {"actors", "learner", "buffer", "envs", "coordinator", "launcher"}
PROGRAMS = {"cli", "demo", "bench", "chaos", "chaos_faults", "hostile", "tiny_model", "model_import", "warmup_data",
            "viewer", "import_agentgym_rl", "report", "__main__", "__init__"}
HEAVY = {"torch", "vllm"}


def imported_names(path: Path) -> set[str]:
    """Every module name imported anywhere in the file (inside functions too). ``from X import y``
    counts as X and X.y (y may be a module); relative imports are resolved against the file's package."""
    package = ["horizonrl", *path.parent.relative_to(PKG).parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}
    return names


def top_module(name: str) -> str | None:
    """``horizonrl.learner.model`` -> ``learner``; ``torch.nn`` -> ``torch``; other packages -> None."""
    bits = name.split(".")
    if bits[0] == "horizonrl" and len(bits) > 1:
        return bits[1]
    return bits[0] if bits[0] in HEAVY else None


def top_level_modules() -> set[str]:
    return {p.stem for p in PKG.glob("*.py")} | {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}


def files_of(module: str) -> list[Path]:
    path = PKG / module
    return sorted(path.rglob("*.py")) if path.is_dir() else [PKG / f"{module}.py"]


def violations(module: str, allowed: set[str]) -> list[str]:
    found = []
    for path in files_of(module):
        bad = {top_module(n) for n in imported_names(path)} - {None} - allowed
        if bad:
            found.append(f"{path.relative_to(PKG)} imports {sorted(bad)}")
    return found


def test_every_top_level_module_has_a_layer():
    assert top_level_modules() - BOTTOM - PARTS - PROGRAMS == set()
    assert not BOTTOM & PARTS and not PARTS & PROGRAMS and not BOTTOM & PROGRAMS


def test_bottom_layer_imports_only_itself_and_neither_torch_nor_vllm():
    found = [v for module in BOTTOM for v in violations(module, BOTTOM)]
    assert not found, found


def test_parts_import_only_the_bottom_layer_and_themselves():
    found = [v for part in PARTS for v in violations(part, BOTTOM | {part} | HEAVY)]
    assert not found, found


@pytest.mark.parametrize("line", ["def f():\n    from horizonrl.learner.model import load_model\n",
                                  "from horizonrl import learner\n", "from ..learner.model import load_model\n",
                                  "from .. import learner\n", "import horizonrl.learner\n"])
def test_the_check_sees_a_violation(tmp_path, monkeypatch, line):
    """The checker itself can fail: a part importing another part, in any import form, is reported."""
    fake = tmp_path / "horizonrl"
    (fake / "buffer").mkdir(parents=True)
    (fake / "buffer" / "__init__.py").write_text("")
    (fake / "buffer" / "server.py").write_text(line)
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert violations("buffer", BOTTOM | {"buffer"}) == ["buffer/server.py imports ['learner']"]
    (fake / "buffer" / "server.py").write_text("from . import groups\nfrom horizonrl.protocol import encode\n")
    assert violations("buffer", BOTTOM | {"buffer"}) == []
