"""The learner's training loop, as a function of the services it uses.

    while steps remain and no rank was asked to stop:
        batch_wait   payload = ranks.share(batches.request(step))      rank 0 asks the buffer; all get its bytes
        step         outcome = train(batch)                             advantages, PPO updates, LR schedule
        save         every save_every steps: checkpointer.save(...)     a collective
        report       reporter.step(...)                                 announces the version the engines get
        weight_sync  publisher.publish(step) every weight_sync_every    a collective; rank 0 sends
    then: the last weights if training ended between two updates, the last checkpoint, the final report.

Every rank runs this same loop with no branch on its rank: rank 0 is given the real services (the
buffer's client, the coordinator's report socket, the weight hub, the event log) and the other ranks
null ones that take part only in the collectives. Tests give it fakes and run it in-process
(tests/learner/test_learner_loop.py); ``learner/services.py`` holds the real ones and ``learner/main.py`` wires them.

Invariants kept here: every trajectory of a batch is trained on or left out for a counted reason
(``accounting``); the checkpoint of step N names what every step since the previous checkpoint
trained on (``consumed``), so a resume replays exactly what was not trained; the version a report
announces is the version the engines are sent next.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Protocol

from horizonrl.core.runtime import PhaseTimer
from horizonrl.protocol import Batch, LearnerReport, decode_as
from horizonrl.protocol.counters import LearnerCounters


class RankGroup(Protocol):
    """What the learner's ranks agree on (collectives; trivial with one rank)."""

    def share(self, payload: bytes | None) -> bytes | None:
        """Rank 0's bytes on every rank (None: rank 0 got none and the loop ends)."""

    def agree_to_stop(self, *reasons: threading.Event) -> bool:
        """True on every rank when any rank has any reason set."""

    def from_rank_zero(self, value: int, what: str) -> int:
        """Rank 0's ``value`` on every rank."""


class BatchSource(Protocol):
    """Rank 0: the buffer. Other ranks: returns None at once (they get rank 0's bytes)."""

    def request(self, step: int, *, should_stop: Callable[[], bool], lineage: list[tuple[int, int]],
                committed_step: int) -> bytes | None: ...


class Reporter(Protocol):
    """Rank 0: the coordinator's report socket, the log and the run's events. Other ranks: nothing."""

    def step_trained(self, step: int) -> None: ...

    def report(self, report: LearnerReport) -> None: ...

    def step_done(self, step: int, metrics: dict[str, float], times: dict[str, float], sent: str) -> None: ...

    def abandoned(self, version: int) -> None: ...

    def done(self, step: int, stopped_early: bool, checkpoint: str, weights: dict[str, float]) -> None: ...


@dataclass
class Publication:
    """What publishing one version did: ``stats`` of the hub on rank 0 (empty elsewhere), or the version whose
    send was ``abandoned`` (after a stop, by engines that did not take it)."""

    stats: dict[str, float] = field(default_factory=dict)
    abandoned: int | None = None


class WeightPublisher(Protocol):
    """Rank 0: the weight hub (gather and send). Other ranks: their part of the gather."""

    def publish(self, version: int, *, background: bool) -> Publication: ...

    def finish_sending(self, in_flight: int) -> int | None:
        """Wait for the background send of version ``in_flight`` at the end; the version abandoned when it had
        to be (a stop, then the grace), else None."""

    def metrics(self) -> dict[str, float]: ...

    @property
    def usable(self) -> bool:
        """False once a send was abandoned: its members may be mid-version, so nothing more is sent."""


class Checkpointer(Protocol):
    def save(self, step: int, lineage: list[tuple[int, int]], consumed: list[dict], since: int) -> str:
        """Collective: the model and the training state at ``step``; returns the checkpoint's path."""


@dataclass
class StepOutcome:
    """What one optimizer step on a batch produced."""

    metrics: dict[str, float]  # loss/, ratio/, grad/, optim/ ...
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    trained_ids: dict  # trajectory ids by outcome (batching.BatchAccounting.ids)
    accounting_metrics: dict[str, float]
    failed_skipped: int


