"""The placement plan (core/placement.py): devices and backends of every process, without a GPU.

The plan is a pure function of the config and the visible GPU ids, so every GPU layout is
tested here on the CPU: 0, 1, 2, 4 and 8 GPUs, tensor parallelism, explicit ``resources``, and
every configuration it must refuse (with the setting to change in the message)."""

import pytest

from horizonrl.core.config import ConfigError, load_config
from horizonrl.core.placement import (
    COLOCATED_ENV,
    ENGINE_CPUS_ENV,
    choose_backends,
    engine_cpus_of,
    engine_weight_transport,
    cpus_of,
    learner_device_index,
    local_device_type,
    plan_placement,
    spread_engines,
    visible_gpus,
    vllm_cpu_binding,
)
from horizonrl.actors.cpu_affinity import starting_on_cpus
from horizonrl.apps.roles import pin_to_cpus

BASE = ["model.path=/m", "envs=[{name: signpost}]"]


def config(*overrides: str):
    return load_config(None, BASE + list(overrides))


def gpus(n: int) -> tuple[str, ...]:
    return tuple(str(i) for i in range(n))


def devices(plan, role: str) -> list[tuple[str, ...]]:
    return [p.gpus for p in (plan.learner if role == "learner" else plan.actors)]


# ------------------------------------------------------------------ no GPU: today's behaviour


def test_no_gpu_is_a_cpu_plan_that_leaves_the_environment_alone():
    plan = plan_placement(config("learner.num_ranks=2", "rollout.num_actors=3"), ())
    assert plan.device_type == "cpu"
    assert (plan.learner_backend, plan.weight_backend) == ("gloo", "gloo")
    assert [p.name for p in plan.learner] == ["learner-0", "learner-1"]
    assert [p.name for p in plan.actors] == ["actor-0", "actor-1", "actor-2"]
    assert all(p.device == "cpu" and p.gpus == () for p in (*plan.learner, *plan.actors))
    assert all(plan.child_env(p) == {} for p in (*plan.learner, *plan.actors))


def test_cpu_on_a_gpu_host_hides_the_gpus():
    plan = plan_placement(config("resources.device=cpu"), gpus(4))
    assert plan.device_type == "cpu" and plan.learner_backend == "gloo"
    assert all(plan.child_env(p) == {"CUDA_VISIBLE_DEVICES": ""} for p in (*plan.learner, *plan.actors))


# ------------------------------------------------------------------ the default split


def test_two_gpus_one_rank_one_actor():
    plan = plan_placement(config("rollout.num_actors=1"), gpus(2))
    assert plan.device_type == "cuda" and not plan.colocated
    assert (plan.learner_backend, plan.weight_backend) == ("nccl", "nccl")
    assert devices(plan, "learner") == [("0",)] and devices(plan, "actor") == [("1",)]
    assert plan.learner[0].device == "cuda:0" and plan.actors[0].device == "cuda:0"
    assert plan.engine_executor == "uni" and plan.unused_gpus == ()


def test_four_gpus_default_config_leaves_one_unused():
    plan = plan_placement(config(), gpus(4))  # 1 learner rank, 2 actors
    assert devices(plan, "learner") == [("0",)]
    assert devices(plan, "actor") == [("1",), ("2",)]
    assert plan.unused_gpus == ("3",)
    assert "unused GPUs: 3" in plan.table()


def test_eight_gpus_two_ranks_three_tp2_engines():
    plan = plan_placement(config("learner.num_ranks=2", "rollout.num_actors=3",
                                 "rollout.engine.tensor_parallel_size=2"), gpus(8))
    assert devices(plan, "learner") == [("0",), ("1",)]
    assert devices(plan, "actor") == [("2", "3"), ("4", "5"), ("6", "7")]
    assert plan.engine_executor == "mp" and plan.tensor_parallel_size == 2
    assert plan.child_env(plan.actors[1]) == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert plan.child_env(plan.learner[1]) == {"CUDA_VISIBLE_DEVICES": "1"}


