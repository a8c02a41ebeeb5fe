"""pass@k against brute force, and the evaluation summary / table / ids file (no engine)."""

import itertools
import json
from types import SimpleNamespace

import pytest

from horizonrl.actors.evaluate import format_table, pass_at_k, summarise
from horizonrl.apps.cli import _read_ids


def brute_force_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The fraction of all k-subsets of the n samples that contain at least one success."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_brute_force(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)


def test_pass_at_1_is_the_success_fraction_and_bad_arguments_raise():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def _ep(success, score=0.0, turns=3, invalid=0, stop="done", windows=0):
    return SimpleNamespace(success=success, score=score, reward=float(success), num_turns=turns, env_turns=turns,
                           invalid_actions=invalid, stop_reason=stop, hidden_turns_at=dict.fromkeys(range(windows), 1))


def test_summary_and_table():
    played = [(1, _ep(True, 100, 2, windows=3)), (1, _ep(False, 20, 4, invalid=1)),
              (2, _ep(False, 0, 6, invalid=6, stop="context_limit")), (2, _ep(False, 10, 6, stop="max_turns"))]
    s = summarise(played, k=2)
    assert s["success_rate"] == 0.25 and s["mean_score"] == pytest.approx(32.5) and s["mean_turns"] == 4.5
    assert s["invalid_action_rate"] == pytest.approx(7 / 18)  # per turn played
    assert s["context_limit_rate"] == 0.25 and s["context_windows"] == 0.75  # per episode
    # task 1: pass@1 = 1/2, pass@2 = 1; task 2: 0 and 0 -> averaged over tasks
    assert s["pass@1"] == pytest.approx(0.25) and s["pass@2"] == pytest.approx(0.5) and s["pass_at_k_tasks"] == 2
    result = {"env": "fake", "tasks": 2, "samples_per_task": 2, "max_turns": 6, "infra_failures": 0, **s,
              "categories": {"easy": summarise(played[:2], 2), "hard": summarise(played[2:], 2)}}
    table = format_table(result)
    assert "pass@2" in table and table.splitlines()[2].startswith("all") and "hard" in table
    json.dumps(result)


def test_ids_file(tmp_path):
    (tmp_path / "a.txt").write_text("3\n\n# held out\n7  # comment\n11\n")
    (tmp_path / "b.json").write_text("[1, 2, 5]")
    assert _read_ids(tmp_path / "a.txt", "signpost") == (3, 7, 11)
    assert _read_ids(tmp_path / "b.json", "signpost") == (1, 2, 5)
