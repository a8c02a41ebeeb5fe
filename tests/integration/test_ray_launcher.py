"""``launcher.type=ray``: the same CPU training run, its processes Ray actors in one placement group.

A Ray instance on this machine (started by the launcher, or a ``ray.cluster_utils.Cluster`` of two
simulated nodes the test starts and the launcher attaches to), with logical GPUs: the learner ranks
and the engines get GPU bundles, see a ``CUDA_VISIBLE_DEVICES`` but no GPU, and run on the CPU over
gloo. Every process other than the coordinator binds a free port and registers it; nothing is left
running afterwards. Needs Ray (the ``ray`` extra, which ``make test`` installs).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
from helpers import (faults, horizonrl_cmd, newest_step, run_events, start_process, steps_trained, stop_process,
                     wait_for_step, wait_until)

from horizonrl.core.run_dirs import latest_checkpoint
from horizonrl.core.run_events import RunEvent

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "signpost_test.yaml"
# A few learner steps of small batches; logical GPUs for the bundles (one per learner rank and engine).
SMALL = ["rollout.n=4", "learner.groups_per_step=2", "buffer.capacity_groups=4", "rollout.groups_in_flight=1",
         "launcher.type=ray", "launcher.ray.num_gpus=4", "rollout.ack_timeout_s=5", "learner.batch_resend_s=10",
         "learner.batch_timeout_s=1800"]  # engines start slowly on a loaded machine
def run_processes(run_dir: Path) -> list[psutil.Process]:
    """Every process of the run, wherever Ray started it: ``horizonrl ROLE --config <run_dir>/config.yaml``."""
    marker = str(run_dir / "config.yaml")
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def role_of(process: psutil.Process) -> str | None:
    """``coordinator``, ``buffer``, ``learner``, ``actor-I``; None for a process that is gone."""
    try:
        cmd = process.cmdline()
    except psutil.Error:
        return None
    role = cmd[cmd.index("horizonrl") + 1]
    return f"{role}-{cmd[cmd.index('--index') + 1]}" if "--index" in cmd else role


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def assert_nothing_left(run_dir: Path, tree: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert alive == [], [" ".join(p.cmdline())[:120] for p in alive if p.is_running()]
    assert run_processes(run_dir) == []


def test_a_killed_actor_is_restarted_by_ray_a_killed_learner_by_the_launcher_and_the_run_finishes(tiny_model,
                                                                                                   tmp_path):
    """One actor, and runs longer than what the buffer holds: the learner cannot finish without the replacement.
    The actor's Ray worker (its host) is killed with SIGKILL, as a lost process would be: Ray ends the actor's
    process tree and restarts it; the new incarnation registers nothing (the buffer and the hub did not move),
    finds them in Control, joins the weight hub at the current weights and the run goes on. Then the learner is
    killed: the launcher starts it again as a new gang from its newest checkpoint, and the run finishes."""
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    # Room after the kill: while the learner waits for its first batch the actor fills the buffer and its own
    # send queue, and the learner can take several steps from those in a second (on a loaded machine it was
    # at step 5 before the kill landed). Afterwards each step needs groups only the replacement can make.
    total = 12
    proc = start_process(horizonrl_cmd("train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}",
                                       *SMALL, "learner.num_ranks=1", "rollout.num_actors=1",
                                       "buffer.capacity_groups=2", "learner.save_every=2",
                                       f"learner.total_steps={total}"), log)
    tree: list[psutil.Process] = []
    try:
        wait_for_step(run_dir, 1, 1200)
        [actor] = [p for p in run_processes(run_dir) if role_of(p) == "actor-0"]
        host = actor.parent()
        assert host.name().startswith("ray::RoleHost") or "RoleHost" in " ".join(host.cmdline()), host.cmdline()
        tree = [host, actor, *actor.children(recursive=True)]
        host.send_signal(signal.SIGKILL)
        # Ends early should the run end without the replacement (it then fails below, saying so).
        wait_until(lambda: proc.poll() is not None
                   or any(f["event"] == "recovered" and f["name"] == "actor-0" for f in faults(run_dir)), 900,
                   "actor-0 to be restarted by Ray and rejoin the weight hub")
        # A checkpoint (save_every=2) past the actor's death, then the learner's process dies. The checkpoint, not
        # the step: step 4 is trained before its checkpoint is written.
        wait_until(lambda: proc.poll() is not None or any(
            e["step"] >= 4 for e in run_events(run_dir, RunEvent.CHECKPOINT_WRITTEN)), 600, "the checkpoint of step 4")
        learner_killed_after = newest_step(run_dir)
        learners = [p for p in run_processes(run_dir) if role_of(p) == "learner"]
        assert proc.poll() is None and len(learners) == 1, (
            f"the run ended (exit code {proc.poll()}) or has {len(learners)} learner processes before the learner "
            f"kill, at step {learner_killed_after}:\n{log.read_text(errors='replace')[-3000:]}")
        [learner] = learners
        learner.send_signal(signal.SIGKILL)
        learner.wait(timeout=60)
        # The newest checkpoint when it died (the learner may have gone on past the step seen above). The
        # replacement takes two steps before it saves again.
        newest_at_death = latest_checkpoint(run_dir)
        rc = proc.wait(timeout=1200)
    finally:
        stop_process(proc)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    [died] = [f for f in faults(run_dir) if f["event"] == "died" and f["name"] == "actor-0"]
    assert died["learner_step"] < total - 2, f"the kill came too late to need the replacement: {died}"
    events = [(f["name"], f["event"]) for f in faults(run_dir)]
    for event in ("died", "restarted", "recovered"):
        assert events.count(("actor-0", event)) == 1, events
    assert learner_killed_after < total, "the learner was killed after the last step"
    assert ("learner-0", "died") in events and ("learner", "restarted") in events, events
    # the new gang goes on from its newest checkpoint (an even step, 4 or later), to the end
    [checkpoint] = [e["resumed_step"] for e in run_events(run_dir, RunEvent.LEARNER_STARTED) if e["resumed_step"]]
    assert newest_at_death is not None and checkpoint == int(newest_at_death.name.removeprefix("step_")), (
        checkpoint, newest_at_death)
    assert checkpoint % 2 == 0 and 4 <= checkpoint < total, checkpoint
    steps = steps_trained(run_dir)
    assert steps[-(total - checkpoint):] == list(range(checkpoint + 1, total + 1)), steps
    # the killed incarnation's process tree (the role process and its engine) went with its host
    _, alive = psutil.wait_procs(tree, timeout=30)
    assert alive == []
    assert run_processes(run_dir) == []


def test_a_ray_run_on_two_simulated_nodes_places_every_process_and_trains_to_the_end(tiny_model, tmp_path):
    """``ray.cluster_utils.Cluster``: a head and a second node on this machine; the launcher attaches to it
    (launcher.ray.address) and spreads one placement group over both (SPREAD): coordinator, buffer, an actor and
    2 learner ranks, a logical GPU for each rank and the engine, every server on a registered free port, the
    learner's ranks meeting through the coordinator from two nodes, trained to the end, nothing left running. (One
    actor: a second engine adds minutes on 2 cores and nothing the placement needs.)"""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "num_gpus": 2, "include_dashboard": False})
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    total = 2
    proc = None
    seen: dict[int, psutil.Process] = {}
    roles: set[str] = set()
    try:
        cluster.add_node(num_cpus=3, num_gpus=2)
        cluster.wait_for_nodes()
        overrides = [o for o in SMALL if not o.startswith("launcher.ray.num_gpus")]
        proc = start_process(horizonrl_cmd(
            "train", str(CONFIG), f"model.path={tiny_model}", f"run.output_dir={run_dir}", *overrides,
            "learner.num_ranks=2", "rollout.num_actors=1", f"learner.total_steps={total}",
            f"launcher.ray.address={cluster.address}", "launcher.ray.strategy=SPREAD"), log)
        deadline = time.monotonic() + 1500
        while proc.poll() is None and time.monotonic() < deadline:
            ours = run_processes(run_dir)
            roles.update(filter(None, map(role_of, ours)))
            seen.update((p.pid, p) for p in ours + descendants(proc.pid))
            time.sleep(1)
        rc = proc.wait(timeout=5)
    finally:
        if proc is not None:
            stop_process(proc)
        cluster.shutdown()
    text = log.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    assert newest_step(run_dir) == total
    placements = run_events(run_dir, RunEvent.PROCESS_PLACED)
    placed = {e["name"]: e["node"] for e in placements}
    assert {"coordinator", "buffer", "learner-0", "learner-1", "actor-0"} <= set(placed), placed
    assert len(set(placed.values())) == 2, placed
    # one placement group: CPU bundles for coordinator and buffer, a logical GPU for each rank and engine
    resources = {e["name"]: e["resources"] for e in placements}
    assert resources["learner-1"] == resources["actor-0"] == {"CPU": 1.0, "GPU": 1.0}, resources
    assert resources["buffer"] == {"CPU": 1.0}, resources
    # every server registered a free port with the coordinator; the learner met through it
    endpoints = {k: v for e in run_events(run_dir, RunEvent.ENDPOINTS_REGISTERED) for k, v in e["endpoints"].items()}
    for name in ("trajectories", "batches", "weights"):
        assert endpoints.get(name, "").startswith("tcp://"), (name, endpoints)
    assert any(k.startswith("learner_rendezvous/") for k in endpoints), endpoints
    config = (run_dir / "config.yaml").read_text()
    assert "trajectory_port: 0" in config and "weight_port: 0" in config and "type: ray" in config
    assert {"coordinator", "buffer", "learner", "actor-0"} <= roles, roles
    # each learner rank and engine saw the GPU Ray gave it, found no GPU behind it, and trained on gloo
    [started] = run_events(run_dir, RunEvent.LEARNER_STARTED)
    assert (started["ranks"], started["backend"], started["device"]) == (2, "gloo", "cpu"), started
    assert_nothing_left(run_dir, list(seen.values()))
