"""``horizonrl slurm CONFIG > job.sbatch``: the run as one Slurm batch job.

One allocation; inside it one ``srun --exact`` step per process, each with the resources of its
bundle in ``core/placement.py``'s :func:`cluster_bundles` (the coordinator and the buffer
``--gres=none`` — a step without it would take every GPU of the job —, one GPU per learner rank,
``tensor_parallel_size`` per engine). The learner's ranks run under ``torchrun`` (one step over
the nodes its ranks need; torchrun's own c10d rendezvous on the first node), the rest as
``python -m horizonrl ROLE``. The coordinator runs on the job's first node, where the batch script
itself runs: its address is the one every process is given, and every other process registers
where Slurm put it (``protocol/registry.py``).

Restarts: a step of an actor or the buffer that fails is started again by the script, at most
``launcher.slurm.max_restarts`` times (it comes back wherever Slurm puts it, and registers again);
the learner is restarted as a gang by ``torchrun --max-restarts``, every rank resuming from the
newest checkpoint (``--resume auto``); a dead coordinator ends the job. Slurm's own requeue
(``--requeue``) with ``resume=auto`` continues a job that lost its node.

The generated script embeds the resolved settings (the config with its overrides applied) so that
it is the whole record of what ran (``horizonrl slurm`` creates ``<output_dir>/logs``: Slurm opens the
job's output file there before the script runs); at start it writes them to ``<output_dir>/submitted.yaml`` and
runs ``horizonrl slurm --prepare`` to fix the coordinator's address, the run id and the resume
point in ``<output_dir>/config.yaml``, the file every step reads (``output_dir`` must be on a file
system every node shares).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from horizonrl.core.config import ConfigError, TrainConfig, dump_config
from horizonrl.core.placement import cluster_bundles

EMBED_MARKER = "HORIZONRL_CONFIG_EOF"


@dataclass(frozen=True)
class SlurmLayout:
    """How many nodes, tasks and GPUs the job asks for, and how the learner's ranks spread."""

    nodes: int
    tasks: int
    learner_nodes: int
    ranks_per_node: int
    gpus_per_rank: int  # 0 on a CPU run
    gpus_per_engine: int  # 0 on a CPU run


def slurm_layout(config: TrainConfig) -> SlurmLayout:
    s = config.launcher.slurm
    gpus = s.gpus_per_node > 0
    bundles = cluster_bundles(config, gpus=gpus, cpus_per_process=s.cpus_per_process)
    ranks = config.learner.num_ranks
    if gpus:
        ranks_per_node = min(ranks, s.gpus_per_node)
        learner_nodes = math.ceil(ranks / ranks_per_node)
        if ranks % ranks_per_node:
            raise ConfigError(f"learner.num_ranks={ranks} does not fill whole nodes of {s.gpus_per_node} GPUs: torchrun "
                              "runs the same number of ranks on every node; use a multiple of "
                              "launcher.slurm.gpus_per_node (or fewer ranks than one node's GPUs)")
        engine_gpus = config.rollout.engine.tensor_parallel_size
        if engine_gpus > s.gpus_per_node:
            raise ConfigError(f"rollout.engine.tensor_parallel_size={engine_gpus} is more than a node's "
                              f"{s.gpus_per_node} GPUs: an engine's GPUs must be on one node")
        need = sum(b.gpus for b in bundles)
        if need > s.nodes * s.gpus_per_node:
            raise ConfigError(f"the run needs {need} GPUs (learner.num_ranks={ranks}, rollout.num_actors="
                              f"{config.rollout.num_actors} x tensor_parallel_size {engine_gpus}) but the job asks for "
                              f"{s.nodes} node(s) x {s.gpus_per_node}: raise launcher.slurm.nodes")
    else:
        ranks_per_node, learner_nodes, engine_gpus = ranks, 1, 0
    if learner_nodes > s.nodes:
        raise ConfigError(f"the learner's {ranks} ranks need {learner_nodes} nodes; the job has launcher.slurm.nodes="
                          f"{s.nodes}")
    tasks = 2 + ranks + config.rollout.num_actors
    return SlurmLayout(s.nodes, tasks, learner_nodes, ranks_per_node, 1 if gpus else 0, engine_gpus)


