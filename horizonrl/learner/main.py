"""The learner process, run once per rank (torchrun-style env vars: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

This module sets a rank up — device, process group, the sharded model, a resumed checkpoint, on
rank 0 the channels to the buffer and the coordinator and the weight hub — and hands the loop
(``loop.py``: batch_wait, step, save, report, weight_sync) the services of this rank: rank 0 the
real ones, the other ranks the null ones that only take part in the collectives.

Rank 0 hosts the weight hub (weight_broadcast.py): engines join it whenever they start (or
restart) and get the newest version at once — at start-up that is version ``step`` (0, or the
step a resumed run continues from) — so the learner never waits for the actors to start. Every
trajectory of a batch is either trained on or left out for a counted reason (``batch/*_skipped``,
see batching.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from horizonrl.core.adapter_format import CHECKPOINT_ADAPTER_DIR
from horizonrl.core.config import TrainConfig
from horizonrl.core.disk import Backoff
from horizonrl.core.placement import (choose_backends, is_colocated, learner_device_index, local_device_type,
                                      visible_gpus)
from horizonrl.core.run_dirs import RunDir, read_run_key
from horizonrl.core.run_events import EventLog, NullEventLog, RunEvent
from horizonrl.learner.batching import samples_from_batch
from horizonrl.learner.turn_advantages import GiGPOSettings
from horizonrl.learner.loop import (LearnerServices, LoopSettings, LoopState, Publication, StepOutcome,
                                    run_training)
from horizonrl.learner.checkpoint import (CheckpointWriteError, checkpoint_dir, disk_refusal, load_train_state,
                                         resolve_resume, save_train_state)
from horizonrl.learner.step_watchdog import StepWatchdog
from horizonrl.learner.lora import LoraSettings, adapter_to_send, merged_state_dict, save_adapter
from horizonrl.learner.model import (
    gather_full_state_dict,
    build_sharded_model,
    learner_precision,
    torch_dtype,
    save_hf_checkpoint,
    weights_to_send,
)
from horizonrl.learner.train_step import AdvantageSettings, LossSettings, UpdateSettings, lr_multiplier, train_on_batch
from horizonrl.core.schedule import TurnBudgetSchedule
from horizonrl.protocol import (ENDPOINT_COLOCATED_ENGINE, ENDPOINT_WEIGHTS, ENDPOINT_WEIGHTS_EPOCH, Batch,
                                LearnerReport, learner_rendezvous_name)
from horizonrl.protocol.counters import LearnerCounters
from horizonrl.protocol.registry import LEARNER_GANG_ENV
from horizonrl.protocol.transport import keep_collectives_on, split_endpoint, tcp_endpoint, wire_security
from horizonrl.protocol.weights import ALIGN_BYTES

log = logging.getLogger("horizonrl.learner")

# Not (yet) in LearnerConfig: extra slack on the learner's own process group, whose ranks
# wait on rank 0 while it waits for a batch or broadcasts weights.
PROCESS_GROUP_SLACK_S = 300.0
STOP_SEND_GRACE_S = 5.0  # at a stop, how long a weight broadcast in progress may still take
CHECKPOINT_RETRY_LIMIT_S = 600.0  # a disk refusing a checkpoint this long is not coming back: the learner stops
# Colocated: how long the learner waits for the engine on its GPU to start (a large model's load and CUDA-graph
# capture take minutes; an actor whose engine fails is restarted by the launcher and registers when it is up).
COLOCATED_ENGINE_START_S = 1800.0




@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int  # 0: rendezvous through the coordinator (rank 0 registers its store; see _init_process_group)
    gang: str = "0"  # this learner incarnation's id (the launcher's $HORIZONRL_LEARNER_GANG), for that rendezvous

    @classmethod
    def from_environ(cls) -> "RankInfo":
        env = os.environ
        return cls(
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT") or 0),
            gang=env.get(LEARNER_GANG_ENV, "0"),
        )


@dataclass
class Trainables:
    """What the optimizer steps touch, and what a checkpoint holds."""

    model: Any
    optimizer: Any
    scheduler: Any
    reference: Any = None  # frozen π_ref (learner.use_kl_loss)
    critic: Any = None  # value model (adv_estimator=gae)
    critic_optimizer: Any = None
    critic_scheduler: Any = None

    def checkpoint_parts(self) -> dict[str, Any]:
        return dict(model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, critic=self.critic,
                    critic_optimizer=self.critic_optimizer, critic_scheduler=self.critic_scheduler)


def build_trainables(config: TrainConfig, device: torch.device) -> Trainables:
    """Policy (+ reference, + critic), each FSDP-sharded, with AdamW and the LR schedule."""
    lc = config.learner

    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_multiplier(s, lc.lr_warmup_steps, lc.total_steps, lc.lr_schedule, lc.min_lr_ratio))

    # Meta-device init, sharded, rank 0 alone reads the weights (model.py); fp32 master weights,
    # compute in learner.compute_dtype (core/precision.py).
    precision = learner_precision(config, device)

    def build(kind, lora=None):
        return build_sharded_model(config.model.path, kind=kind, policy=precision, device=device,
                                   activation_checkpointing=lc.checkpointing, lora=lora,
                                   seed=config.run.seed, compile_layers=lc.compile and kind == "policy")

    model = build("policy", LoraSettings.from_config(config))
    # With learner.lora only the adapters require gradients: AdamW keeps state for them alone.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lc.lr,
                                  weight_decay=lc.weight_decay)
    out = Trainables(model, optimizer, schedule(optimizer))
    if lc.use_kl_loss and lc.kl_loss_coef > 0:
        out.reference = build("reference")
    if config.algorithm.adv_estimator == "gae":
        out.critic = build("critic")
        out.critic_optimizer = torch.optim.AdamW(out.critic.parameters(), lr=config.algorithm.critic_lr or lc.lr,
                                                 weight_decay=lc.weight_decay)
        out.critic_scheduler = schedule(out.critic_optimizer)
    return out


@dataclass
class Resources:
    """Everything that must be released on the way out, whatever way that is."""

    context: Any = None  # zmq.Context (rank 0)
    security: Any = None
    batches: Any = None
    reports: Any = None
    heartbeat: Any = None
    end_training_watch: Any = None
    weight_hub: Any = None
    weight_hub_abandoned: bool = False  # a send thread may still be blocked in it: do not touch it
    step_watchdog: Any = None  # bounds a step's time, and a stop's wait for it (step_watchdog.py)
    events: EventLog = NullEventLog()  # rank 0 writes the run's events (core/run_events.py)

    def close(self) -> None:
        if self.step_watchdog is not None:
            self.step_watchdog.close()
        for thread in (self.heartbeat, self.end_training_watch):
            if thread is not None:
                thread.stop()
        for channel in (self.batches, self.reports):
            if channel is not None:
                channel.close()
        if self.weight_hub is not None and not self.weight_hub_abandoned:
            self.weight_hub.close()
        if self.security is not None:
            self.security.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.context is not None:
            self.context.term()


def main(config: TrainConfig) -> int:
    """Train for ``config.learner.total_steps`` steps; 0 on success or a requested stop, 1 on failure."""
    ranks = RankInfo.from_environ()
    stop = threading.Event()
    _install_stop_handlers(stop)
    resources = Resources()
    try:
        train(config, ranks, stop, resources)
        return 0
    except Exception:
        log.exception("learner rank %d failed", ranks.rank)
        return 1
    finally:
        resources.close()


def train(config: TrainConfig, ranks: RankInfo, stop: threading.Event, res: Resources) -> None:
    """Set up this rank (device, channels on rank 0, process group, model, resume, weight hub), then run the
    loop (loop.py) with the services of this rank."""
    lc = config.learner
    is_main = ranks.rank == 0
    backend, device = _backend_and_device(config, ranks.local_rank, stop)
    if device.type == "cpu":
        # The learner ranks share their cores (resources.learner_cpus), or, without a partition, this host's
        # cores with the actors' engines; oversubscribed torch threads run several times slower than one each.
        cpus = config.resources.learner_cpus
        sharing = ranks.world_size if cpus else ranks.world_size + config.rollout.num_actors
        torch.set_num_threads(max(1, (len(cpus) if cpus else os.cpu_count() or 1) // sharing))
    torch.manual_seed(config.run.seed)
    # Every wait on the learner's own ranks is bounded by this: a rank may wait for rank 0 through a
    # whole batch wait and a weight update.
    control_timeout_s = lc.batch_timeout_s + lc.weight_sync_timeout_s + PROCESS_GROUP_SLACK_S
    counters = LearnerCounters()
    # The coordinator's request to end early (eval.stop_after_plateau): like a stop signal at the step
    # boundaries, but nothing is cut short — the last weights still reach every engine for the final evaluation.
    end_training = threading.Event()
    if is_main:
        _open_report_channel(config, res)
    _init_process_group(config, ranks, backend, control_timeout_s, res, stop)
    if is_main:
        _open_rank_zero_channels(config, res, counters, end_training)

    start = time.perf_counter()
    tr = build_trainables(config, device)
    log.info("model %s loaded and sharded over %d ranks (%s) in %.1f s%s%s", config.model.path, ranks.world_size,
             backend, time.perf_counter() - start, " + reference" if tr.reference is not None else "",
             " + critic" if tr.critic is not None else "")
    res.step_watchdog = StepWatchdog.for_run(config).start()
    step, lineage = _resume(config, tr, res)
    # This incarnation's weights are a new epoch, branching off the checkpoint's lineage at ``step``.
    epoch = _from_rank_zero(next_weight_epoch(config.output_dir) if is_main else 0, control_timeout_s, "weight epoch")
    lineage.append((epoch, step))
    engine_dtype = torch_dtype(learner_precision(config, device).engine_dtype)  # weights go in the engine's dtype
    if is_main:
        _open_weight_hub(config, res, backend, epoch)
    # Collective: every joining engine gets these weights first (no members yet: only gathers).
    lora = LoraSettings.from_config(config)
    publish_weights(tr.model, res.weight_hub, version=step, epoch=epoch, bucket_mb=lc.weight_bucket_mb,
                    dtype=engine_dtype, stop=stop, lora=lora)
    if is_main:
        res.weight_hub.start()
        log.info("weight hub on port %d: engines join it with weights %s (epoch, version)", res.weight_hub.port,
                 (epoch, step))
        res.reports.send(LearnerReport(run_id=config.run.run_id, step=step, weight_version=step, weight_epoch=epoch,
                                       startup=True))

    services = LearnerServices(
        ranks=DistributedRanks(ranks.rank, control_timeout_s),
        batches=BufferBatches(res.batches, lc) if is_main else NoBatches(),
        reporter=RunReporter(res.reports, res.events) if is_main else NullReporter(),
        publisher=(HubPublisher(tr.model, res, epoch, lc.weight_bucket_mb, engine_dtype, stop, lora) if is_main
                   else GatherOnly(tr.model, lc.weight_bucket_mb, engine_dtype, lora)),
        checkpointer=TrainStateCheckpointer(config, tr, res, ranks, counters, control_timeout_s),
        train=train_step_function(config, tr, ranks, device, res.step_watchdog, first_step=step + 1, epoch=epoch),
    )
    state = LoopState(step=step, epoch=epoch, lineage=lineage, saved_step=step, published=step, counters=counters)
    res.events.emit(RunEvent.LEARNER_STARTED, ranks=ranks.world_size, backend=backend, device=device.type,
                    resumed_step=step, epoch=epoch)
    run_training(state, services, LoopSettings.from_config(config), run_id=config.run.run_id, stop=stop,
                 end_training=end_training)


def _open_report_channel(config: TrainConfig, res: Resources) -> None:
    """Rank 0: the run's events and the report socket to the coordinator (the rendezvous may register on it)."""
    import zmq

    from horizonrl.learner.channels import ReportSender

    net = config.network
    res.events = EventLog(config.output_dir, "learner-0")
    res.context = zmq.Context()
    res.security = wire_security(res.context, net.host, net.curve_keys_dir)
    res.reports = ReportSender(res.context, net.endpoint(net.report_port), res.security,
                               key=read_run_key(config.output_dir))


