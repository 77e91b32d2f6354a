"""Training from external clients vs. ordinary env runners: env steps (and seconds) to CartPole-v1 >= 450.

For each algorithm the same config trains twice: once on an in-driver env runner with 4 sub-envs,
once on a policy server fed by 4 client processes, each driving its own gymnasium CartPole
through ``protocols.client.PolicyClient`` (PPO: remote inference; DQN: local inference into the
replay buffer). The return is the smoothed mean of the last 100 episodes, as everywhere in runnel.

Prints one JSON object per line:
  {"bench": "machine", ...}
  {"bench": "to_450", "algo": "PPO", "setup": "env_runners"|"clients", "seed", "env_steps", "train_s", "reached"}
  {"bench": "summary", "algo": ..., "env_steps_ratio": clients / env_runners (medians)}

    python tests/benchmarks/external_learning.py [--algos PPO,DQN] [--seeds 0,1,2] [--max-steps 300000]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

PPO_SETTINGS = {"train_batch_size_per_learner": 2000, "minibatch_size": 128, "num_epochs": 10, "lr": 3e-4}
DQN_SETTINGS = {"lr": 5e-4, "train_batch_size_per_learner": 64, "training_intensity": 16,
                "num_steps_sampled_before_learning_starts": 1000, "target_network_update_freq": 500,
                "n_step": [2, 5], "double_q": True, "dueling": True, "epsilon": [[0, 1.0], [10000, 0.02]],
                "replay_buffer_config": {"type": "PrioritizedEpisodeReplayBuffer", "capacity": 50000,
                                         "alpha": 0.6, "beta": 0.4},
                }
DQN_MODEL = {"fcnet_hiddens": [64, 64], "fcnet_activation": "relu"}
MODES = {"PPO": "remote", "DQN": "local"}
FRAGMENT = {"PPO": 200, "DQN": 4}


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(algo: str, seed: int, address: str | None, journal: str):
    import gymnasium as gym

    from pipeline import DQNConfig, PPOConfig

    env = gym.make("CartPole-v1")
    cfg = PPOConfig() if algo == "PPO" else DQNConfig()
    cfg.training(**(PPO_SETTINGS if algo == "PPO" else DQN_SETTINGS)).debugging(seed=seed)
    if algo == "DQN":
        cfg.rl_module(model_config=DQN_MODEL)
    cfg.env_runners(num_env_runners=0, num_envs_per_env_runner=4, rollout_fragment_length=FRAGMENT[algo])
    if address is None:
        return cfg.environment("CartPole-v1")
    return (cfg.environment(observation_space=env.observation_space, action_space=env.action_space)
            .external_clients(address=address, inference_mode=MODES[algo], journal_dir=journal,
                              max_pending_steps=4 * cfg.steps_per_training_step() if algo == "DQN" else 200_000))


def client(address: str, mode: str, index: int, seed: int, stop: mp.Event, update_interval: float, spool_chunks: int) -> None:
    import gymnasium as gym

    from protocols.client import PolicyClient, run_env

    env = gym.make("CartPole-v1")
    # the server's max_unacked_steps (welcome) keeps a fast client from running far ahead of training
    c = PolicyClient(address, mode, update_interval=update_interval, spool_chunks=spool_chunks, timeout_s=600, seed=seed * 100 + index)
    episode = 0
    while not stop.is_set():
        run_env(c, env, num_episodes=1, seed=seed * 100_000 + index * 10_000 + episode)
        episode += 1
    c.close(flush=False)


def run(algo: str, seed: int, clients: bool, max_steps: int, update_interval: float = 0.5, spool_chunks: int = 1024) -> dict:
    ctx = mp.get_context("spawn")
    address = f"tcp://127.0.0.1:{free_port()}" if clients else None
    with tempfile.TemporaryDirectory() as journal:
        t0 = time.perf_counter()
        trainer = config(algo, seed, address, journal).build()
        stop = ctx.Event()
        procs = [ctx.Process(target=client, args=(address, MODES[algo], i, seed, stop, update_interval, spool_chunks)) for i in range(4)] if clients else []
        for p in procs:
            p.start()
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reached, steps = False, 0
        try:
            while steps < max_steps:
                result = trainer.train()
                steps = result["num_env_steps_sampled_lifetime"]
                if result["env_runners"]["episode_return_mean"] >= 450:
                    reached = True
                    break
        finally:
            train_s = time.perf_counter() - t0
            stop.set()
            trainer.stop()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return {"env_steps": steps, "train_s": train_s, "build_s": build_s, "reached": reached}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default="PPO,DQN")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--max-steps", type=int, default=300_000)
    p.add_argument("--update-interval", type=float, default=0.5, help="local-inference clients pull weights this often (s)")
    p.add_argument("--spool-chunks", type=int, default=1024, help="chunks a client may hold unacknowledged (the "
                   "client's default; the server's max_unacked_steps throttles it)")
    args = p.parse_args()
    import torch

    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
         torch=torch.__version__)
    for algo in args.algos.split(","):
        steps = {"env_runners": [], "clients": []}
        for seed in (int(s) for s in args.seeds.split(",")):
            for setup in ("env_runners", "clients"):  # alternated, so machine noise hits both alike
                row = run(algo, seed, setup == "clients", args.max_steps, args.update_interval, args.spool_chunks)
                emit(bench="to_450", algo=algo, setup=setup, seed=seed, **row)
                steps[setup].append(row["env_steps"] if row["reached"] else float("inf"))
        med = {k: statistics.median(v) for k, v in steps.items()}
        emit(bench="summary", algo=algo, median_env_steps_env_runners=med["env_runners"],
             median_env_steps_clients=med["clients"], env_steps_ratio=med["clients"] / med["env_runners"])


if __name__ == "__main__":
    main()
