"""The coordinator process: owns the turn-budget schedule, the weight version, health
and shutdown, and is the one writer of TensorBoard scalars.

Inputs (PULL): ``LearnerReport`` after each learner step, ``Heartbeat`` from every
process, ``ProcessEvent`` from the launcher (a process died, was restarted, or the launcher
gave up on it), ``Registration`` from every process that serves something. Output (PUB):
``Control`` — completed learner steps, the max-turn budget for episodes started now, the newest
weight version, the stop flag, and every registered endpoint — sent at once on every change and
republished every ``CONTROL_PERIOD_S`` so late subscribers catch up.

The coordinator is the registry (protocol/registry.py): its address is the one every process is
given; the others bind where they run, register there, and find each other in ``Control.endpoints``.

Held-out evaluation during training (``eval.every``): at step 0 (or the step a run resumes
from), every ``eval.every`` steps and at the learner's last step, ``Control.eval_step`` asks actor 0
for one; its ``HeldOutEval`` is logged as ``eval/success_rate`` and ``eval/<env>/...`` at that step (or
at the step of the oldest weights that played it, when the engine had moved past the step asked for).
After the last step the run stays open (rollout paused) until that evaluation is in, at most
``eval.final_wait_s``. With ``eval.stop_after_plateau: K`` the coordinator ends training early once K
evaluations in a row have not beaten the best held-out success by more than ``eval.plateau_min_delta``
(``Control.end_training``: the learner saves and stops at its next step boundary).

After each learner step it writes a status record to stdout (``protocol/status.py``): the launcher
turns it into the console's status block or progress line.

Every message read is counted once, by what became of it: handled (``coordinator/accepted_<kind>``),
undecodable (``coordinator/bad_messages_<error>``), or well-formed but rejected — not this run's truth
(``protocol/report_checks.py``: an unknown process or environment, a number out of range, a learner
report that would take the run back), or, for the kinds that change the run's state, without the run's
key (``coordinator/rejected_<kind>_<reason>``).

The coordinator restarts like every other process (docs/faults.md): it writes what nobody re-sends to
``<output_dir>/coordinator_state.json`` (``core/coordinator_state.py``) and a restarted one reads it
back; the rest comes with the next heartbeats, registrations and reports.

Faults are counted under ``faults/`` in TensorBoard and written one JSON line each to
``<output_dir>/faults.jsonl``: the launcher's events, and when a replacement has recovered
(an actor: its engine is up and joined the weight hub, at the current weights; a buffer: its first
heartbeat, after replaying its log; a learner: its first step; an environment server: it answers
/health, as the launcher reports) with the seconds since its last death.
"""

from __future__ import annotations

import hmac
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import zmq

from horizonrl.core.config import TrainConfig
from horizonrl.protocol import (
    EVENT_DIED,
    EVENT_RECOVERED,
    EVENT_RESTARTED,
    FAILURE_ACTOR_LOST,
    FAILURE_KINDS,
    STOP_CONTEXT,
    STOP_DONE,
    STOP_MAX_TURNS,
    Control,
    EpisodeSample,
    Heartbeat,
    HeldOutEval,
    LearnerReport,
    ProcessEvent,
    ProtocolError,
    Registration,
    decode,
    encode,
)
from horizonrl.protocol.report_checks import (KEYED_KINDS, REJECT_UNAUTHENTICATED, RunShape,
                                              learner_report_order_problem, report_problem)
from horizonrl.protocol.transport import make_socket, wire_security
from horizonrl.protocol.status import BUFFER_CAPACITY, BUFFER_GROUPS, status_record_line
from horizonrl.core.coordinator_state import (CoordinatorSnapshot, IncarnationCounters, PlateauState, Recovering,
                                              load_snapshot, save_snapshot)
from horizonrl.core.run_events import EventLog, RunEvent, iter_events
from horizonrl.core.run_dirs import read_run_key, resumed_step
from horizonrl.core.runtime import RateLimitedLog, StopFlag
from horizonrl.core.schedule import TurnBudgetSchedule
from horizonrl.core.wandb_log import WandbLog, episode_row

log = logging.getLogger("horizonrl.coordinator")

CONTROL_PERIOD_S = 0.5
STOP_BROADCAST_S = 2.0
MAX_REPORT_BYTES = 16 * 1024 * 1024
STATE_SAVE_PERIOD_S = 2.0  # besides every change of what is saved: the counters heartbeats bring
LEARNER_DONE_CHECK_S = 2.0
EVENTS_TAIL_BYTES = 256 * 1024  # where a restarted coordinator looks for the learner's end


