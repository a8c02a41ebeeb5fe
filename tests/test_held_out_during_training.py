"""Held-out evaluation during training (``eval.every``), piece by piece without engines.

- the coordinator asks for an evaluation at the start, every ``eval.every`` steps and after the last
  step (``Control.eval_step``), logs each answer once at the step it was asked for, and holds the run
  open (rollout paused) until the last one is in or ``eval.final_wait_s`` has passed;
- actor 0 plays the first ``eval.episodes_during_training`` test-split tasks of every environment at
  ``eval.temperature`` once its engine holds the step's weights, sends one ``HeldOutEval``, and sends
  nothing to the buffer.
"""

from __future__ import annotations

import asyncio
import glob
import time

import pytest
import zmq
import zmq.asyncio

from horizonrl.actors.actor import Actor
from horizonrl.actors.engine import Generation
from horizonrl.coordinator import Coordinator, HeldOutPlateau, held_out_scalars
from horizonrl.core.config import TrainConfig
from horizonrl.core.runtime import StopFlag
from horizonrl.envs.signpost import SignpostEnv
from horizonrl.launcher import resolve_ports
from horizonrl.protocol import (EVENT_DIED, Control, HeldOutEval, LearnerReport, ProcessEvent, ProtocolError,
                                decode_as)

from helpers import EOT, CharChat

RUN_ID = "held-out"


def make_config(tmp_path, **eval_settings) -> TrainConfig:
    return resolve_ports(TrainConfig.model_validate({
        "run": {"output_dir": str(tmp_path), "run_id": RUN_ID}, "model": {"path": "unused"},
        "envs": [{"name": "signpost", "settings": {"length": 2}}, {"name": "signpost3", "settings": {"length": 3}}],
        "network": {"host": "127.0.0.1"}, "learner": {"total_steps": 5},
        "rollout": {"max_tokens_per_turn": 24, "max_context_tokens": 512},
        "algorithm": {"rounds_ctrl": {"type": "fixed", "rounds": [3]}}, "eval": eval_settings}))


