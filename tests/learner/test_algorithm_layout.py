"""The algorithm reads its config in one place (learner/algorithm.py ``AlgorithmSettings.from_config``), and the
modules holding its equations never see the config: the training step's config, followed through the code, stops
in main.py and algorithm.py. One table says where every estimator's advantages are computed."""

import ast
import typing
from pathlib import Path

from horizonrl.core.config import AlgorithmConfig, load_config
from horizonrl.learner.algorithm import ESTIMATOR_STAGES, AlgorithmSettings

LEARNER = Path(__file__).resolve().parents[2] / "horizonrl" / "learner"
MATH_MODULES = ("batching.py", "advantages.py", "turn_advantages.py", "policy_loss.py", "rollout_correction.py",
                "mismatch.py", "packing.py")


def names_in(tree: ast.AST) -> set[str]:
    return ({node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
            | {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)})


def test_every_estimator_the_config_accepts_has_its_stage():
    accepted = set(typing.get_args(AlgorithmConfig.model_fields["adv_estimator"].annotation))
    assert set(ESTIMATOR_STAGES) == accepted
    assert set(ESTIMATOR_STAGES.values()) == {"episode", "turn", "token"}


def test_the_modules_of_the_equations_never_see_the_config():
    for name in MATH_MODULES:
        tree = ast.parse((LEARNER / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "horizonrl.core.config" not in imported, name
        assert not {"config", "TrainConfig"} & names_in(tree), f"{name} reads the config"


def test_algorithm_py_reads_the_config_only_in_algorithm_settings_from_config():
    tree = ast.parse((LEARNER / "algorithm.py").read_text())
    readers = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "config" in names_in(node):
            readers.append(node.name)
    assert readers == ["from_config"]
    [settings] = [node for node in tree.body if isinstance(node, ast.ClassDef) and "from_config" in
                  {f.name for f in node.body if isinstance(f, ast.FunctionDef)}]
    assert settings.name == "AlgorithmSettings"


def test_the_settings_carry_what_the_config_says():
    config = load_config(None, ["model.path=unused", "envs=[{name: signpost}]", "algorithm.adv_estimator=gigpo", "algorithm.gigpo_gamma=0.9",
                                "algorithm.norm_adv_by_std_in_grpo=false", "learner.ppo_epochs=2",
                                "learner.use_kl_loss=false", "learner.kl_loss_coef=0.3", "rollout.top_p=0.9"])
    settings = AlgorithmSettings.from_config(config)
    assert (settings.advantage.estimator, settings.advantage.gigpo.gamma) == ("gigpo", 0.9)
    assert not settings.advantage.norm_by_std and not settings.advantage.gigpo.norm_by_std
    assert settings.update.ppo_epochs == 2 and settings.loss.top_p == 0.9
    assert settings.loss.kl_loss_coef == 0.0  # use_kl_loss off: no reference term, whatever its coefficient
