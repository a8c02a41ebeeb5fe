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
from datetime import timedelta

import torch
import torch.distributed as dist

from horizonrl.core.config import TrainConfig
from horizonrl.core.placement import (choose_backends, is_colocated, learner_device_index, local_device_type,
                                      visible_gpus)
from horizonrl.core.run_dirs import read_run_key
from horizonrl.core.run_events import EventLog, RunEvent
from horizonrl.learner.algorithm import AlgorithmSettings, Trainables, lr_multiplier, train_step_function
from horizonrl.learner.checkpoint import load_train_state, resolve_resume
from horizonrl.learner.loop import LearnerServices, LoopSettings, LoopState, run_training
from horizonrl.learner.lora import LoraSettings
from horizonrl.learner.model import build_sharded_model, learner_precision, torch_dtype
from horizonrl.learner.services import (BufferBatches, DistributedRanks, GatherOnly, HubPublisher, NoBatches,
                                        NullReporter, RankInfo, Resources, RunReporter, TrainStateCheckpointer,
                                        from_rank_zero, next_weight_epoch, publish_weights, weight_bucket_bytes)
from horizonrl.learner.step_watchdog import StepWatchdog
from horizonrl.protocol import (ENDPOINT_COLOCATED_ENGINE, ENDPOINT_WEIGHTS, ENDPOINT_WEIGHTS_EPOCH, LearnerReport,
                                learner_rendezvous_name)
from horizonrl.protocol.counters import LearnerCounters
from horizonrl.protocol.transport import keep_collectives_on, split_endpoint, tcp_endpoint, wire_security

log = logging.getLogger("horizonrl.learner")

# Not (yet) in LearnerConfig: extra slack on the learner's own process group, whose ranks
# wait on rank 0 while it waits for a batch or broadcasts weights.
PROCESS_GROUP_SLACK_S = 300.0
# Colocated: how long the learner waits for the engine on its GPU to start (a large model's load and CUDA-graph
# capture take minutes; an actor whose engine fails is restarted by the launcher and registers when it is up).
COLOCATED_ENGINE_START_S = 1800.0


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


def main(config: TrainConfig) -> int:
    """Train for ``config.learner.total_steps`` steps; 0 on success or a requested stop, 1 on failure."""
    stop = threading.Event()
    _install_stop_handlers(stop)
    return run_learner(config, RankInfo.from_environ(), stop)


def run_learner(config: TrainConfig, ranks: RankInfo, stop) -> int:
    """This rank until it is done or ``stop`` (a threading.Event, or the inline launcher's StopFlag)."""
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
    epoch = from_rank_zero(next_weight_epoch(config.output_dir) if is_main else 0, control_timeout_s, "weight epoch")
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
        train=train_step_function(AlgorithmSettings.from_config(config), tr, rank=ranks.rank,
                                  world_size=ranks.world_size, device=device, watchdog=res.step_watchdog,
                                  first_step=step + 1, epoch=epoch),
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
        res.batches.next_request_id = state.data_cursor.next_request_id
    log.info("resumed from %s at step %d", resume_from, state.step)
    return state.step, list(state.lineage) or [(0, 0)]


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