def _open_rank_zero_channels(config: TrainConfig, res: Resources, counters: LearnerCounters,
                             end_training: threading.Event) -> None:
    """Rank 0: heartbeats, the coordinator's Control (an early end; where a registered buffer is), the buffer."""
    from horizonrl.learner.channels import BatchClient, BatchLimits, ControlWatch, HeartbeatThread

    net, run_id = config.network, config.run.run_id
    # What the coordinator knows (its Control): an early end, where a registered buffer is, and which report it
    # has taken — the newest one goes again with the heartbeats until it has (ReportSender.unacknowledged).
    res.end_training_watch = watch = ControlWatch(res.context, net.endpoint(net.control_port), run_id, end_training,
                                                  res.security, key=read_run_key(config.output_dir))
    watch.start()
    res.heartbeat = HeartbeatThread(res.context, net.endpoint(net.report_port), counters, run_id, res.security,
                                    key=read_run_key(config.output_dir),
                                    unacknowledged=lambda: res.reports.unacknowledged(watch.control))
    res.heartbeat.start()
    res.batches = BatchClient(res.context, net.endpoint(net.batch_port) if net.batch_port else None, run_id,
                              config.model.vocab_size, res.security,
                              registry=(lambda: watch.endpoints) if not net.batch_port else None,
                              limits=BatchLimits.for_run(config), key=read_run_key(config.output_dir))