@dataclass
class ProcessHealth:
    """Liveness and counters of every process, by incarnation: a restarted process starts its
    cumulative counters from 0 again, so totals add every incarnation's last heartbeat."""

    last_seen: dict[tuple[str, int], float] = field(default_factory=dict)
    current_pid: dict[tuple[str, int], int] = field(default_factory=dict)
    counters: dict[tuple[str, int, int], dict[str, float]] = field(default_factory=dict)  # (role, index, pid)

    def beat(self, hb: Heartbeat) -> dict[str, float] | None:
        """Record a heartbeat; returns the previous incarnation's last counters when this one is new."""
        key = (hb.role, hb.index)
        previous = self.current_pid.get(key)
        self.last_seen[key] = time.monotonic()
        self.current_pid[key] = hb.pid
        self.counters[(hb.role, hb.index, hb.pid)] = hb.counters
        if previous is not None and previous != hb.pid:
            return self.counters.get((hb.role, hb.index, previous), {})
        return None

    def silent(self, timeout_s: float) -> list[str]:
        now = time.monotonic()
        return [f"{r}-{i}" for (r, i), t in self.last_seen.items() if now - t > timeout_s]

    def total(self, role: str, key: str) -> float:
        """A cumulative counter over every incarnation of every process of ``role``."""
        return sum(c.get(key, 0.0) for (r, _, _), c in self.counters.items() if r == role)

    def gauge(self, role: str, key: str) -> float:
        """A level (a depth, a count in progress) over the current incarnations only: a dead process's
        last value is not the state of anything any more."""
        return sum(self.current(r, i).get(key, 0.0) for (r, i) in self.current_pid if r == role)

    def current(self, role: str, index: int) -> dict[str, float]:
        pid = self.current_pid.get((role, index))
        return self.counters.get((role, index, pid), {}) if pid is not None else {}

    def incarnations(self) -> list[IncarnationCounters]:
        return [IncarnationCounters(role, index, pid, dict(counters), self.current_pid.get((role, index)) == pid)
                for (role, index, pid), counters in self.counters.items()]

    def restore(self, incarnations: list[IncarnationCounters]) -> None:
        """A restarted coordinator's health: the counters of every incarnation as last heard, liveness timed
        from now (a process that is gone shows up as silent after the heartbeat timeout)."""
        now = time.monotonic()
        for inc in incarnations:
            self.counters[(inc.role, inc.index, inc.pid)] = dict(inc.counters)
            if inc.current:
                self.current_pid[(inc.role, inc.index)] = inc.pid
                self.last_seen[(inc.role, inc.index)] = now


class RolloutWindow:
    """What the actors did between two learner steps, from their cumulative counters.

    ``rollout/success_rate`` counts every episode the actors finished (no filtering), so
    unlike ``batch/success_mean`` it is not biased by the buffer dropping equal-reward
    groups; it rises only if new weights reach the actors.
    """

    KEYS = ("generated_tokens", "episodes", "completed", "successes", "reward_sum")

    def __init__(self) -> None:
        self._last: tuple[float, dict[str, float]] | None = None

    def update(self, health: "ProcessHealth") -> dict[str, float]:
        now = time.monotonic()
        totals = {k: health.total("actor", k) for k in self.KEYS}
        out: dict[str, float] = {}
        if self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            delta = {k: totals[k] - self._last[1][k] for k in self.KEYS}
            out["rollout/tokens_per_s"] = delta["generated_tokens"] / dt
            out["rollout/episodes_per_s"] = delta["episodes"] / dt
            if delta["completed"] > 0:
                out["rollout/success_rate"] = delta["successes"] / delta["completed"]
                out["rollout/reward_mean"] = delta["reward_sum"] / delta["completed"]
        self._last = (now, totals)
        return out


