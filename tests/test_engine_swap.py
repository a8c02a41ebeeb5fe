"""The rollout engine's weight swap against a stand-in for vLLM's AsyncLLM, to drive the races deterministically:
a request in flight is cut off and goes on under the new weights, one being submitted when the swap starts is
caught too, and every token ends up tagged with the version that sampled it. The real engine does the same in
tests/integration/test_engine_weights.py (a version staged while 8 requests generate)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fake_engine_rpc import enveloped_rpc

from horizonrl.actors.engine import RolloutEngine, spans_of_request
from horizonrl.actors.engine_api import ENGINE_API, EngineApi, EngineVersionError


class FakeLLM:
    """Generates one token per tick; a token's logprob says which weights sampled it: -(version + 1) / 100.
    ``labels``: like vLLM 0.32 on, each token carries the weight label set when it was sampled
    (``update_weight_version``), and the final output lists them as ``weight_versions`` spans."""

    errored = False

    def __init__(self, tick_s: float = 0.002, add_delay_s: float = 0.0, labels: bool = False) -> None:
        self.labels = labels
        self.label = "default"
        self.version = 0
        self.tick_s, self.add_delay_s = tick_s, add_delay_s
        self.running: dict[str, dict] = {}
        self.rpcs: list[str] = []
        self.aborted: list[str] = []
        self.prefix_resets = 0
        self.resumed = asyncio.Event()  # cleared while paused with the requests kept (vLLM's mode "keep")
        self.resumed.set()
        self.unscheduled: set[str] = set()  # requests the worker does not hold yet (not in its output counts)
        self.salts: list[str] = []  # each request's prefix-cache salt, in submission order

    async def add_request(self, request_id, prompt, params):
        await asyncio.sleep(self.add_delay_s)  # vLLM's input processing before the request reaches the engine
        self.salts.append(prompt["cache_salt"])
        queue: asyncio.Queue = asyncio.Queue()
        queue.get_nowait = lambda q=queue: None if q.empty() else asyncio.Queue.get_nowait(q)
        state = {"ids": [], "logprobs": [], "labels": [], "queue": queue, "max": params.max_tokens}
        state["task"] = asyncio.ensure_future(self._generate(request_id, state))
        self.running[request_id] = state
        return queue

    async def _generate(self, request_id: str, state: dict) -> None:
        while len(state["ids"]) < state["max"]:
            await asyncio.sleep(self.tick_s)
            await self.resumed.wait()
            state["ids"].append(1000 + self.version)
            state["logprobs"].append(-(self.version + 1) / 100)
            state["labels"].append(self.label)
        self._finish(request_id, "length")

    def _finish(self, request_id: str, reason: str) -> None:
        state = self.running.pop(request_id)
        logprobs = [{tok: SimpleNamespace(logprob=lp)} for tok, lp in zip(state["ids"], state["logprobs"])]
        completion = SimpleNamespace(token_ids=list(state["ids"]), logprobs=logprobs, finish_reason=reason,
                                     weight_versions=label_spans(state["labels"]) if self.labels else None)
        state["queue"].put_nowait(SimpleNamespace(finished=True, outputs=[completion]))

    async def abort(self, request_ids):
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            if request_id in self.running:
                self.running[request_id]["task"].cancel()
                self.aborted.append(request_id)
                self._finish(request_id, "abort")

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        assert mode == "keep" and not clear_cache
        self.resumed.clear()

    async def update_weight_version(self, new_version: str) -> None:
        assert not self.running or not self.resumed.is_set(), "labels change only while nothing generates"
        self.label = new_version

    async def resume_generation(self):
        self.resumed.set()

    collective_rpc = enveloped_rpc

    async def direct_rpc(self, method, timeout=None, args=()):
        self.rpcs.append(method)
        if method == "horizonrl_output_counts":  # by vLLM's internal ids: ours + "-" + 8 characters
            return [{f"{rid}-0a1b2c3d": len(state["ids"]) for rid, state in self.running.items()
                     if rid not in self.unscheduled}]
        assert not self.running or not self.resumed.is_set(), "weights change while requests run in the engine"
        self.version += 1
        return [(self.version, 0, 0.01, 0.002, 0, "")]

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.prefix_resets += 1


def label_spans(labels: list[str]) -> list[SimpleNamespace]:
    """vLLM's ``CompletionOutput.weight_versions``: runs of one label, ``[start, end)`` over the tokens."""
    spans: list[SimpleNamespace] = []
    for i, label in enumerate(labels):
        if spans and spans[-1].version == label:
            spans[-1].end = i + 1
        else:
            spans.append(SimpleNamespace(version=label, start=i, end=i + 1))
    return spans