def _resume(config: TrainConfig, tr: Trainables, res: Resources) -> tuple[int, list[tuple[int, int]]]:
    """The step and weight lineage to continue from (0 and none for a fresh run); restores the training state."""
    resume_from = resolve_resume(config.learner.resume, config.output_dir)
    if resume_from is None:
        return 0, []
    state = load_train_state(resume_from, **tr.checkpoint_parts())
    if res.batches is not None:
        res.batches.next_request_id = int(state["data_cursor"]["next_request_id"])
    log.info("resumed from %s at step %d", resume_from, int(state["step"]))
    return int(state["step"]), [tuple(pair) for pair in state.get("lineage", [(0, 0)])]


def _open_weight_hub(config: TrainConfig, res: Resources, backend: str, epoch: int) -> None:
    """Rank 0: the hub engines join, registered before the startup report announces the epoch (an engine that
    sees the new epoch in Control finds the new hub in the same Control)."""
    from horizonrl.learner.weight_broadcast import WeightHub

    net, lc = config.network, config.learner
    res.weight_hub = WeightHub(net.bind_address(), net.weight_port, backend="nccl" if backend == "nccl" else "gloo",
                               timeout_s=lc.weight_sync_timeout_s, run_id=config.run.run_id,
                               bucket_bytes=weight_bucket_bytes(lc.weight_bucket_mb),
                               run_key=read_run_key(config.output_dir))
    res.reports.register(config.run.run_id, "learner-0", {
        ENDPOINT_WEIGHTS: tcp_endpoint(net.advertised_host(), res.weight_hub.port),
        ENDPOINT_WEIGHTS_EPOCH: str(epoch)})


