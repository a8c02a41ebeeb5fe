"""Calls into the engine's workers: one absolute deadline carried in, and late answers never taken for a later call's.

``MultiprocLLM`` stands in for vLLM's multi-process executor (tensor parallelism) in one process, as read in 0.33's
``v1/executor/multiproc_executor.py``: each worker runs the calls it is sent one after the other, in a thread of its
own, and puts each answer in its own response queue; ``collective_rpc`` reads one answer per worker, in rank
order, each by the call's ``timeout``, and gives up with TimeoutError at the first one missing, leaving every answer
not read yet in its queue. The workers are ``actors/vllm_worker.py``'s real extension; one is made slow on purpose.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from datetime import timedelta

import pytest

from horizonrl.actors import engine as engine_module
from horizonrl.actors.engine import RolloutEngine
from horizonrl.actors.vllm_worker import WeightReceiverExtension
from horizonrl.actors.weight_receiver import WeightReceiver


class SlowWorker(WeightReceiverExtension):
    """A worker whose ``horizonrl_load_path`` takes ``delay_s`` once (stuck where no deadline reaches) and answers
    with its rank and how many times it was asked."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.delay_s = 0.0
        self.asked = 0

    def horizonrl_load_path(self) -> str:
        self.asked += 1
        delay, self.delay_s = self.delay_s, 0.0
        time.sleep(delay)
        return f"worker {self.rank} answer {self.asked}"


class MultiprocLLM:
    def __init__(self, workers: list) -> None:
        self.workers = workers
        self.requests = [queue.Queue() for _ in workers]
        self.responses = [queue.Queue() for _ in workers]
        self.timeouts: list[float] = []
        self.threads = [threading.Thread(target=self._serve, args=(i,), daemon=True) for i in range(len(workers))]
        for thread in self.threads:
            thread.start()

    def _serve(self, index: int) -> None:
        while (request := self.requests[index].get()) is not None:
            method, args = request
            self.responses[index].put(getattr(self.workers[index], method)(*args))

    async def collective_rpc(self, method, timeout=None, args=()):
        self.timeouts.append(timeout)
        for request in self.requests:
            request.put((method, args))
        return await asyncio.to_thread(self._read, method, timeout)

    def _read(self, method: str, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        answers = []
        for response in self.responses:
            try:
                answers.append(response.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                raise TimeoutError(f"RPC call to {method} timed out.") from None  # nothing drained, as vLLM does
        return answers

    def close(self) -> None:
        for request in self.requests:
            request.put(None)


async def test_an_answer_vllm_gave_up_on_is_never_taken_for_the_next_calls(monkeypatch):
    monkeypatch.setattr(engine_module, "RPC_REPLY_MARGIN_S", 0.3)  # vLLM's time-out: the call's 0.2 s + 0.3 s
    workers = [SlowWorker(0), SlowWorker(1)]
    llm = MultiprocLLM(workers)
    engine = RolloutEngine(llm, on_gpu=False)
    try:
        workers[1].delay_s = 1.5  # far past the executor's time-out
        with pytest.raises(TimeoutError):
            await engine._rpc("horizonrl_load_path", 0.2)
        await asyncio.sleep(1.6)  # worker 1's late answer to call 1 is now queued
        # The next call reads worker 1's late answer first: it is dropped, and worker 1's answer to this call read.
        assert await engine._rpc("horizonrl_load_path", 0.2) == ["worker 0 answer 2", "worker 1 answer 2"]
        assert engine.stale_replies == 1
        # ... and so on for every later call, each answered with its own answers.
        assert await engine._rpc("horizonrl_load_path", 0.2) == ["worker 0 answer 3", "worker 1 answer 3"]
        # A method that raises in the workers is an error naming each, never raised through vLLM's executor
        # (which would leave the other workers' answers queued): the calls after it stay in step.
        with pytest.raises(RuntimeError, match="worker 0: AttributeError.*worker 1: AttributeError"):
            await engine._rpc("horizonrl_model_runner", 0.2)  # these workers have no model runner
        assert await engine._rpc("horizonrl_load_path", 0.2) == ["worker 0 answer 4", "worker 1 answer 4"]
        assert engine.stale_replies == 1
    finally:
        llm.close()


class SilentWork:
    """A collective whose peer never sends: ``wait`` blocks for the whole timeout it is given, as gloo's does."""

    def wait(self, timeout: timedelta) -> bool:
        time.sleep(timeout.total_seconds())
        return False


class SilentGroup:
    def broadcast(self, tensors, options):
        return SilentWork()


async def test_the_workers_waits_end_by_the_deadline_before_vllms_timeout():
    """The worker's receive from a learner that sends nothing ends at the call's deadline (0.5 s), not at the
    group's timeout (60 s), and answers with that error before vLLM's executor would give up (0.5 + 30 s)."""
    worker = SlowWorker(0)
    worker._horizonrl_receiver = WeightReceiver(1, "gloo", 60.0, SilentGroup(), store=None)
    llm = MultiprocLLM([worker])
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="resubmit")  # no pause: nothing is in flight
    try:
        start = time.monotonic()
        with pytest.raises(Exception) as failure:
            await asyncio.wait_for(engine.receive_weights(timeout_s=0.5), 20)
        elapsed = time.monotonic() - start
        assert "deadline" in str(failure.value) or "within 0 s" in str(failure.value), failure.value
        assert 0.4 <= elapsed < 5.0, elapsed  # the deadline, not the group's 60 s
        assert llm.timeouts == [0.5 + engine_module.RPC_REPLY_MARGIN_S]  # vLLM's time-out is past the deadline
    finally:
        llm.close()
