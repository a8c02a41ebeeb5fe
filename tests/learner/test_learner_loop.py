"""The learner's loop logic in-process (learner/loop.py), with fake services: what is reported, published and
checkpointed at each step, and how stops, early ends, abandoned broadcasts and resumes go. The real services
run in tests/learner/test_learner_main_loop.py (a learner process against fake peers over ZMQ) and in every
whole-run test."""

from __future__ import annotations

import threading

import pytest
from helpers import make_trajectory

from horizonrl.learner.loop import LearnerServices, LoopSettings, LoopState, Publication, StepOutcome, run_training
from horizonrl.protocol import Batch, encode

RUN = "test-run"


class OneRank:
    def share(self, payload):
        return payload

    def agree_to_stop(self, *reasons):
        return any(reason.is_set() for reason in reasons)

    def from_rank_zero(self, value, what):
        return value


class Batches:
    """Answers ``answers`` requests with a two-group batch; after that, waits as a silent buffer would, until
    asked to stop (then None). ``on_request(step)`` runs first (a test's stop or early end)."""

    def __init__(self, answers: int, on_request=lambda step: None) -> None:
        self.answers, self.on_request = answers, on_request
        self.requests: list[dict] = []

    def request(self, step, *, should_stop, lineage, committed_step):
        self.on_request(step)
        self.requests.append({"step": step, "lineage": list(lineage), "committed_step": committed_step})
        if len(self.requests) > self.answers or should_stop():
            assert should_stop(), "the loop asked for more batches than the test answers, with no stop"
            return None
        groups = [[make_trajectory(f"s{step}g{g}", i, reward=float(i % 2)) for i in range(2)] for g in range(2)]
        return encode(Batch(run_id=RUN, request_id=100 + len(self.requests), groups=groups))


class Reporter:
    def __init__(self) -> None:
        self.reports, self.done_steps, self.abandoned_versions, self.trained = [], [], [], []
        self.finished = None

    def step_trained(self, step):
        self.trained.append(step)

    def report(self, report):
        self.reports.append(report)

    def step_done(self, step, metrics, times, sent):
        self.done_steps.append(step)

    def abandoned(self, version):
        self.abandoned_versions.append(version)

    def done(self, step, stopped_early, checkpoint, weights):
        self.finished = (step, stopped_early, checkpoint)


class Publisher:
    """Records each version; ``abandon_from``: that version's background send is abandoned (a stop came)."""

    def __init__(self, abandon_from: int | None = None, unfinished_send: bool = False) -> None:
        self.versions: list[tuple[int, bool]] = []
        self.abandon_from, self.unfinished_send = abandon_from, unfinished_send
        self.usable = True

    def publish(self, version, *, background):
        assert self.usable, "published through a hub whose send was abandoned"
        self.versions.append((version, background))
        if self.abandon_from is not None and version >= self.abandon_from:
            self.usable = False
            return Publication(abandoned=version)
        return Publication(stats={"total_s": 0.01, "gather_s": 0.005, "bytes": 1e6, "buckets": 1.0,
                                  "members": 1.0, "dropped": 0.0})

    def finish_sending(self, in_flight):
        assert in_flight == max((v for v, _ in self.versions), default=0)
        if self.unfinished_send:
            self.usable = False
            return self.versions[-1][0]
        return None

    def metrics(self):
        return {"weights/members": 1.0}


class Checkpoints:
    def __init__(self) -> None:
        self.saves: list[dict] = []

    def save(self, step, lineage, consumed, since):
        self.saves.append({"step": step, "steps_consumed": [c["step"] for c in consumed], "since": since})
        return f"ckpt/step_{step}"


def train(batch: Batch) -> StepOutcome:
    ids = [t.trajectory_id for group in batch.groups for t in group]
    return StepOutcome(metrics={"loss/policy": 0.5}, num_samples=len(ids), num_tokens=12 * len(ids),
                       num_loss_tokens=6 * len(ids), trained_ids={"trained": ids},
                       accounting_metrics={"batch/trajectories_trained": float(len(ids))}, failed_skipped=0)


def run(total: int, *, answers: int | None = None, save_every: int = 0, sync_every: int = 1, state: LoopState | None = None,
        on_request=lambda step, stop, end: None, publisher: Publisher | None = None):
    stop, end = threading.Event(), threading.Event()
    services = LearnerServices(ranks=OneRank(), batches=Batches(total if answers is None else answers,
                                                                lambda step: on_request(step, stop, end)),
                               reporter=Reporter(), publisher=publisher or Publisher(), checkpointer=Checkpoints(),
                               train=train)
    final = run_training(state or LoopState(lineage=[(0, 0)]), services, LoopSettings(total, save_every, sync_every),
                         run_id=RUN, stop=stop, end_training=end)
    return final, services


def announced(services) -> list[tuple[int, int, bool]]:
    return [(r.step, r.weight_version, r.final) for r in services.reporter.reports]