def train_step_function(config: TrainConfig, tr: Trainables, ranks: RankInfo, device: torch.device,
                        watchdog: StepWatchdog | None = None, first_step: int = 1, epoch: int = 0):
    """One optimizer step on a batch (every rank, its share of the samples): advantages, ppo_epochs x mini-batches
    of updates, then the LR schedule; bounded in time by ``watchdog`` (step_watchdog.py)."""
    loss_settings, adv_settings = LossSettings.from_config(config), AdvantageSettings.from_config(config)
    update_settings = UpdateSettings.from_config(config)
    steps = [first_step - 1]  # the watchdog names the step it ends

    def train(batch: Batch) -> StepOutcome:
        steps[0] += 1
        # The weights being trained are version steps[0] − 1 of this epoch: the engine's, where it has caught up.
        samples, accounting = samples_from_batch(batch, config.algorithm.norm_adv_by_std_in_grpo,
                                                 config.algorithm.adv_estimator, config.algorithm.gamma,
                                                 current_weights=(epoch, steps[0] - 1),
                                                 gigpo=GiGPOSettings.from_config(config))
        with watchdog.step(steps[0]) if watchdog is not None else nullcontext():
            metrics = train_on_batch(
                tr.model, tr.optimizer, samples, rank=ranks.rank, world_size=ranks.world_size, settings=loss_settings,
                update=update_settings, device=device, advantage=adv_settings, reference=tr.reference,
                critic=tr.critic, critic_optimizer=tr.critic_optimizer,
            )
        metrics["optim/lr"] = tr.scheduler.get_last_lr()[0]
        tr.scheduler.step()
        if tr.critic_scheduler is not None:
            tr.critic_scheduler.step()
        return StepOutcome(metrics=metrics, num_samples=len(samples), num_tokens=sum(s.num_tokens for s in samples),
                           num_loss_tokens=sum(s.num_loss_tokens for s in samples), trained_ids=accounting.ids,
                           accounting_metrics=accounting.metrics(), failed_skipped=sum(accounting.failed.values()))

    return train


# ---------------------------------------------------------------------------- the loop's services (loop.py)


class DistributedRanks:
    """The learner's process group: every collective bounded by ``timeout_s``."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank, self.timeout_s = rank, timeout_s

    def share(self, payload: bytes | None) -> bytes | None:
        from horizonrl.learner.channels import share_bytes

        return share_bytes(payload, self.rank)

    def agree_to_stop(self, *reasons: threading.Event) -> bool:
        return _all_agree_to_stop(reasons, self.timeout_s)

    def from_rank_zero(self, value: int, what: str) -> int:
        return _from_rank_zero(value, self.timeout_s, what)


class BufferBatches:
    """Rank 0's batches: ``learner.groups_per_step`` groups from the buffer (channels.BatchClient)."""

    def __init__(self, client, learner_config) -> None:
        self.client, self.lc = client, learner_config

    def request(self, step: int, *, should_stop, lineage, committed_step: int) -> bytes | None:
        lc = self.lc
        return self.client.request(step, lc.groups_per_step, lc.batch_timeout_s, should_stop, lineage=lineage,
                                   committed_step=committed_step, resend_s=lc.batch_resend_s)


class NoBatches:
    """The other ranks ask nobody: they get rank 0's bytes."""

    def request(self, step: int, **_) -> None:
        return None


class RunReporter:
    """Rank 0: reports to the coordinator, a log line per step, the run's events."""

    def __init__(self, sender, events: EventLog) -> None:
        self.sender, self.events = sender, events

    def step_trained(self, step: int) -> None:
        self.events.emit(RunEvent.STEP_TRAINED, step=step)

    def report(self, report: LearnerReport) -> None:
        self.sender.send(report)

    def step_done(self, step: int, metrics: dict[str, float], times: dict[str, float], sent: str) -> None:
        self.events.emit(RunEvent.STEP_DONE, step=step, weights_sent="not sent" not in sent)
        log.info("step %d: loss %.4f reward %.3f success %.3f staleness %.2f | wait %.2fs step %.2fs %s", step,
                 metrics["loss/policy"], metrics.get("batch/reward_mean", 0.0), metrics.get("batch/success_mean", 0.0),
                 metrics.get("batch/staleness_mean", 0.0), times["batch_wait"], times["step"], sent)

    def abandoned(self, version: int) -> None:
        self.events.emit(RunEvent.BROADCAST_ABANDONED, version=version)
        log.warning("stopping: abandoned the broadcast of version %d (the engines may be gone); the checkpoint "
                    "comes next", version)

    def done(self, step: int, stopped_early: bool, checkpoint: str, weights: dict[str, float]) -> None:
        self.events.emit(RunEvent.LEARNER_DONE, step=step, stopped_early=stopped_early, checkpoint=checkpoint,
                         weights_dropped=weights.get("weights/dropped", 0.0))
        log.info("learner done after %d steps%s; checkpoint %s", step, " (stopped early)" if stopped_early else "",
                 checkpoint or "-")


