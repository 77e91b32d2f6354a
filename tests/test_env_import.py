"""`--env module:Class` finds a module in the current directory without PYTHONPATH, in the driver and
in the Ray env runners."""
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from pipeline.config.base import ConfigError
from pipeline.envs import env_creator

ENV_MODULE = textwrap.dedent('''
    import gymnasium as gym
    import numpy as np


    class MyEnv(gym.Env):
        """Ten steps; reward = the action."""
        observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def __init__(self, config=None):
            self.t = 0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return np.zeros(2, np.float32), {}

        def step(self, action):
            self.t += 1
            return np.zeros(2, np.float32), float(action), self.t >= 10, False, {}
''')

RUNNEL = os.path.join(os.path.dirname(sys.executable), "runnel")


def _env_without_pythonpath() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RAY_DEDUP_LOGS"] = "0"
    return env


@pytest.fixture
def env_dir(tmp_path, monkeypatch):
    """A directory holding myenv_mod.py, made the current directory; sys.path and sys.modules restored after."""
    (tmp_path / "myenv_mod.py").write_text(ENV_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "myenv_mod", raising=False)
    yield tmp_path
    sys.modules.pop("myenv_mod", None)


def test_driver_imports_module_from_current_directory(env_dir):
    creator = env_creator("myenv_mod:MyEnv")
    env = creator({})
    assert type(env).__name__ == "MyEnv"
    assert env.reset(seed=0)[0].shape == (2,)


def test_creator_pickles_as_path_and_imports_in_another_process(env_dir, tmp_path_factory):
    """What an env runner actor gets: unpickling needs no import; building the env imports it from
    the driver's directory, whatever the runner's own current directory is."""
    blob = pickle.dumps(env_creator("myenv_mod:MyEnv"))
    assert b"myenv_mod:MyEnv" in blob  # the path travels, not the class
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    code = ("import pickle, sys; creator = pickle.loads(sys.stdin.buffer.read()); "
            "env = creator({}); print(type(env).__module__, type(env).__name__)")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, cwd=elsewhere,
                         env=_env_without_pythonpath(), timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split() == ["myenv_mod", "MyEnv"]


def test_missing_module_names_the_directory_and_the_fix(env_dir, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("empty"))
    with pytest.raises(ConfigError) as err:
        env_creator("no_such_env_mod:MyEnv")
    message = str(err.value)
    assert "cannot import env 'no_such_env_mod:MyEnv'" in message
    assert os.getcwd() in message and "PYTHONPATH" in message


def test_missing_class_names_the_attribute(env_dir):
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        env_creator("myenv_mod:Nope")


@pytest.mark.slow
def test_cli_trains_on_env_from_current_directory_with_a_ray_runner(env_dir):
    """`runnel train --env myenv_mod:MyEnv` from the env's directory, no PYTHONPATH, 1 Ray env runner."""
    config = '{"train_batch_size_per_learner": 64, "minibatch_size": 32, "num_epochs": 1, "num_envs_per_env_runner": 1}'
    out = subprocess.run(
        [RUNNEL, "train", "--algo", "PPO", "--env", "myenv_mod:MyEnv", "--num-env-runners", "1",
         "--stop", '{"training_iteration": 1}', "--output-dir", str(env_dir / "results"), "--config", config],
        capture_output=True, text=True, cwd=env_dir, env=_env_without_pythonpath(), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "stop criterion met: training_iteration = 1" in out.stdout
    assert "env steps sampled: 64" in out.stdout
    runs = os.listdir(env_dir / "results")
    assert len(runs) == 1 and runs[0].startswith("PPO_myenv_mod_MyEnv")