def check_tags(generation, max_tokens: int) -> None:
    assert len(generation.token_ids) == max_tokens and generation.finish_reason == "length"
    start = 0
    for end, epoch, version in generation.version_spans:
        assert epoch == 0
        assert set(generation.token_ids[start:end]) == {1000 + version}  # every token came from its tag's weights
        assert set(generation.logprobs[start:end]) == {-(version + 1) / 100}
        start = end
    assert start == max_tokens


async def four_requests_in_flight(on_weight_update: str):
    """An engine with four requests of 40 tokens in flight, each 5 tokens in."""
    llm = FakeLLM()
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update=on_weight_update)
    kwargs = dict(max_tokens=40, temperature=1.0, top_p=1.0, stop_token_ids=[])
    requests = [asyncio.ensure_future(engine.generate([1, 2, 3], **kwargs)) for _ in range(4)]
    while engine.clock.in_flight < 4 or any(len(state["ids"]) < 5 for state in llm.running.values()):
        await asyncio.sleep(0.005)
    return llm, engine, requests


async def test_requests_in_flight_are_cut_off_and_go_on_under_the_new_weights():
    llm, engine, requests = await four_requests_in_flight("recompute")
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
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="recompute")
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
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="recompute")
    gate_closed = asyncio.Event()
    original = llm.direct_rpc

    async def slow_rpc(method, timeout=None, args=()):
        gate_closed.set()
        await asyncio.sleep(0.05)
        return await original(method, timeout, args)

    llm.direct_rpc = slow_rpc
    swap = asyncio.ensure_future(engine.load_staged())
    await gate_closed.wait()
    generation = await engine.generate([1], max_tokens=10, temperature=1.0, top_p=1.0, stop_token_ids=[])
    await swap
    assert generation.version_spans == [(10, 0, 1)]
    check_tags(generation, 10)


async def one_request_running():
    """An engine with one long request in the fake engine, and the task generating it."""
    llm = FakeLLM(tick_s=0.05)
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="recompute")
    request = asyncio.ensure_future(engine.generate([1], max_tokens=100, temperature=1.0, top_p=1.0,
                                                    stop_token_ids=[]))
    while not llm.running:
        await asyncio.sleep(0.005)
    return llm, engine, request


async def test_a_cancelled_generation_aborts_its_request():
    llm, engine, request = await one_request_running()
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)
    assert len(llm.aborted) == 1 and not llm.running and engine.clock.in_flight == 0


async def test_a_generation_cancelled_after_the_engine_shut_down_ends_quietly():
    """The actor process ending: the engine is shut down first, then asyncio.run cancels the generations still
    pending. Each ends with its cancellation, not an AttributeError on the engine that is gone (seen in a run's
    log as "unhandled exception during asyncio.run() shutdown")."""
    _, engine, request = await one_request_running()
    engine._llm = None  # what shutdown() leaves (the fake has no processes to stop)
    request.cancel()
    (outcome,) = await asyncio.gather(request, return_exceptions=True)
    assert isinstance(outcome, asyncio.CancelledError) and engine.clock.in_flight == 0


async def test_resubmitting_keeps_the_prefix_cache():
    llm = FakeLLM()
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="resubmit")
    await engine.load_staged()
    assert engine.weights == (0, 1) and llm.prefix_resets == 0


