"""The coordinator process: reads every report (``intake.py``), keeps the jobs below up to date, publishes
``Control`` at once on every change and every ``CONTROL_PERIOD_S`` (so late subscribers catch up), and
saves what a restarted coordinator cannot learn from the others.

The jobs, each its own module: where training is and the rollout pause (``schedule.py``), the registry of
endpoints (``registry.py``), the processes' health (``health.py``), the fault ledger (``faults.py``),
held-out evaluation (``held_out.py``), each step's scalars (``metrics.py``) and where they are written
(``writers.py``). This module wires them: one handler per message kind, and the loop.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

import zmq

from horizonrl.coordinator.faults import FaultLedger
from horizonrl.coordinator.health import ProcessHealth, RolloutWindow
from horizonrl.coordinator.held_out import HeldOutSchedule
from horizonrl.coordinator.intake import MAX_REPORT_BYTES, ReportIntake
from horizonrl.coordinator.metrics import actor_scalars, step_scalars
from horizonrl.coordinator.registry import EndpointRegistry
from horizonrl.coordinator.schedule import TrainingProgress
from horizonrl.coordinator.writers import RunWriters
from horizonrl.core.config import TrainConfig
from horizonrl.core.coordinator_state import (CoordinatorSnapshot, PlateauState, Recovering, load_snapshot,
                                              save_snapshot)
from horizonrl.core.disk import Backoff
from horizonrl.core.run_dirs import read_run_key, resumed_step
from horizonrl.core.run_events import EventLog, RunEvent, iter_events
from horizonrl.core.runtime import RateLimitedLog, StopFlag
from horizonrl.protocol import (EVENT_DIED, Control, EpisodeSample, Heartbeat, HeldOutEval, LearnerReport,
                                ProcessEvent, Registration, encode)
from horizonrl.protocol.counters import ActorGauges, BufferGauges
from horizonrl.protocol.status import BUFFER_CAPACITY, BUFFER_GROUPS
from horizonrl.protocol.transport import bind_held, make_socket, wire_security

log = logging.getLogger("horizonrl.coordinator")

CONTROL_PERIOD_S = 0.5
STOP_BROADCAST_S = 2.0
STATE_SAVE_PERIOD_S = 2.0  # besides every change of what is saved: the counters heartbeats bring
LEARNER_DONE_CHECK_S = 2.0
EVENTS_TAIL_BYTES = 256 * 1024  # where a restarted coordinator looks for the learner's end


class Coordinator:
    def __init__(self, config: TrainConfig, stop: StopFlag, *, start_step: int = 0) -> None:
        self.config = config
        self.stop = stop
        self.progress = TrainingProgress(config, start_step)
        self.health = ProcessHealth()
        self.window = RolloutWindow()
        self.intake = ReportIntake(config, read_run_key(config.output_dir))
        self.registry = EndpointRegistry()
        self.held_out = HeldOutSchedule(config.eval, start_step)
        self.writers = RunWriters(config)
        self.ledger = FaultLedger(lambda record: self.writers.append_line(config.run_dir.faults, record),
                                  self.save_state, lambda: self.progress.learner_step)
        self.restarts = 0  # coordinators before this one in this launch (from the state they left)
        self._silent_log = RateLimitedLog(log, 30.0)
        self._started_wall = time.time()
        self._last_report_wall = 0.0
        net = config.network
        self.ctx = zmq.Context()
        self.security = wire_security(self.ctx, net.host, net.curve_keys_dir)
        self.events = EventLog(config.output_dir, "coordinator")
        self.pub = make_socket(self.ctx, zmq.PUB, security=self.security, server=True)
        self.pull = make_socket(self.ctx, zmq.PULL, hwm=1024, max_message_bytes=MAX_REPORT_BYTES,
                                security=self.security, server=True)
        for sock, port in ((self.pub, net.control_port), (self.pull, net.report_port)):
            bind_coordinator_port(sock, net.endpoint(port), port, stop, self.events)
        self._handlers = {Heartbeat: self.on_heartbeat, LearnerReport: self.on_learner_report,
                          EpisodeSample: self.on_episode_sample, ProcessEvent: self.on_process_event,
                          HeldOutEval: self.on_held_out_eval, Registration: self.on_registration}
        log.info("control on %s, reports on %s; turn budget now %d", net.endpoint(net.control_port),
                 net.endpoint(net.report_port), self.progress.max_turns)

    @classmethod
    def for_run(cls, config: TrainConfig, stop: StopFlag) -> "Coordinator":
        """The run's coordinator. A resumed run continues the schedule from the checkpoint's completed
        step (the turn budget is a pure function of it, so it matches an uninterrupted run at every step)."""
        coordinator = cls(config, stop, start_step=resumed_step(config.learner.resume, config.output_dir))
        snapshot = load_snapshot(config.output_dir, config.run.run_id)
        if snapshot is not None:
            coordinator.restore(snapshot)
        coordinator.save_state()
        return coordinator

    # ------------------------------------------------------------------ the state, as the others see it
    # (the loop's, and what the tests of a whole run read)

    @property
    def learner_step(self) -> int:
        return self.progress.learner_step

    @property
    def finished(self) -> bool:
        return self.progress.finished

    @property
    def rollout_paused(self) -> bool:
        return self.progress.rollout_paused(self.health.gauges(BufferGauges),
                                            self.health.levels(ActorGauges, self.config.monitor.heartbeat_timeout_s))

    @property
    def awaiting_final_eval(self) -> bool:
        return self.held_out.awaiting_final(self.progress.finished)

    @property
    def done(self) -> bool:
        return (self.finished and not self.awaiting_final_eval) or bool(self.stop)

    @property
    def endpoints(self) -> dict[str, str]:
        return self.registry.endpoints

    @property
    def run_key(self) -> str:
        return self.intake.run_key

    @property
    def messages_read(self) -> int:
        return self.intake.messages_read

    @messages_read.setter
    def messages_read(self, value: int) -> None:
        self.intake.messages_read = value

    @property
    def accepted(self):
        return self.intake.accepted

    @property
    def rejected(self):
        return self.intake.rejected

    @property
    def bad_messages(self):
        return self.intake.bad_messages

    def control(self) -> Control:
        p = self.progress
        return Control(
            run_id=self.config.run.run_id, learner_step=p.learner_step, max_turns=p.max_turns,
            weight_version=p.weight_version, weight_epoch=p.weight_epoch,
            # while the last evaluation runs, no new training groups: they would never be trained on
            pause_rollout=self.rollout_paused or self.awaiting_final_eval,
            stop=self.done, eval_step=self.held_out.eval_step, end_training=self.held_out.plateau.reached,
            endpoints=dict(self.registry.endpoints), key=self.run_key)  # signed: subscribers check it

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        last_publish = last_save = last_done_check = 0.0
        finished_at = None
        while True:
            if self.pull.poll(100):
                self._read_reports()
            now = time.monotonic()
            if now - last_save >= STATE_SAVE_PERIOD_S:
                self.save_state()
                self.events.retry()  # what a full disk refused, once it takes it
                last_save = now
            if self.restarts and not self.finished and now - last_done_check >= LEARNER_DONE_CHECK_S:
                self._learner_done_on_disk()
                last_done_check = now
            if now - last_publish >= CONTROL_PERIOD_S:
                self.publish()
                last_publish = now
                self._warn_of_silence()
            if self.done and finished_at is None:
                finished_at = now
                self.publish()
            if finished_at is not None and now - finished_at > STOP_BROADCAST_S:
                self.save_state()
                return

    def _warn_of_silence(self) -> None:
        timeout_s = self.config.monitor.heartbeat_timeout_s
        silent = self.health.silent(timeout_s)
        if silent:
            self._silent_log.warning("no heartbeat for %.0f s from: %s", timeout_s, ", ".join(silent))

    def publish(self) -> None:
        self.pub.send(encode(self.control()))

    def _read_reports(self) -> None:
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.take(data)

    def take(self, data: bytes) -> None:
        """One message from the report socket: decoded, checked, handled — or counted as what was wrong with it."""
        message = self.intake.accept(data, tuple(self._handlers), self.progress.learner_step,
                                     self.progress.weight_epoch, self.registry.pids)
        if message is not None:
            self._handlers[type(message)](message)

    # ------------------------------------------------------------------ one handler per message kind

    def on_heartbeat(self, beat: Heartbeat) -> None:
        paused = self.rollout_paused
        self.ledger.on_heartbeat(beat, self.health.beat(beat))
        if self.rollout_paused != paused:
            self.publish()  # pause or resume the actors at once

    def on_registration(self, registration: Registration) -> None:
        """A process serves its endpoints now (a restarted one: somewhere new). Published at once, so its
        clients reconnect within one Control."""
        changed = self.registry.register(registration)
        if changed:
            self.events.emit(RunEvent.ENDPOINTS_REGISTERED, name=registration.name, endpoints=changed)
            self.publish()
            self.save_state()

    def on_process_event(self, event: ProcessEvent) -> None:
        """The launcher's supervision decisions: counted, written to faults.jsonl, and timed to recovery."""
        self.ledger.on_process_event(event, lambda: self._incarnation_of(event))
        if event.event == EVENT_DIED and event.name == "actor-0" and self.awaiting_final_eval:
            self.held_out.evaluator_died()

    def _incarnation_of(self, event: ProcessEvent) -> int:
        """What will tell a replacement of the process that ``event`` is about from the process that died: the
        learner's weight epoch, or the pid of the incarnation current now."""
        if event.role == "learner":
            return self.progress.weight_epoch
        index = int(event.name.rsplit("-", 1)[1]) if event.role == "actor" else 0
        return self.health.current_pid.get((event.role, index), -1)

    def on_learner_report(self, report: LearnerReport) -> None:
        if not report.startup:
            self.ledger.learner_stepped(report.weight_epoch)  # a restarted learner made its first step
        self._last_report_wall = time.time()
        repeated = self.progress.take(report)
        self.held_out.after_report(report)
        self.publish()  # actors learn the new version and budget at once
        self.save_state()
        if report.startup:
            log.info("learner started at step %d (weight epoch %d)", report.step, report.weight_epoch)
            self._write_status(report.step, {}, startup=True)
            return
        if report.checkpoint:
            log.info("checkpoint saved: %s", report.checkpoint)
        if repeated or report.step == 0:
            # the learner's closing report repeats its last step (its scalars are written), or it stops before
            # its first step (there are none)
            return
        scalars = step_scalars(report.metrics, self.window, self.health, self.progress.scalars(report.step),
                               actor_scalars(self.health, self.ledger.faults["episodes_lost"]), self.ledger.scalars(),
                               {"time/elapsed_s": time.time() - self._started_wall},
                               self.intake.scalars(self.restarts))
        self.ledger.count_write_failure(self.writers.step(scalars, report.step))
        self._write_status(report.step, scalars)

    def on_held_out_eval(self, result: HeldOutEval) -> None:
        """Chart one held-out evaluation (once), and end training at a plateau of held-out success."""
        taken = self.held_out.take(result)
        if taken is None:
            return
        step, scalars = taken
        self.ledger.count_write_failure(self.writers.held_out(scalars, step, self.learner_step))
        played = "" if step == result.learner_step else f" (asked for step {result.learner_step})"
        success = scalars.get("eval/success_rate", 0.0)
        log.info("held-out success at step %d%s: %.3f (%s)", step, played, success,
                 ", ".join(f"{env} {r['success_rate']:.3f}" for env, r in result.results.items()))
        self.events.emit(RunEvent.HELD_OUT_EVALUATED, step=step, success_rate=success)
        plateau = self.held_out.plateau
        if not self.finished and plateau.add(step, success):
            log.info("held-out success has not beaten its best (%.3f at step %d) by more than %.3f for %d "
                     "evaluations: ending training (eval.stop_after_plateau)", plateau.best, plateau.best_step,
                     plateau.min_delta, plateau.patience)
            self.events.emit(RunEvent.TRAINING_ENDED_EARLY, step=step, reason="eval.stop_after_plateau")
            self.publish()
        self.save_state()
        if self.finished:
            self.publish()  # the last evaluation is in: stop now

    def on_episode_sample(self, sample: EpisodeSample) -> None:
        self.ledger.count_write_failure(self.writers.episode_sample(sample, self.learner_step))

    def _write_status(self, step: int, scalars: dict[str, float], *, startup: bool = False) -> None:
        status = {**scalars, BUFFER_GROUPS: self.health.gauges(BufferGauges).ready_groups,
                  BUFFER_CAPACITY: float(self.config.buffer.capacity_groups)}
        self.writers.status(step, status, startup=startup)

    # ------------------------------------------------------------------ restarts

    def save_state(self) -> None:
        """What a restarted coordinator cannot learn from the others (core/coordinator_state.py)."""
        save_snapshot(self.config.output_dir, self.snapshot())

    def snapshot(self) -> CoordinatorSnapshot:
        p, held, plateau, deadline = self.progress, self.held_out, self.held_out.plateau, self.held_out.final_deadline
        return CoordinatorSnapshot(
            run_id=self.config.run.run_id, saved_at=time.time(), started_at=self._started_wall,
            last_report_at=self._last_report_wall, restarts=self.restarts, learner_step=p.learner_step,
            weight_version=p.weight_version, weight_epoch=p.weight_epoch, finished=p.finished,
            eval_step=held.eval_step, evaluated_steps=sorted(held.evaluated_steps),
            final_eval_deadline=None if deadline is None else time.time() + deadline - time.monotonic(),
            plateau=PlateauState(None if plateau.best_step < 0 else plateau.best, plateau.best_step,
                                 plateau.without_progress, plateau.reached),
            endpoints=dict(self.registry.endpoints), faults=dict(self.ledger.faults),
            recovery_s=dict(self.ledger.recovery_s),
            recovering=[Recovering(name, role, died_at, then)
                        for name, (role, died_at, then) in self.ledger.recovering.items()],
            incarnations=self.health.incarnations(), messages_read=self.intake.messages_read,
            bad_messages=dict(self.intake.bad_messages), rejected=dict(self.intake.rejected),
            accepted=dict(self.intake.accepted))

    def restore(self, saved: CoordinatorSnapshot) -> None:
        """Continue where the coordinator before this one was (it died; the launcher started this one)."""
        self.restarts = saved.restarts + 1
        self._started_wall, self._last_report_wall = saved.started_at, saved.last_report_at
        p = self.progress
        p.learner_step, p.weight_version, p.weight_epoch = saved.learner_step, saved.weight_version, saved.weight_epoch
        p.finished = saved.finished
        held = self.held_out
        held.eval_step, held.evaluated_steps = saved.eval_step, set(saved.evaluated_steps)
        if saved.final_eval_deadline is not None:
            held.final_deadline = time.monotonic() + saved.final_eval_deadline - time.time()
        plateau, kept = held.plateau, saved.plateau
        plateau.best = float("-inf") if kept.best is None else kept.best
        plateau.best_step, plateau.without_progress = kept.best_step, kept.without_progress
        plateau.reached = kept.reached
        self.registry.endpoints = dict(saved.endpoints)
        self.ledger.faults.update(saved.faults)
        self.ledger.recovery_s = dict(saved.recovery_s)
        self.ledger.recovering = {r.name: (r.role, r.died_at, r.then) for r in saved.recovering}
        self.health.restore(saved.incarnations)
        self.intake.messages_read = saved.messages_read
        for counts, kept_counts in ((self.intake.bad_messages, saved.bad_messages),
                                    (self.intake.rejected, saved.rejected), (self.intake.accepted, saved.accepted)):
            counts.update(kept_counts)
        log.warning("restarted (coordinator %d of this launch): learner step %d, weights %s (epoch, version), %d "
                    "endpoints registered; state of %.1f s ago", self.restarts + 1, p.learner_step,
                    (p.weight_epoch, p.weight_version), len(self.registry.endpoints), time.time() - saved.saved_at)
        self.events.emit(RunEvent.COORDINATOR_RESTORED, restarts=self.restarts, step=p.learner_step,
                         weight_epoch=p.weight_epoch)
        self.publish()

    def _learner_done_on_disk(self) -> None:
        """The learner's closing report, sent while no coordinator was listening, went down with the learner's
        socket when it exited; its event of the end is in the run directory. One of this launch (after its first
        coordinator started) ends the run as the report would have."""
        for event in iter_events(self.config.output_dir, RunEvent.LEARNER_DONE, tail_bytes=EVENTS_TAIL_BYTES):
            step = event.get("step")
            if (event.get("time", 0.0) >= self._started_wall and isinstance(step, int)
                    and self.learner_step <= step <= self.config.learner.total_steps):
                log.warning("the learner ended at step %d while no coordinator was listening (its event says so): "
                            "ending the run", step)
                self.events.emit(RunEvent.LEARNER_DONE_FROM_DISK, step=step)
                p = self.progress
                self.on_learner_report(LearnerReport(
                    run_id=self.config.run.run_id, step=step, weight_version=p.weight_version
                    if step == p.learner_step else step, weight_epoch=p.weight_epoch, final=True,
                    checkpoint=str(event.get("checkpoint") or "")))
                return

    def close(self) -> None:
        self.writers.close()
        self.pub.close(linger=0)
        self.pull.close(linger=0)
        if self.security is not None:
            self.security.stop()
        self.ctx.term()


