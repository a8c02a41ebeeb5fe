"""The package's layers, checked statically, no exceptions.

Three layers in ``horizonrl/``:
- the bottom layer (``core/``, ``protocol/``): the config, the messages and every other contract between
  processes; it imports only itself, and neither torch nor vllm;
- the parts (actors, learner, buffer, envs, coordinator, launcher): each imports the bottom layer and
  itself, never another part and never a program;
- the programs (``apps/``: the command line, the demo, the benchmarks, chaos, the tiny-model builder, the
  viewer, ...): they wire parts together, so they may import any part and the bottom layer.
Every top-level module must be one of these, so a new module cannot slip past the rule.

An import the checker can read; a module named in a string (``"horizonrl.learner.offline"`` handed to
``python -m``, a ``"module:factory"`` table) it could not. So no string in the package names one of its
modules, but in the registry of programs (``core/programs.py``), whose every name must exist.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "horizonrl"

BOTTOM = {"core", "protocol"}
PARTS = {"actors", "learner", "buffer", "envs", "coordinator", "launcher"}
PROGRAMS = {"apps", "__main__", "__init__"}
HEAVY = {"torch", "vllm"}
REGISTRY_OF_PROGRAMS = Path("core/programs.py")
_DOTTED = re.compile(r"\bhorizonrl(?:\.\w+)+")


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
    """Every module and folder of Python files at the top of the package (a folder without ``__init__.py`` too:
    it is importable as a namespace package, and must not escape the rule)."""
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__" and any(p.rglob("*.py"))}
    return {p.stem for p in PKG.glob("*.py")} | folders


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


def module_of(dotted: str) -> Path | None:
    """The file of the longest prefix of ``horizonrl.a.b.Name`` that is a module of the package, if any."""
    bits = dotted.split(".")[1:]
    for end in range(len(bits), 0, -1):
        path = PKG.joinpath(*bits[:end])
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _skipped_strings(tree: ast.AST) -> set[int]:
    """Docstrings (prose about modules, not a use of one) and logger names (they follow the modules' names)."""
    skipped = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            skipped.add(id(body[0].value))
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "getLogger":
            skipped |= {id(a) for a in node.args}
    return skipped


def module_strings(path: Path) -> list[str]:
    """Every string in the file that names a module of the package: a dotted name of one (with or without a
    ``:attribute`` or ``.Class``), or the ``-m`` argument of a command line."""
    tree = ast.parse(path.read_text())
    skipped = _skipped_strings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            found += [name for name in _DOTTED.findall(node.value) if module_of(name) is not None]
        if isinstance(node, (ast.List, ast.Tuple)):
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            found += [f"-m {after}" for before, after in zip(values, values[1:])
                      if before == "-m" and after == "horizonrl"]  # dotted ones are found above
    return found


def string_violations() -> list[str]:
    found = []
    for path in sorted(PKG.rglob("*.py")):
        if path.relative_to(PKG) != REGISTRY_OF_PROGRAMS:
            found += [f"{path.relative_to(PKG)} names {name!r}" for name in module_strings(path)]
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


def test_programs_import_parts_and_the_bottom_layer():
    found = [v for program in PROGRAMS for v in violations(program, BOTTOM | PARTS | PROGRAMS | HEAVY)]
    assert not found, found


def test_no_module_is_named_by_a_string_outside_the_registry_of_programs():
    found = string_violations()
    assert not found, found


def test_every_name_in_the_registry_of_programs_exists():
    """The registry's names are read by ``python -m`` and by vLLM, never by an import: a renamed module would
    fail only when a run starts it. Each must be a module of the package, or a class that its module defines."""
    registry = PKG / REGISTRY_OF_PROGRAMS
    names = [node.value for node in ast.walk(ast.parse(registry.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("horizonrl")]
    assert names, "the registry names no module"
    for name in names:
        module = module_of(name) if "." in name else PKG / "__main__.py"
        assert module is not None and module.is_file(), name
        rest = name.removeprefix("horizonrl.").split(".")
        defined = rest[-1] if module.stem != rest[-1] and module.parent.name != rest[-1] else None
        if defined is not None:
            tree = ast.parse(module.read_text())
            assert defined in {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}, name


@pytest.mark.parametrize("line", ["def f():\n    from horizonrl.learner.model import load_model\n",
                                  "from horizonrl import learner\n", "from ..learner.model import load_model\n",
                                  "from .. import learner\n", "import horizonrl.learner\n",
                                  "from horizonrl.apps.cli import main\n"])
def test_the_check_sees_a_violation(tmp_path, monkeypatch, line):
    """The checker itself can fail: a part importing another part or a program, in any import form, is
    reported."""
    fake = tmp_path / "horizonrl"
    (fake / "buffer").mkdir(parents=True)
    (fake / "buffer" / "__init__.py").write_text("")
    (fake / "buffer" / "server.py").write_text(line)
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    bad = "apps" if "apps" in line else "learner"
    assert violations("buffer", BOTTOM | {"buffer"}) == [f"buffer/server.py imports ['{bad}']"]
    (fake / "buffer" / "server.py").write_text("from . import groups\nfrom horizonrl.protocol import encode\n")
    assert violations("buffer", BOTTOM | {"buffer"}) == []


@pytest.mark.parametrize("line, named", [
    ('FACTORY = "horizonrl.learner.model:load_model"\n', "horizonrl.learner.model"),
    ('import sys\nARGS = [sys.executable, "-m", "horizonrl.learner", "x"]\n', "horizonrl.learner"),
    ('ARGS = ["python", "-m", "horizonrl", "train"]\n', "-m horizonrl"),
    ('def f():\n    return {"x": "see horizonrl.buffer.server.Server"}\n', "horizonrl.buffer.server.Server"),
])
def test_the_check_sees_a_module_named_by_a_string(tmp_path, monkeypatch, line, named):
    """The string check can fail too; a docstring, a logger's name and a name that is no module pass."""
    fake = tmp_path / "horizonrl"
    for module in ("learner", "buffer", "core"):
        (fake / module).mkdir(parents=True)
        (fake / module / "__init__.py").write_text("")
    (fake / "learner" / "model.py").write_text("")
    (fake / "buffer" / "server.py").write_text('"""Started as ``python -m horizonrl.buffer.server``."""\n'
                                               'import logging\nlog = logging.getLogger("horizonrl.buffer.server")\n'
                                               'NOT_A_MODULE = "horizonrl.nothing_here"\n')
    (fake / "core" / "programs.py").write_text('ENTRY = "horizonrl.learner.model"\n')
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    assert string_violations() == []
    (fake / "buffer" / "server.py").write_text(line)
    found = string_violations()
    assert found == [f"buffer/server.py names {named!r}"], found