@pytest.mark.parametrize("on_weight_update", ["keep", "resubmit", "recompute"])
async def test_the_prefix_cache_is_keyed_by_the_weights_a_request_starts_under(on_weight_update):
    """A request started after a swap never reuses keys and values of the old weights (the real engine's
    logprobs show it: tests/integration/test_engine_weights.py); only resubmit's continuation of a request cut
    off keeps its first salt, to reuse its own context's blocks."""
    llm, engine, requests = await four_requests_in_flight(on_weight_update)
    llm.unscheduled.add(sorted(llm.running)[0])  # keep cuts off (only) a request the worker does not hold yet
    await engine.load_staged()
    later = await engine.generate([1, 2, 3], max_tokens=3, temperature=1.0, top_p=1.0, stop_token_ids=[])
    await asyncio.gather(*requests)
    assert later.version_spans == [(3, 0, 1)]
    continuations = {"keep": ["w0.1"], "resubmit": ["w0.0"] * 4, "recompute": ["w0.1"] * 4}[on_weight_update]
    assert llm.salts[:4] == ["w0.0"] * 4  # then the continuations and the later request, in either order
    assert sorted(llm.salts[4:]) == sorted([*continuations, "w0.1"])


async def test_kept_requests_go_on_through_the_swap_without_a_new_request_and_are_tagged_per_span():
    """on_weight_update=keep: the engine pauses with the requests in it, the worker's counts split each reply
    into the old and the new weights' tokens, nothing is aborted or submitted again; a request the worker does
    not hold yet is cut off as without keeping."""
    llm, engine, requests = await four_requests_in_flight("keep")
    llm.unscheduled.add(sorted(llm.running)[0])
    await engine.load_staged()
    while any(len(state["ids"]) < 12 for state in llm.running.values()):
        await asyncio.sleep(0.005)
    await engine.load_staged()  # a second swap: three spans
    generations = await asyncio.gather(*requests)
    for generation in generations:
        check_tags(generation, 40)
        assert [(e, v) for _, e, v in generation.version_spans] == [(0, 0), (0, 1), (0, 2)]
    assert len(llm.aborted) == 1 and engine.continued_requests == 1  # only the unscheduled one
    assert llm.rpcs.count("horizonrl_output_counts") == 2 and llm.prefix_resets == 0 and llm.resumed.is_set()
    assert engine._switches == {} and engine.clock.in_flight == 0


async def test_the_wait_for_the_engine_to_end_its_step_is_not_counted_as_stall():
    """vLLM pauses between two steps: the engine first ends the step it is in, generating its tokens. The swap
    reports that wait apart (pause_wait_s) and counts as stall only the time from the pause to the resume."""
    llm, engine, requests = await four_requests_in_flight("keep")
    step_s, load_s = 1.0, 0.1
    pause = llm.pause_generation

    async def pause_after_a_step(**kwargs):
        await asyncio.sleep(step_s)  # the step in progress ends first
        await pause(**kwargs)

    rpc = llm.direct_rpc

    async def slow_load(method, timeout=None, args=()):
        if method != "horizonrl_output_counts":
            await asyncio.sleep(load_s)
        return await rpc(method, timeout, args)

    llm.pause_generation = pause_after_a_step
    llm.direct_rpc = slow_load
    update = await engine.load_staged()
    await asyncio.gather(*requests)
    assert update.pause_wait_s >= step_s and update.stall_s >= load_s, update
    # The stall must not hold the step (it did before); 0.9 s of margin for a loaded machine.
    assert update.stall_s < step_s, update


async def test_a_failed_swap_resumes_the_kept_requests_on_the_old_weights():
    llm = FakeLLM()
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="keep")
    request = asyncio.ensure_future(engine.generate([1], max_tokens=30, temperature=1.0, top_p=1.0,
                                                    stop_token_ids=[]))
    while not llm.running or len(next(iter(llm.running.values()))["ids"]) < 5:
        await asyncio.sleep(0.005)

    async def failing_change():
        raise RuntimeError("the learner is gone")

    with pytest.raises(RuntimeError, match="the learner is gone"):
        await engine._swap(failing_change)
    assert llm.resumed.is_set() and engine.weights == (0, 0)
    generation = await request
    check_tags(generation, 30)
    assert generation.version_spans == [(30, 0, 0)]


