"""``horizonrl slurm CONFIG > job.sbatch``: the run as one Slurm batch job.

One allocation; inside it one ``srun --exact`` step per process, each with the resources of its
bundle in ``core/placement.py``'s :func:`cluster_bundles` (the coordinator and the buffer
``--gres=none`` — a step without it would take every GPU of the job —, one GPU per learner rank,
``tensor_parallel_size`` per engine). The learner's ranks run under ``torchrun`` (one step over
the nodes its ranks need; torchrun's own c10d rendezvous on the first node), the rest as
``python -m horizonrl ROLE``. The coordinator runs on the job's first node, where the batch script
itself runs: its address is the one every process is given, and every other process registers
where Slurm put it (``protocol/registry.py``).

Restarts follow the run's supervision policy (``supervision.*``: at most so many restarts within
``window_s``, after a back-off that doubles), written into the script's ``supervise`` function from the
same values the supervisor of the other launchers reads (launcher/supervisor.py): a step of an actor or
the buffer that fails is started again (it comes back wherever Slurm puts it, and registers again); the
learner's step is restarted as a gang, every rank resuming from the newest checkpoint (``--resume
auto``); the coordinator's step is restarted on the job's first node, at the same address and ports, and
continues from the state it saved (``coordinator_state.json``: ``coordinator_restored``), as under the local
launcher. ``launcher.slurm.max_restarts`` overrides both limits. Slurm's
own requeue (``--requeue``) with ``resume=auto`` continues a job that lost its node.

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
from horizonrl.core.programs import PACKAGE_MODULE
from horizonrl.core.run_dirs import RunDir
from horizonrl.launcher.resolve import check_cluster_network, prepare_cluster_run
from horizonrl.launcher.supervisor import RestartPolicy

EMBED_MARKER = "HORIZONRL_CONFIG_EOF"
JOB = RunDir(Path("$RUN_DIR"))  # the run directory's paths as the script names them


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
            raise ConfigError(f"learner.num_ranks={ranks} does not fill whole nodes of {s.gpus_per_node} GPUs: "
                              "torchrun runs the same number of ranks on every node; use a multiple of "
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


def restart_policies(config: TrainConfig) -> tuple[RestartPolicy, RestartPolicy]:
    """(an actor's or the buffer's, the learner gang's): the supervisor's, with ``launcher.slurm.max_restarts``
    as the limit of both when it is set."""
    steps = RestartPolicy.for_processes(config.supervision)
    learner = RestartPolicy.for_learner(config.supervision)
    override = config.launcher.slurm.max_restarts
    if override is not None:
        steps.limit = learner.limit = override
    return steps, learner


def sbatch_script(config: TrainConfig) -> str:
    """The batch script of the run (``horizonrl slurm CONFIG``)."""
    check_cluster_network(config)
    layout = slurm_layout(config)
    steps, learner = restart_policies(config)
    body = (_prelude(config, layout) + _supervise_function(steps) + _coordinator_and_buffer(config, steps.limit)
            + _learner(config, layout, learner.limit) + _actors(config, layout, steps.limit) + _ending(config))
    return "\n".join(_header(config, layout) + body) + "\n"


def _header(config: TrainConfig, layout: SlurmLayout) -> list[str]:
    s = config.launcher.slurm
    run_dir = Path(config.run.output_dir).resolve()
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
        f"#SBATCH --mem={s.mem_per_process_gb * math.ceil(layout.tasks / layout.nodes)}G",
        f"#SBATCH --time={s.time}",
        f"#SBATCH --output={RunDir(run_dir).logs}/slurm-%j.out",
    ]
    head += [f"#SBATCH --gres=gpu:{s.gpus_per_node}"] if s.gpus_per_node else []
    head += [f"#SBATCH --partition={s.partition}"] if s.partition else []
    head += [f"#SBATCH --account={s.account}"] if s.account else []
    return head + [f"#SBATCH {opt}" for opt in s.sbatch]


def _prelude(config: TrainConfig, layout: SlurmLayout) -> list[str]:
    """The settings written down, then ``--prepare``: the coordinator's address fixed in the config every step
    reads."""
    py = config.launcher.slurm.python
    lines = [
        "",
        "set -uo pipefail",
        *config.launcher.slurm.setup,
        f"RUN_DIR={shlex.quote(str(Path(config.run.output_dir).resolve()))}",
        f'CONFIG="{JOB.config}"',
        f'mkdir -p "{JOB.logs}"',
        f'rm -f "{JOB.job_finished}" "{JOB.job_failed}"',
        "# The settings this job runs with (the config and its overrides, resolved when the script was written).",
        f"cat > \"{JOB.submitted_config}\" <<'{EMBED_MARKER}'",
        dump_config(config).rstrip("\n"),
        EMBED_MARKER,
        "",
        "# The coordinator runs here, on the job's first node: its address is the one every process is given.",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    ]
    prepare_extra = ""
    if layout.nodes == 1:
        lines.append("HEAD_ADDR=127.0.0.1  # one node: everything on loopback")
    else:
        lines.append("HEAD_ADDR=$(hostname -I | awk '{print $1}')")
        if config.network.curve_keys_dir is None:
            lines.append(f'[ -d "{JOB.curve_keys}" ] || {py} -m {PACKAGE_MODULE} keys "{JOB.curve_keys}"  '
                         "# CurveZMQ: off loopback")
            prepare_extra = f' network.curve_keys_dir="{JOB.curve_keys}"'
    return lines + [f'{py} -m {PACKAGE_MODULE} slurm "{JOB.submitted_config}" --prepare --coordinator-host '
                    f'"$HEAD_ADDR"{prepare_extra} || exit 1', ""]


def _supervise_function(policy: RestartPolicy) -> list[str]:
    """The supervisor's policy in bash: a failed step is started again after a back-off that doubles (from
    ``backoff_s`` up to ``max_backoff_s``) while it has had fewer than LIMIT restarts within ``window_s``;
    past that the job stops. A stop signal goes to the step."""
    return [
        f"WINDOW_S={policy.window_s:g}; BACKOFF_S={policy.backoff_s:g}; MAX_BACKOFF_S={policy.max_backoff_s:g}",
        "supervise() {  # NAME LIMIT COMMAND...",
        "  local name=$1 limit=$2 rc step now delay t; local -a times=() kept; shift 2",
        '  trap \'kill "$step" 2>/dev/null; exit 143\' TERM',
        "  while true; do",
        f'    "$@" >>"{JOB.logs}/$name.log" 2>&1 & step=$!',
        '    wait "$step" && return 0',
        "    rc=$?",
        f'    [ -e "{JOB.job_finished}" ] && return 0',
        "    now=$(date +%s); kept=()",
        '    for t in "${times[@]}"; do [ $((now - t)) -le "${WINDOW_S%.*}" ] && kept+=("$t"); done',
        '    times=("${kept[@]}")',
        '    if [ "${#times[@]}" -ge "$limit" ]; then',
        '      echo "$(date +%T) $name exited with code $rc; ${#times[@]} restart(s) within ${WINDOW_S} s: '
        'stopping the job" >&2',
        f'      touch "{JOB.job_failed}"; return "$rc"',
        "    fi",
        "    delay=$(awk -v b=\"$BACKOFF_S\" -v m=\"$MAX_BACKOFF_S\" -v n=\"${#times[@]}\" "
        "'BEGIN { d = b * 2 ^ n; print (d > m ? m : d) }')",
        '    times+=("$now")',
        '    echo "$(date +%T) $name exited with code $rc; restarting it in ${delay} s (restart ${#times[@]} of '
        '$limit within ${WINDOW_S} s)" >&2',
        '    sleep "$delay"',
        "  done",
        "}",
        "",
    ]


def _cpu_step(config: TrainConfig) -> str:
    s = config.launcher.slurm
    return f"--exact --nodes=1 --ntasks=1 --cpus-per-task={s.cpus_per_process} --mem={s.mem_per_process_gb}G"


def _coordinator_and_buffer(config: TrainConfig, restarts: int) -> list[str]:
    py, step = config.launcher.slurm.python, _cpu_step(config)
    return [
        "# The coordinator on the first node (its address is every process's), restarted there from its saved state.",
        f'supervise coordinator {restarts} srun {step} --gres=none --nodelist="$HEAD_NODE" \\',
        f'  {py} -m {PACKAGE_MODULE} coordinator --config "$CONFIG" &',
        "COORDINATOR=$!",
        f'supervise buffer {restarts} srun {step} --gres=none \\',
        f'  {py} -m {PACKAGE_MODULE} buffer --config "$CONFIG" &',
    ]


def _learner(config: TrainConfig, layout: SlurmLayout, restarts: int) -> list[str]:
    """Every rank in one step under torchrun; the step restarts as a gang (torchrun itself restarts nothing:
    the policy is supervise's)."""
    s, py = config.launcher.slurm, config.launcher.slurm.python
    gres = f"--gres=gpu:{layout.ranks_per_node}" if layout.gpus_per_rank else "--gres=none"
    rdzv = ("--standalone" if layout.learner_nodes == 1 else
            f'--rdzv-backend=c10d --rdzv-endpoint="$HEAD_ADDR:{s.torchrun_port}" --rdzv-id="$SLURM_JOB_ID"')
    return [
        "# The learner: its ranks under torchrun, restarted all together (a gang) from the newest checkpoint.",
        # --ntasks explicitly: a step inherits the job's SLURM_NTASKS, which would ask for every task's CPUs.
        f"supervise learner {restarts} srun --exact --nodes={layout.learner_nodes} --ntasks={layout.learner_nodes} "
        f"--ntasks-per-node=1 --cpus-per-task={s.cpus_per_process * layout.ranks_per_node} "
        f"--mem={s.mem_per_process_gb * layout.ranks_per_node}G {gres} \\",
        f"  {py} -m torch.distributed.run --nnodes={layout.learner_nodes} --nproc-per-node={layout.ranks_per_node} "
        f"--max-restarts=0 {rdzv} \\",
        f'  -m {PACKAGE_MODULE} learner --config "$CONFIG" --resume auto &',
        "LEARNER=$!",
    ]


def _actors(config: TrainConfig, layout: SlurmLayout, restarts: int) -> list[str]:
    py, step = config.launcher.slurm.python, _cpu_step(config)
    gres = f"--gres=gpu:{layout.gpus_per_engine}" if layout.gpus_per_engine else "--gres=none"
    lines = []
    for i in range(config.rollout.num_actors):
        lines += [f"supervise actor-{i} {restarts} srun {step} {gres} \\",
                  f'  {py} -m {PACKAGE_MODULE} actor --config "$CONFIG" --index {i} &']
    return lines


def _ending(config: TrainConfig) -> list[str]:
    return [
        "",
        "# The run ends with the learner; a step out of restarts (the coordinator's included) ends it early.",
        'while kill -0 "$LEARNER" 2>/dev/null; do',
        f'  if [ -e "{JOB.job_failed}" ] || ! kill -0 "$COORDINATOR" 2>/dev/null; then',
        f'    echo "$(date +%T) stopping the job (see {JOB.logs})" >&2; kill "$LEARNER"; break',
        "  fi",
        "  sleep 5",
        "done",
        'wait "$LEARNER"; RC=$?',
        f'touch "{JOB.job_finished}"',
        "# The coordinator stops on its own after the learner's last report (and a last evaluation).",
        f"for _ in $(seq {int(config.eval.final_wait_s) + 30}); do kill -0 \"$COORDINATOR\" 2>/dev/null || break; "
        "sleep 1; done",
        "kill $(jobs -p) 2>/dev/null  # srun passes the signal on to its step",
        "wait",
        f'[ -e "{JOB.job_failed}" ] && RC=1',
        'exit "$RC"',
    ]


def prepare_slurm_run(config: TrainConfig, coordinator_host: str) -> Path:
    """Inside the job: the resolved config, with the coordinator at ``coordinator_host`` and its fixed ports."""
    s = config.launcher.slurm
    return prepare_cluster_run(config, coordinator_host, config.network.control_port or s.control_port,
                               config.network.report_port or s.control_port + 1)
