"""Does parallel evaluation cost training time? PPO on CartPole, iteration time with and without
``evaluation_parallel_to_training=True, evaluation_duration="auto"`` and one evaluator actor.

Prints one JSON line per measured block and a summary line with the medians and their ratio. The
two setups alternate in blocks (A B A B ...) so that drift on a shared machine hits both alike; the
first ``--warmup`` iterations of each block are not counted (actor start-up, first torch calls).

    python tests/benchmarks/evaluation.py --blocks 5 --iterations 15 [--num-env-runners 2]

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


def block(with_eval: bool, args: argparse.Namespace) -> dict:
    algo = config(with_eval, args.num_env_runners).build()
    times, eval_steps, eval_episodes = [], 0, 0
    try:
        for i in range(args.warmup + args.iterations):
            result = algo.train()
            if i >= args.warmup:
                times.append(result["time_this_iter_s"])
                if with_eval:
                    eval_steps += result["evaluation"]["env_runners"]["num_env_steps_sampled"]
                    eval_episodes += result["evaluation"]["env_runners"]["num_episodes"]
    finally:
        algo.stop()
    return {"evaluation": with_eval, "median_iteration_s": statistics.median(times), "iterations": len(times),
            "eval_env_steps_per_iteration": eval_steps / len(times), "eval_episodes": eval_episodes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=3, help="A/B pairs")
    p.add_argument("--iterations", type=int, default=12, help="measured iterations per block")
    p.add_argument("--warmup", type=int, default=3, help="uncounted iterations at the start of each block")
    p.add_argument("--num-env-runners", type=int, default=1,
                   help="training runners (1 on a 2-core machine leaves the evaluator a core while the runner "
                        "samples; with 2, training alone keeps both cores busy)")
    args = p.parse_args()
    ray.init(num_cpus=args.num_env_runners + 2, include_dashboard=False, log_to_driver=False)
    machine = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    medians: dict[bool, list[float]] = {False: [], True: []}
    try:
        for b in range(args.blocks):
            for with_eval in (False, True):
                out = block(with_eval, args)
                medians[with_eval].append(out["median_iteration_s"])
                print(json.dumps({"block": b, **out, **machine}), flush=True)
    finally:
        ray.shutdown()
    base, par = statistics.median(medians[False]), statistics.median(medians[True])
    print(json.dumps({"summary": True, "median_iteration_s_without_eval": base, "median_iteration_s_parallel_eval": par,
                      "ratio": par / base, **machine}), flush=True)


if __name__ == "__main__":
    main()
