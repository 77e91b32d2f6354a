"""Crash safety of recording: kill -9 of a recording runner process and of a whole driver, and a
recording run in which a runner actor dies and is recreated.

After each, every shard must read back, a damaged tail must be reported (never raised), and every
record before it must equal what was sampled -- checked against what the killed process reported
(ids and digests of the chunks it handed out) before it died.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
import ray

from pipeline import PPOConfig
from pipeline.offline.record import inspect_recording
from protocols.shards import ShardReader
from tests.pieces import COLLECTED, Collect, digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recorded(directory: str) -> tuple[dict[tuple[str, int], str], list[ShardReader]]:
    """(episode id, chunk index) -> digest of every recorded chunk; no chunk may be there twice."""
    out: dict[tuple[str, int], str] = {}
    readers = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".rshard"):
            reader = ShardReader(os.path.join(directory, name))
            for c in reader.chunks():
                key = (c.episode_id, c.chunk_index)
                assert key not in out, f"chunk {key} recorded twice"
                out[key] = digest(c)
            readers.append(reader)
    return out, readers


def contiguous(keys) -> bool:
    """Each episode's chunks are 0, 1, 2, ... with no gap (nothing lost before a tail)."""
    by_episode: dict[str, list[int]] = {}
    for eid, idx in keys:
        by_episode.setdefault(eid, []).append(idx)
    return all(sorted(v) == list(range(len(v))) for v in by_episode.values())


RUNNER_SCRIPT = textwrap.dedent("""
    import hashlib, json, sys
    import gymnasium as gym
    from actors.env import EnvRunner, EnvRunnerSettings
    from actors.offline import RecordingSettings
    from protocols.codec import encode

    out = sys.argv[1]
    settings = EnvRunnerSettings(
        env_creator=lambda ctx: gym.make("CartPole-v1"), num_envs=4, rollout_fragment_length=64, seed=3,
        recording=RecordingSettings(out, output_max_file_size=40_000, output_write_episodes=False,
                                    output_fsync="never", output_max_queue=2))
    runner = EnvRunner(settings, worker_index=1)
    while True:
        chunks = runner.sample()
        runner.flush_recording()  # what a runner does before its chunks leave it
        print(json.dumps([[c.episode_id, c.chunk_index, hashlib.sha1(encode(c, compress=False)).hexdigest()]
                          for c in chunks]), flush=True)
""")


def test_kill_9_of_a_recording_runner_process_loses_nothing_it_handed_out(tmp_path):
    out = str(tmp_path / "rec")
    proc = subprocess.Popen([sys.executable, "-c", RUNNER_SCRIPT, out], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    handed_out: dict[tuple[str, int], str] = {}
    try:
        for _ in range(60):  # 60 sample rounds handed out (the runner keeps writing while we read)
            line = proc.stdout.readline()
            assert line, "the runner process ended early"
            for eid, idx, d in json.loads(line):
                handed_out[(eid, idx)] = d
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    got, readers = recorded(out)
    assert len(readers) > 2  # it rotated, so closed shards and the one being written are both checked
    for key, d in handed_out.items():
        assert got.get(key) == d, f"chunk {key} handed out but {'missing from' if key not in got else 'different in'} the recording"
    assert contiguous(got)
    unclosed = [r for r in readers if not r.scan.complete]
    assert len(unclosed) <= 1  # only the shard being written can lack its index
    summary = inspect_recording(out)
    assert summary["torn_tails"] == sum(1 for r in readers if r.scan.damaged_bytes)  # reported, not raised
    assert summary["damaged_records"] == 0 and summary["chunks"] == len(got)


DRIVER_SCRIPT = textwrap.dedent("""
    import sys
    from pipeline import PPOConfig

    algo = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0, num_envs_per_env_runner=2)
            .training(train_batch_size_per_learner=500, minibatch_size=250, num_epochs=1).debugging(seed=1)
            .offline_data(output=sys.argv[1], output_write_episodes=False, output_max_file_size=30_000)).build()
    while True:
        result = algo.train()
        print(result["num_env_steps_sampled_lifetime"], flush=True)
""")


@pytest.mark.slow
def test_kill_9_of_the_whole_driver_leaves_a_readable_recording(tmp_path):
    out = str(tmp_path / "rec")
    proc = subprocess.Popen([sys.executable, "-c", DRIVER_SCRIPT, out], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True)
    try:
        for _ in range(6):
            line = proc.stdout.readline()
            assert line, "the driver ended early"
            trained = int(line)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert os.path.exists(os.path.join(out, "manifest.json"))
    got, readers = recorded(out)
    assert contiguous(got)
    summary = inspect_recording(out)
    # every step the driver trained on was recorded before the learner saw it
    assert summary["steps"] >= trained and summary["damaged_records"] == 0


@pytest.fixture(scope="module")
def ray_up():
    ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_a_runner_restart_records_every_trained_chunk_exactly_once(tmp_path, ray_up):
    out = str(tmp_path / "rec")
    COLLECTED.clear()
    algo = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2, num_envs_per_env_runner=2)
            .training(train_batch_size_per_learner=400, minibatch_size=200, num_epochs=1).debugging(seed=0)
            .fault_tolerance(restart_failed_env_runners=True, delay_between_env_runner_restarts_s=0.0)
            .callbacks(Collect).offline_data(output=out, output_write_episodes=False)).build()
    try:
        algo.train()
        ray.kill(algo.env_runner_group.manager.handle(1), no_restart=True)
        results = [algo.train() for _ in range(3)]
        assert algo.env_runner_group.wait_until_whole(120)
        results.append(algo.train())
        assert results[-1]["fault_tolerance"]["num_remote_worker_restarts"] == 1
    finally:
        algo.stop()
    got, readers = recorded(out)
    trained = Counter((eid, idx) for eid, idx, _ in COLLECTED)
    assert trained and max(trained.values()) == 1
    for eid, idx, d in COLLECTED:
        assert got.get((eid, idx)) == d, f"trained chunk {(eid, idx)} not recorded as trained"
    assert contiguous(got)
    # the killed runner's shard lacks its index; every other shard was closed at stop()
    assert sum(not r.scan.complete for r in readers) == 1
