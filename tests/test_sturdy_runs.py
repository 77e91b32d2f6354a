"""Runs that end badly still leave a consistent checkpoint, and a run can be resumed.

SIGTERM and Ctrl-C are sent to a real ``runnel train`` process (stdout a pipe, closed by the reader
in one case, as when ``runnel train | tee log`` loses its tee to the same Ctrl-C). Everything samples
in the driver (``--num-env-runners 0``): no Ray.
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import gymnasium as gym
import pytest

from pipeline import Algorithm, register_env
from pipeline.cli.main import main

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMALL = json.dumps({"train_batch_size_per_learner": 128, "minibatch_size": 64, "num_epochs": 1,
                    "num_envs_per_env_runner": 2})
ENDLESS = json.dumps({"training_iteration": 100_000})


def _start(out_dir, *extra):
    code = "import sys; from pipeline.cli.main import main; sys.exit(main())"
    return subprocess.Popen(
        [sys.executable, "-c", code, "train", "--algo", "PPO", "--env", "CartPole-v1", "--num-env-runners", "0",
         "--config", SMALL, "--stop", ENDLESS, "--output-dir", str(out_dir), *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal would start it


def _read_until_iteration(proc, n):
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.match(rf"iter\s+{n}\s", line):
            return lines
    raise AssertionError(f"the run ended before iteration {n}: {''.join(lines)} {proc.stderr.read()}")


def _checkpoint_state(path):
    algo = Algorithm.from_checkpoint(str(path), logdir=None)
    try:
        return algo.iteration, dict(algo.counters)
    finally:
        algo.stop()


def _results(run_dir):
    return [json.loads(line) for line in (run_dir / "result.json").read_text().splitlines()]


def _summary_steps(text):
    m = re.search(r"env steps sampled: ([\d,]+)", text)
    assert m, text
    return int(m.group(1).replace(",", ""))


@pytest.mark.slow
def test_sigterm_checkpoints_after_the_iteration_and_resume_continues(tmp_path, capsys):
    out_dir = tmp_path / "results"
    proc = _start(out_dir)
    _read_until_iteration(proc, 2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "SIGTERM: stopping after this iteration" in err and "Traceback" not in err
    (run_dir,) = out_dir.iterdir()
    results = _results(run_dir)
    last = results[-1]["training_iteration"]
    iteration, counters = _checkpoint_state(run_dir / f"checkpoint_{last:06d}")
    assert iteration == last and counters["num_env_steps_sampled_lifetime"] == \
        results[-1]["num_env_steps_sampled_lifetime"] == _summary_steps(out)
    assert f"runnel train --resume {run_dir}" in out

    # --resume: same directory, results appended, counters continuous
    assert main(["train", "--resume", str(run_dir), "--stop", json.dumps({"training_iteration": last + 2})]) == 0
    resumed_out = capsys.readouterr().out
    assert f"resuming PPO on CartPole-v1 at iteration {last}" in resumed_out
    results = _results(run_dir)
    assert [r["training_iteration"] for r in results] == list(range(1, last + 3))
    steps = [r["num_env_steps_sampled_lifetime"] for r in results]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    iteration, counters = _checkpoint_state(run_dir / f"checkpoint_{last + 2:06d}")
    assert iteration == last + 2 and counters["num_env_steps_sampled_lifetime"] == steps[-1]
    rows = (run_dir / "progress.csv").read_text().splitlines()
    assert len(rows) == 1 + last + 2  # header + one row per iteration, none twice


@pytest.mark.slow
def test_ctrl_c_with_the_stdout_pipe_closed_still_checkpoints(tmp_path):
    out_dir = tmp_path / "results"
    proc = _start(out_dir)
    _read_until_iteration(proc, 2)
    proc.stdout.close()  # the reader is gone: every later print hits a closed pipe
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, err
    assert "BrokenPipeError" not in err and "Traceback" not in err, err
    (run_dir,) = out_dir.iterdir()
    results = _results(run_dir)
    last = results[-1]["training_iteration"]
    iteration, counters = _checkpoint_state(run_dir / f"checkpoint_{last:06d}")
    assert iteration == last
    assert counters["num_env_steps_sampled_lifetime"] == results[-1]["num_env_steps_sampled_lifetime"]


@pytest.mark.slow
def test_two_sigterms_stop_at_once_and_the_checkpoint_matches_the_summary(tmp_path):
    out_dir = tmp_path / "results"
    proc = _start(out_dir)
    _read_until_iteration(proc, 1)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    (run_dir,) = out_dir.iterdir()
    (checkpoint,) = [p for p in run_dir.iterdir() if p.name.startswith("checkpoint_")]
    iteration, counters = _checkpoint_state(checkpoint)
    assert f"after {iteration} iteration" in out
    assert counters["num_env_steps_sampled_lifetime"] == _summary_steps(out)


def test_a_second_sigterm_that_arrives_during_the_last_save_does_not_lose_the_checkpoint(tmp_path, monkeypatch,
                                                                                         capsys):
    """Two SIGTERMs sent back to back reach a busy process apart: the first stops the loop after its iteration,
    the second can come only while the last checkpoint is being written. That write must finish (it once
    raised KeyboardInterrupt inside it and left the run without a checkpoint). Here the signals are sent by
    the process itself at those two moments, in the main thread, where the CLI's handlers run."""
    from pipeline.algorithm import Algorithm as Base

    train, save = Base.train, Base.save_to_path

    def train_then_sigterm(self):
        result = train(self)
        os.kill(os.getpid(), signal.SIGTERM)  # the first: stop after this iteration
        return result

    def save_under_sigterm(self, checkpoint_dir=None):
        os.kill(os.getpid(), signal.SIGTERM)  # the second, while the last checkpoint is written
        return save(self, checkpoint_dir)

    monkeypatch.setattr(Base, "train", train_then_sigterm)
    monkeypatch.setattr(Base, "save_to_path", save_under_sigterm)
    out_dir = tmp_path / "results"
    code = main(["train", "--algo", "PPO", "--env", "CartPole-v1", "--num-env-runners", "0", "--config", SMALL,
                 "--stop", ENDLESS, "--output-dir", str(out_dir)])
    out, err = capsys.readouterr()
    assert code == 130, err
    (run_dir,) = out_dir.iterdir()
    assert [p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint_")] == ["checkpoint_000001"], err
    assert "SIGTERM: stopping after this iteration" in err and "writing the last checkpoint" in err
    monkeypatch.undo()
    iteration, counters = _checkpoint_state(run_dir / "checkpoint_000001")
    assert iteration == 1 and "after 1 iteration" in out and "stopped by SIGTERM" in out
    assert counters["num_env_steps_sampled_lifetime"] == _summary_steps(out)


def test_keep_checkpoints_keeps_the_best_and_the_latest(tmp_path, capsys):
    out_dir = tmp_path / "results"
    assert main(["train", "--algo", "PPO", "--env", "CartPole-v1", "--num-env-runners", "0", "--config", SMALL,
                 "--stop", json.dumps({"training_iteration": 5}), "--checkpoint-freq", "1", "--keep-checkpoints", "2",
                 "--checkpoint-score", "training_iteration", "--output-dir", str(out_dir)]) == 0
    (run_dir,) = out_dir.iterdir()
    kept = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint_"))
    assert kept == ["checkpoint_000004", "checkpoint_000005"]
    assert capsys.readouterr().out.count("removed checkpoint") == 3


class _CrashLater(gym.Env):
    """Steps normally for ``crash_at`` steps (over all episodes), then raises."""
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,))
    action_space = gym.spaces.Discrete(2)

    def __init__(self, ctx=None):
        super().__init__()
        self.steps, self.crash_at = 0, int((ctx or {}).get("crash_at", 300))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        self.steps += 1
        if self.steps > self.crash_at:
            raise RuntimeError("simulator exploded")
        return self.observation_space.sample(), 1.0, self.steps % 20 == 0, False, {}


