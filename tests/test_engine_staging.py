"""The rollout engine's wait for a staged version (``RolloutEngine.stage_weights``): the worker's staging thread
tells the engine over a socket when the version is in; if that message is lost, the engine asks the workers
(``horizonrl_staged_outcome``) and goes on within seconds instead of waiting out the weight-sync timeout (a lost
message once cost a 2-core run 5 of its 15 minutes). The worker's side here is the real extension class and the
real ``StagedReceive`` bookkeeping, with the receive itself stood in for; the real receive and swap run in
tests/integration/test_engine_weights.py."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from fake_engine_rpc import enveloped_rpc

from horizonrl.actors import engine as engine_module
from horizonrl.actors.engine import RolloutEngine
from horizonrl.actors.vllm_worker import WeightReceiverExtension
from horizonrl.actors.weight_receiver import StagedReceive, _notify
from horizonrl.protocol.worker_replies import StageOutcome


class StagingLLM:
    """``collective_rpc`` for one engine worker whose staged receive takes ``receive_s`` and brings ``version``;
    ``tell`` says whether its thread's message to the engine gets through."""

    errored = False

    def __init__(self, version: int, receive_s: float, tell: bool) -> None:
        self.version, self.receive_s, self.tell = version, receive_s, tell
        self.worker = object.__new__(WeightReceiverExtension)  # the real methods, no vLLM worker around them
        self.rpcs: list[str] = []
        self.answers: list[object] = []  # what each horizonrl_staged_outcome returned
        self.asked = threading.Event()  # a silent receive ends only once asked (so the first answer is "not yet")

    collective_rpc = enveloped_rpc

    async def direct_rpc(self, method: str, timeout=None, args=()):
        self.rpcs.append(method)
        if method == "horizonrl_stage_weights":
            stage_id, address = args
            staged = StagedReceive(stage_id, worker=0)

            def receive() -> None:
                time.sleep(self.receive_s)
                if not self.tell:
                    self.asked.wait(10)  # however late the engine's first question comes on a loaded machine
                staged.receive_s = self.receive_s
                staged.layout = SimpleNamespace(version=self.version, epoch=0)
                if self.tell:
                    _notify(address, staged.outcome())

            staged.thread = threading.Thread(target=receive, daemon=True)
            staged.thread.start()
            self.worker._horizonrl_staging = staged
            return [(-1, -1, 0.0, 0.0, 0, "")]
        if method == "horizonrl_staged_outcome":
            answer = self.worker.horizonrl_staged_outcome(*args)
            self.answers.append(answer)
            self.asked.set()
            return [answer]
        raise AssertionError(f"unexpected rpc {method}")

    def shutdown(self, timeout=None) -> None:
        pass


async def stage(llm: StagingLLM):
    engine = RolloutEngine(llm, on_gpu=False)
    try:
        staged = await asyncio.wait_for(engine.stage_weights(timeout_s=300), 30)
        return staged, engine.lost_stage_messages
    finally:
        engine.shutdown()


async def test_a_lost_message_costs_seconds_not_the_timeout(monkeypatch):
    monkeypatch.setattr(engine_module, "STAGED_ASK_AFTER_MS", 200)
    llm = StagingLLM(version=7, receive_s=0.5, tell=False)
    start = time.monotonic()
    staged, lost = await stage(llm)
    assert (staged.version, staged.epoch) == (7, 0) and staged.receive_s == pytest.approx(0.5)
    assert lost == 1 and time.monotonic() - start < 20  # the timeout it used to wait out: 330 s
    # Asked while the thread was still receiving: "not yet", and the engine kept waiting.
    assert llm.answers[0] is None and StageOutcome.from_wire(llm.answers[-1]).version == 7


async def test_the_message_that_arrives_is_taken_without_asking():
    llm = StagingLLM(version=3, receive_s=0.05, tell=True)
    staged, lost = await stage(llm)
    assert staged.version == 3 and lost == 0
    assert llm.rpcs == ["horizonrl_stage_weights"]  # the default wait (10 s) is far longer than this receive


def test_the_worker_answers_only_for_its_own_ended_stage():
    worker = object.__new__(WeightReceiverExtension)
    assert worker.horizonrl_staged_outcome(1) is None  # nothing staged yet
    staged = StagedReceive(2, worker=0)
    staged.thread = threading.Thread(target=lambda: None)
    staged.thread.start()
    staged.thread.join()
    staged.error = RuntimeError("the learner dropped this member")
    worker._horizonrl_staging = staged
    assert worker.horizonrl_staged_outcome(1) is None  # another stage's
    outcome = StageOutcome.from_wire(worker.horizonrl_staged_outcome(2))
    assert outcome.stage_id == 2 and outcome.version == -1 and "dropped" in outcome.error