def scalars_by_step(run_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(glob.glob(str(run_dir / "tensorboard" / "events.*"))[0])
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def report(step: int, final: bool = False) -> LearnerReport:
    return LearnerReport(run_id=RUN_ID, step=step, weight_version=step, metrics={"loss/policy": 0.1}, final=final)


def evaluation(step: int, a: float, b: float, versions=(0, 0)) -> HeldOutEval:
    return HeldOutEval(run_id=RUN_ID, learner_step=step, weight_versions=versions, wall_s=1.5, results={
        "signpost": {"success_rate": a, "episodes_valid": 30.0, "infra_failures": 2.0, "mean_turns": 2.0},
        "signpost3": {"success_rate": b, "episodes_valid": 10.0, "infra_failures": 0.0, "mean_turns": 3.0}})


def test_the_coordinator_asks_at_the_start_every_n_steps_and_after_the_last_one(tmp_path):
    coordinator = Coordinator(make_config(tmp_path, every=2, final_wait_s=60), StopFlag())
    try:
        assert coordinator.control().eval_step == 0  # the starting policy
        coordinator.on_learner_report(report(1))
        assert coordinator.control().eval_step == 0
        coordinator.on_learner_report(report(2))
        assert coordinator.control().eval_step == 2
        coordinator.on_held_out_eval(evaluation(0, 0.1, 0.0))
        coordinator.on_held_out_eval(evaluation(2, 0.4, 0.2, versions=(2, 3)))
        coordinator.on_held_out_eval(evaluation(2, 0.9, 0.9))  # a restarted actor 0 repeating it: ignored
        coordinator.on_learner_report(report(3))
        coordinator.on_learner_report(report(4))
        coordinator.on_learner_report(report(5))
        coordinator.on_learner_report(report(5, final=True))  # 5 is not a multiple of 2: asked for as the last
        control = coordinator.control()
        assert control.eval_step == 5 and not control.stop and control.pause_rollout
        coordinator.on_held_out_eval(evaluation(5, 0.7, 0.5))
        control = coordinator.control()
        assert control.stop and not control.pause_rollout
    finally:
        coordinator.close()
    s = scalars_by_step(tmp_path)
    assert set(s["eval/success_rate"]) == {0, 2, 5}  # step 4's was asked for but never answered
    # 30 and 10 valid episodes: (0.4 * 30 + 0.2 * 10) / 40
    assert s["eval/success_rate"][2] == pytest.approx(0.35)
    assert s["eval/signpost/success_rate"][2] == pytest.approx(0.4)
    assert s["eval/signpost3/success_rate"][5] == pytest.approx(0.5)
    assert s["eval/signpost/infra_failures"][0] == 2.0
    assert (s["eval/weight_version_min"][2], s["eval/weight_version_max"][2]) == (2.0, 3.0)


def test_an_evaluation_played_with_newer_weights_is_logged_at_their_step(tmp_path):
    """Asked for step 0 but played by versions 7-8 (actor 0 came up late): that is not the starting policy."""
    coordinator = Coordinator(make_config(tmp_path, every=10), StopFlag())
    try:
        coordinator.on_held_out_eval(evaluation(0, 0.6, 0.6, versions=(7, 8)))
        coordinator.on_held_out_eval(evaluation(0, 0.1, 0.1))  # asked-for step 0 again (a restart): ignored
        coordinator.on_learner_report(report(10))
        coordinator.on_held_out_eval(evaluation(10, 0.7, 0.7, versions=(10, 11)))
    finally:
        coordinator.close()
    s = scalars_by_step(tmp_path)
    assert s["eval/success_rate"] == {7: pytest.approx(0.6), 10: pytest.approx(0.7)}
    assert s["eval/weight_version_min"] == {7: 7.0, 10: 10.0}


def test_the_run_stops_without_the_last_evaluation_after_final_wait_s(tmp_path):
    coordinator = Coordinator(make_config(tmp_path, every=3, final_wait_s=0.3), StopFlag())
    try:
        coordinator.on_learner_report(report(1, final=True))
        assert not coordinator.control().stop and coordinator.control().eval_step == 1
        time.sleep(0.4)
        assert coordinator.control().stop
    finally:
        coordinator.close()


def test_the_run_stops_at_once_when_actor_0_dies_during_the_last_evaluation(tmp_path):
    coordinator = Coordinator(make_config(tmp_path, every=3, final_wait_s=600), StopFlag())
    try:
        coordinator.on_learner_report(report(2, final=True))
        coordinator.on_process_event(ProcessEvent(run_id=RUN_ID, name="actor-1", role="actor", event=EVENT_DIED,
                                                  exit_code=1, at=time.time()))
        assert not coordinator.control().stop  # actor 1 does not evaluate
        coordinator.on_process_event(ProcessEvent(run_id=RUN_ID, name="actor-0", role="actor", event=EVENT_DIED,
                                                  exit_code=1, at=time.time()))
        assert coordinator.control().stop  # nothing restarts it after the learner's last step
    finally:
        coordinator.close()


def test_off_by_default_nothing_is_asked_and_the_run_stops_at_once(tmp_path):
    config = make_config(tmp_path)
    assert config.eval.every == 0
    coordinator = Coordinator(config, StopFlag())
    try:
        coordinator.on_learner_report(report(2))
        coordinator.on_learner_report(report(2, final=True))
        assert coordinator.control().eval_step == -1 and coordinator.control().stop
    finally:
        coordinator.close()


def test_the_plateau_rule_counts_evaluations_without_progress_and_lets_slow_climbs_through():
    off = HeldOutPlateau(0, 0.02)
    assert not any(off.add(step, 0.5) for step in range(10))
    rule = HeldOutPlateau(2, 0.02)
    assert not rule.add(0, 0.10)          # the first sets the best
    assert not rule.add(10, 0.50)         # progress
    assert not rule.add(20, 0.51)         # within min_delta of 0.50: one without progress
    assert not rule.add(30, 0.53)         # 0.53 > 0.50 + 0.02: a slow climb that added up is progress
    assert (rule.best, rule.best_step) == (0.53, 30)
    assert not rule.add(40, 0.40)         # worse: one without progress
    assert rule.add(50, 0.54) and rule.reached  # still within 0.02 of 0.53: the second in a row
    assert not rule.add(60, 0.99)         # reached stays reached; add reports the moment only once
    assert rule.reached


def test_the_coordinator_ends_training_when_held_out_success_plateaus(tmp_path):
    coordinator = Coordinator(make_config(tmp_path, every=2, stop_after_plateau=2, plateau_min_delta=0.05),
                              StopFlag())
    try:
        coordinator.on_held_out_eval(evaluation(0, 0.1, 0.1))
        for step, success in ((2, 0.6), (4, 0.62)):
            coordinator.on_learner_report(report(step))
            coordinator.on_held_out_eval(evaluation(step, success, success))
            assert not coordinator.control().end_training
        coordinator.on_learner_report(report(6))
        coordinator.on_held_out_eval(evaluation(6, 0.58, 0.58))  # the second without progress over 0.6
        control = coordinator.control()
        assert control.end_training and not control.stop  # the learner stops; the run ends after its last step
        coordinator.on_learner_report(report(7, final=True))  # the learner's step after the request
        control = coordinator.control()
        assert control.eval_step == 7 and not control.stop and control.pause_rollout
        coordinator.on_held_out_eval(evaluation(7, 0.6, 0.6))
        assert coordinator.control().stop
    finally:
        coordinator.close()


def test_stop_after_plateau_without_evaluations_is_refused(tmp_path):
    with pytest.raises(Exception, match="eval.stop_after_plateau needs held-out evaluations"):
        make_config(tmp_path, stop_after_plateau=3)


def test_the_learner_stops_when_the_coordinators_control_says_end_training(tmp_path):
    """Rank 0's watch over a real PUB/SUB pair: Controls of another run and without end_training leave
    the stop event alone; the first with it sets the event."""
    import threading

    import zmq

    from horizonrl.learner.channels import EndTrainingWatch
    from horizonrl.protocol import encode

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    watch = EndTrainingWatch(ctx, f"tcp://127.0.0.1:{port}", RUN_ID, stop)
    watch.start()
    try:
        def control(run_id, end):
            return encode(Control(run_id=run_id, learner_step=3, max_turns=2, weight_version=3, end_training=end))

        # ~5 s of messages that must not stop it (PUB drops what it sends before the SUB has connected; on
        # loopback that takes milliseconds)
        quiet_until = time.monotonic() + 5
        while time.monotonic() < quiet_until and not stop.is_set():
            pub.send(control(RUN_ID, False))
            pub.send(control("another-run", True))
            pub.send(b"not msgpack")
            time.sleep(0.05)
        assert not stop.is_set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not stop.is_set():
            pub.send(control(RUN_ID, True))
            stop.wait(0.1)
        assert stop.is_set()
    finally:
        watch.stop()
        pub.close(linger=0)
        ctx.term()
    assert not watch.is_alive()


def test_held_out_scalars_leave_infrastructure_failures_out_of_the_overall_rate():
    s = held_out_scalars(evaluation(4, 0.5, 1.0))
    assert s["eval/success_rate"] == pytest.approx((0.5 * 30 + 1.0 * 10) / 40)
    assert s["eval/episodes_valid"] == 40.0 and s["eval/wall_s"] == 1.5


class TurnsOnlyEngine:
    """Follows a sign that points left or right, answers "go left" to one that points straight: it succeeds
    exactly on the tasks without a straight sign. Records the temperature it was asked for."""

    dead = False

    def __init__(self):
        self.temperatures = []
        self.weights = (0, 0)  # (epoch, version) it holds, as RolloutEngine.weights

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, stop_token_ids):
        self.temperatures.append(temperature)
        await asyncio.sleep(0)
        sign = CharChat().decode(prompt_ids).rsplit("A sign points ", 1)[1].split(".")[0]
        ids = [ord(c) + 100 for c in f"Action: go {sign if sign != 'straight' else 'left'}"] + [EOT]
        return Generation(ids, [-0.5] * len(ids), "stop")