class Coordinator:
    def __init__(self, config: TrainConfig, stop: StopFlag, *, start_step: int = 0) -> None:
        self.config = config
        self.stop = stop
        self.schedule = TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl)
        self.learner_step = start_step
        self.weight_version = start_step
        self.weight_epoch = 0  # the learner's incarnation: its startup report says which
        self.finished = False
        self.health = ProcessHealth()
        self.window = RolloutWindow()
        self.bad_messages: Counter[str] = Counter()  # by kind: ProtocolError, ForeignRunError, UnexpectedMessage
        self.faults: Counter[str] = Counter()  # faults/<role>_<event>, faults/episodes_lost
        self._recovering: dict[str, tuple[str, float, int]] = {}  # name -> (role, died at, pid or learner epoch then)
        self.recovery_s: dict[str, float] = {}  # role -> seconds from its last death to its recovery
        self.messages_read = 0
        self.accepted: Counter[str] = Counter()  # handled, by kind (the message's tag)
        self.rejected: Counter[str] = Counter()  # <kind>_<reason>: well-formed, not this run's truth
        self.shape = run_shape(config)
        self.run_key = read_run_key(config.output_dir)  # "": a run without a key; nothing to check
        self.restarts = 0  # coordinators before this one in this launch (from the state they left)
        self._bad_log = RateLimitedLog(log)
        self._silent_log = RateLimitedLog(log, 30.0)
        self._write_log = RateLimitedLog(log, 60.0)
        self._started_wall = time.time()
        self._last_report_wall = 0.0
        net = config.network
        self.ctx = zmq.Context()
        self.security = wire_security(self.ctx, net.host, net.curve_keys_dir)
        self.pub = make_socket(self.ctx, zmq.PUB, security=self.security, server=True)
        self.pub.bind(net.endpoint(net.control_port))
        self.pull = make_socket(self.ctx, zmq.PULL, hwm=1024, max_message_bytes=MAX_REPORT_BYTES,
                                security=self.security, server=True)
        self.pull.bind(net.endpoint(net.report_port))
        self.writer = _make_writer(config)
        self.wandb = _make_wandb(config)
        self.events = EventLog(config.output_dir, "coordinator")
        self._wandb_rows: list[list] = []  # episode samples since the last step, logged with its scalars
        # Held-out evaluation during training: the newest step asked for, the steps logged, and (after the
        # learner's last step) until when the run waits for the last one.
        self.eval_step = start_step if config.eval.every else -1
        self.evaluated_steps: set[int] = set()
        self._final_eval_deadline: float | None = None
        self.plateau = HeldOutPlateau(config.eval.stop_after_plateau, config.eval.plateau_min_delta)
        self.endpoints: dict[str, str] = {}  # the registry: the newest registration of each name
        log.info("control on %s, reports on %s; turn budget now %d", net.endpoint(net.control_port),
                 net.endpoint(net.report_port), self.max_turns)

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

    @property
    def rollout_paused(self) -> bool:
        """Backpressure before the work is done: while the buffer holds a full load of
        groups, actors start no new ones (generating them would only make stale data and
        take CPU from the learner). Groups in flight still finish and are delivered."""
        ready = self.health.gauge("buffer", "ready_groups")
        return ready >= self.config.buffer.capacity_groups

    @property
    def awaiting_final_eval(self) -> bool:
        """The learner is done, but the held-out evaluation of its last step is not in yet (nor overdue)."""
        if not self.finished or self._final_eval_deadline is None or self.eval_step in self.evaluated_steps:
            return False
        if time.monotonic() < self._final_eval_deadline:
            return True
        log.warning("no held-out evaluation of step %d within eval.final_wait_s=%.0f s; stopping without it",
                    self.eval_step, self.config.eval.final_wait_s)
        self._final_eval_deadline = None
        return False

    @property
    def done(self) -> bool:
        return (self.finished and not self.awaiting_final_eval) or bool(self.stop)

    @property
    def max_turns(self) -> int:
        return self.schedule.budget_after(self.learner_step)

    def control(self) -> Control:
        return Control(
            run_id=self.config.run.run_id,
            learner_step=self.learner_step,
            max_turns=self.max_turns,
            weight_version=self.weight_version,
            weight_epoch=self.weight_epoch,
            # while the last evaluation runs, no new training groups: they would never be trained on
            pause_rollout=self.rollout_paused or self.awaiting_final_eval,
            stop=self.done,
            eval_step=self.eval_step,
            end_training=self.plateau.reached,
            endpoints=dict(self.endpoints),
        )

    def run(self) -> None:
        last_publish = last_save = last_done_check = 0.0
        finished_at = None
        while True:
            if self.pull.poll(100):
                self._read_reports()
            now = time.monotonic()
            if now - last_save >= STATE_SAVE_PERIOD_S:
                self.save_state()
                last_save = now
            if self.restarts and not self.finished and now - last_done_check >= LEARNER_DONE_CHECK_S:
                self._learner_done_on_disk()
                last_done_check = now
            if now - last_publish >= CONTROL_PERIOD_S:
                self.publish()
                last_publish = now
                silent = self.health.silent(self.config.monitor.heartbeat_timeout_s)
                if silent:
                    self._silent_log.warning("no heartbeat for %.0f s from: %s",
                                             self.config.monitor.heartbeat_timeout_s, ", ".join(silent))
            if self.done and finished_at is None:
                finished_at = now
                self.publish()
            if finished_at is not None and now - finished_at > STOP_BROADCAST_S:
                self.save_state()
                return

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
        """One message from the report socket: decoded, checked, handled — or counted as what was wrong with it
        (nothing a peer sends can stop the coordinator)."""
        self.messages_read += 1
        try:
            message = decode(data, MAX_REPORT_BYTES, self.config.run.run_id)
        except ProtocolError as exc:
            self.bad_messages[type(exc).__name__] += 1
            self._bad_log.warning("rejected malformed report #%d: %s", sum(self.bad_messages.values()), exc)
            return
        handler = self._handlers.get(type(message))
        if handler is None:
            self.bad_messages["UnexpectedMessage"] += 1
            self._bad_log.warning("unexpected %s on the report socket", type(message).__name__)
            return
        kind = type(message).__struct_config__.tag
        problem = self._authority_problem(message) or report_problem(message, self.shape)
        if problem is None and isinstance(message, LearnerReport):
            problem = learner_report_order_problem(message, self.learner_step, self.weight_epoch)
        if problem is not None:
            self.rejected[f"{kind}_{problem[0]}"] += 1
            self._bad_log.warning("rejected %s #%d (%s): %s", kind, sum(self.rejected.values()), problem[0], problem[1])
            return
        self.accepted[kind] += 1
        handler(message)

    @property
    def _handlers(self) -> dict:
        return {Heartbeat: self.on_heartbeat, LearnerReport: self.on_learner_report,
                EpisodeSample: self.on_episode_sample, ProcessEvent: self.on_process_event,
                HeldOutEval: self.on_held_out_eval, Registration: self.on_registration}

    def _authority_problem(self, message) -> tuple[str, str] | None:
        """The kinds that change the run's state come only from processes holding the run's key."""
        if not self.run_key or not isinstance(message, KEYED_KINDS):
            return None
        if hmac.compare_digest(message.key.encode(), self.run_key.encode()):
            return None
        return REJECT_UNAUTHENTICATED, "without the run's key (<output_dir>/run_key)"

    def on_heartbeat(self, beat: Heartbeat) -> None:
        paused = self.rollout_paused
        previous = self.health.beat(beat)
        if previous is not None and beat.role == "actor":
            # The episodes the dead incarnation was playing were never produced: infrastructure failures.
            lost = previous.get("episodes_in_progress", 0.0)
            self.faults["episodes_lost"] += lost
            log.warning("actor-%d is back (pid %d); %d episodes it was playing were lost", beat.index, beat.pid, lost)
        name = f"{beat.role}-{beat.index}" if beat.role == "actor" else beat.role
        pending = self._recovering.get(name)
        if pending is not None and beat.role in ("actor", "buffer") and beat.pid != pending[2]:
            # A buffer is back at its first heartbeat (it replayed its log first); an actor once its
            # engine is up and has joined the weight hub (it holds the current weights and may play).
            if beat.role == "buffer" or beat.counters.get("weight_joins", 0.0) > 0:
                self._recovered(name)
        if self.rollout_paused != paused:
            self.publish()  # pause or resume the actors at once

    def on_registration(self, registration: Registration) -> None:
        """A process serves ``endpoints`` now (a restarted one: somewhere new). Published at once, so
        its clients reconnect within one Control."""
        changed = {k: v for k, v in registration.endpoints.items() if self.endpoints.get(k) != v}
        if not changed:
            return
        self.endpoints.update(changed)
        log.info("%s (pid %d) registered %s", registration.name, registration.pid,
                 ", ".join(f"{k}={v}" for k, v in sorted(changed.items())))
        self.events.emit(RunEvent.ENDPOINTS_REGISTERED, name=registration.name, endpoints=changed)
        self.publish()
        self.save_state()

    def on_process_event(self, event: ProcessEvent) -> None:
        """The launcher's supervision decisions: counted, written to faults.jsonl, and timed to recovery."""
        if event.event == EVENT_RECOVERED:
            if event.name in self._recovering:
                self._recovered(event.name)
            return
        self.faults[f"{event.role}_{event.event}"] += 1
        self._fault_line({"event": event.event, "name": event.name, "role": event.role, "exit_code": event.exit_code,
                          "restarts": event.restarts, "delay_s": event.delay_s, "at": event.at,
                          "learner_step": self.learner_step})
        if event.event == EVENT_RESTARTED and event.role == "coordinator" and event.name in self._recovering:
            self._recovered(event.name)  # this process is the replacement, and it is reading
        if event.event == EVENT_DIED and event.name == "actor-0" and self.awaiting_final_eval:
            # after the learner's last step the launcher restarts nothing: that evaluation will not come
            log.warning("actor-0 died during the held-out evaluation of the last step; stopping without it")
            self._final_eval_deadline = None
        if event.event == EVENT_DIED:
            name = "learner" if event.role == "learner" else event.name
            then = self.weight_epoch if event.role == "learner" else self.health.current_pid.get(
                (event.role, int(event.name.rsplit("-", 1)[1]) if event.role == "actor" else 0), -1)
            # A process that dies again before it recovered: its time to recover counts from this death.
            self._recovering[name] = (event.role, event.at or time.time(), then)
        # INFO: the launcher, which decided it, has already said so on the console.
        log.info("%s %s%s", event.name, event.event,
                 f" (exit code {event.exit_code})" if event.exit_code is not None else
                 f" after {event.delay_s:.1f} s (restart {event.restarts})" if event.event == EVENT_RESTARTED else "")

    def _recovered(self, name: str) -> None:
        role, died_at, _ = self._recovering.pop(name)
        seconds = time.time() - died_at
        self.faults[f"{role}_recovered"] += 1
        self.recovery_s[role] = seconds
        self._fault_line({"event": "recovered", "name": name, "role": role, "recovery_s": round(seconds, 2),
                          "at": time.time(), "learner_step": self.learner_step})
        log.info("%s recovered %.1f s after it died", name, seconds)

    def _fault_line(self, record: dict) -> None:
        self._append_line("faults.jsonl", record)
        self.save_state()

    def _append_line(self, name: str, record: dict) -> None:
        """One JSON line to a file of the run directory; a full or read-only disk costs the line, not the run."""
        try:
            with open(self.config.output_dir / name, "ab") as out:
                out.write(msgspec.json.encode(record) + b"\n")
        except OSError as exc:
            self.faults["coordinator_write_failures"] += 1
            self._write_log.warning("cannot write %s: %s", self.config.output_dir / name, exc)

    def on_learner_report(self, report: LearnerReport) -> None:
        pending = self._recovering.get("learner")
        if pending is not None and not report.startup and report.weight_epoch > pending[2]:
            self._recovered("learner")  # the restarted learner made its first step
        repeated = report.step == self.learner_step and report.step > 0
        self._last_report_wall = time.time()
        self.learner_step = report.step
        self.weight_version = report.weight_version
        self.weight_epoch = report.weight_epoch
        self.finished = report.final
        self._ask_for_eval(report)
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
        scalars = dict(report.metrics)
        scalars.update(self.window.update(self.health))
        scalars["schedule/max_turns"] = float(self.schedule.max_turns(report.step))
        scalars["schedule/next_max_turns"] = float(self.max_turns)
        # Cumulative episode outcomes by kind: failures (never trained on) and the agent's own endings.
        for kind in FAILURE_KINDS[1:]:
            scalars[f"rollout/failures/{kind}"] = self.health.total("actor", f"failures_{kind}")
        scalars[f"rollout/failures/{FAILURE_ACTOR_LOST}"] = self.faults["episodes_lost"]
        scalars.update({f"faults/{key}": float(value) for key, value in self.faults.items()})
        scalars.update({f"faults/recovery_s/{role}": seconds for role, seconds in self.recovery_s.items()})
        for reason in (STOP_DONE, STOP_MAX_TURNS, STOP_CONTEXT):
            scalars[f"rollout/stop/{reason}"] = self.health.total("actor", f"stop_{reason}")
        # The agent's own errors: turns whose reply named no valid action (the environment said so and went on).
        invalid, turns = self.health.total("actor", "invalid_actions"), self.health.total("actor", "completed_turns")
        scalars["rollout/agent/invalid_actions"] = invalid
        if turns:
            scalars["rollout/agent/invalid_action_rate"] = invalid / turns
        # Weight updates, cumulative over actors: how long the engines generated nothing for them (the stall),
        # the receive (in the background with rollout.weight_staging), the load into the engine, and the wait for
        # the engine to end its step before a pause (generating meanwhile: not stall).
        for key in ("weight_stall_s", "weight_transfer_s", "weight_load_s", "weight_pause_wait_s", "weight_updates",
                    "weight_versions_skipped", "continued_requests", "kept_requests", "lost_stage_messages"):
            scalars[f"rollout/{key}"] = self.health.total("actor", key)
        scalars["rollout/paused_s"] = self.health.total("actor", "paused_s")
        scalars["rollout/send_wait_s"] = self.health.total("actor", "send_wait_s")
        # Cumulative, over all actors: what `horizonrl bench` and idle-share plots read.
        for key in ("generated_tokens", "episodes", "engine_idle_s", "engine_wall_s", "engine_request_s"):
            scalars[f"rollout/{key}_total"] = self.health.total("actor", key)
        scalars["time/elapsed_s"] = time.time() - self._started_wall
        scalars.update(self.message_scalars())
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, report.step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.scalars(scalars, report.step)  # the same names as TensorBoard's
            self.wandb.episodes(self._wandb_rows, report.step)
            self._wandb_rows = []
        self._write_status(report.step, scalars)

    def _ask_for_eval(self, report: LearnerReport) -> None:
        """Ask for a held-out evaluation every ``eval.every`` steps and after the last one."""
        every = self.config.eval.every
        if not every or report.startup:
            return
        if report.step > self.eval_step and (report.step % every == 0 or report.final):
            self.eval_step = report.step
        if report.final and self.eval_step not in self.evaluated_steps and self._final_eval_deadline is None:
            self._final_eval_deadline = time.monotonic() + self.config.eval.final_wait_s
            log.info("waiting up to %.0f s for the held-out evaluation of step %d", self.config.eval.final_wait_s,
                     self.eval_step)

    def on_held_out_eval(self, result: HeldOutEval) -> None:
        """Log one held-out evaluation (once: a restarted actor 0 may repeat it) at the step of the oldest
        weights that played it: the step asked for, or later when the engine had moved on by then (a
        step-0 evaluation that actor 0 could only start after the learner's first steps is not the
        starting policy, and the curve must not say it is)."""
        if result.learner_step in self.evaluated_steps:
            return
        self.evaluated_steps.add(result.learner_step)
        step = max(result.learner_step, result.weight_versions[0])
        scalars = held_out_scalars(result)
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            # W&B's steps only go forward: log at the current step, with the evaluated step beside it
            self.wandb.scalars({**scalars, "eval/learner_step": float(step)}, self.learner_step)
        played = "" if step == result.learner_step else f" (asked for step {result.learner_step})"
        log.info("held-out success at step %d%s: %.3f (%s)", step, played, scalars.get("eval/success_rate", 0.0),
                 ", ".join(f"{env} {r['success_rate']:.3f}" for env, r in result.results.items()))
        self.events.emit(RunEvent.HELD_OUT_EVALUATED, step=step, success_rate=scalars.get("eval/success_rate", 0.0))
        if not self.finished and self.plateau.add(step, scalars.get("eval/success_rate", 0.0)):
            log.info("held-out success has not beaten its best (%.3f at step %d) by more than %.3f for %d "
                     "evaluations: ending training (eval.stop_after_plateau)", self.plateau.best,
                     self.plateau.best_step, self.plateau.min_delta, self.plateau.patience)
            self.events.emit(RunEvent.TRAINING_ENDED_EARLY, step=step, reason="eval.stop_after_plateau")
            self.publish()
        self.save_state()
        if self.finished:
            self.publish()  # the last evaluation is in: stop now

    def _write_status(self, step: int, scalars: dict[str, float], *, startup: bool = False) -> None:
        """The step's status record on stdout, for the console of the launcher (protocol/status.py)."""
        status = {**scalars, BUFFER_GROUPS: self.health.gauge("buffer", "ready_groups"),
                  BUFFER_CAPACITY: float(self.config.buffer.capacity_groups)}
        sys.stdout.write(status_record_line(step, self.config.learner.total_steps, status, startup=startup) + "\n")
        sys.stdout.flush()

    def on_episode_sample(self, sample: EpisodeSample) -> None:
        """What the agent did, for a person: TensorBoard text (episodes/<env>), one JSON line in episodes.jsonl,
        and a row of the next step's W&B episode table."""
        if self.writer is not None:
            self.writer.add_text(f"episodes/{sample.env}", episode_markdown(sample), self.learner_step)
        if self.wandb is not None:
            self._wandb_rows.append(episode_row(sample, self.learner_step))
        self._append_line("episodes.jsonl", {"learner_step": self.learner_step, **msgspec.structs.asdict(sample)})

    def message_scalars(self) -> dict[str, float]:
        """Every message on the report socket is read once and counted by what became of it (and its kind)."""
        scalars = {"coordinator/messages_read": float(self.messages_read),
                   "coordinator/bad_messages": float(sum(self.bad_messages.values())),
                   "coordinator/rejected": float(sum(self.rejected.values())),
                   "coordinator/restarts": float(self.restarts)}
        for prefix, counts in (("bad_messages", self.bad_messages), ("rejected", self.rejected),
                               ("accepted", self.accepted)):
            scalars.update({f"coordinator/{prefix}_{kind}": float(n) for kind, n in counts.items()})
        return scalars

    # ------------------------------------------------------------------ restarts

    def save_state(self) -> None:
        """What a restarted coordinator cannot learn from the others (core/coordinator_state.py)."""
        save_snapshot(self.config.output_dir, self.snapshot())

    def snapshot(self) -> CoordinatorSnapshot:
        plateau = self.plateau
        deadline = self._final_eval_deadline
        return CoordinatorSnapshot(
            run_id=self.config.run.run_id, saved_at=time.time(), started_at=self._started_wall,
            last_report_at=self._last_report_wall, restarts=self.restarts, learner_step=self.learner_step,
            weight_version=self.weight_version, weight_epoch=self.weight_epoch, finished=self.finished,
            eval_step=self.eval_step, evaluated_steps=sorted(self.evaluated_steps),
            final_eval_deadline=None if deadline is None else time.time() + deadline - time.monotonic(),
            plateau=PlateauState(None if plateau.best_step < 0 else plateau.best, plateau.best_step,
                                 plateau.without_progress, plateau.reached),
            endpoints=dict(self.endpoints), faults=dict(self.faults), recovery_s=dict(self.recovery_s),
            recovering=[Recovering(name, role, died_at, then)
                        for name, (role, died_at, then) in self._recovering.items()],
            incarnations=self.health.incarnations(), messages_read=self.messages_read,
            bad_messages=dict(self.bad_messages), rejected=dict(self.rejected), accepted=dict(self.accepted))

    def restore(self, saved: CoordinatorSnapshot) -> None:
        """Continue where the coordinator before this one was (it died; the launcher started this one)."""
        self.restarts = saved.restarts + 1
        self._started_wall, self._last_report_wall = saved.started_at, saved.last_report_at
        self.learner_step, self.weight_version, self.weight_epoch = (saved.learner_step, saved.weight_version,
                                                                     saved.weight_epoch)
        self.finished = saved.finished
        self.eval_step, self.evaluated_steps = saved.eval_step, set(saved.evaluated_steps)
        if saved.final_eval_deadline is not None:
            self._final_eval_deadline = time.monotonic() + saved.final_eval_deadline - time.time()
        p = saved.plateau
        self.plateau.best = float("-inf") if p.best is None else p.best
        self.plateau.best_step, self.plateau.without_progress, self.plateau.reached = (p.best_step, p.without_progress,
                                                                                       p.reached)
        self.endpoints = dict(saved.endpoints)
        self.faults.update(saved.faults)
        self.recovery_s = dict(saved.recovery_s)
        self._recovering = {r.name: (r.role, r.died_at, r.then) for r in saved.recovering}
        self.health.restore(saved.incarnations)
        self.messages_read = saved.messages_read
        for counts, kept in ((self.bad_messages, saved.bad_messages), (self.rejected, saved.rejected),
                             (self.accepted, saved.accepted)):
            counts.update(kept)
        log.warning("restarted (coordinator %d of this launch): learner step %d, weights %s (epoch, version), %d "
                    "endpoints registered; state of %.1f s ago", self.restarts + 1, self.learner_step,
                    (self.weight_epoch, self.weight_version), len(self.endpoints), time.time() - saved.saved_at)
        self.events.emit(RunEvent.COORDINATOR_RESTORED, restarts=self.restarts, step=self.learner_step,
                         weight_epoch=self.weight_epoch)
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
                self.on_learner_report(LearnerReport(
                    run_id=self.config.run.run_id, step=step, weight_version=self.weight_version if step ==
                    self.learner_step else step, weight_epoch=self.weight_epoch, final=True,
                    checkpoint=str(event.get("checkpoint") or "")))
                return

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
        self.pub.close(linger=0)
        self.pull.close(linger=0)
        if self.security is not None:
            self.security.stop()
        self.ctx.term()