class NullReporter:
    def step_trained(self, step: int) -> None: ...

    def report(self, report: LearnerReport) -> None: ...

    def step_done(self, step: int, metrics: dict[str, float], times: dict[str, float], sent: str) -> None: ...

    def abandoned(self, version: int) -> None: ...

    def done(self, step: int, stopped_early: bool, checkpoint: str, weights: dict[str, float]) -> None: ...


class HubPublisher:
    """Rank 0: the weights gathered bucket by bucket and sent to every engine in the hub. After a stop, a send
    the engines do not take within STOP_SEND_GRACE_S is abandoned, and nothing more is sent."""

    def __init__(self, model, res: Resources, epoch: int, bucket_mb: float, dtype: torch.dtype | None,
                 stop: threading.Event, lora: LoraSettings | None = None) -> None:
        self.model, self.res, self.epoch = model, res, epoch
        self.bucket_mb, self.dtype, self.stop, self.lora = bucket_mb, dtype, stop, lora

    @property
    def usable(self) -> bool:
        return not self.res.weight_hub_abandoned

    def publish(self, version: int, *, background: bool) -> Publication:
        stats = publish_weights(self.model, self.res.weight_hub, version=version, epoch=self.epoch,
                                bucket_mb=self.bucket_mb, dtype=self.dtype, stop=self.stop, background=background,
                                lora=self.lora)
        if stats is None:
            return Publication(abandoned=self._abandon(version))
        return Publication(stats=stats)

    def finish_sending(self, in_flight: int) -> int | None:
        hub = self.res.weight_hub
        if hub.wait_for_send(_abandon_after(self.stop, STOP_SEND_GRACE_S)) and hub.abandoned is None:
            return None
        return self._abandon(in_flight)

    def _abandon(self, version: int) -> int:
        """The version abandoned (the hub's own record when it has one); the hub is not touched again."""
        self.res.weight_hub_abandoned = True
        hub = self.res.weight_hub
        return hub.abandoned[1] if hub.abandoned is not None else version

    def metrics(self) -> dict[str, float]:
        hub = self.res.weight_hub
        return {**{f"weights/{k}": float(v) for k, v in hub.counters.items()},
                "weights/members": float(len(hub.members))}


class GatherOnly:
    """The other ranks: their part of each gather (a collective); rank 0 sends."""

    usable = True

    def __init__(self, model, bucket_mb: float, dtype: torch.dtype | None, lora: LoraSettings | None = None) -> None:
        self.model, self.bucket_mb, self.dtype, self.lora = model, bucket_mb, dtype, lora

    def publish(self, version: int, *, background: bool) -> Publication:
        publish_weights(self.model, None, version=version, epoch=0, bucket_mb=self.bucket_mb, dtype=self.dtype,
                        stop=threading.Event(), lora=self.lora)
        return Publication()

    def finish_sending(self, in_flight: int) -> int | None:
        return None

    def metrics(self) -> dict[str, float]:
        return {}


