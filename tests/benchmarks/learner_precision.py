"""Learner updates in float32 against bfloat16 autocast (``.learners(learner_precision="bfloat16")``).

For each workload, two algorithms are built that differ only in ``learner_precision``; one batch of chunks is
sampled once and both learners update on it in alternating rounds (one ``update`` call each per round: PPO's
epochs of minibatches, APPO's V-trace and its minibatches). Prints one JSON object per line:

  {"bench": "machine", ...}
  {"bench": "update", "workload", "algo", "precision", "round", "ms"}    one update call
  {"bench": "summary", "workload", "algo", "float32_ms", "bfloat16_ms", "speedup"}   medians over rounds, and
                                                                        the median of each round's ratio

Workloads: "frames_cnn" (84x84x4 uint8 frames, ``tests.envs.FrameEnv``, the default Nature CNN; 500 steps
a batch in minibatches of 125) and "cartpole_mlp" (CartPole-v1, the default MLP; the same sizes).

    python tests/benchmarks/learner_precision.py [--rounds 7] [--workloads frames_cnn,cartpole_mlp]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workers import emit  # noqa: E402

WORKLOADS = {"frames_cnn": "tests.envs:FrameEnv", "cartpole_mlp": "CartPole-v1"}
BATCH, MINIBATCH = 500, 125


def build(algo: str, env: str, precision: str):
    from pipeline import APPOConfig, PPOConfig

    config = (PPOConfig() if algo == "ppo" else APPOConfig()).environment(env)
    config.env_runners(num_env_runners=0, num_envs_per_env_runner=4, rollout_fragment_length=BATCH // 4)
    config.training(train_batch_size_per_learner=BATCH, minibatch_size=MINIBATCH, num_epochs=2)
    return config.learners(learner_precision=precision).debugging(seed=0).build(logdir=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--algos", default="ppo,appo")
    args = p.parse_args()

    import torch

    from actors.metrics import MetricsLogger

    torch.set_num_threads(1)
    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(), torch=torch.__version__,
         torch_threads=torch.get_num_threads(), load_avg=[round(x, 2) for x in os.getloadavg()])
    for workload in args.workloads.split(","):
        for algo_name in args.algos.split(","):
            algos = {prec: build(algo_name, WORKLOADS[workload], prec) for prec in ("float32", "bfloat16")}
            try:
                chunks = algos["float32"].env_runner_group.sample(BATCH, MetricsLogger())
                times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
                for rnd in range(-1, args.rounds):  # round -1 warms up
                    for prec, algo in algos.items():
                        learner = algo.learner_group.local
                        t0 = time.perf_counter()
                        learner.update(list(chunks), BATCH)
                        ms = 1e3 * (time.perf_counter() - t0)
                        if rnd >= 0:
                            times[prec].append(ms)
                            emit(bench="update", workload=workload, algo=algo_name, precision=prec, round=rnd,
                                 ms=round(ms, 1))
                full, low = (statistics.median(times[k]) for k in ("float32", "bfloat16"))
                emit(bench="summary", workload=workload, algo=algo_name, float32_ms=round(full, 1),
                     bfloat16_ms=round(low, 1), speedup=round(statistics.median(
                         f / b for f, b in zip(times["float32"], times["bfloat16"])), 2))
            finally:
                for algo in algos.values():
                    algo.stop()


if __name__ == "__main__":
    main()
