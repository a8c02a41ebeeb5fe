"""The learning-clock study's arithmetic (apps/bench/learning_clock.py): when a curve reaches a success, the
paired ratios and the bounds a two-core machine puts on them. The runs themselves are the study's, not a test's."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from horizonrl.apps.bench.learning_clock import (
    ARMS,
    checkpoint_steps,
    cpu_times,
    peer_curve,
    peer_summary,
    reach_peer,
    pipeline_bound,
    reach_time,
    run_command,
    summary,
)


def test_reach_time_interpolates_between_checkpoints():
    curve = [(0.0, 0.2), (100.0, 0.4), (200.0, 0.6)]
    assert reach_time(curve, 0.5) == pytest.approx(150.0)
    assert reach_time(curve, 0.2) == 0.0
    assert reach_time(curve, 0.6) == pytest.approx(200.0)
    assert reach_time(curve, 0.61) is None
    # a dip after the first crossing does not move it
    assert reach_time([(0.0, 0.1), (60.0, 0.5), (120.0, 0.3), (180.0, 0.7)], 0.45) == pytest.approx(52.5)


def test_pipeline_bound():
    """g = 30 s generation, t = 60 s training: a perfect overlap hides the shorter phase (90 / 60 = 1.5)."""
    assert pipeline_bound(30.0, 60.0) == pytest.approx(1.5)


def test_cpu_times_are_the_machines():
    busy, total = cpu_times()
    assert 0 < busy <= total


def _run(curve, **figures):
    base = {"samples_per_s": 1.0, "learner_idle_share": 0.1, "engine_idle_share": 0.5, "staleness": 0.5,
            "mismatch_mean": 0.01, "k3_kl": 1e-4, "truncated_fraction": 0.0, "generate_s_per_step": 30.0,
            "train_s_per_step": 60.0}
    return {"curve": curve, "cpu_busy_share": 0.8, **{**base, **figures}}


def test_summary_pairs_each_arm_with_the_baseline_of_its_seed():
    result = {"runs": {
        "synchronous": {"0": _run([(0, 0.2), (600, 0.5)]), "1": _run([(0, 0.2), (900, 0.6)])},
        "async": {"0": _run([(0, 0.2), (200, 0.4), (400, 0.6)]), "1": _run([(0, 0.2), (300, 0.5)])},
    }}
    rows = summary(result)
    # seed 0: reaches 0.5 at 300 s (600 / 300 = 2); seed 1 never reaches 0.6
    assert rows["async"]["reached"] == "1/2"
    assert rows["async"]["baseline_time_ratio"]["median"] == pytest.approx(2.0)
    assert rows["async"]["reach_baseline_min"]["median"] == pytest.approx(5.0)
    assert rows["synchronous"]["baseline_time_ratio"]["median"] == pytest.approx(1.0)
    assert rows["synchronous"]["bounds"]["pipeline_bound"]["median"] == pytest.approx(1.5)
    assert rows["synchronous"]["bounds"]["cpu_bound"]["median"] == pytest.approx(1.25)  # 1 / 0.8


def test_every_arm_runs_the_same_config_with_its_own_overrides():
    assert checkpoint_steps(10, 3) == [3, 6, 9, 10]
    commands = {arm: run_command(Path("c.yaml"), Path("out"), arm, 1, 10, 2, ["x=1"]) for arm in ARMS}
    for arm, command in commands.items():
        assert command[-1] == "x=1" and "run.seed=1" in command and "learner.total_steps=10" in command
        assert all(o in command for o in ARMS[arm])
    assert "rollout.synchronous=true" in commands["synchronous"]
    assert "algorithm.rollout_correction.is_level=none" in commands["async_stale"]
    assert "learner.decoupled_loss=true" in commands["async_stale_corrected"]


def test_a_peer_is_read_on_its_scripts_clock_and_against_the_baselines_median(tmp_path):
    """peer_trl.py's heldout.jsonl: the peer's clock counts from its script's start (script_wall_s), like a
    launch; its curve starts at the shared model's success; it is read against the baseline seeds' medians."""
    rows = [{"step": 10, "wall_s": 500.0, "script_wall_s": 560.0, "success_rate": 0.5},
            {"step": 5, "wall_s": 240.0, "script_wall_s": 300.0, "success_rate": 0.3}]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    peer = peer_curve(tmp_path, 0.2)
    assert peer["curve"] == [(0.0, 0.2), (300.0, 0.3), (560.0, 0.5)]
    base = {str(seed): {"curve": [(0.0, 0.2), (wall, final)]}
            for seed, (wall, final) in enumerate([(400.0, 0.4), (480.0, 0.35), (600.0, 0.45)])}
    row = peer_summary(peer, base)
    # the baseline's median final 0.4 is reached half-way from 300 s (0.3) to 560 s (0.5): 430 s; median wall 480 s
    assert row["reach_baseline_min"] == pytest.approx(430.0 / 60)
    assert row["baseline_time_ratio"] == pytest.approx(480.0 / 430.0)
    assert row["reached"] == "1/1" and row["final_success"] == 0.5
    assert peer_summary({"curve": [(0.0, 0.2), (300.0, 0.3)]}, base)["reached"] == "0/1"


def test_each_arm_is_timed_to_the_peers_final_success():
    """reach_peer: seed by seed, when the arm's curve reaches the peer's last success, and the peer's wall over it."""
    peer = {"curve": [(0.0, 0.2), (900.0, 0.4)]}
    runs = {"async": {"0": {"curve": [(0.0, 0.2), (200.0, 0.6)]}, "1": {"curve": [(0.0, 0.2), (300.0, 0.3)]}}}
    row = reach_peer(runs, peer)["async"]
    assert row["reached"] == "1/2"  # seed 1 never got to 0.4
    assert row["reach_min"]["median"] == pytest.approx(100.0 / 60)  # 0.4 half-way up seed 0's line
    assert row["time_ratio"]["median"] == pytest.approx(9.0)
