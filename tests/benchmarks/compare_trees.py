"""Run benchmark scripts on two source trees in one session, interleaved, and compare medians.

Used to check a change for regressions against the commit before it (a ``git worktree`` beside
this tree)::

    git worktree add ../old <commit>
    python tests/benchmarks/compare_trees.py --old ../old --rounds 3

Each round runs every benchmark once per tree, alternating which tree goes first (machines are
noisy and drift: interleaving spreads that over both columns). A tree's scripts run with the tree
as working directory and first on ``PYTHONPATH``, with this interpreter. Prints JSON lines: each
benchmark line as the script printed it, tagged ``tree`` and ``round``; then one ``compare`` line
per figure with both medians and new/old.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NEW = Path(__file__).resolve().parents[2]

# figure name -> (script and its arguments, how to pick the figure's values from the script's lines)
BENCHES = {
    "ppo": (["tests/benchmarks/ppo_cartpole.py", "--seeds", "0,1,2", "--sampling-seconds", "5"], {
        "ppo_time_to_450_train_s": lambda ls: [x["train_s"] for x in ls if x.get("bench") == "time_to_450" and x["reached"]],
        "ppo_env_steps_to_450": lambda ls: [x["env_steps"] for x in ls if x.get("bench") == "time_to_450" and x["reached"]],
        "ppo_sampling_1x32_steps_per_s": lambda ls: [x["env_steps_per_s"] for x in ls
                                                     if x.get("bench") == "sampling" and x["layout"] == "1x32"],
        "ppo_sampling_2x16_steps_per_s": lambda ls: [x["env_steps_per_s"] for x in ls
                                                     if x.get("bench") == "sampling" and x["layout"] == "2x16"],
    }),
    "appo": (["tests/benchmarks/appo_cartpole.py", "--skip-solve", "--warmup-s", "5", "--measure-s", "20"], {
        "appo_env_steps_sampled_per_s": lambda ls: [x["env_steps_sampled_per_s"] for x in ls
                                                    if x.get("kind") == "throughput"],
        "appo_env_steps_trained_per_s": lambda ls: [x["env_steps_trained_per_s"] for x in ls
                                                    if x.get("kind") == "throughput"],
    }),
}


def run(tree: Path, argv: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run([sys.executable, *argv], cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[0]} failed in {tree} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the other tree (e.g. a git worktree of the previous commit)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bench", choices=[*BENCHES, "all"], default="all")
    args = p.parse_args()
    trees = {"old": Path(args.old).resolve(), "new": NEW}
    names = list(BENCHES) if args.bench == "all" else [args.bench]
    values: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        for name in names:
            argv, figures = BENCHES[name]
            for tree in order:
                t0 = time.perf_counter()
                lines = run(trees[tree], argv)
                for line in lines:
                    print(json.dumps({"tree": tree, "round": r, **line}), flush=True)
                for figure, pick in figures.items():
                    values.setdefault((figure, tree), []).extend(pick(lines))
                print(json.dumps({"tree": tree, "round": r, "bench": name,
                                  "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)
    for name in names:
        for figure in BENCHES[name][1]:
            old, new = values.get((figure, "old"), []), values.get((figure, "new"), [])
            mo = statistics.median(old) if old else None
            mn = statistics.median(new) if new else None
            print(json.dumps({"compare": figure, "old_median": mo, "new_median": mn, "old_n": len(old),
                              "new_n": len(new), "new_over_old": round(mn / mo, 3) if mo and mn else None}),
                  flush=True)


if __name__ == "__main__":
    main()