def test_spans_of_a_request_kept_through_swaps():
    # 10 new tokens after 5 of an earlier request; swaps after its 3rd token, then after its 3rd again (no token
    # between: no empty span), then past its end (it had finished before the swap reached it)
    assert spans_of_request(5, 10, (0, 1), [(3, (0, 2)), (3, (0, 3)), (10, (0, 4))]) == [(8, 0, 1), (15, 0, 3)]
    assert spans_of_request(0, 4, (1, 7), []) == [(4, 1, 7)]
    assert spans_of_request(0, 0, (1, 7), [(0, (1, 8))]) == []


async def test_an_engine_that_does_not_pause_fails_the_swap_in_bounded_time_and_is_resumed(monkeypatch):
    import horizonrl.actors.engine as engine_module

    monkeypatch.setattr(engine_module, "SUBMIT_WAIT_S", 0.2)
    llm = FakeLLM()
    resumes = []

    async def never_pauses(*, mode, clear_cache):
        await asyncio.Event().wait()

    async def resume():
        resumes.append(True)

    llm.pause_generation = never_pauses
    llm.resume_generation = resume
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="keep")
    with pytest.raises(RuntimeError, match="did not pause within"):
        await engine.load_staged()
    assert resumes == [True] and engine.weights == (0, 0) and "horizonrl_load_staged" not in llm.rpcs
    assert engine._gate_open.is_set()  # requests can enter again


# ------------------------------------------------------------------ what differs between vLLM releases


def api_of(version: str, missing: set[str] = frozenset()) -> EngineApi:
    """What check_engine_api finds in a release: every entry holds but ``missing`` (docs/gpu.md's matrix)."""
    return EngineApi(version, {e.key: (f"{e.name}: not there" if e.key in missing else None) for e in ENGINE_API},
                     frozenset({"v1", "v2"}))


NO_LABELS = {"weight_version_label", "weight_version_span", "weight_version_spans"}
VLLM_0_16 = api_of("0.16.0", {"shutdown_timeout", "v2_reload", *NO_LABELS})
VLLM_0_31 = api_of("0.31.0", NO_LABELS)
VLLM_0_33 = api_of("0.33.0")


class FakeLLM016(FakeLLM):
    """vLLM 0.16's AsyncLLM: pause_generation(mode="keep") calls a pause_scheduler_async() that takes no
    arguments, and shutdown() takes no time-out."""

    def __init__(self) -> None:
        super().__init__()
        self.engine_core = SimpleNamespace(pause_scheduler_async=self._pause_scheduler)
        self.shut_down = False

    async def _pause_scheduler(self) -> None:
        self.resumed.clear()

    async def pause_generation(self, *, mode="abort", wait_for_inflight_requests=None, clear_cache=True):
        assert mode == "keep" and not clear_cache
        await self.engine_core.pause_scheduler_async()

    def shutdown(self) -> None:
        self.shut_down = True


async def test_vllm_0_16_keeps_requests_through_a_swap_and_shuts_down():
    """0.16's pause_scheduler_async() takes no arguments and its shutdown() no time-out (both TypeErrors before:
    the swap failed at the first join, and evaluate() lost its metrics to the shutdown in its finally)."""
    llm = FakeLLM016()
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="keep", api=VLLM_0_16)
    kwargs = dict(max_tokens=30, temperature=1.0, top_p=1.0, stop_token_ids=[])
    request = asyncio.ensure_future(engine.generate([1], **kwargs))
    while not llm.running or len(next(iter(llm.running.values()))["ids"]) < 5:
        await asyncio.sleep(0.005)
    await engine.load_staged()
    generation = await request
    check_tags(generation, 30)
    assert [(e, v) for _, e, v in generation.version_spans] == [(0, 0), (0, 1)] and engine.kept_requests == 1
    engine.shutdown()
    assert llm.shut_down


