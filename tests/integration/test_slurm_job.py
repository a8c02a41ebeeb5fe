"""``horizonrl slurm CONFIG > job.sbatch``, submitted to a real Slurm: a one-node cluster on this machine.

Needs root and Debian's ``slurmd slurmctld slurm-client munge`` (``make system-deps`` installs them as
root; ``.ci/run`` runs it). The test starts munged, slurmctld and slurmd itself with
``scripts/slurm_single_node.sh`` — everything under its temporary directory, on free ports, a node
that declares 16 CPUs and no GPUs — submits the generated script, waits for the job, and stops the
three daemons by their pids. The job runs the CPU training run with one ``srun --exact`` step per
process (the learner under torchrun) and must finish with exit code 0 — after a ``kill -9`` of its coordinator
once the run is under way, which the job's script restarts on the first node and which continues from its saved
state (``coordinator_restored``).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from helpers import horizonrl_cmd, run_events

from horizonrl.protocol.transport import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.system]  # Slurm and munge

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
SETUP = REPO / "scripts" / "slurm_single_node.sh"
DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


@pytest.fixture
def slurm(tmp_path):
    """SLURM_CONF of a one-node cluster started for this test (and stopped after it)."""
    if os.geteuid() != 0:
        pytest.fail("this test starts slurmd, which must run as root (make system-deps installs Slurm as root)")
    state = tmp_path / "slurm"
    started = subprocess.run(["bash", str(SETUP), "start", str(state)], capture_output=True, text=True, timeout=180)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(SETUP), "stop", str(state)], timeout=60)


def job_state(job_id: str, env: dict) -> tuple[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env,
                         timeout=30).stdout
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"ExitCode=(\S+)", out)
    return (state.group(1) if state else "?"), (code.group(1) if code else "?")


def coordinator_pid(run_dir: Path) -> int | None:
    """The job's coordinator process: ``horizonrl coordinator --config RUN_DIR/config.yaml`` (this test's run)."""
    config = str(run_dir / "config.yaml")
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "coordinator" in cmdline and config in cmdline and "srun" not in cmdline[0]:
            return proc.info["pid"]
    return None


def test_the_generated_batch_job_trains_to_the_end_under_slurm_through_a_dead_coordinator(tiny_model, tmp_path,
                                                                                          slurm):
    run_dir = tmp_path / "run"
    control, torchrun = free_ports(2)
    script = subprocess.run(horizonrl_cmd(
        "slurm", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}", "learner.total_steps=6",
        "rollout.n=4", "learner.groups_per_step=2", "buffer.capacity_groups=4", "learner.batch_timeout_s=1800",
        f"launcher.slurm.python={sys.executable}", "launcher.slurm.cpus_per_process=1",
        "launcher.slurm.mem_per_process_gb=2", f"launcher.slurm.control_port={control}",
        f"launcher.slurm.torchrun_port={torchrun}", "launcher.slurm.time=00:40:00"),
        capture_output=True, text=True, check=True, timeout=120).stdout
    job_file = tmp_path / "job.sbatch"
    job_file.write_text(script)
    # the submitting environment (PYTHONPATH) goes with the job (sbatch --export=ALL)
    submitted = subprocess.run(["sbatch", "--parsable", str(job_file)], capture_output=True, text=True, env=slurm,
                               check=True, timeout=60)
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 2400
    state, code, killed = "?", "?", None
    try:
        while time.monotonic() < deadline:
            state, code = job_state(job_id, slurm)
            if state in DONE_STATES:
                break
            # Once the learner has trained a step, the coordinator dies (kill -9 of the job's coordinator process).
            if killed is None and run_events(run_dir, "step_trained"):
                killed = coordinator_pid(run_dir)
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(1 if killed is None else 5)
    finally:
        if state not in DONE_STATES:
            subprocess.run(["scancel", job_id], env=slurm, timeout=30)
    logs = run_dir / "logs"
    tails = [path.read_text(errors="replace")[-3000:] for path in (*logs.glob("slurm-*.out"), logs / "learner.log")
             if path.exists()]
    assert (state, code) == ("COMPLETED", "0:0"), "\n".join(tails)
    coordinator = (logs / "coordinator.log").read_text(errors="replace")
    assert "registered batches=tcp://127.0.0.1:" in coordinator and "weights=tcp://127.0.0.1:" in coordinator
    # The learner's last step reached the coordinator: its report, or (when the learner ended while no coordinator
    # listened) its end read from the run directory by the restarted one.
    assert '"step":6,"total":6,"startup":false' in coordinator or [
        e for e in run_events(run_dir, "learner_done_from_disk") if e["step"] == 6]
    assert killed is not None, "the coordinator was never found to kill"
    [restored] = run_events(run_dir, "coordinator_restored")
    assert restored["restarts"] == 1 and "coordinator exited with code" in "\n".join(tails + [
        p.read_text(errors="replace") for p in logs.glob("slurm-*.out")])
    assert (run_dir / ".finished").exists() and not (run_dir / ".failed").exists()