class TrainStateCheckpointer:
    """Collective: the Hugging Face files and the full training state of a step (``_save``).

    A disk that refuses the checkpoint (full, read-only: ``core/disk.py``) is the machine's fault, not the
    learner's: every rank waits and writes it again, together (``Backoff``: up to ``CHECKPOINT_RETRY_LIMIT_S``),
    each refusal counted (``checkpoint_write_retries``) and the outage's start and end written as events — no
    restart is spent on it. Training waits meanwhile: a step past an unwritten checkpoint could not be resumed."""

    def __init__(self, config: TrainConfig, tr: Trainables, res: Resources, ranks: RankInfo,
                 counters: LearnerCounters | None = None, timeout_s: float = 600.0) -> None:
        self.config, self.tr, self.res, self.ranks = config, tr, res, ranks
        self.counters = counters if counters is not None else LearnerCounters()
        self.timeout_s = timeout_s

    def save(self, step: int, lineage: list[tuple[int, int]], consumed: list[dict], since: int) -> str:
        start = time.perf_counter()
        state_dict = gather_full_state_dict(self.tr.model)
        out = checkpoint_dir(self.config.output_dir, step)
        backoff = Backoff(limit_s=CHECKPOINT_RETRY_LIMIT_S)
        while True:
            try:
                _save(self.config, self.tr, state_dict, step, self.res, self.ranks, lineage, consumed, since,
                      lambda error: _first_refusal(error, self.timeout_s))
                break
            except CheckpointWriteError as exc:  # raised on every rank alike: all retry, or all stop
                again, wait_s = backoff.failed()
                self._refused(out, str(exc), backoff.retries == 1)
                if not again:
                    raise CheckpointWriteError(f"checkpoint {out}: the disk still refuses it after "
                                               f"{CHECKPOINT_RETRY_LIMIT_S:.0f} s: {exc}") from exc
                self.counters.checkpoint_write_retries += 1
                time.sleep(wait_s)
        outage_s = backoff.succeeded()
        if outage_s is not None:
            log.warning("checkpoint %s written after the disk refused it for %.1f s (%d retries)", out, outage_s,
                        backoff.retries)
            self.res.events.emit(RunEvent.WRITE_RECOVERED, path=str(out), retries=backoff.retries,
                                 outage_s=round(outage_s, 3))
        log.info("saved %s in %.1f s", out, time.perf_counter() - start)
        return str(out)

    def _refused(self, out: Path, error: str, first: bool) -> None:
        if first:
            log.warning("checkpoint %s: the disk refuses it (%s); training waits and every rank writes it again "
                        "(for up to %.0f s)", out, error, CHECKPOINT_RETRY_LIMIT_S)
            self.res.events.emit(RunEvent.WRITE_FAILED, path=str(out), error=error[:500], critical=True)


def _first_refusal(error: str | None, timeout_s: float) -> str | None:
    """Collective: ``error`` (what the disk refused this rank, or None) of every rank -> this rank's, or that
    another refused its part, or None when every rank wrote its part. Bounded like every wait on the ranks."""
    refused = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    _wait_for_ranks(dist.all_reduce(refused, op=dist.ReduceOp.MAX, async_op=True), timeout_s,
                    "agreeing whether the checkpoint was written")
    return error or ("another learner rank could not write its part" if refused.item() else None)


def _save(config: TrainConfig, tr: Trainables, state_dict: dict[str, torch.Tensor], step: int, res: Resources,
          ranks: RankInfo, lineage: list[tuple[int, int]], consumed: list[dict], since: int,
          agree: Callable[[str | None], str | None]) -> Path:
    """Collective: rank 0 writes the Hugging Face files, then every rank its share of the training state; a
    part the disk refused raises CheckpointWriteError on every rank (``agree`` ends each part).

    The state also names what every step since the checkpoint of step ``since`` (the one this run
    saved or resumed from last) trained on (``consumed``: trajectory ids by outcome), and the weight
    lineage a resumed run continues."""
    out_dir = checkpoint_dir(config.output_dir, step)
    refused = None
    if ranks.rank == 0:
        refused = disk_refusal(lambda: save_policy(config, tr.model.config, state_dict, out_dir))
    refused = agree(refused)
    if refused is not None:
        raise CheckpointWriteError(refused)
    schedule = TurnBudgetSchedule.from_config(config.algorithm.rounds_ctrl)
    state = {
        "step": step,
        "weight_version": step,
        "data_cursor": {"next_request_id": res.batches.next_request_id if res.batches is not None else 0,
                        "batches_consumed": step},
        "coordinator": {"learner_step": step, "next_max_turns": schedule.budget_after(step)},
        "lineage": [list(pair) for pair in lineage],
        "consumed": consumed,
        "consumed_since": since,
    }
    save_train_state(out_dir, state=state, agree=agree, **tr.checkpoint_parts())
    res.events.emit(RunEvent.CHECKPOINT_WRITTEN, step=step, path=str(out_dir))
    return out_dir


def save_policy(config: TrainConfig, model_config, state_dict: dict[str, torch.Tensor], out_dir: Path) -> Path:
    """The policy as a Hugging Face model at ``out_dir``. With ``learner.lora`` the adapter is merged into the
    base weights (W = W₀ + s·BA: a plain model for transformers, vLLM and ``horizonrl eval``) and also kept as a
    PEFT adapter in ``out_dir/adapter``."""
    lora = LoraSettings.from_config(config)
    if lora is None:
        return save_hf_checkpoint(model_config, state_dict, config.model.path, out_dir)
    return save_hf_checkpoint(model_config, merged_state_dict(state_dict, lora), config.model.path, out_dir,
                              extra=lambda tmp: save_adapter(tmp / CHECKPOINT_ADAPTER_DIR, state_dict, lora,
                                                             base_model=config.model.path))


def next_weight_epoch(output_dir: Path) -> int:
    """This learner incarnation's weight epoch: one more than the last one started in this run directory."""
    path = RunDir(output_dir).learner_epoch
    epoch = int(path.read_text()) + 1 if path.is_file() else 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(epoch))
    os.replace(tmp, path)
    return epoch


