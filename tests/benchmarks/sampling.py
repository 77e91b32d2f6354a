"""Env-runner sampling against the loops it cannot beat: CartPole-v1, 32 envs, a 64x64 MLP, one core.

Each round times every case for ``--seconds`` of this process's CPU (so other jobs on the machine do not move
the figures; ``torch`` is held to one thread), cases alternating; ratios are taken within a round and the
summary reports their medians over ``--rounds``:

* ``native_loop``: gymnasium's own vector CartPole (``gym.make_vec(..., vectorization_mode="vector_entry_point")``)
  driving the MLP -- one forward pass and one ``Categorical`` draw per vector step, nothing stored: the limit;
* ``sync_loop``: the same with ``gym.vector.SyncVectorEnv`` (32 Python envs);
* ``runner``: runnel's env runner in this process as a default config builds it (``gym_env_vectorize_mode="auto"``:
  the native vector env; ``runner_backend="auto"``: acting with the numpy export), everything it does included
  (time-major buffers, chunks cut, counters); ``runner_torch``: the same acting with the torch module;
  ``runner_sync``: the default with ``gym_env_vectorize_mode="sync"``; with ``--lstm-cell N``, ``runner_lstm`` and
  ``runner_lstm_torch``: the runner with an LSTM of N units after the MLP, acting with numpy and with torch.

Then, with Ray, env steps per wall-clock second gathered at the driver from one runner actor with 32 envs and
from two with 16 each (``--remote-seconds``; 0 skips them).

Prints JSON lines: {"bench": "machine"}, {"bench": "round", ...} per round, {"bench": "remote", ...},
{"bench": "summary", ...}.

    python tests/benchmarks/sampling.py [--rounds 3] [--seconds 3] [--remote-seconds 6] [--lstm-cell 64]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Callable

import gymnasium as gym
import numpy as np
import torch

NUM_ENVS = 32
HIDDEN = 64


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def mlp(obs_dim: int, num_actions: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(obs_dim, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, num_actions))


def bare_loop(env: gym.vector.VectorEnv) -> Callable[[int], int]:
    """A loop over ``env`` with the MLP choosing actions; returns a function running ``n`` vector steps."""
    net = mlp(4, 2)
    obs, _ = env.reset(seed=0)
    state = {"obs": obs}

    def run(n: int) -> int:
        obs = state["obs"]
        with torch.inference_mode():
            for _ in range(n):
                logits = net(torch.from_numpy(obs))
                actions = torch.distributions.Categorical(logits=logits).sample().numpy()
                obs = env.step(actions)[0]
        state["obs"] = obs
        return n * NUM_ENVS

    return run


def runner_loop(mode: str, backend: str = "numpy", lstm_cell: int = 0) -> Callable[[int], int]:
    from actors.env import EnvRunner, EnvRunnerSettings
    from actors.env.creators import GymMaker
    from pipeline.groups.env_runners import numpy_plan

    env = gym.make("CartPole-v1")
    model = {"fcnet_hiddens": [HIDDEN, HIDDEN]}
    if lstm_cell:  # fragments of 64 steps: sequences as long, so chunks are cut where they would be without
        model.update(use_lstm=True, lstm_cell_size=lstm_cell, max_seq_len=64)
    settings = EnvRunnerSettings(env_creator=GymMaker("CartPole-v1"), num_envs=NUM_ENVS, vectorize_mode=mode,
                                 rollout_fragment_length=64, seed=0, model_config=model,
                                 observation_space=env.observation_space, action_space=env.action_space)
    settings.numpy_policy = numpy_plan(settings, backend)
    runner = EnvRunner(settings, worker_index=1)

    def run(n: int) -> int:
        before = runner.num_env_steps_sampled_lifetime
        for _ in range(max(1, n // 64)):
            runner.sample()
        return runner.num_env_steps_sampled_lifetime - before

    return run


def steps_per_cpu_s(run: Callable[[int], int], seconds: float) -> float:
    run(64)  # warm-up
    steps, t0 = 0, time.process_time()
    while time.process_time() - t0 < seconds:
        steps += run(128)
    return steps / (time.process_time() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="CPU seconds per case per round")
    p.add_argument("--remote-seconds", type=float, default=6.0)
    p.add_argument("--lstm-cell", type=int, default=0,
                   help="also time the runner with an LSTM of this many units after the MLP, acting with numpy "
                        "(runner_lstm) and with torch (runner_lstm_torch); 0 skips them")
    args = p.parse_args()
    torch.set_num_threads(1)
    emit(bench="machine", platform=platform.platform(), processor=platform.processor() or platform.machine(),
         cpus=os.cpu_count(), python=platform.python_version(), torch=torch.__version__, gymnasium=gym.__version__,
         loadavg=os.getloadavg())
    cases = {
        "native_loop": bare_loop(gym.make_vec("CartPole-v1", num_envs=NUM_ENVS, vectorization_mode="vector_entry_point")),
        "sync_loop": bare_loop(gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * NUM_ENVS)),
        "runner": runner_loop("auto"),
        "runner_torch": runner_loop("auto", "torch"),
        "runner_sync": runner_loop("sync"),
    }
    if args.lstm_cell:
        cases["runner_lstm"] = runner_loop("auto", "numpy", args.lstm_cell)
        cases["runner_lstm_torch"] = runner_loop("auto", "torch", args.lstm_cell)
    rounds = []
    for r in range(args.rounds):
        rates = {name: steps_per_cpu_s(run, args.seconds) for name, run in cases.items()}
        row = {f"{k}_steps_per_cpu_s": round(v) for k, v in rates.items()}
        row["runner_vs_native_loop"] = round(rates["runner"] / rates["native_loop"], 3)
        row["runner_torch_vs_native_loop"] = round(rates["runner_torch"] / rates["native_loop"], 3)
        row["runner_vs_runner_torch"] = round(rates["runner"] / rates["runner_torch"], 3)
        row["runner_sync_vs_sync_loop"] = round(rates["runner_sync"] / rates["sync_loop"], 3)
        if args.lstm_cell:
            row["runner_lstm_vs_runner_lstm_torch"] = round(rates["runner_lstm"] / rates["runner_lstm_torch"], 3)
        rounds.append(row)
        emit(bench="round", round=r, **row)
    summary = {k: statistics.median(row[k] for row in rounds) for k in rounds[0]}
    if args.remote_seconds > 0:
        import ray
        from ppo_cartpole import sampling_remote as remote  # PPO's runner group, sampled at the driver

        ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        try:
            one = [remote(1, 32, args.remote_seconds) for _ in range(args.rounds)]
            two = [remote(2, 16, args.remote_seconds) for _ in range(args.rounds)]
        finally:
            ray.shutdown()
        emit(bench="remote", one_runner_32_envs_steps_per_s=[round(x) for x in one],
             two_runners_16_envs_steps_per_s=[round(x) for x in two])
        summary["remote_1x32_steps_per_s"] = round(statistics.median(one))
        summary["remote_2x16_steps_per_s"] = round(statistics.median(two))
        summary["remote_2x16_vs_1x32"] = round(statistics.median(two) / statistics.median(one), 3)
    emit(bench="summary", rounds=args.rounds, **summary,
         target_runner_vs_native_loop=0.9, target_remote_2x16_vs_1x32=1.7, numpy=np.__version__)


if __name__ == "__main__":
    main()