@dataclass(frozen=True)
class LoopSettings:
    total_steps: int
    save_every: int
    weight_sync_every: int

    @classmethod
    def from_config(cls, config) -> "LoopSettings":
        return cls(config.learner.total_steps, config.learner.save_every, config.rollout.weight_sync_every)


@dataclass
class LoopState:
    """Where the loop stands; the start state comes from a resumed checkpoint (or step 0)."""

    step: int = 0
    epoch: int = 0  # this learner incarnation's weight epoch
    lineage: list[tuple[int, int]] = field(default_factory=list)
    saved_step: int = 0  # the newest checkpointed (or resumed-from) step
    published: int = 0  # the newest version the engines were sent
    consumed: list[dict] = field(default_factory=list)  # what each step since saved_step trained on
    checkpoint: str = ""
    counters: LearnerCounters = field(default_factory=LearnerCounters)  # the learner's heartbeat


@dataclass
class LearnerServices:
    ranks: RankGroup
    batches: BatchSource
    reporter: Reporter
    publisher: WeightPublisher
    checkpointer: Checkpointer
    train: Callable[[Batch], StepOutcome]


def run_training(state: LoopState, services: LearnerServices, settings: LoopSettings, *, run_id: str,
                 stop: threading.Event, end_training: threading.Event) -> LoopState:
    """Train until ``settings.total_steps``, a stop signal (``stop``) or the coordinator's request to end
    early (``end_training``); then send the last weights (when ended early), checkpoint and report."""
    s = services
    last_sync: dict[str, float] = {}
    while state.step < settings.total_steps and not s.ranks.agree_to_stop(stop, end_training):
        timer = PhaseTimer()
        with timer("batch_wait"):
            payload = s.ranks.share(s.batches.request(
                state.step, should_stop=lambda: stop.is_set() or end_training.is_set(), lineage=state.lineage,
                committed_step=state.saved_step))
        if payload is None:
            break  # rank 0 was asked to stop while waiting
        batch = decode_as(payload, Batch)  # rank 0 checked it (BatchClient); every rank holds the same bytes
        with timer("step"):
            outcome = s.train(batch)
        state.step += 1
        step = state.step
        s.reporter.step_trained(step)
        state.consumed.append({"step": step, "request_id": batch.request_id, "trajectories": outcome.trained_ids})
        _count(state.counters, step, outcome)
        if settings.save_every and step % settings.save_every == 0 and step < settings.total_steps:
            with timer("save"):
                state.checkpoint = s.checkpointer.save(step, state.lineage, state.consumed, state.saved_step)
                state.saved_step, state.consumed = step, []
        metrics = step_metrics(batch, outcome, step, timer.seconds, last_sync, s.publisher.metrics())
        # rollout.weight_sync_every: the same decision on every rank (the publish is collective).
        send_now = step % settings.weight_sync_every == 0 or step == settings.total_steps
        # The report announces the version: the engines start receiving and wait for the buckets.
        s.reporter.report(LearnerReport(run_id=run_id, step=step, weight_version=step if send_now else state.published,
                                        weight_epoch=state.epoch, metrics=metrics,
                                        checkpoint=state.checkpoint if state.saved_step == step else ""))
        sent = ""
        if send_now:
            # Gathered on every rank; rank 0 sends in the background while the next step trains.
            publication = s.publisher.publish(step, background=True)
            state.published = step
            if publication.abandoned is not None:
                s.reporter.abandoned(publication.abandoned)
                continue
            last_sync = publication.stats
            sent = _describe(publication.stats)
        s.reporter.step_done(step, metrics, timer.seconds, sent or
                             f"weights not sent (every {settings.weight_sync_every} steps)")
    return finish(state, s, settings, run_id=run_id, stop=stop)


