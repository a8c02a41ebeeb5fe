"""The rollout engine's weight swap against a stand-in for vLLM's AsyncLLM, to drive the races deterministically:
a request in flight is cut off and goes on under the new weights, one being submitted when the swap starts is
caught too, and every token ends up tagged with the version that sampled it. The real engine does the same in
tests/integration/test_engine_weights.py (a version staged while 8 requests generate)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from horizonrl.actors.engine import RolloutEngine


class FakeLLM:
    """Generates one token per tick; a token's logprob says which weights sampled it: -(version + 1) / 100."""

    errored = False

    def __init__(self, tick_s: float = 0.002, add_delay_s: float = 0.0) -> None:
        self.version = 0
        self.tick_s, self.add_delay_s = tick_s, add_delay_s
        self.running: dict[str, dict] = {}
        self.rpcs: list[str] = []
        self.aborted: list[str] = []
        self.prefix_resets = 0

    async def add_request(self, request_id, prompt, params):
        await asyncio.sleep(self.add_delay_s)  # vLLM's input processing before the request reaches the engine
        queue: asyncio.Queue = asyncio.Queue()
        queue.get_nowait = lambda q=queue: None if q.empty() else asyncio.Queue.get_nowait(q)
        state = {"ids": [], "logprobs": [], "queue": queue, "max": params.max_tokens}
        state["task"] = asyncio.ensure_future(self._generate(request_id, state))
        self.running[request_id] = state
        return queue

    async def _generate(self, request_id: str, state: dict) -> None:
        while len(state["ids"]) < state["max"]:
            await asyncio.sleep(self.tick_s)
            state["ids"].append(1000 + self.version)
            state["logprobs"].append(-(self.version + 1) / 100)
        self._finish(request_id, "length")

    def _finish(self, request_id: str, reason: str) -> None:
        state = self.running.pop(request_id)
        logprobs = [{tok: SimpleNamespace(logprob=lp)} for tok, lp in zip(state["ids"], state["logprobs"])]
        completion = SimpleNamespace(token_ids=list(state["ids"]), logprobs=logprobs, finish_reason=reason)
        state["queue"].put_nowait(SimpleNamespace(finished=True, outputs=[completion]))

    async def abort(self, request_ids):
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            if request_id in self.running:
                self.running[request_id]["task"].cancel()
                self.aborted.append(request_id)
                self._finish(request_id, "abort")

    async def collective_rpc(self, method, timeout=None, args=()):
        self.rpcs.append(method)
        assert not self.running, "weights change while requests are in the engine"
        self.version += 1
        return [(self.version, 0, 0.01, 0.002, 0, "")]

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.prefix_resets += 1


def check_tags(generation, max_tokens: int) -> None:
    assert len(generation.token_ids) == max_tokens and generation.finish_reason == "length"
    start = 0
    for end, epoch, version in generation.version_spans:
        assert epoch == 0
        assert set(generation.token_ids[start:end]) == {1000 + version}  # every token came from its tag's weights
        assert set(generation.logprobs[start:end]) == {-(version + 1) / 100}
        start = end
    assert start == max_tokens


async def test_requests_in_flight_are_cut_off_and_go_on_under_the_new_weights():
    llm = FakeLLM()
    engine = RolloutEngine(llm, on_gpu=False)
    kwargs = dict(max_tokens=40, temperature=1.0, top_p=1.0, stop_token_ids=[])
    requests = [asyncio.ensure_future(engine.generate([1, 2, 3], **kwargs)) for _ in range(4)]
    while engine.clock.in_flight < 4 or any(len(state["ids"]) < 5 for state in llm.running.values()):
        await asyncio.sleep(0.005)
    update = await engine.load_staged()
    assert engine.weights == (0, 1) and (update.epoch, update.version) == (0, 1)
    generations = await asyncio.gather(*requests)
    for generation in generations:
        check_tags(generation, 40)
        assert [(e, v) for _, e, v in generation.version_spans] == [(0, 0), (0, 1)]  # all four were cut
    assert engine.continued_requests == 4 and len(llm.aborted) == 4 and llm.prefix_resets == 1
    assert engine.clock.in_flight == 0


async def test_a_request_being_submitted_when_the_swap_starts_is_caught_by_it():
    llm = FakeLLM(add_delay_s=0.5)
    engine = RolloutEngine(llm, on_gpu=False)
    request = asyncio.ensure_future(engine.generate([1], max_tokens=60, temperature=1.0, top_p=1.0, stop_token_ids=[]))
    while engine._submitting == 0:
        await asyncio.sleep(0.001)  # now inside add_request: not in the engine yet
    swap = asyncio.ensure_future(engine.load_staged())
    await asyncio.sleep(0.01)
    assert not swap.done()  # it waits for the submission, so it can abort what it submitted
    await swap
    generation = await request
    check_tags(generation, 60)


async def test_a_request_started_during_a_swap_waits_and_runs_on_the_new_weights():
    llm = FakeLLM()
    engine = RolloutEngine(llm, on_gpu=False)
    gate_closed = asyncio.Event()
    original = llm.collective_rpc

    async def slow_rpc(method, timeout=None, args=()):
        gate_closed.set()
        await asyncio.sleep(0.05)
        return await original(method, timeout, args)

    llm.collective_rpc = slow_rpc
    swap = asyncio.ensure_future(engine.load_staged())
    await gate_closed.wait()
    generation = await engine.generate([1], max_tokens=10, temperature=1.0, top_p=1.0, stop_token_ids=[])
    await swap
    assert generation.version_spans == [(10, 0, 1)]
    check_tags(generation, 10)


async def test_a_cancelled_generation_aborts_its_request():
    llm = FakeLLM(tick_s=0.05)
    engine = RolloutEngine(llm, on_gpu=False)
    request = asyncio.ensure_future(engine.generate([1], max_tokens=100, temperature=1.0, top_p=1.0,
                                                    stop_token_ids=[]))
    while not llm.running:
        await asyncio.sleep(0.005)
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    assert len(llm.aborted) == 1 and not llm.running and engine.clock.in_flight == 0


async def test_keeping_the_old_keys_and_values_skips_the_prefix_cache_reset():
    llm = FakeLLM()
    engine = RolloutEngine(llm, on_gpu=False, recompute_kv_on_update=False)
    await engine.load_staged()
    assert engine.weights == (0, 1) and llm.prefix_resets == 0
