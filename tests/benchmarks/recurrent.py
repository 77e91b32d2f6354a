"""PPO with and without an LSTM on Stateless CartPole (velocities hidden): the issue's bar is a mean return of
350 within 500k env steps for seeds 0-2 with the LSTM, which the MLP does not reach.

Run: ``.venv/bin/python tests/benchmarks/recurrent.py [--seeds 0 1 2] [--budget 500000] [--target 350]
[--models lstm mlp] [--cell 64] [--lr 3e-4] [--epochs 6] [--vf-loss-coeff 0.05] [--no-filter]``.
Settings: RLlib's tuned example for PPO on Stateless CartPole (``MeanStdFilter``, lr 3e-4, 6 epochs,
value-loss weight 0.05, sequences of 20), with a smaller LSTM (64 units) whose policy and value share it. Prints JSON lines: ``machine``, then one ``run`` per (model, seed) -- best smoothed
return, env steps and seconds to reach the target (or the budget) -- and one ``summary`` per model (runs
that reached the target, median steps). In-process (no Ray): one runner of 8 envs in the driver.
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

from tests.helpers import train_until  # noqa: E402
from workers import emit  # noqa: E402

def config(model: str, seed: int, args: argparse.Namespace):
    from pipeline import APPOConfig, PPOConfig
    from pipeline.connectors import mean_std_filter
    from tests.envs import StatelessCartPole

    lstm = {"use_lstm": True, "lstm_cell_size": args.cell, "max_seq_len": 20, "fcnet_hiddens": [64]}
    if args.algo == "APPO":  # RLlib's APPO example: lr 5e-4, one epoch, value weight 0.05, entropy 0.005
        base = APPOConfig().training(lr=5e-4, vf_loss_coeff=0.05, entropy_coeff=0.005)
    else:
        base = PPOConfig().training(lr=args.lr, num_epochs=args.epochs, vf_loss_coeff=args.vf_loss_coeff)
    return (base.environment(StatelessCartPole)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=8,
                         env_to_module_connector=None if args.no_filter else mean_std_filter)
            .rl_module(model_config=lstm if model == "lstm" else {})
            .debugging(seed=seed))


def run(model: str, seed: int, args: argparse.Namespace) -> dict:
    budget, target = args.budget, args.target
    algo = config(model, seed, args).build(logdir=None)
    t0 = time.perf_counter()
    try:
        best, result = train_until(algo, target, budget)
    finally:
        algo.stop()
    steps = result["num_env_steps_sampled_lifetime"]
    return {"algo": args.algo, "model": model, "seed": seed, "best_return": round(best, 1), "env_steps": steps,
            "reached": best >= target, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget", type=int, default=500_000)
    p.add_argument("--target", type=float, default=350.0)
    p.add_argument("--models", nargs="+", default=["lstm", "mlp"], choices=["lstm", "mlp"])
    p.add_argument("--algo", choices=["PPO", "APPO"], default="PPO",
                   help="APPO: RLlib's APPO settings; --lr/--epochs/--vf-loss-coeff are PPO's")
    p.add_argument("--cell", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--vf-loss-coeff", type=float, default=0.05)
    p.add_argument("--no-filter", action="store_true", help="without MeanStdFilter")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(),
         load_avg=[round(x, 2) for x in os.getloadavg()])
    for model in args.models:
        runs = [run(model, seed, args) for seed in args.seeds]
        for r in runs:
            emit(bench="run", **r)
        reached = [r["env_steps"] for r in runs if r["reached"]]
        emit(bench="summary", model=model, reached=f"{len(reached)}/{len(runs)}", target=args.target,
             budget=args.budget, median_env_steps=statistics.median(reached) if reached else None,
             settings={k: v for k, v in vars(args).items() if k not in ("seeds", "models")})


if __name__ == "__main__":
    main()
