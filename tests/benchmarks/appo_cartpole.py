"""APPO (or IMPALA) on CartPole-v1 with streaming env runners: time to solve and steady-state throughput.

Run: ``.venv/bin/python tests/benchmarks/appo_cartpole.py [--algo APPO|IMPALA] [--runners 2] [--envs 16]
[--warmup-s 5] [--measure-s 25] [--max-steps 1000000] [--config JSON] [--skip-solve]``. Prints one JSON object per line:

1. ``machine``: CPU count, platform, library versions, load average before the run.
2. ``solve``: the default config (seed 0) trained until ``episode_return_mean >= 450``: wall seconds
   (build, train, total), env steps sampled and trained, iterations, mean weights lag.
3. ``throughput``: a fresh algorithm, ``--warmup-s`` of training discarded, then ``--measure-s``: env
   steps sampled (received by the learner side) and trained per second over the window (counter
   deltas over wall time), learner updates per second, mean/max weights lag, mean learner-queue
   depth and the time runners spent blocked on back-pressure.

Ray is started here with ``num_cpus = runners + 1`` (the driver's learner is the "+1").
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from pipeline import APPOConfig, IMPALAConfig  # noqa: E402


ARGS: dict = {}


def emit(kind: str, **fields) -> None:
    if kind != "machine":
        fields["config_overrides"] = ARGS.get("config", {})
    print(json.dumps({"kind": kind, **fields}), flush=True)


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__,
            "numpy": np.__version__, "loadavg_1m_5m_15m": list(os.getloadavg())}


def build(args, **reporting):
    cls = APPOConfig if args.algo == "APPO" else IMPALAConfig
    config = (cls().environment("CartPole-v1")
              .env_runners(num_env_runners=args.runners, num_envs_per_env_runner=args.envs)
              .reporting(**reporting).debugging(seed=args.seed))
    return config.update_from_dict(json.loads(args.config)).build()


def solve(args) -> None:
    t0 = time.perf_counter()
    algo = build(args)
    t_built = time.perf_counter()
    lags, result = [], None
    threads = torch.get_num_threads()  # as the algorithm set it for its learner
    try:
        while True:
            result = algo.train()
            if result["num_learner_updates"]:
                lags.append(result["stream"]["weights_lag_mean"])
            if result["env_runners"]["episode_return_mean"] >= 450 or \
                    result["num_env_steps_sampled_lifetime"] >= args.max_steps:
                break
        t_done = time.perf_counter()
    finally:
        algo.stop()
    emit("solve", algo=args.algo, runners=args.runners, envs_per_runner=args.envs, seed=args.seed,
         solved=result["env_runners"]["episode_return_mean"] >= 450,
         episode_return_mean=round(result["env_runners"]["episode_return_mean"], 1),
         env_steps_sampled=result["num_env_steps_sampled_lifetime"],
         env_steps_trained=result["num_env_steps_trained_lifetime"], iterations=result["training_iteration"],
         build_s=round(t_built - t0, 2), train_s=round(t_done - t_built, 2), wall_s=round(t_done - t0, 2),
         weights_lag_mean=round(float(np.mean(lags)), 2) if lags else None, driver_torch_threads=threads)


def throughput(args) -> None:
    algo = build(args, min_time_s_per_iteration=1.0)
    threads = torch.get_num_threads()
    try:
        t_end = time.perf_counter() + args.warmup_s
        while time.perf_counter() < t_end:
            algo.train()
        c0 = dict(algo.counters)
        t0 = time.perf_counter()
        lag_sum = lag_w = 0.0
        lag_max, qsizes, updates, blocked0 = 0, [], 0, None
        while time.perf_counter() - t0 < args.measure_s:
            r = algo.train()
            if blocked0 is None:
                blocked0 = r["stream"]["runner_send_blocked_s"]
            if r["num_learner_updates"]:
                lag_sum += r["stream"]["weights_lag_mean"] * r["num_learner_updates"]
                lag_w += r["num_learner_updates"]
                lag_max = max(lag_max, r["stream"]["weights_lag_max"])
                qsizes.append(r["learner_queue"]["size_mean"])
            updates += r["num_learner_updates"]
        dt = time.perf_counter() - t0
        sampled = algo.counters["num_env_steps_sampled_lifetime"] - c0["num_env_steps_sampled_lifetime"]
        trained = algo.counters["num_env_steps_trained_lifetime"] - c0["num_env_steps_trained_lifetime"]
        emit("throughput", algo=args.algo, runners=args.runners, envs_per_runner=args.envs,
             train_batch_size=algo.config.train_batch_size_per_learner,
             rollout_fragment_length=algo.config.get_rollout_fragment_length(),
             measure_s=round(dt, 1), env_steps_sampled_per_s=round(sampled / dt),
             env_steps_trained_per_s=round(trained / dt), learner_updates_per_s=round(updates / dt, 1),
             weights_lag_mean=round(lag_sum / lag_w, 2) if lag_w else None, weights_lag_max=lag_max,
             learner_queue_size_mean=round(float(np.mean(qsizes)), 2) if qsizes else None,
             learner_queue_capacity=algo.config.learner_queue_size,
             runner_send_blocked_s=round(r["stream"]["runner_send_blocked_s"] - (blocked0 or 0.0), 2),
             episode_return_mean=round(r["env_runners"]["episode_return_mean"], 1),
             driver_torch_threads=threads, loadavg_1m=os.getloadavg()[0])
    finally:
        algo.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", choices=["APPO", "IMPALA"], default="APPO")
    p.add_argument("--runners", type=int, default=2)
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--measure-s", type=float, default=25.0)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--config", default="{}", help='JSON of config overrides, e.g. \'{"broadcast_interval": 2}\'')
    p.add_argument("--skip-solve", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    args = p.parse_args()
    ARGS["config"] = json.loads(args.config)
    emit("machine", **machine())
    ray.init(address="local", num_cpus=args.runners + 1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        if not args.skip_solve:
            solve(args)
        if not args.skip_throughput:
            throughput(args)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