def test_ids_are_passed_on_as_the_launcher_sees_them():
    # CUDA_VISIBLE_DEVICES=4,5,6 on the launcher: position 0 is GPU 4.
    plan = plan_placement(config("rollout.num_actors=2"), ("4", "5", "6"))
    assert plan.child_env(plan.learner[0]) == {"CUDA_VISIBLE_DEVICES": "4"}
    assert [plan.child_env(a)["CUDA_VISIBLE_DEVICES"] for a in plan.actors] == ["5", "6"]
    assert plan.learner[0].positions == (0,) and plan.actors[1].positions == (2,)


def test_one_gpu_one_actor_is_colocated_and_both_are_told():
    plan = plan_placement(config("rollout.num_actors=1"), gpus(1))
    assert plan.colocated and plan.weight_backend == "nccl"
    assert devices(plan, "learner") == [("0",)] and devices(plan, "actor") == [("0",)]
    # Both see the GPU as cuda:0 (a CUDA-IPC handle names the device by index) and know they share it.
    assert plan.child_env(plan.learner[0]) == plan.child_env(plan.actors[0]) == {
        "CUDA_VISIBLE_DEVICES": "0", COLOCATED_ENV: "1"}
    table = plan.table()
    assert "CUDA IPC to the engine on the learner's GPU" in table
    assert "colocated: learner-0, actor-0 share a GPU; memory split: engine 0.5" in table and "learner 0.4" in table


def test_only_the_engine_on_the_learners_gpu_is_colocated():
    plan = plan_placement(config("resources.learner_gpus=[0]", "resources.actor_gpus=[[0],[1]]"), gpus(2))
    assert plan.colocated
    assert COLOCATED_ENV in plan.child_env(plan.actors[0]) and COLOCATED_ENV not in plan.child_env(plan.actors[1])
    assert COLOCATED_ENV in plan.child_env(plan.learner[0])


def test_a_colocated_memory_split_that_does_not_fit_names_the_settings():
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.7 \+ resources.learner_memory_fraction=0.4 = "
                                          r"1.1 .* over 0.95.*e.g. rollout.engine.gpu_memory_utilization=0.55"):
        plan_placement(config("rollout.num_actors=1", "rollout.engine.gpu_memory_utilization=0.7"), gpus(1))
    plan = plan_placement(config("rollout.num_actors=1", "rollout.engine.gpu_memory_utilization=0.3",
                                 "resources.learner_memory_fraction=0.65"), gpus(1))
    assert (plan.engine_memory, plan.learner_memory) == (0.3, 0.65)


def test_a_tensor_parallel_engine_cannot_share_the_learners_gpu():
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 would share the learner's GPU"):
        plan_placement(config("rollout.num_actors=1", "rollout.engine.tensor_parallel_size=2",
                              "resources.learner_gpus=[0]", "resources.actor_gpus=[[0,1]]"), gpus(2))


def test_the_engine_learns_its_weight_transport_from_the_plan():
    assert engine_weight_transport(True, {COLOCATED_ENV: "1"}) == "cuda_ipc"
    assert engine_weight_transport(True, {}) == "nccl" and engine_weight_transport(False, {}) == "gloo"
    with pytest.raises(ConfigError, match="sees no GPU"):
        engine_weight_transport(False, {COLOCATED_ENV: "1"})


def test_one_gpu_two_actors_is_too_few():
    with pytest.raises(ConfigError, match=r"1 GPU\(s\) visible, but the run needs 3.*colocated mode: set "
                                          r"rollout.num_actors=1"):
        plan_placement(config(), gpus(1))


def test_two_gpus_default_two_actors_names_the_fix():
    with pytest.raises(ConfigError, match=r"needs 3.*set rollout.num_actors=1"):
        plan_placement(config(), gpus(2))


def test_tp_that_does_not_fit_names_the_fix():
    with pytest.raises(ConfigError, match=r"needs 5: .*tensor_parallel_size=2.*set rollout.num_actors=1"):
        plan_placement(config("rollout.engine.tensor_parallel_size=2"), gpus(4))


