"""`runnel train` / `runnel evaluate`, run in-process through pipeline.cli.main.

Everything samples in the driver (num_env_runners=0), so Ray is never started here.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import gymnasium as gym
import pytest

from pipeline import PPOConfig, register_env
from pipeline.algorithms.ppo.algorithm import PPO
from pipeline.cli.main import main

SMALL = json.dumps({"train_batch_size_per_learner": 256, "minibatch_size": 128, "num_epochs": 2,
                    "num_envs_per_env_runner": 2})


def _one_error_line(capsys):
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("runnel: error: "), err
    assert "Traceback" not in err and "Traceback" not in out
    return lines[0]


def _train(out_dir, *extra):
    return main(["train", "--algo", "PPO", "--env", "CartPole-v1", "--num-env-runners", "0",
                 "--output-dir", str(out_dir), *extra])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real (untrained) PPO checkpoint written by Algorithm.save()."""
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint_000000"
    config = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0, num_envs_per_env_runner=1)
    algo = config.training(train_batch_size_per_learner=64, minibatch_size=32).debugging(seed=0).build()
    try:
        return algo.save(str(path))
    finally:
        algo.stop()


def test_help_answers_without_importing_torch_or_ray_tune():
    """``runnel --help`` and ``runnel train --help`` in a fresh interpreter: the usage text, and neither torch
    nor Ray Tune imported (each took ~3 s of the answer before)."""
    probe = ("import json, sys\nfrom pipeline.cli.main import main\ncodes = [main(['--help']), main(['train', '--help'])]\n"
             "print(json.dumps([codes, [m for m in ('torch', 'ray.tune') if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "usage: runnel" in out and "--algo" in out
    assert json.loads(out.strip().splitlines()[-1]) == [[0, 0], []]


# --- train: bad inputs --------------------------------------------------------------------------
@pytest.mark.parametrize("args, code, expected", [
    (["--algo", "PPO", "--env", "CartPol-v1"], 2, ["unknown env 'CartPol-v1'", "CartPole-v1"]),
    (["--algo", "PPOO", "--env", "CartPole-v1"], 2, ["unknown algorithm 'PPOO'", "PPO"]),
    (["--algo", "PPO", "--env", "CartPole-v1", "--stop", '{"training_iteration" 2}'], 2,
     ["--stop is not valid JSON", "Expecting ':' delimiter", "line 1 column 23", '{"training_iteration" >>>2}']),
    (["--algo", "PPO", "--env", "CartPole-v1", "--stop", '[1, 2]'], 2, ["--stop must be a JSON object"]),
    (["--algo", "PPO", "--env", "CartPole-v1", "--stop", '{"training_iteration": "soon"}'], 2,
     ["threshold of 'training_iteration' must be a number"]),
    (["--algo", "PPO", "--env", "CartPole-v1", "--config", "{'lr': 0.1}"], 2,
     ["--config is not valid JSON", "double quotes", "column 2"]),
    (["--algo", "PPO", "--env", "CartPole-v1", "--config", '{"lrr": 0.001, "num_epoch": 3}'], 2,
     ["unknown config setting 'lrr'", "did you mean 'lr'", "'num_epochs'"]),
    (["--algo", "PPO", "--env", "CartPole-v1", "--config", '{"gamma": 1.5}'], 2, ["gamma must be in [0, 1]"]),
    (["--algo", "PPO", "--env", "CartPole-v1", "--framework", "tf2"], 2, ["'tf2' is not supported", "torch"]),
    (["--env", "CartPole-v1"], 2, ["--algo is required"]),
    (["--algo", "PPO"], 2, ["--env is required"]),
    (["--algo", "PPO", "--env", "CartPole-v1", "--checkpoint-freq", "-1"], 2, ["--checkpoint-freq", ">= 0"]),
    (["cartpole.yaml"], 2, ["unexpected argument 'cartpole.yaml'", "runnel train file cartpole.yaml"]),
    (["file", "/nonexistent/x.yaml"], 2, ["no such file: '/nonexistent/x.yaml'"]),
])
def test_train_bad_input_one_line_error_and_no_results_dir(tmp_path, capsys, args, code, expected):
    out_dir = tmp_path / "results"
    assert main(["train", *args, "--output-dir", str(out_dir)]) == code
    line = _one_error_line(capsys)
    for text in expected:
        assert text in line
    assert not out_dir.exists() or not os.listdir(out_dir)


@pytest.mark.parametrize("content, expected", [
    ("algo: PPO\nenv: CartPole-v1\nstopp: {training_iteration: 1}\n",
     ["unknown top-level key 'stopp' (did you mean 'stop'?)", "valid keys: algo, run, env, stop, config"]),
    ("algo: PPO\nenv: CartPole-v1\nconfig: [1, 2]\n", ["'config' must be a mapping"]),
    ("algo: PPO\nenv: [CartPole-v1\n", ["is not valid YAML", "line 3"]),
    ("- PPO\n", ["must hold a mapping"]),
    ("algo: PPO\nenv: CartPole-v1\nconfig: {lr: 0.001, num_env_runner: 0}\n", ["'num_env_runner'", "num_env_runners"]),
])
def test_train_file_errors(tmp_path, capsys, content, expected):
    f = tmp_path / "bad.yaml"
    f.write_text(content)
    out_dir = tmp_path / "results"
    assert main(["train", "file", str(f), "--output-dir", str(out_dir)]) == 2
    line = _one_error_line(capsys)
    for text in expected:
        assert text in line
    assert not out_dir.exists() or not os.listdir(out_dir)


# --- evaluate: bad checkpoints ------------------------------------------------------------------
def _broken_copy(checkpoint, tmp_path, how):
    path = tmp_path / "checkpoint_broken"
    shutil.copytree(checkpoint, path)
    if how == "manifest":
        (path / "manifest.json").write_text('{"format_version": 1, "algorithm": ')
    elif how == "learner":
        (path / "learner.pt").write_bytes(b"not a torch file at all")
    elif how == "version":
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["format_version"] = 999
        (path / "manifest.json").write_text(json.dumps(manifest))
    elif how == "no-manifest":
        (path / "manifest.json").unlink()
    return path


@pytest.mark.parametrize("how, expected", [
    ("missing", "no checkpoint directory"),
    ("no-manifest", "has no manifest.json: it is not a runnel checkpoint directory"),
    ("manifest", "manifest.json' is corrupted"),
    ("learner", "learner.pt cannot be read"),
    ("version", "has format version 999"),
])
def test_evaluate_bad_checkpoint(checkpoint, tmp_path, capsys, how, expected):
    path = tmp_path / "nowhere" if how == "missing" else _broken_copy(checkpoint, tmp_path, how)
    assert main(["evaluate", str(path), "--episodes", "1"]) == 1
    assert expected in _one_error_line(capsys)


def test_evaluate_wrong_algo_and_render_without_display(checkpoint, capsys, monkeypatch):
    assert main(["evaluate", checkpoint, "--algo", "PPOO"]) == 2
    assert "unknown algorithm 'PPOO'" in _one_error_line(capsys)
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    assert main(["evaluate", checkpoint, "--episodes", "1", "--render"]) == 1
    assert "--render needs a display" in _one_error_line(capsys)


def test_evaluate_json(checkpoint, capsys):
    assert main(["evaluate", checkpoint, "--episodes", "2", "--json", "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["algorithm"] == "PPO" and out["env"] == "CartPole-v1" and out["episodes"] == 2
    assert len(out["episode_returns"]) == 2
    assert out["episode_return_mean"] == pytest.approx(sum(out["episode_returns"]) / 2)


@pytest.mark.slow
def test_evaluate_with_evaluator_actors(checkpoint, capsys):
    """--num-env-runners: the same evaluators as evaluation during training, as Ray actors (Ray is
    started for the command and shut down after it)."""
    import ray

    assert main(["evaluate", checkpoint, "--episodes", "3", "--json", "--num-env-runners", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["episodes"] == 3 and len(out["episode_lengths"]) == 3
    assert not ray.is_initialized()


# --- train: real short runs ---------------------------------------------------------------------
def test_train_short_run_then_evaluate_printed_command(tmp_path, capsys):
    out_dir = tmp_path / "results"
    assert _train(out_dir, "--stop", '{"training_iteration": 2}', "--config", SMALL, "--seed", "1") == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    (run_dir,) = out_dir.iterdir()
    assert re.fullmatch(r"PPO_CartPole-v1_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d", run_dir.name)
    names = set(os.listdir(run_dir))
    assert {"params.json", "result.json", "progress.csv", "checkpoint_000002"} <= names
    assert any(n.startswith("events.out.tfevents.") for n in names)
    params = json.loads((run_dir / "params.json").read_text())
    assert params["env"] == "CartPole-v1" and params["train_batch_size_per_learner"] == 256 and params["seed"] == 1
    results = [json.loads(line) for line in (run_dir / "result.json").read_text().splitlines()]
    assert [r["training_iteration"] for r in results] == [1, 2]
    assert len((run_dir / "progress.csv").read_text().splitlines()) == 3
    assert len(re.findall(r"^iter +\d+ \| env steps", out, re.M)) == 2
    assert "stop criterion met: training_iteration = 2 >= 2" in out

    m = re.search(r"^  runnel evaluate (\S+) --episodes 10$", out, re.M)
    assert m, out
    assert m.group(1) == str(run_dir / "checkpoint_000002")
    assert main(["evaluate", m.group(1), "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^  episode +\d: return", out, re.M)) == 2
    assert "mean return over 2 episodes" in out


def test_train_file_with_flag_overrides_and_stop_key_warning(tmp_path, capsys):
    f = tmp_path / "tuned.yaml"
    f.write_text(
        "# RLlib's experiment layout, with run: instead of algo:\n"
        "cartpole-ppo:\n"
        "  run: PPO\n"
        "  env: CartPole-v1\n"
        "  stop: {training_iteration: 5}\n"
        "  config: {lr: 1e-4, num_env_runners: 0, framework: torch, train_batch_size_per_learner: 128,\n"
        "           minibatch_size: 64, num_envs_per_env_runner: 2}\n"
        "  checkpoint_freq: 1\n")
    out_dir = tmp_path / "results"
    code = main(["train", "file", str(f), "--output-dir", str(out_dir), "--config", '{"num_epochs": 1}',
                 "--stop", '{"episode_reward_mean": 1000, "training_iteration": 1}', "--no-checkpoint-at-end"])
    assert code == 0
    out, err = capsys.readouterr()
    (run_dir,) = out_dir.iterdir()
    params = json.loads((run_dir / "params.json").read_text())
    assert params["lr"] == 1e-4 and params["num_epochs"] == 1 and params["minibatch_size"] == 64
    assert len((run_dir / "result.json").read_text().splitlines()) == 1  # --stop replaced the file's stop
    assert (run_dir / "checkpoint_000001" / "manifest.json").is_file()  # checkpoint_freq from the file
    warning = [line for line in err.splitlines() if line.startswith("runnel: warning:")]
    # an old stop key is mapped at start (said once), never left to run forever
    assert len(warning) == 1 and "'episode_reward_mean' is RLlib's old name" in warning[0]
    assert "stopping on 'env_runners/episode_return_mean'" in warning[0]
    assert json.loads((run_dir / "run.json").read_text())["stop"] == {
        "env_runners/episode_return_mean": 1000, "training_iteration": 1}


class _CrashOnStep(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,))
    action_space = gym.spaces.Discrete(2)

    def __init__(self, ctx=None):
        super().__init__()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        raise RuntimeError("simulator exploded")


def test_failure_before_first_iteration_leaves_no_run_dir(tmp_path, capsys):
    register_env("runnel-test-crash", lambda ctx: _CrashOnStep(ctx))
    out_dir = tmp_path / "results"
    assert main(["train", "--algo", "PPO", "--env", "runnel-test-crash", "--num-env-runners", "0",
                 "--config", SMALL, "--output-dir", str(out_dir)]) == 1
    line = _one_error_line(capsys)
    assert "training failed before the first iteration finished" in line and "simulator exploded" in line
    assert not out_dir.exists() or not os.listdir(out_dir)


@pytest.fixture
def sigint_default():
    """A suite started in the background by a non-interactive shell inherits SIGINT ignored, and
    the CLI rightly leaves an ignored Ctrl-C alone: these tests get the terminal's default."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupting_train(monkeypatch, at_calls):
    """PPO.train that delivers SIGINT (like Ctrl-C) while running the given calls (1-based)."""
    original, calls = PPO.train, []

    def train(self):
        calls.append(1)
        if len(calls) in at_calls:
            signal.raise_signal(signal.SIGINT)
        return original(self)

    monkeypatch.setattr(PPO, "train", train)


def test_ctrl_c_stops_after_the_iteration_and_saves(tmp_path, capsys, monkeypatch, sigint_default):
    _interrupting_train(monkeypatch, at_calls={2})
    out_dir = tmp_path / "results"
    handler = signal.getsignal(signal.SIGINT)
    assert _train(out_dir, "--config", SMALL) == 130
    assert signal.getsignal(signal.SIGINT) is handler
    out, err = capsys.readouterr()
    assert "stopping after this iteration" in err
    (run_dir,) = out_dir.iterdir()
    assert len((run_dir / "result.json").read_text().splitlines()) == 2
    assert (run_dir / "checkpoint_000002" / "manifest.json").is_file()
    assert f"runnel evaluate {run_dir / 'checkpoint_000002'} --episodes 10" in out


def test_second_ctrl_c_stops_at_once(tmp_path, capsys, monkeypatch, sigint_default):
    _interrupting_train(monkeypatch, at_calls={1})
    original = signal.raise_signal

    def twice(sig):  # two Ctrl-C in a row: the second raises KeyboardInterrupt inside train()
        original(sig)
        original(sig)

    monkeypatch.setattr(signal, "raise_signal", twice)
    out_dir = tmp_path / "results"
    assert _train(out_dir, "--config", SMALL) == 130
    assert "nothing was saved" in capsys.readouterr().err
    assert not out_dir.exists() or not os.listdir(out_dir)  # no iteration finished: no run dir


# --- record / train --input / inspect -------------------------------------------------------------
def test_record_then_train_bc_from_the_recording_then_inspect(checkpoint, tmp_path, capsys):
    rec = tmp_path / "rec"
    assert main(["record", checkpoint, "--episodes", "3", "--output", str(rec), "--json", "--explore"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["episodes"] == 3 and out["steps"] == sum(out["episode_lengths"])
    assert main(["inspect", str(rec), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["episodes"] == 3 and summary["steps"] == out["steps"] and summary["algorithm"] == "PPO"
    assert sorted(summary["episode_returns"]) == sorted(out["episode_returns"])

    out_dir = tmp_path / "results"
    assert main(["train", "--algo", "BC", "--input", str(rec), "--env", "CartPole-v1", "--num-env-runners", "0",
                 "--stop", '{"training_iteration": 2}', "--output-dir", str(out_dir),
                 "--config", '{"train_batch_size_per_learner": 64, "minibatch_size": 32}']) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"^iter +\d+ \| env steps", out, re.M)) == 2
    (run_dir,) = out_dir.iterdir()
    results = [json.loads(line) for line in (run_dir / "result.json").read_text().splitlines()]
    assert results[-1]["evaluation"]["env_runners"]["episode_return_mean"] > 0  # the env evaluates

    assert main(["record", str(tmp_path / "nope"), "--output", str(rec)]) == 2
    assert "is not a directory" in _one_error_line(capsys)
    assert main(["train", "--algo", "BC", "--env", "CartPole-v1", "--num-env-runners", "0",
                 "--output-dir", str(out_dir)]) == 2
    assert "learns from recorded experience" in _one_error_line(capsys)
