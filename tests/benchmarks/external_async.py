"""IMPALA and APPO from external clients vs. from env runners: env steps to CartPole-v1 >= 450.

For each algorithm and seed the same config trains twice: once with the tuned CartPole setup of
``tests/benchmarks/appo_cartpole.py`` (the algorithm's defaults, 2 streaming env runners x 16 sub-envs),
once with a policy server in the runners' place (one runner slot, a Ray actor) fed by 4 client
processes, each playing its own gymnasium CartPole through ``protocols.client.PolicyClient`` with
remote inference. Env steps are the algorithm's ``num_env_steps_sampled_lifetime``; the return is the
smoothed mean of the last 100 episodes, as everywhere in runnel.

Prints one JSON object per line:
  {"bench": "machine", ...}
  {"bench": "to_450", "algo", "setup": "env_runners"|"clients", "seed", "env_steps", "reached", "train_s",
   "iterations", "weights_lag_mean", "env_steps_per_s"}
  {"bench": "summary", "algo", "median_env_steps_env_runners", "median_env_steps_clients",
   "env_steps_ratio": clients / env runners (medians)}

    python tests/benchmarks/external_async.py [--algos APPO,IMPALA] [--seeds 0,1,2] [--max-steps 3000000]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from pipeline import APPOConfig, IMPALAConfig  # noqa: E402
from tests.test_external import free_port  # noqa: E402
from tests.test_external_streaming import ClientProcesses  # noqa: E402

CONFIGS = {"APPO": APPOConfig, "IMPALA": IMPALAConfig}


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def build(algo: str, seed: int, address: str | None, journal: str, overrides: dict):
    config = CONFIGS[algo]().debugging(seed=seed).update_from_dict(overrides)
    if address is None:
        return config.environment("CartPole-v1").env_runners(num_env_runners=2).build()
    env = gym.make("CartPole-v1")
    return (config.environment(observation_space=env.observation_space, action_space=env.action_space)
            .env_runners(num_env_runners=1).external_clients(address=address, journal_dir=journal).build())


def run(algo: str, seed: int, clients: bool, max_steps: int, num_clients: int, overrides: dict) -> dict:
    address = f"tcp://127.0.0.1:{free_port()}" if clients else None
    lags, result, iterations = [], None, 0
    with tempfile.TemporaryDirectory() as journal:
        trainer = build(algo, seed, address, journal, overrides)
        try:
            with ClientProcesses(address, num_clients, seed) if clients else _Nothing() as procs:
                t0 = time.perf_counter()
                while True:
                    result = trainer.train()
                    iterations += 1
                    procs.check()
                    if result["num_learner_updates"]:
                        lags.append(result["stream"]["weights_lag_mean"])
                    if result["env_runners"].get("episode_return_mean", 0) >= 450 \
                            or result["num_env_steps_sampled_lifetime"] >= max_steps:
                        break
                train_s = time.perf_counter() - t0
        finally:
            trainer.stop()
    steps = result["num_env_steps_sampled_lifetime"]
    return {"env_steps": steps, "reached": result["env_runners"].get("episode_return_mean", 0) >= 450,
            "train_s": round(train_s, 1), "iterations": iterations,
            "weights_lag_mean": round(float(np.mean(lags)), 2) if lags else None,
            "env_steps_per_s": round(steps / train_s)}


class _Nothing:
    """Stands in for the client processes in the env-runner runs."""

    def __enter__(self) -> "_Nothing":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def check(self) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default="APPO,IMPALA")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--setups", default="env_runners,clients")
    p.add_argument("--max-steps", type=int, default=3_000_000)
    p.add_argument("--clients", type=int, default=4, help="client processes (remote inference)")
    p.add_argument("--config", default="{}", help="JSON of config overrides for both setups")
    args = p.parse_args()
    overrides = json.loads(args.config)
    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
         torch=torch.__version__, ray=ray.__version__, loadavg_1m_5m_15m=list(os.getloadavg()),
         config_overrides=overrides)
    ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        for algo in args.algos.split(","):
            steps: dict[str, list] = {s: [] for s in args.setups.split(",")}
            for seed in (int(s) for s in args.seeds.split(",")):
                for setup in steps:  # alternated, so machine noise hits both alike
                    row = run(algo, seed, setup == "clients", args.max_steps, args.clients, overrides)
                    emit(bench="to_450", algo=algo, setup=setup, seed=seed, **row)
                    steps[setup].append(row["env_steps"] if row["reached"] else float("inf"))
            med = {k: statistics.median(v) for k, v in steps.items()}
            if len(med) == 2:
                emit(bench="summary", algo=algo, median_env_steps_env_runners=med["env_runners"],
                     median_env_steps_clients=med["clients"], env_steps_ratio=med["clients"] / med["env_runners"])
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