# ------------------------------------------------------------------ explicit resources


def test_explicit_resources():
    plan = plan_placement(config("learner.num_ranks=2", "rollout.num_actors=2",
                                 "rollout.engine.tensor_parallel_size=2",
                                 "resources.learner_gpus=[6,7]", "resources.actor_gpus=[[0,1],[2,3]]"), gpus(8))
    assert devices(plan, "learner") == [("6",), ("7",)]
    assert devices(plan, "actor") == [("0", "1"), ("2", "3")]
    assert plan.unused_gpus == ("4", "5")
    assert "resources.learner_gpus and resources.actor_gpus" in plan.source


def test_explicit_learner_only_takes_the_rest_in_order():
    plan = plan_placement(config("resources.learner_gpus=[2]"), gpus(3))
    assert devices(plan, "learner") == [("2",)] and devices(plan, "actor") == [("0",), ("1",)]


def test_explicit_actors_only_gives_the_learner_the_first_free():
    plan = plan_placement(config("resources.actor_gpus=[[0],[1]]"), gpus(3))
    assert devices(plan, "learner") == [("2",)] and devices(plan, "actor") == [("0",), ("1",)]


def test_explicit_sharing_of_one_gpu_by_learner_and_engine_is_colocated():
    plan = plan_placement(config("rollout.num_actors=1", "resources.learner_gpus=[0]", "resources.actor_gpus=[[0]]"),
                          gpus(2))
    assert plan.colocated and plan.unused_gpus == ("1",)


@pytest.mark.parametrize("overrides, n, message", [
    (["learner.num_ranks=2", "resources.learner_gpus=[0]"], 4, r"learner_gpus has 1 GPU\(s\) for learner.num_ranks=2"),
    (["resources.actor_gpus=[[1]]"], 4, r"actor_gpus has 1 list\(s\) for rollout.num_actors=2"),
    (["rollout.engine.tensor_parallel_size=2", "resources.actor_gpus=[[1,2],[3]]"], 8,
     r"actor_gpus\[1\] has 1 GPU\(s\) but rollout.engine.tensor_parallel_size=2"),
    (["resources.actor_gpus=[[1],[9]]"], 4, r"actor_gpus\[1\] names GPU 9, but only 4 GPU\(s\) are visible"),
    (["resources.learner_gpus=[5]"], 4, r"learner_gpus names GPU 5"),
    (["learner.num_ranks=2", "resources.learner_gpus=[1,1]"], 4, "one GPU to two learner ranks"),
    (["resources.actor_gpus=[[1],[1]]"], 4, "GPU 1 is given to the engines of actor 0 and actor 1"),
    (["rollout.engine.tensor_parallel_size=2", "resources.actor_gpus=[[1,1],[2,3]]"], 4, "names a GPU twice"),
    (["learner.num_ranks=2", "resources.learner_gpus=[0,1]", "resources.actor_gpus=[[1],[2]]"], 4,
     "overlap the engines' GPUs"),
    (["resources.device=cuda"], 0, "resources.device=cuda but no GPU is visible"),
    (["resources.learner_gpus=[0]"], 0, "set but the run is on the CPU"),
    (["resources.device=cpu", "resources.actor_gpus=[[0],[1]]"], 4, "resources.device=cpu"),
    (["learner.backend=gloo"], 4, "learner.backend=gloo with GPUs"),
    (["learner.backend=nccl"], 0, "learner.backend=nccl without a GPU"),
])
def test_refused(overrides, n, message):
    with pytest.raises(ConfigError, match=message):
        plan_placement(config(*overrides), gpus(n))


def test_negative_gpu_positions_are_a_config_error():
    with pytest.raises(ConfigError, match="resources.learner_gpus"):
        config("resources.learner_gpus=[-1]")


# ------------------------------------------------------------------ what the processes decide themselves


