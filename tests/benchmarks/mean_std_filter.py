"""PPO on a CartPole whose observations are scaled and shifted far from unit size (``tests.envs.ScaledCartPole``),
with and without ``MeanStdFilter``: the filter should learn it, the raw observations should not.

Run: ``.venv/bin/python tests/benchmarks/mean_std_filter.py [--seeds 0] [--budget 300000] [--target 450]``.
Prints JSON lines: ``machine``, one ``run`` per (filter on/off, seed): best smoothed return, env steps, seconds.
In-process (no Ray): one runner of 8 envs in the driver, PPO's defaults.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.helpers import train_until  # noqa: E402
from workers import emit  # noqa: E402


def run(filtered: bool, seed: int, budget: int, target: float) -> dict:
    from pipeline import PPOConfig
    from pipeline.connectors import mean_std_filter
    from tests.envs import ScaledCartPole

    algo = (PPOConfig().environment(ScaledCartPole)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=8,
                         env_to_module_connector=mean_std_filter if filtered else None)
            .debugging(seed=seed).build(logdir=None))
    t0 = time.perf_counter()
    try:
        best, result = train_until(algo, target, budget)
    finally:
        algo.stop()
    steps = result["num_env_steps_sampled_lifetime"]
    return {"filter": filtered, "seed": seed, "best_return": round(best, 1), "env_steps": steps,
            "reached": best >= target, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--budget", type=int, default=300_000)
    p.add_argument("--target", type=float, default=450.0)
    p.add_argument("--filter", choices=["on", "off", "both"], default="both")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(),
         load_avg=[round(x, 2) for x in os.getloadavg()])
    for filtered in {"on": [True], "off": [False], "both": [True, False]}[args.filter]:
        for seed in args.seeds:
            emit(bench="run", **run(filtered, seed, args.budget, args.target))


if __name__ == "__main__":
    main()
