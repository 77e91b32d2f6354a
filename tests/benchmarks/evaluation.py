"""Does parallel evaluation cost training time? PPO on CartPole, iteration time with and without
``evaluation_parallel_to_training=True, evaluation_duration="auto"`` and one evaluator actor.

Both setups are built side by side and their iterations alternate (A, B, A, B, ...), so each pair
meets the same machine; one JSON line per pair, then a summary with the medians and the median
per-pair ratio.

    python tests/benchmarks/evaluation.py --iterations 40 [--num-env-runners 2]

Parallel evaluators run at the lowest OS priority, so they take CPU time training leaves idle; where
training keeps every core busy (two runners and the learner on two cores), evaluation gets little
done and the iteration still pays for the extra process.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ray  # noqa: E402

from pipeline import PPOConfig  # noqa: E402


def config(with_eval: bool, num_env_runners: int) -> PPOConfig:
    cfg = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=num_env_runners)
           .debugging(seed=0))
    if with_eval:
        cfg.evaluation(evaluation_interval=1, evaluation_num_env_runners=1, evaluation_parallel_to_training=True,
                       evaluation_duration="auto", evaluation_config={"explore": False})
    return cfg


def drain(algo) -> None:
    """Wait (bounded) until the evaluator finished the request it was on when training ended, so it
    does not run during the other setup's iteration."""
    manager = algo.evaluators.group.manager
    for _ in range(100):
        if not any(manager.num_in_flight(i) for i in manager.healthy_ids()):
            return
        manager.fetch_ready(timeout_s=0.1)


def run(args: argparse.Namespace) -> list[dict]:
    """Both setups side by side, iterations alternating (A, B, A, B...): each pair meets the same
    machine, so the per-pair ratio is fair on a noisy one."""
    plain, evaluated = config(False, args.num_env_runners).build(), config(True, args.num_env_runners).build()
    rows = []
    try:
        for i in range(args.warmup + args.iterations):
            a = plain.train()["time_this_iter_s"]
            result = evaluated.train()
            drain(evaluated)
            if i >= args.warmup:
                ev = result["evaluation"]["env_runners"]
                rows.append({"iteration": i, "without_eval_s": a, "parallel_eval_s": result["time_this_iter_s"],
                             "ratio": result["time_this_iter_s"] / a, "eval_env_steps": ev["num_env_steps_sampled"],
                             "eval_episodes": ev["num_episodes"]})
    finally:
        plain.stop()
        evaluated.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=40, help="measured iteration pairs")
    p.add_argument("--warmup", type=int, default=3, help="uncounted pairs at the start (actor start-up, first torch calls)")
    p.add_argument("--num-env-runners", type=int, default=1,
                   help="training runners (1 on a 2-core machine leaves the evaluator a core while the runner "
                        "samples; with 2, training alone keeps both cores busy)")
    args = p.parse_args()
    ray.init(address="local", num_cpus=2 * args.num_env_runners + 2, include_dashboard=False, log_to_driver=False)
    machine = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        rows = run(args)
    finally:
        ray.shutdown()
    for row in rows:
        print(json.dumps({**row, **machine}), flush=True)
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    print(json.dumps({"summary": True, "num_env_runners": args.num_env_runners, "iterations": len(rows),
                      "median_iteration_s_without_eval": med("without_eval_s"),
                      "median_iteration_s_parallel_eval": med("parallel_eval_s"), "median_ratio": med("ratio"),
                      "eval_env_steps_per_iteration": med("eval_env_steps"),
                      "eval_episodes": sum(r["eval_episodes"] for r in rows), **machine}), flush=True)


if __name__ == "__main__":
    main()
