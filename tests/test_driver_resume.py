"""A driver killed with SIGKILL resumes from its last checkpoint with ``runnel train --resume``.

A real ``runnel train`` process (PPO with a Ray env runner and a Ray learner, so it starts its own local
Ray) checkpoints every iteration and is killed with SIGKILL -- nothing of it runs after that -- once a
checkpoint is complete (read off the disk after each progress line, no sleeps). Then:

* every process of the killed run's Ray goes away by itself: Ray ties the head's processes (GCS, raylet,
  dashboard, monitors) to the driver and the workers to the raylet; the per-node dashboard and runtime-env
  agents notice the raylet's death and exit within about a minute (they first try, for 60 s, to report it
  to the dead GCS). The test waits on each process's exit (pidfds), with a deadline;
* ``--resume`` continues from the latest complete checkpoint: iteration, env steps and the results files
  continue from it (results written after it are dropped, a half-written checkpoint removed), and the
  resumed run leaves no process behind either.

The runs' processes are found by an environment variable only they carry (Ray's workers inherit the
driver's environment through the raylet).
"""
import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time
import uuid

import pytest

from pipeline.checkpoints.keeper import checkpoints_in

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = json.dumps({"train_batch_size_per_learner": 256, "minibatch_size": 128, "num_epochs": 1,
                     "num_envs_per_env_runner": 2, "num_learners": 1})
MARK = "RUNNEL_TEST_RUN_MARK"
RAY_EXIT_S = 180  # the agents' own exit takes about 65 s; three times that on a busy machine

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"),
                                reason="finds processes in /proc and waits on pidfds (Linux >= 5.3)")


def start(mark, stderr_path, *args):
    code = "import sys; from pipeline.cli.main import main; sys.exit(main())"
    with open(stderr_path, "w", encoding="utf-8") as stderr:  # Ray logs a lot: a pipe nobody reads would fill
        return subprocess.Popen([sys.executable, "-c", code, "train", *args], cwd=ROOT, env={**os.environ, MARK: mark},
                                stdout=subprocess.PIPE, stderr=stderr, text=True)


def marked_processes(mark):
    """Pids of the processes whose environment holds ``MARK=mark``: a run's driver, its Ray and its workers."""
    needle = f"{MARK}={mark}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:  # gone meanwhile, or another user's
                continue
    return pids


def still_running_after(pids, timeout_s):
    """Wait until every process of ``pids`` has exited or ``timeout_s`` passed (woken by each exit);
    returns the pids still running."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + timeout_s
    try:
        while fds and (left := deadline - time.monotonic()) > 0:
            for fd in select.select(list(fds), [], [], left)[0]:
                os.close(fd)
                del fds[fd]
        return sorted(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


def describe(pids):
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: {pathlib.Path(f'/proc/{pid}/cmdline').read_bytes().replace(bytes(1), b' ')[:120]!r}")
        except OSError:
            out.append(f"{pid}: gone")
    return "; ".join(out)


def results(run_dir):
    return [json.loads(line) for line in (run_dir / "result.json").read_text().splitlines()]


@pytest.mark.slow
def test_a_driver_killed_with_sigkill_resumes_from_its_last_checkpoint_leaving_no_process(tmp_path):
    out_dir, killed_mark, resumed_mark = tmp_path / "results", uuid.uuid4().hex, uuid.uuid4().hex
    proc = start(killed_mark, tmp_path / "killed.err", "--algo", "PPO", "--env", "CartPole-v1", "--num-env-runners",
                 "1", "--config", CONFIG, "--checkpoint-freq", "1", "--stop", '{"training_iteration": 100000}',
                 "--output-dir", str(out_dir))
    run_dir, lines = None, []
    try:
        for line in proc.stdout:  # a checkpoint is written after its iteration's line: look after each line
            lines.append(line)
            m = re.search(r"results in (\S+)$", line.strip())
            run_dir = pathlib.Path(m.group(1)) if m else run_dir
            if run_dir is not None and len(checkpoints_in(str(run_dir))) >= 2:
                break
        else:
            raise AssertionError(f"the run ended first: {''.join(lines)}{(tmp_path / 'killed.err').read_text()}")
        ray_processes = [pid for pid in marked_processes(killed_mark) if pid != proc.pid]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the driver's Ray: GCS, raylet, the env runner and the learner, the agents...
    assert len(ray_processes) >= 4, describe(ray_processes)
    checkpoint = checkpoints_in(str(run_dir))[-1][0]
    at_checkpoint = next(r for r in results(run_dir) if r["training_iteration"] == checkpoint)

    resumed = start(resumed_mark, tmp_path / "resumed.err", "--resume", str(run_dir), "--stop",
                    json.dumps({"training_iteration": checkpoint + 2}))
    out = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, out + (tmp_path / "resumed.err").read_text()
    assert f"resuming PPO on CartPole-v1 at iteration {checkpoint}" in out

    # counters continue from the checkpoint; results after it were dropped and trained again
    rows = results(run_dir)
    assert [r["training_iteration"] for r in rows] == list(range(1, checkpoint + 3))
    steps = [r["num_env_steps_sampled_lifetime"] for r in rows]
    assert steps[checkpoint - 1] == at_checkpoint["num_env_steps_sampled_lifetime"]
    assert all(later > earlier for earlier, later in zip(steps, steps[1:])), steps
    trained = [r["num_env_steps_trained_lifetime"] for r in rows]
    assert all(later > earlier for earlier, later in zip(trained, trained[1:])), trained
    progress = (run_dir / "progress.csv").read_text().splitlines()
    assert len(progress) == 1 + checkpoint + 2  # header + one row per iteration, none twice
    assert [iteration for iteration, _ in checkpoints_in(str(run_dir))][-1] == checkpoint + 2
    assert not [p for p in os.listdir(run_dir) if p.startswith(".checkpoint_")]  # no half-written checkpoint

    # nothing of either run is left running
    left = still_running_after(ray_processes, RAY_EXIT_S) + still_running_after(marked_processes(resumed_mark),
                                                                                   RAY_EXIT_S)
    assert not left, f"left running: {describe(left)}"
