"""Where each algorithm lives, and what loading it costs.

Each built-in algorithm is a folder (``pipeline/algorithms/<name>/``): ``config.py`` and ``learner.py``,
which learner actors unpickle, import no Ray Tune (nor pandas or Ray Data, which it pulls in);
``algorithm.py`` registers the algorithm. The package exports all three's names (``from
pipeline.algorithms.ppo import PPO, PPOConfig``, as from RLlib's ``ray.rllib.algorithms.ppo``), each loaded on
first use, as ``pipeline``'s names are; the first algorithm or config name from ``pipeline`` registers every
built-in, with Tune too. The import checks run in a fresh interpreter, since this one has imported
everything already.
"""
import json
import subprocess
import sys

import pytest

from pipeline.config.base import ConfigError
from pipeline.registry import BUILTINS, get_algorithm

PROBE = r"""
import json, sys
stages = {}
def heavy():
    return sorted(m for m in ("ray.tune", "pandas", "ray.data", "pipeline.algorithm", "pipeline.registry")
                  if m in sys.modules)
import importlib
names = %(names)r
for name in names:
    importlib.import_module(f"pipeline.algorithms.{name}.config")
    if name != "bc":
        importlib.import_module(f"pipeline.algorithms.{name}.learner")
import pipeline
stages["config_and_learner_modules"] = heavy()
from pipeline.algorithms.dqn.config import DQNConfig
config = DQNConfig()
stages["before_build"] = heavy()
stages["dqn"] = [config.algorithm_class().__name__, config.get_default_learner_class().__name__]
stages["after_dqn"] = sorted(pipeline.registry._ALGORITHMS)
from pipeline.algorithms.sac import SACConfig  # a name from an algorithm's package registers that algorithm
stages["after_package_name"] = sorted(pipeline.registry._ALGORITHMS)
from pipeline import PPOConfig
stages["after_first_name"] = sorted(pipeline.registry._ALGORITHMS)
from ray.tune.registry import get_trainable_cls
stages["tune"] = {n: get_trainable_cls(n).__name__ for n in stages["after_first_name"]}
print(json.dumps(stages))
"""


@pytest.fixture(scope="module")
def stages():
    names = sorted(name.lower() for name in BUILTINS)
    out = subprocess.run([sys.executable, "-c", PROBE % {"names": names}], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow  # a fresh interpreter imports torch and Ray Tune: ~8 s
def test_config_and_learner_modules_import_no_tune(stages):
    assert stages["config_and_learner_modules"] == []
    assert stages["before_build"] == []


@pytest.mark.slow  # a fresh interpreter imports torch and Ray Tune: ~8 s
def test_a_config_imported_alone_finds_its_algorithm(stages):
    assert stages["dqn"] == ["DQN", "DQNLearner"]
    assert stages["after_dqn"] == ["DQN"]


@pytest.mark.slow  # a fresh interpreter imports torch and Ray Tune: ~8 s
def test_a_name_from_an_algorithms_package_registers_that_algorithm(stages):
    assert stages["after_package_name"] == ["DQN", "SAC"]


@pytest.mark.slow  # a fresh interpreter imports torch and Ray Tune: ~8 s
def test_the_first_algorithm_name_registers_every_builtin_with_tune(stages):
    assert stages["after_first_name"] == sorted(BUILTINS)
    assert stages["tune"] == {name: name for name in BUILTINS}


def test_unknown_names_are_errors_that_list_the_algorithms():
    with pytest.raises(ConfigError, match=r"unknown algorithm 'PPOO'.*'APPO'.*'PPO'"):
        get_algorithm("PPOO")
    assert get_algorithm("ppo")[1].__name__ == "PPO"
    import pipeline

    with pytest.raises(AttributeError, match="no attribute 'PPOO'"):
        pipeline.PPOO  # noqa: B018
    assert {"PPO", "PPOConfig", "DefaultModelConfig", "register_env"} <= set(dir(pipeline))


def test_each_algorithm_package_exports_its_classes_as_rllibs_do():
    import importlib

    for name in BUILTINS:
        package = importlib.import_module(f"pipeline.algorithms.{name.lower()}")
        config_cls, algo_cls = get_algorithm(name)
        assert getattr(package, name) is algo_cls and getattr(package, f"{name}Config") is config_cls
        assert {name, f"{name}Config"} <= set(package.__all__) <= set(dir(package))
        with pytest.raises(AttributeError, match=f"'pipeline.algorithms.{name.lower()}' has no attribute 'nope'"):
            package.nope  # noqa: B018
