"""PPO on CartPole-v1: time and env steps to a mean return of 450, and env-runner sampling throughput.

Prints one JSON object per line:
  {"bench": "machine", ...}
  {"bench": "sampling", "layout": "1x32", "env_steps_per_s": ...}   one in-process runner, 32 envs
  {"bench": "sampling", "layout": "2x16", "env_steps_per_s": ...}   two Ray runner actors, 16 envs each
  {"bench": "time_to_450", "seed": s, "train_s": ..., "env_steps": ..., "build_s": ...}  per seed
  {"bench": "summary", ...}                                           medians

``train_s`` counts the ``train()`` calls until the smoothed return (last 100 episodes) reaches 450;
``build_s`` (starting Ray and the actors) is reported separately.

    python tests/benchmarks/ppo_cartpole.py [--seeds 0,1,2] [--sampling-seconds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import gymnasium as gym
import ray
import torch

from actors.env import EnvRunner, EnvRunnerSettings
from pipeline import PPOConfig
from pipeline.envs import env_creator


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def sampling_in_process(num_envs: int, seconds: float) -> float:
    torch.set_num_threads(1)
    runner = EnvRunner(EnvRunnerSettings(env_creator=env_creator("CartPole-v1"), num_envs=num_envs,
                                         rollout_fragment_length=64, seed=0), worker_index=1)
    runner.sample()  # warm-up
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        steps += sum(len(c) for c in runner.sample())
    return steps / (time.perf_counter() - t0)


def sampling_remote(num_runners: int, num_envs: int, seconds: float) -> float:
    algo = (PPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=num_runners, num_envs_per_env_runner=num_envs, rollout_fragment_length=128)
            .debugging(seed=0).build())
    try:
        group = algo.env_runner_group
        per_call = num_runners * num_envs * 128
        group.sample(per_call, algo.metrics)  # warm-up
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            chunks = group.sample(per_call, algo.metrics)
            steps += sum(len(c) for c in chunks)
        return steps / (time.perf_counter() - t0)
    finally:
        algo.stop()


def time_to_450(seed: int, max_steps: int) -> dict:
    t0 = time.perf_counter()
    algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2).debugging(seed=seed).build()
    build_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        while True:
            r = algo.train()
            if r["env_runners"]["episode_return_mean"] >= 450 or r["num_env_steps_sampled_lifetime"] >= max_steps:
                break
        return {"seed": seed, "reached": r["env_runners"]["episode_return_mean"] >= 450,
                "train_s": round(time.perf_counter() - t0, 2), "env_steps": r["num_env_steps_sampled_lifetime"],
                "iterations": r["training_iteration"], "build_s": round(build_s, 2)}
    finally:
        algo.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--sampling-seconds", type=float, default=5.0)
    p.add_argument("--max-steps", type=int, default=400_000)
    args = p.parse_args()
    emit(bench="machine", platform=platform.platform(), processor=platform.processor() or platform.machine(),
         cpus=os.cpu_count(), python=platform.python_version(), torch=torch.__version__, ray=ray.__version__,
         gymnasium=gym.__version__)
    ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        emit(bench="sampling", layout="1x32", where="in-process runner, one core",
             env_steps_per_s=round(sampling_in_process(32, args.sampling_seconds)))
        emit(bench="sampling", layout="2x16", where="two Ray runner actors, measured at the driver",
             env_steps_per_s=round(sampling_remote(2, 16, args.sampling_seconds)))
        runs = []
        for seed in (int(s) for s in args.seeds.split(",")):
            runs.append(time_to_450(seed, args.max_steps))
            emit(bench="time_to_450", **runs[-1])
        ok = [r for r in runs if r["reached"]]
        emit(bench="summary", seeds=len(runs), reached=len(ok),
             median_train_s=statistics.median(r["train_s"] for r in ok) if ok else None,
             median_env_steps=statistics.median(r["env_steps"] for r in ok) if ok else None,
             median_build_s=statistics.median(r["build_s"] for r in runs))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
