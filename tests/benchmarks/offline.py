"""Offline experience benchmark: what recording costs, how fast recordings read, reader memory.

Run: ``.venv/bin/python tests/benchmarks/offline.py [--repeats 3] [--big-gb 4] [--anchors-python PY]``.
Prints one JSON object per line:

- ``{"bench": "record_cost", ...}``: one in-process ``EnvRunner`` (CartPole-v1, 8 sub-envs, 256
  steps per sub-env per round) sampling ``--sample-steps`` steps with recording off and on
  (episodes mode, the default), in alternation, ``--repeats`` times each; medians of steps/s and
  ``cost`` = 1 - on/off (target <= 0.05). Recording's work (encode, LZ4, write) runs in the
  recorder's thread; ``flush_recording`` before each round returns, as in training.
- ``{"bench": "read", "data": "cartpole"|"atari84", ...}``: the local reader (``OfflineReader``,
  shuffle buffer 10,000 steps) handing out a recording made here (CartPole: recorded by the runner
  above; atari84: synthetic 84x84x4 uint8 frame stacks in 200-step episodes), transitions/s,
  median of repeats, each repeat a fresh reader reading the whole recording once.
- ``{"bench": "read", "reader": "ray_data", ...}``: the same recordings through the Ray Data path
  (``actors.offline.dataset.transition_dataset(...).iter_batches``: shards read by Ray Data tasks,
  decoded into per-step columns in ``map_batches``), on a local Ray of 2 CPUs; and
  ``"reader": "ray_data_stage"``: the ``input_reader="ray_data"`` stage (``RayDataReader``: records
  read and checked by Ray Data tasks, handed out as chunks through the local reader's shuffle
  buffer of 10,000 steps), as the local reader's rows are measured. Each repeat is a fresh dataset
  (or reader) reading the whole recording once, so Ray Data's start-up per execution is included;
  one untimed pass first (it starts Ray's worker processes).
  ``--only read`` runs only these rows (the CartPole recording is then made by one recording
  runner of ``--sample-steps`` steps, without the cost measurement).
- ``{"bench": "read", "system": "rllib", ...}``: RLlib 2.60 in the anchors venv
  (``--anchors-python``) recording CartPole with its env runners (``offline_data(output=...)``,
  Parquet) and reading it back through ``ray.data.read_parquet(...).iter_batches`` (the Ray Data
  pipeline its ``OfflineData`` is built on), rows (transitions)/s; ``skipped`` with the reason
  when the venv or RLlib's offline path is unavailable.
- ``{"bench": "reader_memory", ...}``: RSS growth of this process while the local reader reads a
  synthetic recording of ``--big-gb`` GB of frames once (made here, deleted after), from the
  point its shuffle buffer (10,000 steps) is full; target < 50 MB. ``rss_before_reader_mb`` and
  ``rss_buffer_full_mb`` show what the buffer itself holds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402

from actors.env import EnvRunner, EnvRunnerSettings  # noqa: E402
from actors.offline import OfflineReader, ReaderSettings, Recorder, RecordingSettings, reader_class, write_manifest  # noqa: E402
from protocols.episode import EpisodeChunk, new_episode_id  # noqa: E402

ANCHORS_PYTHON = "/work/anchors-venv/bin/python"


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def runner(recording: RecordingSettings | None) -> EnvRunner:
    settings = EnvRunnerSettings(env_creator=lambda ctx: gym.make("CartPole-v1"), num_envs=8,
                                 rollout_fragment_length=256, seed=0, recording=recording)
    return EnvRunner(settings, worker_index=1)


def sample_rate(r: EnvRunner, steps: int) -> float:
    r.sample()  # warm
    r.flush_recording()
    done, t0 = 0, time.perf_counter()
    while done < steps:
        done += sum(len(c) for c in r.sample())
        r.flush_recording()
    return done / (time.perf_counter() - t0)


def record_cost(tmp: str, steps: int, repeats: int) -> str:
    off, on = runner(None), runner(RecordingSettings(os.path.join(tmp, "cartpole")))
    write_manifest(os.path.join(tmp, "cartpole"), gym.spaces.Box(-np.inf, np.inf, (4,), np.float32),
                   gym.spaces.Discrete(2), "bench", {}, "bench")
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        rates["off"].append(sample_rate(off, steps))
        rates["on"].append(sample_rate(on, steps))
    off.stop()
    on.stop()
    a, b = statistics.median(rates["off"]), statistics.median(rates["on"])
    emit({"bench": "record_cost", "env": "CartPole-v1", "num_envs": 8, "steps_per_repeat": steps,
          "steps_per_s_off": round(a), "steps_per_s_on": round(b), "cost": round(1 - b / a, 4),
          "target_cost<=0.05": 1 - b / a <= 0.05, "repeats": repeats})
    return os.path.join(tmp, "cartpole")


def record_cartpole(tmp: str, steps: int) -> str:
    """The CartPole recording of ``record_cost``, without measuring anything (``--only read``)."""
    path = os.path.join(tmp, "cartpole")
    write_manifest(path, gym.spaces.Box(-np.inf, np.inf, (4,), np.float32), gym.spaces.Discrete(2), "bench", {}, "bench")
    r = runner(RecordingSettings(path))
    done = 0
    while done < steps:
        done += sum(len(c) for c in r.sample())
        r.flush_recording()
    r.stop()
    return path


def atari_recording(path: str, steps: int, seed: int = 0) -> int:
    """Synthetic 84x84x4 frame-stack episodes of 200 steps (smooth frames, so LZ4 compresses them
    about as much as real Atari frames). Returns the bytes written."""
    rng = np.random.default_rng(seed)
    write_manifest(path, gym.spaces.Box(0, 255, (84, 84, 4), np.uint8), gym.spaces.Discrete(6), "bench", {}, "bench")
    rec = Recorder(RecordingSettings(path, output_max_file_size=256 << 20), "bench000")
    # blocky frames with a little noise: LZ4 compresses them about as much as real Atari frames
    base = np.kron(rng.integers(0, 8, (21, 21)) * 32, np.ones((4, 4), np.int64)).astype(np.uint8)[None, :, :, None]
    written = 0
    while written < steps:
        t = 200
        obs = np.repeat(base, t + 1, axis=0).repeat(4, axis=3)
        noise = rng.integers(0, 84, (t + 1, 2))
        obs[np.arange(t + 1), noise[:, 0], noise[:, 1], :] = 255  # one moving "ball" pixel per frame
        rec.record([EpisodeChunk(episode_id=new_episode_id(), chunk_index=0, obs=obs,
                                 actions=rng.integers(0, 6, t), rewards=rng.normal(size=t).astype(np.float32),
                                 terminated=True, extra={"action_logp": np.full(t, -1.79, np.float32)})])
        written += t
    rec.close()
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def read_rate(path: str, action_space: gym.Space, total: int, input_reader: str = "local") -> float:
    settings = EnvRunnerSettings(env_creator=None, rollout_fragment_length=1000, seed=0, action_space=action_space)
    if input_reader == "ray_data":
        start_ray()
    cls = reader_class(ReaderSettings(path, input_reader=input_reader))
    reader = cls(settings, offline=ReaderSettings(path, shuffle_buffer_size=10_000, input_reader=input_reader))
    done, t0 = 0, time.perf_counter()
    while done < total:
        done += sum(len(c) for c in reader.sample(num_timesteps=1000))
    rate = done / (time.perf_counter() - t0)
    reader.stop()
    return rate


def steps_in(path: str) -> int:
    from pipeline.offline.record import inspect_recording

    return inspect_recording(path)["steps"]


def reads(cartpole: str, tmp: str, repeats: int, atari_steps: int) -> None:
    atari = os.path.join(tmp, "atari84")
    size = atari_recording(atari, atari_steps)
    for name, path, space in (("cartpole", cartpole, gym.spaces.Discrete(2)), ("atari84", atari, gym.spaces.Discrete(6))):
        total = steps_in(path)
        rates = [read_rate(path, space, total) for _ in range(repeats)]
        emit({"bench": "read", "system": "runnel", "reader": "local", "data": name, "steps": total,
              "bytes": size if name == "atari84" else None, "transitions_per_s": round(statistics.median(rates)),
              "repeats": repeats})
        rates = [ray_data_rate(path) for _ in range(repeats + 1)][1:]  # the first pass starts Ray's workers
        emit({"bench": "read", "system": "runnel", "reader": "ray_data", "data": name, "steps": total,
              "bytes": size if name == "atari84" else None, "transitions_per_s": round(statistics.median(rates)),
              "repeats": repeats})
        rates = [read_rate(path, space, total, "ray_data") for _ in range(repeats + 1)][1:]
        emit({"bench": "read", "system": "runnel", "reader": "ray_data_stage", "data": name, "steps": total,
              "bytes": size if name == "atari84" else None, "transitions_per_s": round(statistics.median(rates)),
              "repeats": repeats})


def start_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")


def ray_data_rate(path: str) -> float:
    """The Ray Data path: ``transition_dataset`` (shards listed, read and checked by Ray Data tasks,
    decoded into per-step columns in ``map_batches``) through ``iter_batches``, transitions/s."""
    import glob

    from actors.offline.dataset import transition_dataset

    start_ray()
    files = sorted(glob.glob(os.path.join(path, "*.rshard")))
    done, t0 = 0, time.perf_counter()
    for batch in transition_dataset(files).iter_batches(batch_size=1000, batch_format="numpy"):
        done += len(batch["rewards"])
    return done / (time.perf_counter() - t0)


RLLIB_SCRIPT = r'''
import json, sys, time, glob, os
out, steps = sys.argv[1], int(sys.argv[2])
import ray
from ray.rllib.algorithms.ppo import PPOConfig
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
cfg = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0, num_envs_per_env_runner=8,
       rollout_fragment_length=256).offline_data(output=out, output_write_episodes=False)
       .training(train_batch_size_per_learner=2048, num_epochs=1))
algo = cfg.build_algo() if hasattr(cfg, "build_algo") else cfg.build()
t0 = time.perf_counter(); sampled = 0
while sampled < steps:
    r = algo.train()
    sampled = r["env_runners"]["num_env_steps_sampled_lifetime"]
write_s = time.perf_counter() - t0
algo.stop()
files = glob.glob(os.path.join(out, "**", "*.parquet"), recursive=True)
rates = []
for _ in range(int(sys.argv[3])):
    ds = ray.data.read_parquet(out)
    t0 = time.perf_counter(); rows = 0
    for batch in ds.iter_batches(batch_size=1000, batch_format="numpy"):
        rows += len(next(iter(batch.values())))
    rates.append(rows / (time.perf_counter() - t0))
rates.sort()
print(json.dumps({"bench": "read", "system": "rllib", "version": ray.__version__, "data": "cartpole",
                  "steps": rows, "parquet_files": len(files), "transitions_per_s": round(rates[len(rates) // 2]),
                  "record_steps_per_s_with_training": round(sampled / write_s)}))
ray.shutdown()
'''


def rllib_anchor(python: str, tmp: str, steps: int, repeats: int) -> dict | None:
    if not os.path.exists(python):
        emit({"bench": "read", "system": "rllib", "skipped": f"no anchors venv at {python}"})
        return None
    out = os.path.join(tmp, "rllib_parquet")
    try:
        proc = subprocess.run([python, "-c", RLLIB_SCRIPT, out, str(steps), str(repeats)], capture_output=True,
                              text=True, timeout=900)
    except subprocess.TimeoutExpired:
        emit({"bench": "read", "system": "rllib", "skipped": "RLlib's run took over 15 minutes"})
        return None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        emit({"bench": "read", "system": "rllib", "skipped": f"RLlib failed (exit {proc.returncode}): "
              + " | ".join(proc.stderr.strip().splitlines()[-3:])[:600]})
        return None
    result = json.loads(lines[-1])
    emit(result)
    return result


def reader_memory(tmp: str, gb: float) -> None:
    path = os.path.join(tmp, "big")
    steps = int(gb * (1 << 30) / (84 * 84 * 4))  # frame bytes before compression
    t0 = time.perf_counter()
    size = atari_recording(path, steps, seed=1)
    made_s = time.perf_counter() - t0
    settings = EnvRunnerSettings(env_creator=None, rollout_fragment_length=1000, seed=0, action_space=gym.spaces.Discrete(6))
    before = rss_mb()
    reader = OfflineReader(settings, offline=ReaderSettings(path, shuffle_buffer_size=10_000))
    reader.sample(num_timesteps=1000)  # the shuffle buffer is full from here on
    base, peak, done = rss_mb(), rss_mb(), 0
    t0 = time.perf_counter()
    while done < steps:
        done += sum(len(c) for c in reader.sample(num_timesteps=1000))
        peak = max(peak, rss_mb())
    emit({"bench": "reader_memory", "recording_frame_gb": round(steps * 84 * 84 * 4 / (1 << 30), 2),
          "recording_file_gb": round(size / (1 << 30), 3), "steps": done, "make_s": round(made_s, 1),
          "read_s": round(time.perf_counter() - t0, 1), "rss_before_reader_mb": round(before), "rss_buffer_full_mb": round(base), "rss_growth_mb": round(peak - base, 1),
          "target_growth<50": peak - base < 50})
    reader.stop()
    shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sample-steps", type=int, default=100_000)
    p.add_argument("--atari-steps", type=int, default=20_000)
    p.add_argument("--big-gb", type=float, default=4.0)
    p.add_argument("--anchors-python", default=ANCHORS_PYTHON)
    p.add_argument("--skip-anchor", action="store_true")
    p.add_argument("--only", choices=["all", "read"], default="all",
                   help="read: only the read rows (local reader, Ray Data path, Ray Data reader stage)")
    args = p.parse_args()
    emit({"machine": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()})
    tmp = tempfile.mkdtemp(prefix="runnel-offline-bench-")
    if args.only == "read":
        try:
            reads(record_cartpole(tmp, args.sample_steps), tmp, args.repeats, args.atari_steps)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    try:
        cartpole = record_cost(tmp, args.sample_steps, args.repeats)
        reads(cartpole, tmp, args.repeats, args.atari_steps)
        runnel_cartpole = None
        if not args.skip_anchor:
            anchor = rllib_anchor(args.anchors_python, tmp, args.sample_steps, args.repeats)
            if anchor is not None:
                runnel_cartpole = read_rate(cartpole, gym.spaces.Discrete(2), steps_in(cartpole))
                emit({"bench": "read_ratio", "runnel_over_rllib": round(runnel_cartpole / anchor["transitions_per_s"], 2),
                      "target>=5": runnel_cartpole / anchor["transitions_per_s"] >= 5})
        if args.big_gb > 0:
            reader_memory(tmp, args.big_gb)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