def test_a_failing_run_leaves_a_checkpoint_of_its_state(tmp_path, capsys):
    register_env("runnel-test-crash-later", lambda ctx: _CrashLater(ctx))
    out_dir = tmp_path / "results"
    config = json.dumps({**json.loads(SMALL), "env_config": {"crash_at": 200}})
    assert main(["train", "--algo", "PPO", "--env", "runnel-test-crash-later", "--num-env-runners", "0",
                 "--config", config, "--stop", ENDLESS, "--output-dir", str(out_dir)]) == 1
    err = capsys.readouterr().err
    assert "simulator exploded" in err and "checkpoint of the state at the failure" in err
    assert "--resume" in err
    (run_dir,) = out_dir.iterdir()
    (checkpoint,) = [p for p in run_dir.iterdir() if p.name.startswith("checkpoint_")]
    iteration, _ = _checkpoint_state(checkpoint)
    assert iteration == len(_results(run_dir)) >= 1


def test_resume_refuses_what_it_cannot_continue(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no run.json there" in capsys.readouterr().err
    (tmp_path / "run.json").write_text(json.dumps({"algo": "PPO", "env": "CartPole-v1", "stop": {}, "config": {},
                                                   "checkpoint_freq": 0, "checkpoint_at_end": True,
                                                   "output_dir": str(tmp_path), "num_env_runners": 0,
                                                   "seed": None}))
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path), "--env", "Pendulum-v1"]) == 2
    assert "cannot change it" in capsys.readouterr().err


@pytest.mark.slow
def test_printed_follow_up_commands_work_in_a_fresh_shell(tmp_path):
    """`make train` runs .venv/bin/runnel with the venv not activated: the commands it prints at the
    end (evaluate, resume) must run as printed in a shell whose PATH has no runnel."""
    runnel = os.path.join(os.path.dirname(sys.executable), "runnel")
    if not os.path.isfile(runnel):
        pytest.skip(f"no runnel console script next to {sys.executable} (not an installed venv)")
    fresh_env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path)),
                 "RUNNEL_RESULTS_DIR": str(tmp_path)}
    out_dir = tmp_path / "results"
    done = subprocess.run([os.path.relpath(runnel, ROOT), "train", "--algo", "PPO", "--env", "CartPole-v1",
                           "--num-env-runners", "0", "--config", SMALL, "--output-dir", str(out_dir),
                           "--stop", json.dumps({"training_iteration": 1})],
                          cwd=ROOT, env=fresh_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    evaluate = lines[lines.index("Evaluate it with:") + 1].strip()
    resume = lines[lines.index("Continue training with:") + 1].strip()
    assert evaluate.startswith(runnel) and resume.startswith(runnel)
    for command in (evaluate, f"{resume} --stop '{{\"training_iteration\": 2}}'"):
        ran = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=fresh_env, capture_output=True, text=True,
                             timeout=300)
        assert ran.returncode == 0, (command, ran.stdout[-2000:], ran.stderr[-2000:])
