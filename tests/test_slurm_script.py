"""``horizonrl slurm CONFIG > job.sbatch``: the generated batch script, read as text and checked by bash.

No Slurm needed: what each step asks for (one ``srun --exact`` per process, ``--gres=none`` for the CPU
processes so that they take no GPU of the job, the engines' and learner's GPUs), the learner under
torchrun with gang restarts from the newest checkpoint, restarts under the run's supervision policy (its limit
within a window and doubling back-off, as the other launchers apply it), the coordinator on the first node, and the
``--prepare`` step that the job runs to fix the coordinator's address in the resolved config.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from horizonrl.core.config import ConfigError, load_config
from horizonrl.launcher.slurm import prepare_slurm_run, sbatch_script, slurm_layout

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "signpost_test.yaml"


def config_for(tmp_path, *overrides):
    return load_config(CONFIG, [f"run.output_dir={tmp_path / 'run'}", "launcher.type=slurm", *overrides])


def steps(script: str) -> list[str]:
    """Each srun command, continuation lines joined."""
    joined = script.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if re.match(r"(supervise \S+ \d+ )?srun ", line.strip())]


def test_a_gpu_job_has_one_exact_step_per_process_with_its_gpus(tmp_path):
    config = config_for(tmp_path, "launcher.slurm.nodes=2", "launcher.slurm.gpus_per_node=4", "learner.num_ranks=2",
                        "rollout.num_actors=3", "rollout.engine.tensor_parallel_size=2",
                        "launcher.slurm.partition=gpu", "launcher.slurm.setup=['source /opt/venv/bin/activate']")
    script = sbatch_script(config)
    assert script.startswith("#!/bin/bash\n")
    for option in ("--nodes=2", "--ntasks=7", "--gres=gpu:4", "--partition=gpu", "--time=24:00:00"):
        assert f"#SBATCH {option}" in script, option
    assert "source /opt/venv/bin/activate" in script
    found = steps(script)
    assert len(found) == 1 + 1 + 1 + 3  # coordinator, buffer, learner, actors
    assert all("srun --exact --nodes=" in s for s in found)
    coordinator = next(s for s in found if "horizonrl coordinator" in s)
    assert "--gres=none" in coordinator and '--nodelist="$HEAD_NODE"' in coordinator
    assert coordinator.startswith("supervise coordinator 5 srun")  # restarted, always on the first node
    buffer = next(s for s in found if "horizonrl buffer" in s)
    assert "--gres=none" in buffer and buffer.startswith("supervise buffer 5 srun")
    learner = next(s for s in found if "horizonrl learner" in s)
    assert "--gres=gpu:2" in learner and "-m torch.distributed.run" in learner
    # a gang: the whole step restarts under the run's policy (supervision.max_learner_restarts), not torchrun
    assert learner.startswith("supervise learner 3 srun") and "--max-restarts=0" in learner
    assert "--nproc-per-node=2" in learner and "--resume auto" in learner
    actors = [s for s in found if "horizonrl actor" in s]
    assert [re.search(r"--index (\d+)", s).group(1) for s in actors] == ["0", "1", "2"]
    assert all("--gres=gpu:2" in s and "supervise actor-" in s for s in actors)
    # off loopback: CurveZMQ keys are made for the run and the coordinator is the first node's address
    assert 'horizonrl keys "$RUN_DIR/keys"' in script and "hostname -I" in script


def test_the_embedded_settings_are_the_resolved_config(tmp_path):
    config = config_for(tmp_path, "learner.total_steps=7")
    script = sbatch_script(config)
    embedded = script.split("<<'HORIZONRL_CONFIG_EOF'\n", 1)[1].split("\nHORIZONRL_CONFIG_EOF\n", 1)[0]
    data = yaml.safe_load(embedded)
    assert data["learner"]["total_steps"] == 7 and data["launcher"]["type"] == "slurm"
    assert "HEAD_ADDR=127.0.0.1" in script  # one node: loopback, no keys
    assert "horizonrl keys" not in script


def test_the_script_is_valid_bash(tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(sbatch_script(config_for(tmp_path, "launcher.slurm.nodes=3", "launcher.slurm.gpus_per_node=8",
                                             "learner.num_ranks=16")))
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_layouts_that_cannot_run_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="whole nodes"):
        slurm_layout(config_for(tmp_path, "launcher.slurm.gpus_per_node=4", "learner.num_ranks=6",
                                "launcher.slurm.nodes=4"))
    with pytest.raises(ConfigError, match="on one node"):
        slurm_layout(config_for(tmp_path, "launcher.slurm.gpus_per_node=2", "rollout.engine.tensor_parallel_size=4",
                                "launcher.slurm.nodes=4"))
    with pytest.raises(ConfigError, match="raise launcher.slurm.nodes"):
        slurm_layout(config_for(tmp_path, "launcher.slurm.gpus_per_node=2", "learner.num_ranks=2"))
    with pytest.raises(ConfigError, match="network.batch_port"):
        sbatch_script(config_for(tmp_path, "network.batch_port=5555"))
    layout = slurm_layout(config_for(tmp_path, "launcher.slurm.nodes=3", "launcher.slurm.gpus_per_node=8",
                                     "learner.num_ranks=16", "rollout.num_actors=8"))
    assert (layout.learner_nodes, layout.ranks_per_node, layout.tasks) == (2, 8, 26)


def test_prepare_fixes_the_coordinator_and_leaves_every_other_port_to_registration(tmp_path):
    config = config_for(tmp_path, "model.path=/nonexistent")
    path = prepare_slurm_run(config, "127.0.0.1")
    resolved = load_config(path)
    net = resolved.network
    assert (net.host, net.control_port, net.report_port) == ("127.0.0.1", 29400, 29401)
    assert (net.trajectory_port, net.batch_port, net.weight_port, net.dist_port) == (0, 0, 0, 0)
    assert resolved.run.run_id and net.resolved


def test_the_command_writes_the_script_to_stdout(tmp_path):
    out = subprocess.run([sys.executable, "-m", "horizonrl", "slurm", str(CONFIG), f"run.output_dir={tmp_path}/r"],
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.startswith("#!/bin/bash") and "srun --exact" in out.stdout


def supervise_in_bash(tmp_path, script: str, limit: int, failures: int) -> tuple[int, list[str], bool]:
    """Run the script's own ``supervise`` function on a step that fails ``failures`` times, then succeeds: its
    exit code, what it said, and whether it marked the job failed."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("WINDOW_S="))
    end = lines.index("}", start)
    counter = tmp_path / "attempts"
    step = f'n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}; [ "$n" -ge {failures} ] || exit 3'
    program = "\n".join([f"RUN_DIR={tmp_path}", f'mkdir -p "{tmp_path}/logs"', *lines[start:end + 1],
                         f"supervise step {limit} bash -c '{step}'", "echo rc=$?"])
    out = subprocess.run(["bash", "-c", program], capture_output=True, text=True, timeout=60)
    return int(out.stdout.split("rc=")[1]), out.stderr.splitlines(), (tmp_path / ".failed").exists()


def test_the_scripts_restarts_follow_the_supervision_policy(tmp_path):
    """The same limits and back-off as the other launchers: a step that fails is started again after a
    doubling back-off while it has had fewer than the limit of restarts within the window; one more stops the
    job."""
    config = config_for(tmp_path, "supervision.backoff_s=0.05", "supervision.max_backoff_s=0.1",
                        "supervision.window_s=600", "supervision.max_restarts=2")
    script = sbatch_script(config)
    assert "WINDOW_S=600; BACKOFF_S=0.05; MAX_BACKOFF_S=0.1" in script
    rc, said, failed = supervise_in_bash(tmp_path / "a", script, limit=2, failures=2)
    assert rc == 0 and not failed
    assert "restarting it in 0.05 s (restart 1 of 2" in said[0] and "restarting it in 0.1 s (restart 2 of 2" in said[1]
    rc, said, failed = supervise_in_bash(tmp_path / "b", script, limit=2, failures=3)
    assert rc == 3 and failed and "2 restart(s) within 600 s: stopping the job" in said[-1]
