"""Benchmarks parts 4 and 5 in their smallest configuration: real processes, sockets and process groups."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from horizonrl.apps.bench.report import is_summary


def _assert_shape(result: dict, part: str) -> None:
    assert result["part"] == part
    assert result["rows"] and result["ratios"] and result["settings"]
    for summary in result["ratios"].values():
        assert is_summary(summary) and summary["median"] > 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_weight_sync_benchmark_tiny(tmp_path):
    from horizonrl.apps.bench.weight_sync import run

    result = run(False, tmp_path, models=["tiny"], repeats=1, receivers=2, timeout_s=60)
    _assert_shape(result, "weight_sync")
    labels = [row["label"] for row in result["rows"]]
    assert labels == ["tiny / horizonrl", "tiny / raw", "tiny / raw, fresh recv buffer"]
    ours = result["rows"][0]
    assert ours["received_ok"] is True  # every receiver got the sender's bytes, versions in order
    assert ours["tensors"] == 26 and 1.0 < ours["MB"] < 2.0
    for row in result["rows"]:
        assert row["MB_per_s"]["min"] > 0 and row["receive_ms"]["min"] > 0
    assert 0 < ours["stall_share@10s (derived)"]["median"] < 1
    assert set(result["ratios"]) == {"tiny: horizonrl / raw MB/s", "tiny: horizonrl / raw-fresh MB/s"}
    assert (tmp_path / "weight_sync" / "results.json").exists() and (tmp_path / "weight_sync" / "chart.png").exists()
    assert not mp.active_children()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_transport_benchmark_smallest(tmp_path):
    from horizonrl.apps.bench.transport import MPQ_LISTS, MPQ_NUMPY, ZMQ, run

    result = run(True, tmp_path, sizes=(1024,), producers=(1, 2), repeats=1, counts={1024: 80}, timeout_s=30,
                 intake=False)
    _assert_shape(result, "transport")
    assert len(result["rows"]) == 2 * 3 and len(result["ratios"]) == 2 * 2
    for row in result["rows"]:
        assert row["traj_per_s"]["min"] > 0 and row["MB_per_s"]["min"] > 0
        assert row["all_received"] is True  # received count == sent count in every run
        assert row["first_equal"] is True  # the decoded trajectory equals what the producer built
    wire = {row["label"].split(" / ")[1]: row["wire_KB"] for row in result["rows"][:3]}
    assert set(wire) == {ZMQ, MPQ_LISTS, MPQ_NUMPY}
    assert wire[ZMQ] < wire[MPQ_LISTS]  # raw bytes beat pickled Python ints and floats
    assert not mp.active_children()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_buffer_intake_with_and_without_the_log():
    from horizonrl.apps.bench.buffer_intake import BASELINE, MODES, measure

    rows, ratios, settings = measure(True, repeats=1, per_producer=40)
    assert [row["label"].split(" / ")[1] for row in rows] == list(MODES)
    assert all(row["traj_per_s"]["min"] > 0 for row in rows)  # every trajectory acknowledged, in every mode
    assert set(ratios) == {f"buffer intake: {m} / {BASELINE} traj/s" for m in MODES if m != BASELINE}
    assert settings["intake_trajectories_per_producer"] == 40


def test_transport_content_round_trips_through_the_real_codec():
    import numpy as np

    from horizonrl.apps.bench.transport import as_plain_dict, make_trajectory
    from horizonrl.protocol import Trajectory, decode_as, encode

    sent = make_trajectory(1024, 3, 5)
    assert sent.trajectory_id == "p3-m5" and sent.num_tokens == 1024
    assert decode_as(encode(sent), Trajectory) == sent
    plain = as_plain_dict(sent, "lists")
    assert isinstance(plain["token_ids"], list) and len(plain["token_ids"]) == 1024
    assert np.array_equal(as_plain_dict(sent, "numpy")["logprobs"], np.asarray(plain["logprobs"], dtype=np.float32))


def test_weight_sync_smollm2_shape_is_smollm2s():
    """The benchmark's SmolLM2 row sends what a SmolLM2 run sends: 134,515,008 parameters (SmolLM2-135M-Instruct's
    config.json, tied embeddings), a Llama."""
    from horizonrl.apps.bench.weight_sync import MODELS, _model_on_meta

    model = _model_on_meta(MODELS["smollm2"])
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_weight_sync_benchmark_refuses_an_unknown_model(capsys):
    from horizonrl.apps.bench.weight_sync import main

    with pytest.raises(SystemExit) as exit_:
        main(["--models", "tiny,7B"])
    assert exit_.value.code == 2 and "7B" in capsys.readouterr().err