def test_each_step_is_reported_published_and_the_run_ends_with_a_checkpoint_naming_what_it_trained():
    final, s = run(5, save_every=2)
    assert announced(s) == [(1, 1, False), (2, 2, False), (3, 3, False), (4, 4, False), (5, 5, False), (5, 5, True)]
    assert s.publisher.versions == [(v, True) for v in range(1, 6)]  # each in the background while the next trains
    assert s.reporter.trained == s.reporter.done_steps == [1, 2, 3, 4, 5]
    # save_every=2: steps 2 and 4, and the last one; each names the steps since the one before
    assert s.checkpointer.saves == [{"step": 2, "steps_consumed": [1, 2], "since": 0},
                                    {"step": 4, "steps_consumed": [3, 4], "since": 2},
                                    {"step": 5, "steps_consumed": [5], "since": 4}]
    assert [r.checkpoint for r in s.reporter.reports] == ["", "ckpt/step_2", "", "ckpt/step_4", "", "ckpt/step_5"]
    assert [r["committed_step"] for r in s.batches.requests] == [0, 0, 2, 2, 4]
    assert s.reporter.finished == (5, False, "ckpt/step_5")
    assert final.counters.trajectories_trained == 20 and final.counters.step == 5
    metrics = s.reporter.reports[0].metrics
    for key in ("loss/policy", "batch/reward_mean", "batch/staleness_mean", "time/batch_wait_s", "time/step_s",
                "time/weight_sync_s", "throughput/learner_tokens_per_s", "weights/members", "batch/tokens"):
        assert key in metrics, key
    assert s.reporter.reports[1].metrics["time/weight_sync_s"] == 0.01  # the previous update's


def test_weight_sync_every_sends_every_nth_version_and_the_last_and_reports_only_versions_sent():
    _, s = run(3, sync_every=2)
    assert announced(s) == [(1, 0, False), (2, 2, False), (3, 3, False), (3, 3, True)]
    assert s.publisher.versions == [(2, True), (3, True)]


def test_a_stop_while_waiting_for_a_batch_checkpoints_the_steps_trained_and_sends_nothing_more():
    def stop_at_step_2(step, stop, end):
        if step == 2:
            stop.set()

    _, s = run(50, answers=2, on_request=stop_at_step_2, sync_every=3)
    assert s.reporter.trained == [1, 2]
    assert s.publisher.versions == []  # version 2 was never due, and a stop sends no last weights
    assert s.checkpointer.saves[-1]["step"] == 2
    assert s.reporter.finished == (2, True, "ckpt/step_2")
    assert announced(s)[-1] == (2, 2, True)


def test_an_early_end_between_two_updates_still_sends_the_last_weights_for_the_final_evaluation():
    def end_after_step_2(step, stop, end):
        if step == 2:
            end.set()

    _, s = run(50, on_request=end_after_step_2, sync_every=3)
    # the end is seen at the step boundary before step 3's batch is asked for
    assert s.reporter.trained == [1, 2]
    assert s.publisher.versions == [(2, False)]  # not in the background: the evaluation needs them now
    assert announced(s)[-2:] == [(2, 2, False), (2, 2, True)]  # announced, then sent, then the final report
    assert s.reporter.finished == (2, True, "ckpt/step_2")


def test_an_abandoned_broadcast_is_reported_and_the_hub_is_never_used_again():
    def stop_at_step_3(step, stop, end):
        if step == 3:
            stop.set()

    _, s = run(50, answers=50, on_request=stop_at_step_3, publisher=Publisher(abandon_from=3))
    assert s.publisher.versions == [(1, True), (2, True), (3, True)]
    assert s.reporter.abandoned_versions == [3]
    assert 3 not in s.reporter.done_steps  # its step line says nothing was sent
    assert s.checkpointer.saves[-1]["step"] == 3 and s.reporter.finished == (3, True, "ckpt/step_3")


def test_a_send_still_running_at_the_end_is_abandoned_after_a_stop_but_the_checkpoint_is_written():
    def stop_at_step_2(step, stop, end):
        if step == 2:
            stop.set()

    _, s = run(50, answers=2, on_request=stop_at_step_2, publisher=Publisher(unfinished_send=True))
    assert s.reporter.abandoned_versions == [2]
    assert s.checkpointer.saves[-1]["step"] == 2


@pytest.mark.parametrize("saved", [True, False])
def test_a_resumed_loop_continues_from_its_checkpoint_with_its_lineage(saved):
    state = LoopState(step=4, epoch=1, lineage=[(0, 0), (1, 4)], saved_step=4, published=4)
    final, s = run(6, save_every=3 if saved else 0, state=state)
    assert [r["step"] for r in s.batches.requests] == [4, 5]
    assert all(r["lineage"] == [(0, 0), (1, 4)] for r in s.batches.requests)
    assert all(r.weight_epoch == 1 for r in s.reporter.reports)
    assert s.checkpointer.saves[-1] == {"step": 6, "steps_consumed": [5, 6], "since": 4}
    assert final.published == 6