def sbatch_script(config: TrainConfig) -> str:
    """The batch script of the run (``horizonrl slurm CONFIG``)."""
    from horizonrl.launcher import check_cluster_network

    check_cluster_network(config)
    s = config.launcher.slurm
    layout = slurm_layout(config)
    run_dir = Path(config.run.output_dir).resolve()
    restarts = s.max_restarts if s.max_restarts is not None else (
        config.supervision.max_restarts if config.supervision.restart else 0)
    learner_restarts = s.max_restarts if s.max_restarts is not None else (
        config.supervision.max_learner_restarts if config.supervision.recover == "auto" else 0)
    per_node_tasks = math.ceil(layout.tasks / layout.nodes)
    py = s.python
    q = shlex.quote
    head = [
        "#!/bin/bash",
        f"# horizonrl run {config.run.name!r}: written by `horizonrl slurm`; submit with `sbatch THIS_FILE`.",
        f"# {layout.tasks} processes: coordinator and buffer (CPU), {config.learner.num_ranks} learner rank(s) under "
        f"torchrun on {layout.learner_nodes} node(s), {config.rollout.num_actors} actor(s)"
        + (f" with {layout.gpus_per_engine} GPU(s) each" if layout.gpus_per_engine else " (CPU)") + ".",
        f"#SBATCH --job-name=horizonrl-{config.run.name}",
        f"#SBATCH --nodes={layout.nodes}",
        f"#SBATCH --ntasks={layout.tasks}",
        f"#SBATCH --cpus-per-task={s.cpus_per_process}",
        f"#SBATCH --mem={s.mem_per_process_gb * per_node_tasks}G",
        f"#SBATCH --time={s.time}",
        f"#SBATCH --output={run_dir}/logs/slurm-%j.out",
    ]
    if s.gpus_per_node:
        head.append(f"#SBATCH --gres=gpu:{s.gpus_per_node}")
    if s.partition:
        head.append(f"#SBATCH --partition={s.partition}")
    if s.account:
        head.append(f"#SBATCH --account={s.account}")
    head += [f"#SBATCH {opt}" for opt in s.sbatch]

    loopback = layout.nodes == 1
    mem = f"--mem={s.mem_per_process_gb}G"
    cpu_step = f"--exact --nodes=1 --ntasks=1 --cpus-per-task={s.cpus_per_process} {mem}"
    body = [
        "",
        "set -uo pipefail",
        *s.setup,
        f"RUN_DIR={q(str(run_dir))}",
        'CONFIG="$RUN_DIR/config.yaml"',
        'mkdir -p "$RUN_DIR/logs"',
        'rm -f "$RUN_DIR/.finished" "$RUN_DIR/.failed"',
        "# The settings this job runs with (the config and its overrides, resolved when the script was written).",
        f"cat > \"$RUN_DIR/submitted.yaml\" <<'{EMBED_MARKER}'",
        dump_config(config).rstrip("\n"),
        EMBED_MARKER,
        "",
        "# The coordinator runs here, on the job's first node: its address is the one every process is given.",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    ]
    if loopback:
        body.append("HEAD_ADDR=127.0.0.1  # one node: everything on loopback")
        prepare_extra = ""
    else:
        body.append("HEAD_ADDR=$(hostname -I | awk '{print $1}')")
        if config.network.curve_keys_dir is None:
            body.append('[ -d "$RUN_DIR/keys" ] || ' + f'{py} -m horizonrl keys "$RUN_DIR/keys"  # CurveZMQ: off loopback')
            prepare_extra = ' network.curve_keys_dir="$RUN_DIR/keys"'
        else:
            prepare_extra = ""
    body += [
        f'{py} -m horizonrl slurm "$RUN_DIR/submitted.yaml" --prepare --coordinator-host "$HEAD_ADDR"{prepare_extra} '
        '|| exit 1',
        "",
        "# Start a step again when it fails, at most N times (actors, the buffer); give up: the job stops.",
        "supervise() {  # NAME RESTARTS COMMAND...",
        "  local name=$1 left=$2 rc; shift 2",
        "  while true; do",
        '    "$@" >>"$RUN_DIR/logs/$name.log" 2>&1 && return 0',
        "    rc=$?",
        '    [ -e "$RUN_DIR/.finished" ] && return 0',
        '    if [ "$left" -le 0 ]; then',
        '      echo "$(date +%T) $name exited with code $rc; no restarts left: stopping the job" >&2',
        '      touch "$RUN_DIR/.failed"; return "$rc"',
        "    fi",
        "    left=$((left - 1))",
        '    echo "$(date +%T) $name exited with code $rc; restarting it ($left restart(s) left)" >&2',
        "    sleep 2",
        "  done",
        "}",
        "",
        f'srun {cpu_step} --gres=none --nodelist="$HEAD_NODE" --output="$RUN_DIR/logs/coordinator.log" \\',
        f'  {py} -m horizonrl coordinator --config "$CONFIG" &',
        "COORDINATOR=$!",
        f'supervise buffer {restarts} srun {cpu_step} --gres=none \\',
        f'  {py} -m horizonrl buffer --config "$CONFIG" &',
    ]
    learner_gres = f"--gres=gpu:{layout.ranks_per_node}" if layout.gpus_per_rank else "--gres=none"
    rdzv = (f"--standalone" if layout.learner_nodes == 1 else
            f'--rdzv-backend=c10d --rdzv-endpoint="$HEAD_ADDR:{s.torchrun_port}" --rdzv-id="$SLURM_JOB_ID"')
    body += [
        "# The learner: its ranks under torchrun, which restarts them all (a gang) from the newest checkpoint.",
        # --ntasks explicitly: a step inherits the job's SLURM_NTASKS, which would ask for every task's CPUs.
        f"srun --exact --nodes={layout.learner_nodes} --ntasks={layout.learner_nodes} --ntasks-per-node=1 "
        f"--cpus-per-task={s.cpus_per_process * layout.ranks_per_node} "
        f"--mem={s.mem_per_process_gb * layout.ranks_per_node}G {learner_gres} "
        '--output="$RUN_DIR/logs/learner.log" \\',
        f"  {py} -m torch.distributed.run --nnodes={layout.learner_nodes} --nproc-per-node={layout.ranks_per_node} "
        f"--max-restarts={learner_restarts} {rdzv} \\",
        f'  -m horizonrl learner --config "$CONFIG" --resume auto &',
        "LEARNER=$!",
    ]
    actor_gres = f"--gres=gpu:{layout.gpus_per_engine}" if layout.gpus_per_engine else "--gres=none"
    for i in range(config.rollout.num_actors):
        body += [f"supervise actor-{i} {restarts} srun {cpu_step} {actor_gres} \\",
                 f'  {py} -m horizonrl actor --config "$CONFIG" --index {i} &']
    body += [
        "",
        "# The run ends with the learner; a dead coordinator, or a step out of restarts, ends it early.",
        'while kill -0 "$LEARNER" 2>/dev/null; do',
        '  if [ -e "$RUN_DIR/.failed" ] || ! kill -0 "$COORDINATOR" 2>/dev/null; then',
        '    echo "$(date +%T) stopping the job (see $RUN_DIR/logs)" >&2; kill "$LEARNER"; break',
        "  fi",
        "  sleep 5",
        "done",
        'wait "$LEARNER"; RC=$?',
        'touch "$RUN_DIR/.finished"',
        "# The coordinator stops on its own after the learner's last report (and a last evaluation).",
        f"for _ in $(seq {int(config.eval.final_wait_s) + 30}); do kill -0 \"$COORDINATOR\" 2>/dev/null || break; "
        "sleep 1; done",
        "kill $(jobs -p) 2>/dev/null  # srun passes the signal on to its step",
        "wait",
        '[ -e "$RUN_DIR/.failed" ] && RC=1',
        'exit "$RC"',
    ]
    return "\n".join(head + body) + "\n"


def prepare_slurm_run(config: TrainConfig, coordinator_host: str) -> Path:
    """Inside the job: the resolved config, with the coordinator at ``coordinator_host`` and its fixed ports."""
    from horizonrl.launcher import prepare_cluster_run

    s = config.launcher.slurm
    return prepare_cluster_run(config, coordinator_host, config.network.control_port or s.control_port,
                               config.network.report_port or s.control_port + 1)
