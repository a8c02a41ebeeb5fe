"""What the cluster launchers (ray, slurm) share, without a cluster: the run as a bundle per process (the same
placement rules as on one host), the resolved config that fixes only the coordinator's address, and what a
cluster cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest

from horizonrl.core.config import ConfigError, load_config
from horizonrl.core.placement import cluster_bundles
from horizonrl.launcher import launch, prepare_cluster_run

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "signpost_test.yaml"


def config(tmp_path, *overrides):
    return load_config(CONFIG, [f"run.output_dir={tmp_path / 'run'}", "model.path=/nonexistent", *overrides])


def test_bundles_give_each_rank_a_gpu_and_each_engine_its_tensor_parallel_gpus(tmp_path):
    bundles = cluster_bundles(config(tmp_path, "learner.num_ranks=2", "rollout.num_actors=3",
                                     "rollout.engine.tensor_parallel_size=2"), gpus=True, cpus_per_process=2)
    assert [(b.name, b.resources) for b in bundles] == [
        ("coordinator", {"CPU": 2}), ("buffer", {"CPU": 2}),
        ("learner-0", {"CPU": 2, "GPU": 1.0}), ("learner-1", {"CPU": 2, "GPU": 1.0}),
        ("actor-0", {"CPU": 2, "GPU": 2.0}), ("actor-1", {"CPU": 2, "GPU": 2.0}), ("actor-2", {"CPU": 2, "GPU": 2.0})]


def test_cpu_bundles_and_what_a_cluster_refuses(tmp_path):
    bundles = cluster_bundles(config(tmp_path), gpus=False)
    assert all(b.gpus == 0 for b in bundles) and len(bundles) == 2 + 1 + 2
    with pytest.raises(ConfigError, match="scheduler picks them"):
        cluster_bundles(config(tmp_path, "resources.learner_gpus=[0]"), gpus=True)
    with pytest.raises(ConfigError, match="device=cpu"):
        cluster_bundles(config(tmp_path, "resources.device=cpu"), gpus=True)


def test_the_cluster_config_fixes_the_coordinator_and_registers_the_rest(tmp_path):
    path = prepare_cluster_run(config(tmp_path, "launcher.type=ray"), "127.0.0.1", 40001, 40002)
    resolved = load_config(path)
    net = resolved.network
    assert (net.host, net.control_port, net.report_port) == ("127.0.0.1", 40001, 40002)
    assert (net.trajectory_port, net.batch_port, net.weight_port, net.dist_port) == (0, 0, 0, 0)
    assert resolved.run.run_id and resolved.launcher.type == "ray"
    with pytest.raises(ConfigError, match="CurveZMQ"):
        prepare_cluster_run(config(tmp_path / "b", "launcher.type=ray"), "10.0.0.5", 40001, 40002)
    with pytest.raises(ConfigError, match="only the coordinator has fixed ports"):
        prepare_cluster_run(config(tmp_path / "c", "launcher.type=ray", "network.weight_port=7000"), "127.0.0.1", 1, 2)
    managed = ["envs=[{name: http, settings: {env: signpost, managed: true}}]"]
    with pytest.raises(ConfigError, match="does not start environment servers"):
        prepare_cluster_run(config(tmp_path / "d", "launcher.type=ray", *managed), "127.0.0.1", 1, 2)


def test_train_sends_slurm_runs_to_sbatch_and_keeps_auto_hosts_off_one_machine(tmp_path):
    with pytest.raises(ConfigError, match="horizonrl slurm CONFIG"):
        launch(config(tmp_path, "launcher.type=slurm"))
    with pytest.raises(ConfigError, match="network.host=auto"):
        launch(config(tmp_path, "network.host=auto"))
