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

# One in-process env runner sampling CartPole for a few seconds: short enough to repeat many times
# (a noisy machine needs many windows to resolve a few percent). Imports either module layout.
SAMPLING = """
import json, sys, time, torch
try:
    from actors.env import EnvRunner, EnvRunnerSettings
except ImportError:  # trees before the actors/ restructure
    from actors.env_runner import EnvRunner, EnvRunnerSettings
from pipeline.envs import env_creator
torch.set_num_threads(1)
runner = EnvRunner(EnvRunnerSettings(env_creator=env_creator("CartPole-v1"), num_envs=32,
                                     rollout_fragment_length=64, seed=0), worker_index=1)
runner.sample()
for _ in range(int(sys.argv[1])):
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < float(sys.argv[2]):
        steps += sum(len(c) for c in runner.sample())
    print(json.dumps({"bench": "sampling_window", "env_steps_per_s": steps / (time.perf_counter() - t0)}))
"""

# Two Ray env-runner actors x 16 envs, sampled through the group as PPO does, measured at the driver.
REMOTE_SAMPLING = """
import json, sys, time, ray
from pipeline import PPOConfig
ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
algo = (PPOConfig().environment("CartPole-v1")
        .env_runners(num_env_runners=2, num_envs_per_env_runner=16, rollout_fragment_length=128)
        .debugging(seed=0).build())
group = algo.env_runner_group
metrics = getattr(algo, "metrics", None)  # the driver's metrics logger, after the restructure
def sample(n):
    return group.sample(n)[0] if metrics is None else group.sample(n, metrics)
sample(4096)
for _ in range(int(sys.argv[1])):
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < float(sys.argv[2]):
        steps += sum(len(c) for c in sample(4096))
    print(json.dumps({"bench": "remote_sampling_window", "env_steps_per_s": steps / (time.perf_counter() - t0)}))
algo.stop()
ray.shutdown()
"""

# A cold build() that starts Ray, one runner actor and two learner actors (what a learner actor imports is on
# its path), then one iteration; a fresh process each time.
LEARNER_BUILD = """
import json, time
t0 = time.perf_counter()
from pipeline import PPOConfig
t1 = time.perf_counter()
algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1).learners(num_learners=2).build(logdir=None)
t2 = time.perf_counter()
algo.train()
t3 = time.perf_counter()
algo.stop()
print(json.dumps({"bench": "learner_build", "import_s": round(t1 - t0, 2), "build_s": round(t2 - t1, 2),
                  "first_train_s": round(t3 - t2, 2)}))
"""

# figure name -> (script and its arguments, how to pick the figure's values from the script's lines)
BENCHES = {
    "remote_sampling": (["-c", REMOTE_SAMPLING, "4", "2.0"], {
        "sampling_2x16_ray_actors_steps_per_s": lambda ls: [x["env_steps_per_s"] for x in ls
                                                            if x.get("bench") == "remote_sampling_window"],
    }),
    "sampling": (["-c", SAMPLING, "3", "2.0"], {
        "sampling_1x32_in_process_steps_per_s": lambda ls: [x["env_steps_per_s"] for x in ls
                                                            if x.get("bench") == "sampling_window"],
    }),
    "ppo": (["tests/benchmarks/ppo_cartpole.py", "--seeds", "0,1,2", "--sampling-seconds", "5"], {
        "ppo_time_to_450_train_s": lambda ls: [x["train_s"] for x in ls if x.get("bench") == "time_to_450" and x["reached"]],
        "ppo_env_steps_to_450": lambda ls: [x["env_steps"] for x in ls if x.get("bench") == "time_to_450" and x["reached"]],
        "ppo_sampling_1x32_steps_per_s": lambda ls: [x["env_steps_per_s"] for x in ls
                                                     if x.get("bench") == "sampling" and x["layout"] == "1x32"],
        "ppo_sampling_2x16_steps_per_s": lambda ls: [x["env_steps_per_s"] for x in ls
                                                     if x.get("bench") == "sampling" and x["layout"] == "2x16"],
    }),
    "learner_build": (["-c", LEARNER_BUILD], {
        "build_with_2_learner_actors_s": lambda ls: [x["build_s"] for x in ls if x.get("bench") == "learner_build"],
        "import_pipeline_s": lambda ls: [x["import_s"] for x in ls if x.get("bench") == "learner_build"],
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
    p.add_argument("--bench", choices=list(BENCHES), action="append",
                   help="a benchmark to run (repeatable); default: all of them")
    args = p.parse_args()
    trees = {"old": Path(args.old).resolve(), "new": NEW}
    names = args.bench or list(BENCHES)
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
