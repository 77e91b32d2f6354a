"""``model_config normalize_returns`` on and off, the same seeds, in one run: env steps to the target.

Two tasks, each PPO with runnel's tuned file and the runners in the driver (PPO is synchronous: the learning per
env step is the same as with runner actors):
  ``cartpole_x100``  CartPole-v1 paying 100 a step (``tuned/cartpole-ppo.yaml``), to 450 in CartPole's units
                     (45,000 paid), within 150k env steps; ``cartpole`` is plain CartPole for reference;
  ``pendulum``       Pendulum-v1 (``tuned/pendulum-ppo.yaml``, which turns the setting on; ``off`` here drops it),
                     to -400 within the file's 300k.
Runs alternate on and off seed by seed. Prints JSON lines: one ``run`` per (task, setting, seed) with the env
steps sampled when it stopped, whether it reached the target, its last mean return (in the task's own units, so
cartpole_x100's is divided by 100) and the seconds it trained; then one ``summary`` per (task, setting).

    python tests/benchmarks/return_normalization.py [--tasks cartpole_x100,cartpole,pendulum] [--seeds 0,1,2]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import gymnasium as gym
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pipeline import PPOConfig, register_env  # noqa: E402

# task: (tuned file, env, reward scale, target in the task's units, env-step budget)
TASKS = {"cartpole_x100": ("cartpole-ppo.yaml", "cartpole_x100", 100.0, 450.0, 150_000),
         "cartpole": ("cartpole-ppo.yaml", "CartPole-v1", 1.0, 450.0, 150_000),
         "pendulum": ("pendulum-ppo.yaml", "Pendulum-v1", 1.0, -400.0, 300_000)}


class HundredfoldRewards(gym.RewardWrapper):
    def reward(self, reward):
        return 100.0 * reward


register_env("cartpole_x100", lambda cfg: HundredfoldRewards(gym.make("CartPole-v1")))


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def run(task: str, normalize: bool, seed: int) -> dict:
    file, env, scale, target, budget = TASKS[task]
    spec = yaml.safe_load(open(ROOT / "tuned" / file))
    config = PPOConfig().environment(env).debugging(seed=seed)
    config.update_from_dict(spec["config"])
    model_config = {**spec["config"].get("model_config", {}), "normalize_returns": normalize}
    algo = config.env_runners(num_env_runners=0).rl_module(model_config=model_config).build()
    t0 = time.perf_counter()
    try:
        while True:
            result = algo.train()
            ret = result["env_runners"].get("episode_return_mean", float("nan")) / scale
            steps = result["num_env_steps_sampled_lifetime"]
            if ret >= target or steps >= budget:
                break
    finally:
        algo.stop()
    return {"bench": "run", "task": task, "normalize_returns": normalize, "seed": seed, "env_steps": steps,
            "reached": ret >= target, "last_return": round(ret, 1), "train_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="cartpole_x100,cartpole,pendulum")
    p.add_argument("--seeds", default="0,1,2")
    args = p.parse_args()
    tasks, seeds = args.tasks.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        p.error(f"unknown task(s) {unknown}; choose from {sorted(TASKS)}")
    emit(bench="machine", cpus=__import__("os").cpu_count(), platform=platform.platform(), processor=platform.processor())
    rows = []
    for task in tasks:
        for seed in seeds:
            for normalize in (True, False):
                rows.append(run(task, normalize, seed))
                emit(**rows[-1])
    for task in tasks:
        for normalize in (True, False):
            mine = [r for r in rows if r["task"] == task and r["normalize_returns"] == normalize]
            reached = [r["env_steps"] for r in mine if r["reached"]]
            emit(bench="summary", task=task, normalize_returns=normalize, reached=f"{len(reached)} of {len(mine)}",
                 median_env_steps_of_those_reached=statistics.median(reached) if reached else None,
                 env_steps=[r["env_steps"] for r in mine], last_returns=[r["last_return"] for r in mine])


if __name__ == "__main__":
    main()