class HeldOutPlateau:
    """``eval.stop_after_plateau``: reached once ``patience`` evaluations in a row have not beaten the best
    held-out success so far by more than ``min_delta`` (never with ``patience`` 0). The first evaluation
    sets the best; only progress moves it, so a slow climb (rises below ``min_delta`` that add up) still
    counts as progress once it has added up. A reached plateau stays reached."""

    def __init__(self, patience: int, min_delta: float) -> None:
        self.patience = patience
        self.min_delta = min_delta
        self.best = float("-inf")
        self.best_step = -1
        self.without_progress = 0
        self.reached = False

    def add(self, step: int, success: float) -> bool:
        """Count one evaluation (in step order); True when this one reaches the plateau."""
        if not self.patience or self.reached:
            return False
        if success > self.best + self.min_delta or self.best_step < 0:
            self.best, self.best_step, self.without_progress = success, step, 0
            return False
        self.without_progress += 1
        self.reached = self.without_progress >= self.patience
        return self.reached


def episode_markdown(sample: EpisodeSample) -> str:
    """One episode as TensorBoard markdown: a header line, then each observation and reply as a code block."""
    outcome = f"failed ({sample.failure})" if sample.failure else ("success" if sample.success else "no success")
    lines = [f"**{sample.env} task {sample.task_id}** · actor {sample.actor_id} · weights v{sample.weight_version} · "
             f"{outcome} · reward {sample.reward:.3g} · score {sample.score:.3g} · "
             f"{sample.num_turns}/{sample.max_turns} turns · ended: {sample.stop_reason}", ""]
    turn = 0
    for role, text in sample.transcript:
        turn += role == "reply"
        label = f"reply {turn}" if role == "reply" else ("task" if turn == 0 else f"observation after reply {turn}")
        # TensorBoard renders markdown: a fenced block shows the text verbatim (backticks inside cannot close it)
        lines += [f"*{label}*", "", "~~~~text", text.replace("~~~~", "~ ~ ~ ~"), "~~~~", ""]
    return "\n".join(lines)