def weight_bucket_bytes(bucket_mb: float) -> int:
    return max(ALIGN_BYTES, int(bucket_mb * (1 << 20)))


def publish_weights(model, hub, *, version: int, epoch: int, bucket_mb: float, dtype: torch.dtype | None,
                    stop: threading.Event, grace_s: float = STOP_SEND_GRACE_S,
                    background: bool = False, lora: LoraSettings | None = None) -> dict[str, float] | None:
    """Collective (every rank calls it; ``hub`` is rank 0's, None elsewhere): the model's weights go to
    every engine bucket by bucket, gathered from the FSDP shards on the learner's device in ``dtype``
    (weight_broadcast.py; ``background``: see ``WeightHub.publish``). Rank 0 returns the hub's statistics,
    or None when a stop was requested and the engines still had not taken the version ``grace_s`` later
    (they may have exited already; the checkpoint matters more than this version). Other ranks return None.

    ``lora``: a version is the adapter alone (learner/lora.py ``adapter_to_send``), which the engines load as
    their LoRA adapter in place of the last one; the base weights never leave the learner."""
    from horizonrl.learner.weight_broadcast import gather_without_sending

    # sharded DTensors: nothing gathered yet
    named = adapter_to_send(model, lora) if lora is not None else weights_to_send(model.config, model.state_dict())
    if hub is None:
        gather_without_sending(named, bucket_bytes=weight_bucket_bytes(bucket_mb), dtype=dtype)
        return None
    return hub.publish(version, epoch, named, dtype=dtype, should_abandon=_abandon_after(stop, grace_s),
                       background=background)


def _abandon_after(stop: threading.Event, grace_s: float):
    """True once ``stop`` has been set for longer than ``grace_s``."""
    seen_at: list[float] = []

    def should_abandon() -> bool:
        if not stop.is_set():
            return False
        if not seen_at:
            seen_at.append(time.monotonic())
        return time.monotonic() - seen_at[0] > grace_s

    return should_abandon


class LearnerRanksError(RuntimeError):
    """A collective among the learner's own ranks did not complete in time: another rank died or hangs."""


def _wait_for_ranks(work, timeout_s: float, what: str) -> None:
    """Wait for ``work`` (an ``async_op`` collective of the learner's group) at most ``timeout_s``.

    These control collectives move CPU tensors, which go over gloo even when the group is NCCL for
    CUDA tensors (``cpu:gloo,cuda:nccl``), so the wait is a real bound and the ``.item()`` after it
    reads a finished result; a dead peer ends it with this error instead of a hang."""
    failure = f"learner rank {dist.get_rank()}: {what} did not complete within {timeout_s:.0f} s " \
              "(another learner rank died or hangs)"
    try:
        completed = work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise LearnerRanksError(f"{failure}: {exc}") from exc
    if completed is False:
        raise LearnerRanksError(failure)


