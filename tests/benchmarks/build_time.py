"""Cold start: PPO on CartPole-v1 with 2 env runner actors, each run in a fresh Python process.

Prints one JSON line per run -- ``import_s`` (``from pipeline import PPOConfig``), ``build_s`` (``build()``:
starting Ray, the runner actors and the learner), ``first_train_s`` (the first ``train()``) -- and a summary
with their medians. The issue 31 target is ``build_s`` <= 2 s on 2 cores.

    python tests/benchmarks/build_time.py [--runs 3]
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
algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2).build(logdir=None)
t2 = time.perf_counter()
algo.train()
t3 = time.perf_counter()
algo.stop()
print(json.dumps({"import_s": round(t1 - t0, 2), "build_s": round(t2 - t1, 2), "first_train_s": round(t3 - t2, 2)}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runs = []
    for i in range(args.runs):
        out = subprocess.run([sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        runs.append(row)
        print(json.dumps({"bench": "cold_build", "run": i, **row}), flush=True)
    print(json.dumps({"bench": "summary", "runs": args.runs, "loadavg": os.getloadavg(),
                      **{f"median_{k}": statistics.median(r[k] for r in runs) for k in runs[0]},
                      "target_build_s": 2.0}), flush=True)


if __name__ == "__main__":
    main()