def test_backends_are_chosen_in_one_place():
    assert choose_backends("cuda", "auto") == ("nccl", "nccl")
    assert choose_backends("cuda", "nccl") == ("nccl", "nccl")
    assert choose_backends("cpu", "auto") == ("gloo", "gloo")
    assert choose_backends("cpu", "gloo") == ("gloo", "gloo")
    with pytest.raises(ConfigError, match="resources.device=cpu"):
        choose_backends("cuda", "gloo")


def test_visible_gpus():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3,1"}, lambda: 2) == ("3", "1")
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, lambda: 0) == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, lambda: 0) == ()
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, lambda: 1) == ("0",)  # CUDA stops at the first invalid id
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-ab12, GPU-cd34"}, lambda: 2) == ("GPU-ab12", "GPU-cd34")
    assert visible_gpus({}, lambda: 2) == ("0", "1")
    assert visible_gpus({}, lambda: 0) == ()
    # Set, but no GPU behind it (a CPU-only torch, a CI box): the CPU, as before.
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0"}, lambda: 0) == ()
    # Ids that do not exist are not counted (CUDA ignores them too).
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,7"}, lambda: 2) == ("0", "1")


def test_a_started_process_agrees_with_the_plan():
    assert local_device_type("auto", ()) == "cpu"
    assert local_device_type("auto", ("3",)) == "cuda"
    assert local_device_type("cpu", ("3",)) == "cpu"
    with pytest.raises(ConfigError):
        local_device_type("cuda", ())
    assert learner_device_index(("5",), local_rank=1) == 0  # placed by the launcher: its own GPU is cuda:0
    assert learner_device_index(("0", "1", "2", "3"), local_rank=2) == 2  # torchrun by hand: all GPUs visible
    with pytest.raises(ConfigError, match="LOCAL_RANK=2"):
        learner_device_index(("0", "1"), local_rank=2)


def test_table_lists_every_process_and_the_backends():
    plan = plan_placement(config("learner.num_ranks=2", "rollout.num_actors=2",
                                 "rollout.engine.tensor_parallel_size=2"), gpus(6))
    text = plan.table()
    lines = text.splitlines()
    assert lines[0].startswith("placement: 6 visible GPU(s)")
    row = next(line for line in lines if line.strip().startswith("actor-1"))
    assert row.split() == ["actor-1", "GPU", "4,", "5", "4,5", "cuda:0,", "cuda:1"]
    assert "learner process group nccl, weight broadcast nccl" in text
    assert "tensor_parallel_size 2 (vLLM executor mp)" in text
    cpu = plan_placement(config(), ()).table()
    assert cpu.splitlines()[0] == "placement: CPU (no GPU visible)"
    assert "(unchanged)" in cpu and "gloo" in cpu


# ------------------------------------------------------------------ the launcher hands the plan to its children


def spawned_envs(cfg, plan, tmp_path, monkeypatch) -> dict[str, dict[str, str] | None]:
    """What ``Launcher.start_all`` would start, by child name -> the env it adds (None: nothing); nothing is
    started."""
    import io

    from horizonrl.launcher.console import RunConsole
    from horizonrl.launcher import Launcher

    launcher = Launcher(cfg, tmp_path / "config.yaml", plan=plan,
                        console=RunConsole(io.StringIO(), title="t", total=1, live=False))
    started: dict[str, dict[str, str] | None] = {}
    monkeypatch.setattr(launcher.processes, "start", lambda spec: started.setdefault(spec.name, spec.env or None))
    launcher.start_all()
    return started


def test_launcher_gives_each_child_its_gpus(tmp_path, monkeypatch):
    cfg = config("learner.num_ranks=2", "rollout.num_actors=2", "rollout.engine.tensor_parallel_size=2",
                 f"run.output_dir={tmp_path}")
    envs = spawned_envs(cfg, plan_placement(cfg, ("7", "6", "5", "4", "3", "2")), tmp_path, monkeypatch)
    assert envs["learner-0"]["CUDA_VISIBLE_DEVICES"] == "7" and envs["learner-1"]["CUDA_VISIBLE_DEVICES"] == "6"
    assert envs["learner-1"]["RANK"] == "1" and envs["learner-1"]["WORLD_SIZE"] == "2"
    assert envs["actor-0"] == {"CUDA_VISIBLE_DEVICES": "5,4"}
    assert envs["actor-1"] == {"CUDA_VISIBLE_DEVICES": "3,2"}
    assert envs["coordinator"] is None and envs["buffer"] is None  # no GPU work: the environment as is