def _from_rank_zero(value: int, timeout_s: float, what: str) -> int:
    """Rank 0's ``value`` on every rank (a collective)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    _wait_for_ranks(dist.broadcast(tensor, src=0, async_op=True), timeout_s, f"sharing rank 0's {what}")
    return int(tensor.item())


def _all_agree_to_stop(reasons: tuple[threading.Event, ...], timeout_s: float) -> bool:
    """A stop signal (or end-training request) seen by any rank stops all of them at the same phase boundary."""
    flag = torch.tensor([int(any(reason.is_set() for reason in reasons))], dtype=torch.int64)
    _wait_for_ranks(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), timeout_s,
                    "agreeing whether to stop")
    return bool(flag.item())


def _init_process_group(config: TrainConfig, ranks: RankInfo, backend: str, timeout_s: float, res: Resources,
                        stop: threading.Event) -> None:
    """The learner's own process group. With MASTER_PORT (the local launcher, torchrun) at
    MASTER_ADDR:MASTER_PORT, as torchrun does; without it through the coordinator: rank 0 hosts the
    rendezvous store on a free port of its host and registers it under this incarnation's gang id, the
    other ranks (on any node) find it in Control. A restarted learner is a new gang: its ranks never
    meet at the address of the one before."""
    timeout = timedelta(seconds=timeout_s)
    # On GPU the CPU-side collectives (batch bytes, metrics) go over gloo, tensors over NCCL.
    kind = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
    net = config.network
    keep_collectives_on(net.bind_address())  # gloo's and NCCL's own sockets listen where the run binds
    from horizonrl.learner.weight_broadcast import hosted_store

    if ranks.master_port and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # under torchrun its agent hosts the store (a cluster: launcher.type=slurm): every rank is its client
        dist.init_process_group(backend=kind, init_method=f"tcp://{ranks.master_addr}:{ranks.master_port}",
                                rank=ranks.rank, world_size=ranks.world_size, timeout=timeout)
        return
    if ranks.master_port:
        # the launcher's rendezvous (MASTER_ADDR:MASTER_PORT), rank 0's store listening on MASTER_ADDR alone
        store = (hosted_store(ranks.master_addr, ranks.master_port, ranks.world_size, timeout) if ranks.rank == 0
                 else dist.TCPStore(ranks.master_addr, ranks.master_port, ranks.world_size, False, timeout))
        dist.init_process_group(backend=kind, store=store, rank=ranks.rank, world_size=ranks.world_size,
                                timeout=timeout)
        return
    name = learner_rendezvous_name(ranks.gang)
    if ranks.rank == 0:
        store = hosted_store(net.bind_address(), 0, ranks.world_size, timeout)
        endpoint = tcp_endpoint(net.advertised_host(), store.port)
        res.reports.register(config.run.run_id, "learner-0", {name: endpoint})
    else:
        endpoint = _registered(config, name, timeout_s, stop, "learner rank 0's rendezvous")
        host, port = split_endpoint(endpoint)
        store = dist.TCPStore(host, port, ranks.world_size, False, timeout)
    log.info("learner rank %d of %d: rendezvous at %s (gang %s)", ranks.rank, ranks.world_size, endpoint, ranks.gang)
    dist.init_process_group(backend=kind, store=store, rank=ranks.rank, world_size=ranks.world_size, timeout=timeout)


def _registered(config: TrainConfig, name: str, timeout_s: float, stop: threading.Event, what: str) -> str:
    """The endpoint registered under ``name``, once the coordinator's Control names it (TimeoutError after
    ``timeout_s``, RuntimeError on a stop)."""
    import zmq

    from horizonrl.protocol.registry import wait_for_endpoints

    net = config.network
    context = zmq.Context()
    security = wire_security(context, net.host, net.curve_keys_dir)
    try:
        found = wait_for_endpoints(context, net.endpoint(net.control_port), config.run.run_id,
                                   lambda endpoints: name in endpoints, timeout_s, security=security,
                                   should_stop=stop.is_set, key=read_run_key(config.output_dir))
    finally:
        if security is not None:
            security.stop()
        context.term()
    if found is None:
        raise RuntimeError(f"stopped while waiting for {what}")
    return found[name]


def _wait_for_colocated_engine(config: TrainConfig, stop: threading.Event) -> None:
    """Colocated (one GPU for the learner and an engine): the engine starts first, alone on the device, and the
    learner touches the GPU once it is up. The order is vLLM's: at start it refuses unless utilization × total is
    free, then sizes its KV cache from how much free memory its own profiling used, asserting that free memory
    did not grow meanwhile (0.33's gpu_worker.determine_available_memory). A learner loading its model then would
    be counted as the engine's (a smaller cache, or none), and one releasing memory would fail that assertion. The
    learner needs no such quiet moment: torch caps it at resources.learner_memory_fraction whatever the order."""
    log.info("colocated: waiting for the engine on this GPU to start before touching the GPU")
    pid = _registered(config, ENDPOINT_COLOCATED_ENGINE, COLOCATED_ENGINE_START_S, stop, "the colocated engine")
    log.info("colocated: the engine (pid %s) has started; the learner takes the GPU", pid)


def _backend_and_device(config: TrainConfig, local_rank: int,
                        stop: threading.Event | None = None) -> tuple[str, torch.device]:
    """The process group's backend and this rank's device, decided by the rules the launcher's plan
    used (core/placement.py): the launcher gave this rank one GPU (seen as cuda:0) or hid the GPUs of a
    CPU plan, so the rank agrees with the plan; started by hand (torchrun) it takes ``cuda:LOCAL_RANK``.
    ``learner.backend`` that contradicts the device (gloo with GPUs) is a ConfigError, not a hang."""
    gpus = visible_gpus(os.environ, lambda: torch.cuda.device_count() if torch.cuda.is_available() else 0)
    device_type = local_device_type(config.resources.device, gpus)
    backend, _weight_backend = choose_backends(device_type, config.learner.backend)
    if device_type == "cpu":
        return backend, torch.device("cpu")
    index = learner_device_index(gpus, local_rank)
    if is_colocated(os.environ) and stop is not None:
        _wait_for_colocated_engine(config, stop)  # before this process's CUDA context takes device memory
    torch.cuda.set_device(index)
    if is_colocated(os.environ):
        # An engine shares this GPU: keep to our share of its memory, so that going over it is our own clear
        # out-of-memory error rather than the engine's (core/placement.py checks the two shares fit).
        fraction = config.resources.learner_memory_fraction
        torch.cuda.set_per_process_memory_fraction(fraction, index)
        log.info("colocated with an engine on cuda:%d: the learner may allocate %.0f%% of its memory "
                 "(resources.learner_memory_fraction)", index, 100 * fraction)
    return backend, torch.device("cuda", index)


def _install_stop_handlers(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return

    def request_stop(signum, _frame):
        log.warning("received %s: stopping at the next phase boundary", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
