"""Cold start: PPO on CartPole-v1, each run in a fresh Python process.

Two setups, alternating run by run: ``runners=2`` (2 env runner actors: ``build()`` starts Ray) and
``runners=0`` (sampling in the driver, as ``--runnel-config '{"ppo": {"num_env_runners": 0}}'`` runs the PPO
benchmark: ``build()`` starts no Ray). Prints one JSON line per run -- ``import_s`` (``from pipeline import
PPOConfig``), ``build_s`` (``build()``: Ray and the runner actors when there are any, and the learner),
``first_train_s`` (the first ``train()``) -- and a summary per setup with their medians. The issue 31 target
is ``build_s`` <= 2 s on 2 cores. ``--evaluators N`` adds N evaluation env runner actors built at set-up
(``evaluation_interval=1``) to every setup with runner actors; ``--learners N`` makes every setup train with
N learner actors (``num_learners=N``: ``build()`` then starts Ray even without runner actors).

    python tests/benchmarks/build_time.py [--runs 3] [--runners 2,0] [--evaluators 1] [--learners 1]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = """
import json, time
t0 = time.perf_counter()
from pipeline import PPOConfig
t1 = time.perf_counter()
config = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=RUNNERS).learners(num_learners=LEARNERS)
if EVALUATORS:
    config = config.evaluation(evaluation_interval=1, evaluation_num_env_runners=EVALUATORS, evaluation_duration=1)
algo = config.build(logdir=None)
t2 = time.perf_counter()
algo.train()
t3 = time.perf_counter()
algo.stop()
print(json.dumps({"import_s": round(t1 - t0, 2), "build_s": round(t2 - t1, 2), "first_train_s": round(t3 - t2, 2)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--runners", default="2,0", help="num_env_runners of each setup, comma-separated")
    p.add_argument("--evaluators", type=int, default=0, help="evaluation_num_env_runners with runner actors")
    p.add_argument("--learners", type=int, default=0, help="num_learners of every setup (learner actors)")
    args = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    setups = [int(x) for x in args.runners.split(",")]
    runs: dict[int, list[dict]] = {n: [] for n in setups}
    evaluators = {n: args.evaluators if n else 0 for n in setups}  # evaluator actors only beside runner actors
    for i in range(args.runs):
        for n in setups:
            child = (CHILD.replace("RUNNERS", str(n)).replace("EVALUATORS", str(evaluators[n]))
                     .replace("LEARNERS", str(args.learners)))
            out = subprocess.run([sys.executable, "-c", child], cwd=root, capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs[n].append(row)
            print(json.dumps({"bench": "cold_build", "runners": n, "evaluators": evaluators[n], "learners": args.learners,
                              "run": i, **row}), flush=True)
    for n in setups:
        print(json.dumps({"bench": "summary", "runners": n, "evaluators": evaluators[n], "learners": args.learners,
                          "runs": args.runs,
                          "loadavg": os.getloadavg(),
                          **{f"median_{k}": statistics.median(r[k] for r in runs[n]) for k in runs[n][0]},
                          "target_build_s": 2.0}), flush=True)

if __name__ == "__main__":
    main()