BIND_RETRY_LIMIT_S = 600.0


def bind_coordinator_port(sock: zmq.Socket, endpoint: str, port: int, stop: StopFlag, events: EventLog,
                          limit_s: float = BIND_RETRY_LIMIT_S) -> None:
    """Bind one of the coordinator's ports: on the socket the local launcher holds for it (nobody else can have
    taken it: protocol/transport.py ``hold_port``), or else plainly — and a port another process holds (a
    squatter, or the dead coordinator's lingering socket) is tried again with back-off for up to ``limit_s``
    inside this process, instead of exiting and spending a restart of the supervisor's budget each second."""
    backoff = Backoff(first_s=0.5, max_s=5.0, limit_s=limit_s)
    while True:
        try:
            held = bind_held(sock, endpoint, port)
            if backoff.since is not None:
                log.warning("bound %s after %.0f s", endpoint, backoff.succeeded())
            log.debug("bound %s%s", endpoint, " (the launcher's socket)" if held else "")
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or stop:
                raise
            again, wait_s = backoff.failed()
            if backoff.retries == 1:
                log.warning("%s is taken by another process; trying again for up to %.0f s", endpoint, limit_s)
                events.emit(RunEvent.PORT_TAKEN, endpoint=endpoint)
            if not again:
                raise RuntimeError(f"{endpoint} was still taken by another process after {limit_s:.0f} s") from exc
            stop.wait(wait_s)


def main(config: TrainConfig) -> int:
    return run_coordinator(config, StopFlag().install())


def run_coordinator(config: TrainConfig, stop: StopFlag, status_out: Callable[[str], None] | None = None) -> int:
    """The coordinator until the run finishes or ``stop``; ``status_out`` takes each step's status record (default:
    stdout, which the launcher reads)."""
    coordinator = Coordinator.for_run(config, stop)
    if status_out is not None:
        coordinator.writers.status_out = status_out
    try:
        coordinator.run()
    finally:
        coordinator.close()
    log.info("stopped at learner step %d (%s)", coordinator.learner_step,
             "finished" if coordinator.finished else stop.signal_name or "stopped")
    return 0
