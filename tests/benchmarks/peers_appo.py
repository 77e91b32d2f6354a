"""APPO on CartPole-v1 beside RLlib's and Sample Factory's, on the same machine, in one run: time to 450 and
env steps per second end to end.

Run: ``.venv/bin/python tests/benchmarks/peers_appo.py [--systems runnel,rllib,sf] [--seeds 0,1,2]
[--max-minutes 4] [--budget 2000000] [--verbose]``. Each (seed, system) runs in its own process, the systems
interleaved seed by seed; a run is killed after ``--max-minutes``. Prints JSON lines: ``machine`` (CPU, library
versions of each venv), one ``run`` per (system, seed) and one ``summary`` per system (medians over the runs
that reached the target, and runnel's ratio to each peer).

A run's figures: ``train_s`` (from the end of the set-up to the first report at a mean return of 450 over the
last 100 episodes), ``env_steps`` sampled then, ``build_s`` (the set-up: Ray and its actors, or Sample Factory's
processes) and ``env_steps_per_s`` (``env_steps / train_s``: sampling while learning, end to end).

The systems, each with its own published CartPole settings and the same env-runner shape where it has one:
  runnel  ``APPOConfig()`` with its defaults, 2 env-runner actors x 16 envs (``appo_cartpole.py``'s shape);
          this venv's Python.
  rllib   RLlib 2.60 with the settings of ``rllib/examples/algorithms/appo/cartpole_appo.py`` (not in the wheel;
          as read at ray-project/ray commit 0c994fb): ``circular_buffer_iterations_per_batch=2``,
          ``vf_loss_coeff=0.05``, ``entropy_coeff=0``, a value function sharing the policy's layers; 2 env runners x
          16 envs instead of its 5 x 16 (2 cores here), and what ``run_rllib_example_script_experiment`` adds on a
          CPU machine. The anchors venv's Python (``--anchors-python``; set up as in ``offpolicy.py``'s docstring).
  sf      Sample Factory 2.1.1's documented CartPole-v1 command (``sf_examples/train_gym_env.py``: APPO without
          V-trace, no RNN, 20 envs per worker, 2 policy workers, batch 512, reward scale 0.1), with its default
          of one rollout worker per CPU (2); the reward it reports is the env's, before scaling. Its own venv
          (``--sf-python``): Sample Factory needs numpy < 2 and gymnasium < 1.0::

              python3 -m venv /work/sf-venv
              /work/sf-venv/bin/pip install "torch==2.13.0"
              /work/sf-venv/bin/pip install -c /work/anchors-constraints.txt "sample-factory==2.1.1" \\
                  "gymnasium[classic_control]<1.0"

          After each of its training steps the 100-episode mean of the episodes reported so far is checked (its
          runner keeps those as they arrive; its console report every 5 s is not waited for); its env steps are
          those its learner has counted.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from workers import (Progress, emit, median_of, num, run_interleaved, run_worker, split_lists, train_to_target,
                     versions_of, worker_env)

ROOT = Path(__file__).resolve().parents[2]
ANCHORS_PYTHON = "/work/anchors-venv/bin/python"
SF_PYTHON = "/work/sf-venv/bin/python"
SYSTEMS = ("runnel", "rllib", "sf")
TARGET, SMOOTHING, RUNNERS, ENVS = 450.0, 100, 2, 16

# Sample Factory's documented CartPole-v1 command (sf_examples/train_gym_env.py's docstring), as arguments.
SF_ARGS = ["--algo=APPO", "--use_rnn=False", "--num_envs_per_worker=20", "--policy_workers_per_policy=2",
           "--recurrence=1", "--with_vtrace=False", "--batch_size=512", "--reward_scale=0.1", "--env=CartPole-v1"]


def worker_runnel(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from pipeline import APPOConfig
    from pipeline.algorithm_results import lookup

    t0 = time.perf_counter()
    config = (APPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=RUNNERS, num_envs_per_env_runner=ENVS).debugging(seed=a.seed))
    algo = config.build()

    def read(result: dict) -> tuple[int, float | None]:
        return (int(lookup(result, "num_env_steps_sampled_lifetime") or 0),
                num(lookup(result, "env_runners/episode_return_mean")))
    train_to_target(a.budget, TARGET, t0, algo.train, algo.stop, read)


def worker_rllib(a: argparse.Namespace) -> None:
    import ray
    from ray.rllib.algorithms.appo import APPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    config = (APPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=RUNNERS, num_envs_per_env_runner=ENVS)
              .training(circular_buffer_iterations_per_batch=2, vf_loss_coeff=0.05, entropy_coeff=0.0)
              .rl_module(model_config=DefaultModelConfig(vf_share_layers=True)))
    # What run_rllib_example_script_experiment does with its default arguments on a CPU machine.
    config.framework("torch")
    config.resources(num_gpus=0)
    config.learners(num_gpus_per_learner=0)
    config.debugging(seed=a.seed)
    t0 = time.perf_counter()
    # One logical CPU per env runner and one for the driver's learner, as runnel's own start asks for: with Ray's
    # default of one per core (2 here) the algorithm's three bundles never fit and build_algo() waits forever.
    ray.init(address="local", ignore_reinit_error=True, num_cpus=RUNNERS + 1, include_dashboard=False)
    algo = config.build_algo()

    def read(result: dict) -> tuple[int, float | None]:
        env = result.get("env_runners", {})
        steps = int(env.get("num_env_steps_sampled_lifetime") or result.get("num_env_steps_sampled_lifetime") or 0)
        return steps, num(env.get("episode_return_mean"))

    def stop() -> None:
        algo.stop()
        ray.shutdown()
    train_to_target(a.budget, TARGET, t0, algo.train, stop, read)


def worker_sf(a: argparse.Namespace) -> None:
    import numpy as np
    from sample_factory.algo.runners.runner import AlgoObserver
    from sample_factory.cfg.arguments import parse_full_cfg, parse_sf_args
    from sample_factory.envs.env_utils import register_env
    from sample_factory.train import make_runner

    register_env("CartPole-v1", make_cartpole)
    train_dir = tempfile.mkdtemp(prefix="sf_peers_")
    argv = SF_ARGS + ["--device=cpu", f"--seed={a.seed}", f"--train_for_env_steps={a.budget}",
                      f"--train_dir={train_dir}",
                      f"--experiment=cartpole_seed{a.seed}", f"--stats_avg={SMOOTHING}", "--save_every_sec=100000",
                      "--save_best_every_sec=100000", "--keep_checkpoints=1"]
    parser, _ = parse_sf_args(argv=argv)
    cfg = parse_full_cfg(parser, argv)
    t0 = time.perf_counter()
    state = {"build_s": None, "steps": 0, "ret": None, "reached": False, "iterations": 0}
    progress = Progress(t0)

    class StopAtTarget(AlgoObserver):
        def on_start(self, runner) -> None:
            state["build_s"] = time.perf_counter() - t0

        def on_training_step(self, runner, training_iteration_since_resume: int) -> None:
            state["iterations"] += 1
            state["steps"] = int(runner.total_env_steps_since_resume or 0)
            rewards = runner.policy_avg_stats.get("reward", [[]])[0]
            if len(rewards):
                state["ret"] = float(np.mean(rewards))
            progress(state["steps"], state["ret"], state["iterations"])
            if state["ret"] is not None and len(rewards) >= SMOOTHING and state["ret"] >= TARGET \
                    and not state["reached"]:
                state["reached"] = True
                state["at"] = time.perf_counter()
                runner.cfg.train_for_env_steps = 0  # its own stop rule then ends the run after this step

    cfg, runner = make_runner(cfg)
    runner.register_observer(StopAtTarget())
    status = runner.init()
    if status == 0:
        runner.run()
    end = state.get("at", time.perf_counter())
    build_s = state["build_s"] if state["build_s"] is not None else end - t0
    emit(bench="result", reached=state["reached"], env_steps=state["steps"], wall_s=round(end - t0, 2),
         build_s=round(build_s, 2), train_s=round(end - t0 - build_s, 2), iterations=state["iterations"],
         last_return=state["ret"], stop="target" if state["reached"] else "budget")
    emit(bench="teardown", stop_s=round(time.perf_counter() - end, 2))


def make_cartpole(full_env_name, cfg=None, env_config=None, render_mode=None):
    """Sample Factory's env factory (its example's, at module level: its rollout processes unpickle it)."""
    import gymnasium as gym
    return gym.make(full_env_name, render_mode=render_mode)


# --- driver -------------------------------------------------------------------------------------------
def run_one(system: str, seed: int, args: argparse.Namespace) -> dict:
    python = {"runnel": sys.executable, "rllib": args.anchors_python, "sf": args.sf_python}[system]
    cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--seeds", str(seed), "--budget",
           str(args.budget)]
    base = {"bench": "run", "system": system, "seed": seed, "target": TARGET, "budget": args.budget}
    out = run_worker(cmd, base, env=worker_env(args.torch_threads, anchor=system != "runnel"),
                     cwd=str(ROOT) if system == "runnel" else "/tmp", max_minutes=args.max_minutes,
                     verbose=args.verbose, label=f"{system} seed {seed}")
    if out.get("reached") and out.get("train_s"):
        out["env_steps_per_s"] = round(out["env_steps"] / out["train_s"])
    return out


def summarize(runs: list[dict], systems: list[str]) -> None:
    table = {}
    for system in systems:
        rs = [r for r in runs if r["system"] == system]
        ok = [r for r in rs if r.get("reached")]
        table[system] = {"runs": len(rs), "reached": len(ok),
                         "median_train_s": median_of([r.get("train_s") for r in ok]),
                         "median_env_steps": median_of([r.get("env_steps") for r in ok]),
                         "median_env_steps_per_s": median_of([r.get("env_steps_per_s") for r in ok]),
                         "median_build_s": median_of([r.get("build_s") for r in rs])}
    mine = table.get("runnel")
    for system in systems:
        row = dict(table[system])
        if system != "runnel" and mine is not None:
            for fig in ("median_train_s", "median_env_steps", "median_env_steps_per_s"):
                a, b = mine[fig], row[fig]
                row[f"runnel_over_{system}_{fig[7:]}"] = round(a / b, 3) if a and b else None
        emit(bench="summary", system=system, **row)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="runnel,rllib,sf")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budget", type=int, default=2_000_000, help="env steps a run may sample before it stops")
    p.add_argument("--max-minutes", type=float, default=4.0, help="per run; a run still going is killed")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="OMP_NUM_THREADS/MKL_NUM_THREADS for every worker (0: each system's own choice)")
    p.add_argument("--anchors-python", default=ANCHORS_PYTHON, help="the anchors venv's python (RLlib)")
    p.add_argument("--sf-python", default=SF_PYTHON, help="Sample Factory's venv's python")
    p.add_argument("--verbose", action="store_true", help="pass the workers' output and progress to stderr")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args()
    split_lists(p, args, SYSTEMS)
    return args


def main() -> None:
    args = parse()
    if args.worker:
        args.seed = args.seeds[0]
        {"runnel": worker_runnel, "rllib": worker_rllib, "sf": worker_sf}[args.worker](args)
        return
    pythons = {"runnel": sys.executable, "rllib": args.anchors_python, "sf": args.sf_python}
    emit(bench="machine", cpu_count=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
         loadavg=os.getloadavg(), versions={s: {"python": pythons[s], **versions_of(pythons[s])} for s in args.systems},
         systems=args.systems, seeds=args.seeds, budget=args.budget, max_minutes=args.max_minutes,
         runners=RUNNERS, envs_per_runner=ENVS)
    runs = run_interleaved(args.seeds, args.systems, lambda system, seed: run_one(system, seed, args))
    summarize(runs, args.systems)


if __name__ == "__main__":
    main()