class RecordingSignpost(SignpostEnv):
    resets: list[tuple[int, int]] = []  # (length, task_id) of every episode played

    async def reset(self, task_id):
        RecordingSignpost.resets.append((self.length, task_id))
        return await super().reset(task_id)


def make_recording_env(name, settings):
    return RecordingSignpost(**settings)


async def test_actor_0_plays_the_first_test_tasks_with_the_step_weights_and_sends_one_result(tmp_path):
    config = make_config(tmp_path, every=2, episodes_during_training=6, temperature=0.7)
    RecordingSignpost.resets = []
    engine = TurnsOnlyEngine()
    ctx = zmq.asyncio.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(config.network.endpoint(config.network.report_port))
    actor = Actor(config, 0, StopFlag(), engine, CharChat(), make_recording_env)
    RecordingSignpost.resets = []  # the actor's probes of the environments at start
    engine.weights = (0, 1)
    actor.control = Control(run_id=RUN_ID, learner_step=2, max_turns=3, weight_version=2, eval_step=2)
    evaluating = asyncio.create_task(actor._evaluate_held_out())
    try:
        await asyncio.sleep(0.3)
        assert RecordingSignpost.resets == []  # the engine still holds version 1: it waits for step 2's weights
        engine.weights = (0, 2)
        result = None
        while result is None:
            data = await asyncio.wait_for(pull.recv(), 30)
            try:
                result = decode_as(data, HeldOutEval, run_id=RUN_ID)
            except ProtocolError:  # anything else on the report socket (none is expected here)
                continue
    finally:
        evaluating.cancel()
        await asyncio.gather(evaluating, return_exceptions=True)
        await actor.close()
        pull.close(linger=0)
        ctx.term()
    test2, test3 = SignpostEnv(length=2).task_ids("test")[:6], SignpostEnv(length=3).task_ids("test")[:6]
    assert sorted(t for n, t in RecordingSignpost.resets if n == 2) == sorted(test2)
    assert sorted(t for n, t in RecordingSignpost.resets if n == 3) == sorted(test3)
    assert set(engine.temperatures) == {0.7}
    assert result.learner_step == 2 and result.weight_versions == (2, 2)

    async def no_straight_sign(length, task_id):  # the tasks the engine solves
        env = SignpostEnv(length=length)
        await env.reset(task_id)
        return "straight" not in env._signs

    for name, length, ids in (("signpost", 2, test2), ("signpost3", 3, test3)):
        expected = sum([await no_straight_sign(length, t) for t in ids]) / len(ids)
        assert 0 < expected < 1  # the tasks tell a right count from a wrong one
        assert result.results[name]["success_rate"] == pytest.approx(expected)
        assert result.results[name]["episodes_valid"] == 6.0
    assert actor.counters.episodes == 0 and actor.counters.eval_episodes == 12
    assert not actor.delivery.unacked  # nothing went to the buffer
