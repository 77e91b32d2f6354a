"""IMPALA (or APPO) on CartPole-v1 past 450: how often a run that learned falls back to random play.

Run: ``.venv/bin/python tests/benchmarks/impala_stability.py [--algo IMPALA] [--runs 6] [--budget 800000]
[--learner-pause-s 0.03 | --num-learners 2] [--stop-at 450] [--config JSON ...]``. Each run trains the learning test's config (2
runner actors, seed 0; runs differ by their asynchrony) for ``--budget`` env steps without stopping at 450 (with
``--stop-at 450``: until the first iteration at 450, the learning test's rule), and prints one JSON line: the first
env step count at an iteration's mean return of 450, whether the run collapsed after it (a
return below 50 once it had reached 450), and (return, entropy, gradient norm, weights lag, env steps) per
iteration. ``--num-learners 2`` runs the two-learner test's setting (learner actors, half the batch each).
``--config`` (repeatable) gives training settings per arm; the runs alternate between the arms.
``--learner-pause-s`` sleeps that long after each learner update (the driver's learner, patched in this
process): the learner becomes the bottleneck and the data lags ~12 updates, as in the suite's failed runs.

Measured 2026-12-05 (docs/HISTORY.md; rows in results_impala_stability_amd_2026-12-05.jsonl): the default config
of then (policy-gradient ratio clipped at 1) collapsed in 1 of 9 runs to 800k, in 2 of 6 with a 0.03 s pause; to 1M
with the pause in 7 of 11, and clipped at 3 in none of 8 (results_impala_pg_clip_amd_2026-12-05.jsonl). On 2026-12-06,
with the learner the bottleneck without a pause (lag ~12.5), clipped at 3: 9 of 30 runs fell below 50 and 2 never
reached 450; at 1e6 none of 30 fell; at 100 (the default since) 2 of 95 ``--stop-at 450`` runs missed 450 within 1M,
on a plateau (results_impala_clip_amd_2026-12-06.jsonl).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402

from pipeline import get_algorithm  # noqa: E402


def pause_learner_updates(algo_name: str, seconds: float) -> None:
    """Every update of the algorithm's learner class sleeps ``seconds`` after it (in this process)."""
    learner_cls = get_algorithm(algo_name)[1].learner_class
    update = learner_cls.update

    def slow_update(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        time.sleep(seconds)
        return out

    learner_cls.update = slow_update


def one_run(algo_name: str, overrides: dict, budget: int, num_learners: int = 0, stop_at: float | None = None) -> dict:
    config = get_algorithm(algo_name)[0]().environment("CartPole-v1").env_runners(num_env_runners=2).debugging(seed=0)
    if num_learners > 0:  # the two-learner test's setting: the default batch split (the same steps per update)
        per_learner = config.train_batch_size_per_learner // num_learners
        config = config.learners(num_learners=num_learners).training(train_batch_size_per_learner=per_learner,
                                                                     minibatch_size=per_learner)
    if overrides:
        config = config.training(**overrides)
    algo = config.build()
    rows, start = [], time.perf_counter()
    try:
        # ``not >=``: an iteration that ended no episode has a NaN return, which has not reached the target
        while not rows or (rows[-1][-1] < budget and (stop_at is None or not rows[-1][0] >= stop_at)):
            r = algo.train()
            learner = r.get("learners", {}).get("default_policy", {})
            rows.append([round(float(r["env_runners"].get("episode_return_mean", float("nan"))), 1),
                         round(float(learner.get("entropy", float("nan"))), 3),
                         round(float(learner.get("gradients_global_norm", float("nan"))), 2),
                         round(float(r["stream"].get("weights_lag_mean", float("nan"))), 1),
                         int(r["num_env_steps_sampled_lifetime"])])
    finally:
        algo.stop()
    first = next((i for i, row in enumerate(rows) if row[0] >= 450), None)
    collapsed = first is not None and any(row[0] < 50 for row in rows[first:])
    return {"bench": "impala_stability", "algo": algo_name, "config": overrides, "num_learners": num_learners,
            "budget": budget,
            "first_450_env_steps": None if first is None else rows[first][-1], "collapsed_after_450": collapsed,
            "wall_s": round(time.perf_counter() - start, 1), "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algo", default="IMPALA", choices=["IMPALA", "APPO"])
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--budget", type=int, default=800_000)
    p.add_argument("--learner-pause-s", type=float, default=0.0)
    p.add_argument("--num-learners", type=int, default=0,
                   help="learner actors (0: the learner in this process); the batch is split between them")
    p.add_argument("--stop-at", type=float, default=None,
                   help="end a run at the first iteration whose mean return reaches this (the learning test's rule)")
    p.add_argument("--config", action="append", type=json.loads, default=[],
                   help='training settings of one arm, e.g. \'{"lr": 0.0005}\' (repeatable; default: the defaults)')
    args = p.parse_args()
    if args.learner_pause_s > 0 and args.num_learners > 0:
        p.error("--learner-pause-s patches the learner in this process; with --num-learners the learners are actors")
    if args.learner_pause_s > 0:
        pause_learner_updates(args.algo, args.learner_pause_s)
    arms = args.config or [{}]
    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        for i in range(args.runs):
            out = one_run(args.algo, arms[i % len(arms)], args.budget, args.num_learners, args.stop_at)
            print(json.dumps({**out, "run": i, "learner_pause_s": args.learner_pause_s}), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