def test_launcher_on_the_cpu_leaves_the_environment_as_it_was(tmp_path, monkeypatch):
    cfg = config("learner.num_ranks=2", f"run.output_dir={tmp_path}")
    envs = spawned_envs(cfg, plan_placement(cfg, ()), tmp_path, monkeypatch)
    assert "CUDA_VISIBLE_DEVICES" not in envs["learner-0"] and "CUDA_VISIBLE_DEVICES" not in envs["learner-1"]
    assert envs["actor-0"] is None and envs["actor-1"] is None
    hidden = spawned_envs(cfg, plan_placement(config("learner.num_ranks=2", "resources.device=cpu"), ("0", "1")),
                          tmp_path, monkeypatch)
    assert hidden["learner-0"]["CUDA_VISIBLE_DEVICES"] == "" and hidden["actor-1"] == {"CUDA_VISIBLE_DEVICES": ""}


def test_launcher_resolves_the_plan_from_the_environment():
    from horizonrl.launcher import resolve_placement

    plan = resolve_placement(config("rollout.num_actors=1"), {"CUDA_VISIBLE_DEVICES": "2,3"}, lambda: 2)
    assert [p.gpus for p in (*plan.learner, *plan.actors)] == [("2",), ("3",)]
    assert resolve_placement(config(), {}, lambda: 0).device_type == "cpu"


# ------------------------------------------------------------------ train --dry-run