def finish(state: LoopState, s: LearnerServices, settings: LoopSettings, *, run_id: str,
           stop: threading.Event) -> LoopState:
    """After the last step: the send in flight ends (or is abandoned after a stop), the last weights go out if
    training ended between two updates (the final evaluation plays them; not after a stop signal, which ends at
    once), the last steps are checkpointed, and the final report goes to the coordinator."""
    abandoned = s.publisher.finish_sending(state.published) if s.publisher.usable else None
    if abandoned is not None:
        s.reporter.abandoned(abandoned)
    unsent = state.published < state.step
    # Rank 0 decides for all: the publish is collective.
    if unsent and s.ranks.from_rank_zero(int(not stop.is_set() and s.publisher.usable),
                                         "decision to send the last weights"):
        s.reporter.report(LearnerReport(run_id=run_id, step=state.step, weight_version=state.step,
                                        weight_epoch=state.epoch))
        s.publisher.publish(state.step, background=False)
        state.published = state.step
    if state.step > state.saved_step and state.step > 0:
        state.checkpoint = s.checkpointer.save(state.step, state.lineage, state.consumed, state.saved_step)
        state.saved_step, state.consumed = state.step, []
    stopped_early = state.step < settings.total_steps
    s.reporter.done(state.step, stopped_early, state.checkpoint, s.publisher.metrics())
    s.reporter.report(LearnerReport(run_id=run_id, step=state.step, weight_version=state.step,
                                    weight_epoch=state.epoch, metrics={"learner/stopped_early": float(stopped_early)},
                                    checkpoint=state.checkpoint, final=True))
    return state


def step_metrics(batch: Batch, outcome: StepOutcome, step: int, times: dict[str, float],
                 last_sync: dict[str, float], publisher_metrics: dict[str, float]) -> dict[str, float]:
    """Everything the report of ``step`` carries to TensorBoard."""
    return {
        **outcome.metrics,
        **batch_metrics(batch, learner_version=step - 1),  # the version the batch was asked for at
        **outcome.accounting_metrics,
        "batch/loss_tokens": float(outcome.num_loss_tokens),
        "batch/tokens": float(outcome.num_tokens),
        **{f"time/{name}_s": seconds for name, seconds in times.items()},
        "time/gather_s": last_sync.get("gather_s", 0.0),  # of the previous update (gathering is part of sending)
        "time/weight_sync_s": last_sync.get("total_s", 0.0),  # of the previous update
        "throughput/learner_tokens_per_s": outcome.num_tokens / max(times.get("step", 0.0), 1e-9),
        **publisher_metrics,
    }


def batch_metrics(batch: Batch, learner_version: int) -> dict[str, float]:
    """What the batch says about the actors: returns, success, turns, policy lag, per environment."""
    trajectories = [t for group in batch.groups for t in group]
    metrics = {"batch/groups": float(len(batch.groups)), "batch/trajectories": float(len(trajectories))}
    if trajectories:
        staleness = [learner_version - t.oldest_version for t in trajectories]
        metrics.update({
            "batch/reward_mean": _mean(t.reward for t in trajectories),
            "batch/success_mean": _mean(float(t.success) for t in trajectories),
            "batch/turns_mean": _mean(t.num_turns - len(t.summary_turns) for t in trajectories),  # the env's
            "batch/max_turns": float(max(t.max_turns for t in trajectories)),
            "batch/staleness_mean": _mean(staleness),
            "batch/staleness_max": float(max(staleness)),
        })
    by_env: dict[str, list] = defaultdict(list)
    for trajectory in trajectories:
        by_env[trajectory.env].append(trajectory)
    for env, members in by_env.items():
        metrics[f"env/{env}/success_mean"] = _mean(float(t.success) for t in members)
        metrics[f"env/{env}/reward_mean"] = _mean(t.reward for t in members)
    metrics.update({f"buffer/{name}": float(value) for name, value in batch.buffer_stats.items()})
    return metrics


def _count(counters: LearnerCounters, step: int, outcome: StepOutcome) -> None:
    counters.step = counters.weight_version = step
    counters.trajectories_trained += outcome.num_samples
    counters.tokens_trained += outcome.num_tokens
    counters.failed_skipped += outcome.failed_skipped


def _describe(stats: dict[str, float]) -> str:
    if not stats:
        return "weights gathered"
    return (f"gather {stats['gather_s']:.2f}s sync {stats['total_s']:.3f}s ({stats['bytes'] / 1e6:.1f} MB in "
            f"{stats['buckets']:.0f} buckets to {stats['members']:.0f} engine workers"
            + (f", {stats['dropped']:.0f} dropped)" if stats["dropped"] else ")"))


def _mean(values) -> float:
    values = list(values)
    return float(sum(values) / len(values)) if values else 0.0
