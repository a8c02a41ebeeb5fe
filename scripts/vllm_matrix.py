"""Which vLLM releases have everything of vLLM's this code uses: a compatibility matrix.

For each release (by default the newest patch of every minor version in ``SUPPORTED_VLLM``, from
``pip index versions vllm``), download the GPU wheel without its dependencies, unpack its Python sources, read
every entry of ``horizonrl/actors/engine_api.py``'s ``ENGINE_API`` from them (``actors/vllm_source.py``: read
with ``ast``, nothing imported, so a CUDA wheel reads on a CPU machine), then delete the wheel and the sources
before the next one (each wheel is 300-500 MB). Prints the matrix as Markdown (docs/gpu.md holds its output)
and, with ``--json``, writes the same facts as data.

    python scripts/vllm_matrix.py                      # every minor release in the declared range
    python scripts/vllm_matrix.py --versions 0.16.0 0.33.0 --json matrix.json
    python scripts/vllm_matrix.py --source /path/to/site-packages --label installed   # a tree already here
    python scripts/vllm_matrix.py --from-json matrix.json    # the table again from an earlier --json

Cells: ✓ the entry holds, ✗ it does not (the problems are listed under the table), · not applicable (a model
runner that release does not have). Needed entries stop an engine at start; optional ones are handled in
``actors/engine.py`` / ``actors/vllm_worker.py``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from horizonrl.actors.engine_api import (ENGINE_API, RUNNER_MODULES, SUPPORTED_VLLM,  # noqa: E402
                                         inspect_tree, vllm_version)
from horizonrl.actors.vllm_source import SourceTree, string_constant_after  # noqa: E402

PIP_TIMEOUT_S = 900


def released_minors(spec: str) -> list[str]:
    """The newest release of each minor version that ``spec`` allows, oldest first (one registry query)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "vllm"], capture_output=True, text=True,
                         timeout=PIP_TIMEOUT_S, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("Available versions:"))
    released = [Version(v.strip()) for v in line.split(":", 1)[1].split(",")]
    allowed = [v for v in released if v in SpecifierSet(spec) and not v.is_prerelease]
    newest: dict[tuple[int, int], Version] = {}
    for version in allowed:
        key = (version.major, version.minor)
        newest[key] = max(newest.get(key, version), version)
    return [str(newest[key]) for key in sorted(newest)]


def unpacked_release(version: str, workdir: Path) -> Path:
    """Download vLLM ``version``'s wheel (no dependencies) and unpack its ``.py`` files; returns the root."""
    wheels = workdir / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                    f"vllm=={version}", "-d", str(wheels)], check=True, timeout=PIP_TIMEOUT_S)
    wheel = next(wheels.glob(f"vllm-{version}-*.whl"))
    root = workdir / "src"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(root, [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    wheel.unlink()  # 300-500 MB each: only the sources stay, until this release is read
    return root


def read_release(root: Path, label: str | None = None) -> dict:
    """One column of the matrix: each entry's problem (None: holds; absent key: not applicable) and the facts
    that decide which model runner a worker gets."""
    tree = SourceTree(root)
    return {
        "version": label or vllm_version(tree),
        "problems": inspect_tree(tree),
        "runners": [r for r, module in RUNNER_MODULES.items() if tree.has_module(module)],
        "v2_runner_env_default": string_constant_after(tree, "vllm.envs", "VLLM_USE_V2_MODEL_RUNNER"),
        "v2_runner_decided_by_config": tree.class_info("vllm.config.vllm", "VllmConfig") is not None
        and "use_v2_model_runner" in tree.class_info("vllm.config.vllm", "VllmConfig").methods,
    }


def markdown(columns: list[dict]) -> str:
    versions = [c["version"] for c in columns]
    lines = ["| entry | needed | " + " | ".join(versions) + " |", "|---|---|" + "---|" * len(versions)]
    for entry in ENGINE_API:
        cells = []
        for column in columns:
            if entry.key not in column["problems"]:
                cells.append("·")
            else:
                cells.append("✓" if column["problems"][entry.key] is None else "✗")
        scope = "yes" if entry.needed else "optional"
        lines.append(f"| {_label(entry)} | {scope} | " + " | ".join(cells) + " |")
    lines.append("| V2 model runner: `VLLM_USE_V2_MODEL_RUNNER` default | | "
                 + " | ".join(_runner_default(c) for c in columns) + " |")
    footnotes = [f"{mark} `{e.owner}`: {', '.join(e.parameters)}."
                 for mark, e in zip(SUPERSCRIPTS, [e for e in ENGINE_API if _long(e)])]
    return "\n".join(lines + [""] + footnotes + [""] + _problem_notes(columns))


SUPERSCRIPTS = "¹²³⁴⁵⁶⁷⁸⁹"


def _long(entry) -> bool:
    return entry.kind == "call" and len(entry.parameters) > 4


def _label(entry) -> str:
    """The entry's name, a long parameter list shortened (it is spelled out under the table)."""
    name = entry.name if entry.owner else f"{entry.module}.{entry.name}"  # a module's own function: say whose
    if _long(entry):
        mark = SUPERSCRIPTS[[e for e in ENGINE_API if _long(e)].index(entry)]
        name = f"{entry.owner}({len(entry.parameters)} fields{mark})"
    return f"`{name}`" + (f" ({entry.runner.upper()} runner)" if entry.runner else "") + (
        " (vLLM-CPU)" if entry.platform else "")


def _runner_default(column: dict) -> str:
    if "v2" not in column["runners"]:
        return "no V2"
    if "v1" not in column["runners"]:
        return "V2 only"
    if column["v2_runner_decided_by_config"]:
        return "config"
    return f"{column['v2_runner_env_default']!s}"


def _problem_notes(columns: list[dict]) -> list[str]:
    """Each entry that fails somewhere: in which releases, and the first release's reason."""
    notes = []
    for entry in ENGINE_API:
        failing = [c for c in columns if c["problems"].get(entry.key)]
        if failing:
            notes.append(f"- `{entry.name}` fails in {', '.join(c['version'] for c in failing)}: "
                         f"{failing[0]['problems'][entry.key]}")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="*", help="releases to read (default: each minor in the range)")
    parser.add_argument("--source", type=Path, help="read the tree under this directory instead of downloading")
    parser.add_argument("--label", help="the column's name for --source (default: its vllm/_version.py)")
    parser.add_argument("--json", type=Path, help="also write the columns as JSON here")
    parser.add_argument("--from-json", type=Path, help="print the table of an earlier --json (nothing downloaded)")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        columns = json.loads(args.from_json.read_text())
    elif args.source is not None:
        columns = [read_release(args.source, args.label)]
    else:
        columns = []
        for version in args.versions or released_minors(SUPPORTED_VLLM):
            workdir = Path(tempfile.mkdtemp(prefix=f"vllm-{version}-"))
            try:
                columns.append(read_release(unpacked_release(version, workdir), version))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            print(f"read vLLM {version}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps(columns, indent=1))
    print(markdown(columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
