"""The environments' data commands (``apps/env_data.py``), run through ``horizonrl``'s command line in-process:
each writes what its domain module builds."""

from __future__ import annotations

import json

import horizonrl.envs.webarena.data.generate as webarena_data
from horizonrl.apps.cli import main
from horizonrl.envs.synthetic_corpus import generate


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_make_corpus_writes_the_corpus_the_environment_generates(tmp_path):
    assert main(["make-corpus", str(tmp_path), "--people", "60", "--seed", "3"]) == 0
    data = generate(seed=3, num_people=60)
    for name in ("corpus", "train", "test"):
        assert read_jsonl(tmp_path / f"{name}.jsonl") == json.loads(json.dumps(data[name]))
    assert main(["make-corpus", str(tmp_path / "bad"), "--people", "0"]) == 2


def test_make_webarena_tasks_writes_the_files_the_package_ships(tmp_path, monkeypatch):
    shipped = webarena_data.HERE
    monkeypatch.setattr(webarena_data, "HERE", tmp_path)
    assert main(["make-webarena-tasks"]) == 0
    for name in ("local_tasks.json", "local_expert.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((shipped / name).read_text())