async def test_with_vllms_labels_kept_requests_are_tagged_without_the_model_runners_internals():
    """From vLLM 0.32 on, every token carries the weight label set when it was sampled: the swap sets the new
    weights' label while paused and never asks the worker for the model runner's request states (which Model
    Runner V2, vLLM's default for dense models, does not have). Nothing is cut off: a request not scheduled yet
    is kept like the others."""
    llm = FakeLLM(labels=True)
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="keep", api=VLLM_0_33)
    rpc = llm.direct_rpc

    async def no_request_states(method, timeout=None, args=()):
        if method == "horizonrl_output_counts":
            raise AttributeError("'GPUModelRunner' object has no attribute 'requests'")  # Model Runner V2
        return await rpc(method, timeout, args)

    llm.direct_rpc = no_request_states
    kwargs = dict(max_tokens=40, temperature=1.0, top_p=1.0, stop_token_ids=[])
    requests = [asyncio.ensure_future(engine.generate([1, 2, 3], **kwargs)) for _ in range(4)]
    while engine.clock.in_flight < 4 or any(len(state["ids"]) < 5 for state in llm.running.values()):
        await asyncio.sleep(0.005)
    await engine.load_staged()
    while any(len(state["ids"]) < 12 for state in llm.running.values()):
        await asyncio.sleep(0.005)
    await engine.load_staged()
    for generation in await asyncio.gather(*requests):
        check_tags(generation, 40)
        assert [(e, v) for _, e, v in generation.version_spans] == [(0, 0), (0, 1), (0, 2)]
    assert "horizonrl_output_counts" not in llm.rpcs and not llm.aborted and engine.continued_requests == 0
    assert engine.kept_requests == 8 and llm.label == "w0.2" and llm.resumed.is_set()


@pytest.mark.parametrize("on_weight_update", ["resubmit", "recompute"])
async def test_with_vllms_labels_cut_off_requests_are_tagged_too(on_weight_update):
    """Every swap sets the new weights' label, not only keep's: the tags come from the labels whatever
    on_weight_update says."""
    llm = FakeLLM(labels=True)
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update=on_weight_update, api=VLLM_0_33)
    kwargs = dict(max_tokens=40, temperature=1.0, top_p=1.0, stop_token_ids=[])
    requests = [asyncio.ensure_future(engine.generate([1, 2, 3], **kwargs)) for _ in range(2)]
    while engine.clock.in_flight < 2 or any(len(state["ids"]) < 5 for state in llm.running.values()):
        await asyncio.sleep(0.005)
    await engine.load_staged()
    for generation in await asyncio.gather(*requests):
        check_tags(generation, 40)
        assert [(e, v) for _, e, v in generation.version_spans] == [(0, 0), (0, 1)]
    assert engine.continued_requests == 2 and llm.label == "w0.1"


@pytest.mark.parametrize(("runner", "holds_requests", "refused"), [("v1", True, False), ("v2", False, True)])
async def test_a_model_runner_without_what_the_updates_need_is_refused_at_the_first_join(runner, holds_requests,
                                                                                          refused):
    """Before vLLM 0.32, keep counts tokens in the V1 runner's request states; a worker on Model Runner V2 (asked
    for by hand) is refused at the first join, before any weights move, naming what is missing and the way out."""
    llm = FakeLLM()
    rpc = llm.direct_rpc

    async def runner_facts(method, timeout=None, args=()):
        if method == "horizonrl_model_runner":
            return [{"runner": runner, "class": "GPUModelRunner", "holds_requests": holds_requests}]
        return await rpc(method, timeout, args)

    llm.direct_rpc = runner_facts
    engine = RolloutEngine(llm, on_gpu=False, on_weight_update="keep", api=VLLM_0_31)
    join = engine.join_weights("127.0.0.1", 1, actor=0, run_id="r", timeout_s=5)
    if refused:
        with pytest.raises(EngineVersionError, match="keeps no per-request token lists") as info:
            await join
        assert "VLLM_USE_V2_MODEL_RUNNER" in str(info.value) and "horizonrl_join_weight_hub" not in llm.rpcs
    else:
        assert (await join).version == 1 and llm.rpcs[-1] == "horizonrl_join_weight_hub"
