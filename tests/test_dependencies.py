"""The parts are coupled only through protocol/ and config (STYLE.md §2): checked statically."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "horizonrl"

# part -> horizonrl modules it must never import
FORBIDDEN = {
    "protocol": {"actors", "learner", "buffer", "envs", "coordinator", "launcher", "torch", "vllm"},
    "learner": {"actors", "buffer", "envs", "coordinator", "launcher"},
    "buffer": {"actors", "learner", "envs", "coordinator", "launcher"},
    "actors": {"learner", "buffer", "coordinator", "launcher"},  # actors play episodes over envs/
    "envs": {"actors", "learner", "buffer", "coordinator", "launcher"},
}
BOTTOM = {"config.py", "schedule.py", "runtime.py"}


def imported_names(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def top_parts(names: set[str]) -> set[str]:
    parts = set()
    for name in names:
        bits = name.split(".")
        if bits[0] == "horizonrl" and len(bits) > 1:
            parts.add(bits[1])
        elif bits[0] in ("torch", "vllm"):
            parts.add(bits[0])
    return parts


def test_parts_do_not_import_each_other():
    violations = []
    for part, forbidden in FORBIDDEN.items():
        for path in (PKG / part).rglob("*.py"):
            bad = top_parts(imported_names(path)) & forbidden
            if bad:
                violations.append(f"{path.relative_to(PKG)} imports {sorted(bad)}")
    assert not violations, violations


def test_bottom_layer_imports_no_part_and_no_torch():
    for name in BOTTOM:
        parts = top_parts(imported_names(PKG / name))
        assert not parts & {"actors", "learner", "buffer", "envs", "coordinator", "launcher", "torch", "vllm"}, name