def held_out_scalars(result: HeldOutEval) -> dict[str, float]:
    """``eval/<env>/<metric>`` per environment, and ``eval/success_rate`` over all of them (successes over
    valid episodes: infrastructure failures are not the agent's doing and are left out, as in docs/evaluation.md)."""
    scalars: dict[str, float] = {}
    successes = valid = 0.0
    for env, metrics in sorted(result.results.items()):
        for key, value in metrics.items():
            scalars[f"eval/{env}/{key}"] = float(value)
        valid += metrics.get("episodes_valid", 0.0)
        successes += metrics.get("success_rate", 0.0) * metrics.get("episodes_valid", 0.0)
    if valid:
        scalars["eval/success_rate"] = successes / valid
    scalars["eval/episodes_valid"] = valid
    scalars["eval/weight_version_min"], scalars["eval/weight_version_max"] = (float(v) for v in result.weight_versions)
    scalars["eval/wall_s"] = result.wall_s
    return scalars


def run_shape(config: TrainConfig) -> RunShape:
    """Who may report what in this run (protocol/report_checks.py)."""
    schedule = TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl)
    return RunShape(num_actors=config.rollout.num_actors, learner_ranks=config.learner.num_ranks,
                    env_names=frozenset(spec.name for spec in config.envs), total_steps=config.learner.total_steps,
                    max_turns=max(max(config.algorithm.rounds_ctrl.rounds), schedule.final_max_turns,
                                  config.eval.max_turns or 0),
                    env_servers=len(config.envs))


def _make_writer(config: TrainConfig):
    from torch.utils.tensorboard import SummaryWriter  # torch only here, and lazily

    return SummaryWriter(log_dir=str(config.output_dir / "tensorboard"))


def _make_wandb(config: TrainConfig) -> WandbLog | None:
    settings = config.monitor.wandb
    if settings is None:
        return None
    return WandbLog(settings.model_dump(), config.output_dir, config.run.run_id, config.model_dump(mode="json"))


def main(config: TrainConfig) -> int:
    stop = StopFlag().install()
    coordinator = Coordinator.for_run(config, stop)
    try:
        coordinator.run()
    finally:
        coordinator.close()
    log.info("stopped at learner step %d (%s)", coordinator.learner_step,
             "finished" if coordinator.finished else stop.signal_name or "stopped")
    return 0