def dry_run(tmp_path, capsys, monkeypatch, visible: str | None, *overrides: str) -> tuple[int, str, str]:
    import yaml

    from horizonrl.apps.cli import main

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    # This machine has no GPU: the launcher is told the ids it sees exist.
    monkeypatch.setattr("horizonrl.launcher.resolve.cuda_device_count", lambda: len([g for g in (visible or "").split(",") if g]))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": "/m"}, "envs": [{"name": "signpost"}]}))
    rc = main(["train", str(path), *overrides, "--dry-run"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_dry_run_prints_the_plan_after_the_config(tmp_path, capsys, monkeypatch):
    import yaml

    rc, out, _ = dry_run(tmp_path, capsys, monkeypatch, "0,1,2,3", "rollout.num_actors=1",
                         "rollout.engine.tensor_parallel_size=2")
    assert rc == 0
    assert yaml.safe_load(out)["rollout"]["engine"]["tensor_parallel_size"] == 2  # still loadable YAML
    plan = out[out.index("# placement:"):].splitlines()
    assert plan[0] == "# placement: 4 visible GPU(s) [0, 1, 2, 3], default split: the learner's GPUs first, then " \
                      "each engine's"
    assert [line.split()[1:4] for line in plan[2:4]] == [["learner-0", "GPU", "0"], ["actor-0", "GPU", "1,"]]
    assert plan[3].split()[5:] == ["1,2", "cuda:0,", "cuda:1"]
    assert "# unused GPUs: 3" in out.replace("#   ", "# ")


def test_dry_run_on_the_cpu(tmp_path, capsys, monkeypatch):
    rc, out, _ = dry_run(tmp_path, capsys, monkeypatch, "")
    assert rc == 0 and "# placement: CPU (no GPU visible)" in out and "weight broadcast gloo" in out


def test_dry_run_refuses_what_train_refuses(tmp_path, capsys, monkeypatch):
    rc, out, err = dry_run(tmp_path, capsys, monkeypatch, "0", "rollout.num_actors=1")
    assert rc == 0 and "# colocated: learner-0, actor-0 share a GPU" in out.replace("#   ", "# ")
    rc, out, err = dry_run(tmp_path, capsys, monkeypatch, "0", "rollout.num_actors=1",
                           "rollout.engine.gpu_memory_utilization=0.9")
    assert rc == 2 and err.startswith("error: the learner and an engine share a GPU, but") and "# placement" not in out
    rc, out, err = dry_run(tmp_path, capsys, monkeypatch, "0,1", "learner.backend=gloo")
    assert rc == 2 and "learner.backend=gloo with GPUs" in err and "# placement" not in out


# ------------------------------------------------------------------ CPU partitions (resources.*_cpus)


def test_cpu_partition_gives_each_process_its_cores():
    c = config("rollout.num_actors=2", "resources.learner_cpus=[0]", "resources.actor_cpus=[[1], [2, 3]]")
    assert cpus_of(c, "learner") == [0] and cpus_of(c, "coordinator") == [0] and cpus_of(c, "buffer") == [0]
    assert cpus_of(c, "actor", 0) == [1] and cpus_of(c, "actor", 1) == [2, 3]
    assert cpus_of(config(), "actor", 0) is None and cpus_of(config(), "learner") is None


def test_an_engine_may_have_cores_apart_from_its_actor():
    c = config("rollout.num_actors=2", "resources.actor_cpus=[[0], [0]]", "resources.engine_cpus=[[1], [2, 3]]")
    assert cpus_of(c, "actor", 1) == [0] and engine_cpus_of(c, 0) == [1] and engine_cpus_of(c, 1) == [2, 3]
    both = config("rollout.num_actors=2", "resources.actor_cpus=[[1], [2, 3]]")
    assert engine_cpus_of(both, 1) == [2, 3]  # default: the actor's own
    assert engine_cpus_of(config(), 0, {}) is None
    # then the share the launcher's plan gave it; the config's placement wins over it
    assert engine_cpus_of(config(), 1, {ENGINE_CPUS_ENV: "2,3"}) == [2, 3]
    assert engine_cpus_of(c, 1, {ENGINE_CPUS_ENV: "0"}) == [2, 3]
    with pytest.raises(ConfigError, match=ENGINE_CPUS_ENV):
        engine_cpus_of(config(), 0, {ENGINE_CPUS_ENV: "0-3"})


def test_engines_on_one_host_get_cores_of_their_own():
    """vLLM-CPU binds every engine it starts to the same cores; the plan gives each its own share."""
    assert spread_engines([0, 1], 2, 1) == ((0,), (1,))
    assert spread_engines([5, 4, 7, 6, 8], 2, 1) == ((4, 5), (6, 7))  # sorted; the odd core left to the rest
    assert spread_engines([0, 1], 4, 1) == ((0,), (1,), (0,), (1,))  # more engines than cores: round the cores
    assert spread_engines(range(8), 2, 2) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert spread_engines(range(4), 3, 2) == ((0, 1), (2, 3), (0, 1))  # a share holds a core per worker
    # vLLM's own binding: one engine (it already has all cores but its reserved one), no cores known, or an
    # engine with more workers than the host has cores
    assert spread_engines([0, 1], 1, 1) == () and spread_engines((), 2, 1) == () and spread_engines([0], 2, 2) == ()


def test_the_cpu_plan_spreads_unplaced_engines_through_the_actors_environment(tmp_path, monkeypatch):
    cfg = config("rollout.num_actors=2", f"run.output_dir={tmp_path}")
    plan = plan_placement(cfg, (), host_cpus=[0, 1])
    assert [p.engine_cpus for p in plan.actors] == [(0,), (1,)]
    envs = spawned_envs(cfg, plan, tmp_path, monkeypatch)
    assert envs["actor-0"] == {ENGINE_CPUS_ENV: "0"} and envs["actor-1"] == {ENGINE_CPUS_ENV: "1"}
    assert ENGINE_CPUS_ENV not in (envs["learner-0"] or {})
    assert "actor-0 [0], actor-1 [1]" in plan.table()
    # the config's placement is the user's: no share on top of it
    for placed in ("resources.engine_cpus=[[1], [1]]", "resources.actor_cpus=[[0], [1]]"):
        assert all(not p.engine_cpus for p in plan_placement(config("rollout.num_actors=2", placed), (), [0, 1]).actors)
    # GPUs: the engines are on them, and their CPU side is left alone
    assert all(not p.engine_cpus for p in plan_placement(cfg, gpus(3), [0, 1]).actors)


def test_the_launcher_shares_out_its_own_cores_unless_vllm_binding_is_set():
    import os

    from horizonrl.launcher import resolve_placement

    cfg = config("rollout.num_actors=2")
    own = sorted(os.sched_getaffinity(0))
    assert [p.engine_cpus for p in resolve_placement(cfg, {}, lambda: 0).actors] == list(spread_engines(own, 2, 1))
    told = resolve_placement(cfg, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, lambda: 0)
    assert all(not p.engine_cpus for p in told.actors)


def test_processes_and_threads_started_on_other_cores():
    """A process started inside starting_on_cpus runs on its cores; this thread, and a thread started
    meanwhile, are back on their own afterwards. (With one core allowed it cannot tell them apart: it needs 2.)"""
    import os
    import subprocess
    import sys
    import threading

    before = os.sched_getaffinity(0)
    other = max(before)
    release = threading.Event()
    seen: list[set[int]] = []

    def started_meanwhile():
        release.wait(30)
        seen.append(os.sched_getaffinity(0))

    with starting_on_cpus([other]):
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, timeout=60)
        thread = threading.Thread(target=started_meanwhile)
        thread.start()
    release.set()
    thread.join(30)
    assert child.stdout.strip() == f"[{other}]"
    assert os.sched_getaffinity(0) == before and seen == [before]
    with starting_on_cpus(None):
        assert os.sched_getaffinity(0) == before


def test_vllm_binds_each_tensor_parallel_worker_to_its_share_of_the_cores():
    assert vllm_cpu_binding([1], 1) == "1"
    assert vllm_cpu_binding([2, 3, 4, 5], 2) == "2,3|4,5"
    assert vllm_cpu_binding([1], 2) == "nobind"  # fewer cores than workers


@pytest.mark.parametrize("overrides, words", [
    (["rollout.num_actors=2", "resources.actor_cpus=[[1]]"], "one list per actor"),
    (["resources.actor_cpus=[[]]"], "non-empty"),
    (["rollout.num_actors=2", "resources.engine_cpus=[[1]]"], "engine_cpus has 1 core lists"),
    (["resources.learner_cpus=[-1]"], "core ids"),
])
def test_a_wrong_cpu_partition_is_refused(overrides, words):
    with pytest.raises(ConfigError, match=words):
        config(*overrides)


def test_pinning_restricts_this_process_and_binds_the_engine(monkeypatch):
    import os

    before = os.sched_getaffinity(0)
    core = min(before)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "")  # then deleted: restored as it was after the test (a
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")       # leaked "1" broke a later tensor-parallel engine)
    try:
        assert pin_to_cpus(config(), "actor", 0) is None and os.sched_getaffinity(0) == before
        assert pin_to_cpus(config("rollout.num_actors=1", f"resources.actor_cpus=[[{core}]]"), "actor", 0) == [core]
        assert os.sched_getaffinity(0) == {core}
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(core)
        with pytest.raises(ConfigError, match="may not use"):
            pin_to_cpus(config(f"resources.learner_cpus=[{max(before) + 1}]"), "learner")
        os.sched_setaffinity(0, before)
        # The engine on other cores: the process keeps the actor's, the engine's threads bind to the engine's.
        apart = config("rollout.num_actors=1", f"resources.actor_cpus=[[{core}]]",
                       f"resources.engine_cpus=[[{max(before)}]]")
        assert pin_to_cpus(apart, "actor", 0) == [core] and os.sched_getaffinity(0) == {core}
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(max(before))
        with pytest.raises(ConfigError, match="the engine of actor 0 is given CPU cores"):
            pin_to_cpus(config("rollout.num_actors=1", f"resources.engine_cpus=[[{max(before) + 1}]]"), "actor", 0)
    finally:
        os.sched_setaffinity(0, before)
