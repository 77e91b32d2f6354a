"""The Python API as RLlib users write it: dict configs, ``env=``, results written by ``train()``,
collision-free ``save()``, and old names that point to the runnel way. No Ray (local sampling)."""
import json
import os
import subprocess
import sys
import pathlib

import pytest

from pipeline import PPO, DQNConfig, PPOConfig
from pipeline.config.base import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = {"num_env_runners": 0, "num_envs_per_env_runner": 2, "train_batch_size_per_learner": 128,
         "minibatch_size": 64, "num_epochs": 1}


def test_dict_config_and_env_keyword_build(tmp_path):
    algo = PPO(config={"env": "CartPole-v1", **SMALL}, logdir=None)
    try:
        assert algo.config.env == "CartPole-v1" and algo.config.train_batch_size_per_learner == 128
    finally:
        algo.stop()
    algo = PPO(config=PPOConfig().env_runners(num_env_runners=0), env="CartPole-v1", logdir=None)
    try:
        assert algo.config.env == "CartPole-v1"
    finally:
        algo.stop()
    with pytest.raises(ConfigError, match="build it from a PPOConfig"):
        PPO(config=DQNConfig().environment("CartPole-v1"))
    with pytest.raises(TypeError, match="pass logdir=DIR"):
        PPO(config={"env": "CartPole-v1"}, logger_creator=lambda cfg: None)


def test_train_writes_a_results_directory_and_save_uses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNNEL_RESULTS_DIR", str(tmp_path))
    algo = PPO(config={"env": "CartPole-v1", **SMALL})
    try:
        assert algo.logdir is None  # made at the first result, not at build
        algo.train()
        algo.train()
        run_dir = pathlib.Path(algo.logdir)
        assert run_dir.parent == tmp_path and run_dir.name.startswith("PPO_CartPole-v1_")
        rows = [json.loads(line) for line in (run_dir / "result.json").read_text().splitlines()]
        assert [r["training_iteration"] for r in rows] == [1, 2]
        assert json.loads((run_dir / "params.json").read_text())["train_batch_size_per_learner"] == 128
        assert len((run_dir / "progress.csv").read_text().splitlines()) == 3
        path = algo.save()
        assert path == str(run_dir / "checkpoint_000002") and os.path.isfile(os.path.join(path, "manifest.json"))
    finally:
        algo.stop()
    off = PPO(config={"env": "CartPole-v1", **SMALL}, logdir=None)
    try:
        off.train()
        assert off.logdir is None and len(list(tmp_path.iterdir())) == 1
    finally:
        off.stop()


@pytest.mark.slow
def test_two_processes_saving_at_once_never_collide(tmp_path):
    """Both start their run directory in the same second: each gets its own."""
    code = ("import sys; from pipeline import PPO\n"
            "a = PPO(config={'env': 'CartPole-v1', 'num_env_runners': 0, 'num_envs_per_env_runner': 1})\n"
            "sys.stdin.readline()\n"  # both wait here, then save together
            "print(a.save(), flush=True); a.stop()\n")
    env = {**os.environ, "RUNNEL_RESULTS_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate("go\n", timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    paths = [o[0].strip().splitlines()[-1] for o in outs]
    assert len(set(paths)) == 2 and all(os.path.isfile(os.path.join(p, "manifest.json")) for p in paths)


def test_old_algorithm_api_names():
    algo = PPO(config={"env": "CartPole-v1", **SMALL}, logdir=None)
    try:
        with pytest.raises(AttributeError, match="use algo.env_runner_group"):
            algo.workers
        assert algo.env_runner_group.foreach_worker(lambda runner: 7) == [7]
        assert algo.get_module() is not None
        with pytest.raises(AttributeError, match=r"get_module\(\)"):
            algo.get_policy()
        assert algo.config["lr"] == algo.config.lr and algo.config.get("no_such_key", 3) == 3
        assert algo.compute_single_action([0.0, 0.0, 0.01, 0.0]) in (0, 1)
    finally:
        algo.stop()


def test_restore_with_another_number_of_sub_envs_starts_fresh_episodes(tmp_path):
    algo = PPO(config={"env": "CartPole-v1", **SMALL}, logdir=None)
    try:
        algo.train()
        path = algo.save(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    from pipeline import Algorithm

    restored = Algorithm.from_checkpoint(path, logdir=None, num_envs_per_env_runner=4)
    try:
        assert restored.iteration == 1
        result = restored.train()  # runs on 4 fresh sub-envs with the checkpoint's weights and counters
        assert result["num_env_steps_sampled_lifetime"] > 128
    finally:
        restored.stop()


def test_import_paths_find_modules_in_the_current_directory(tmp_path, monkeypatch):
    """``callbacks_class="mycallbacks:MyCallbacks"`` beside the user's script, without PYTHONPATH."""
    from pipeline.config.plain import resolve_import_path

    (tmp_path / "runnel_cwd_callbacks.py").write_text("from pipeline import Callbacks\n\n\nclass Mine(Callbacks):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert resolve_import_path("runnel_cwd_callbacks:Mine", "callbacks class").__name__ == "Mine"
    with pytest.raises(ConfigError, match="cannot import callbacks class 'no_such_module_here:X'"):
        resolve_import_path("no_such_module_here:X", "callbacks class")
