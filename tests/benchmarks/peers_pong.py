"""APPO on Atari Pong beside Sample Factory's and RLlib's, on the same CPU machine, in one run: frames per second
end to end over a fixed stretch of training, and where the return got to.

Run: ``.venv/bin/python tests/benchmarks/peers_pong.py [--systems runnel,runnel_fp32,sf,sf_async,rllib]
[--seeds 0,1,2] [--train-minutes 3] [--runnel-runners 0] [--sf-args ...] [--verbose]``. Each (seed, system)
runs in its own process, the systems interleaved seed by seed. Prints JSON lines: ``machine``, one ``run`` per
(system, seed) and one ``summary`` per system (medians, and runnel's ratio to each peer).

No system reaches a good Pong score in minutes on a few CPU cores (the issue's Pong bar is asked of a GPU
run); what this measures is how fast each turns CPU into trained-on frames with its own Atari settings. A run
trains for ``--train-minutes`` after its set-up and reports:
  ``frames``        emulator frames (4 per env step) the learner has trained on by then -- runnel: env steps
                    sampled x 4 (with ``--runnel-runners 0`` every sampled batch is trained on, once or more);
                    Sample Factory: its learner's own count (``summaries_use_frameskip``: frames);
  ``frames_per_s``  ``frames / train_s``, the whole loop (acting, env, learning) on this machine's cores;
  ``last_return``   the mean game score of the last 100 episodes (Pong has no lives, and its rewards are +-1
                    already, so runnel's per-life clipped return is the game score here);
  ``build_s``       the set-up (runnel: ``build()``; Sample Factory: its processes up to the first step).

The systems, each with its own documented Pong settings:
  runnel       ``tuned/pong-appo.yaml`` with the overrides its header names for a machine without a GPU
               (``num_gpus_per_learner: 0``) and this benchmark's core count: ``num_env_runners`` 0 by default (8
               envs sampled in the driver, the learner on the same process, every batch trained: the set-up of
               the 2026-11-27 CPU runs), learner and acting in bfloat16 where the CPU has the instructions
               (``--runnel-precision``); each 500-step batch trained for 2 epochs of 4 minibatches.
  runnel_fp32  the same in float32 (Sample Factory computes in float32).
  runnel_ppo   PPO with ``tuned/pong-ppo.yaml`` (CleanRL's and Sample Factory's Atari PPO settings) and the same
               overrides and precision as ``runnel``; ``runnel_ppo_fp32`` in float32.
  sf           Sample Factory 2.1.1's documented Atari command (``python -m sf_examples.atari.train_atari
               --algo=APPO --env=atari_pong``; its Atari defaults: 8 rollout workers x 1 env, 4-frame stacks,
               synchronous PPO-style: 1,024 steps a batch, 4 epochs of 4 minibatches of 256) on ``--device=cpu``, plus
               ``--sf-args``. Its own venv (``--sf-python``), set up as ``peers_appo.py`` says, then
               ``pip install "ale-py==0.12.1"`` into it (that ale-py registers its ids with gymnasium 0.29 only
               when asked: the worker does so).
  sf_async     the same with the settings that were fastest on a 2-core VM in short trials (2026-12-06: 1.49k
               frames/s against 1.16-1.19k for the defaults and for 2 workers x 4 envs synchronous):
               ``--async_rl=True --num_workers=<cores> --num_envs_per_worker=4``.
  rllib        RLlib 2.60 with the settings of ``rllib/examples/algorithms/appo/pong_appo.py`` (not in the wheel; as
               read at ray-project/ray commit 41ac965): RLlib's Atari wrappers at 64x64, 4-frame stacking as
               connectors, its 4-layer CNN, 500-step batches, circular buffer 4 x 2, 2 runners x 2 envs and 2
               aggregator actors; Ray given one logical CPU per actor and one for the driver's learner. The anchors
               venv's Python (``--anchors-python``; set up as in ``offpolicy.py``'s docstring, then
               ``pip install "ale-py==0.12.1" opencv-python-headless`` into it). Its frames: env steps sampled x 4.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from workers import (Progress, emit, median_of, num, run_interleaved, run_worker, split_lists, versions_of,
                     worker_env)

ROOT = Path(__file__).resolve().parents[2]
SF_PYTHON = "/work/sf-venv/bin/python"
SYSTEMS = ("runnel", "runnel_fp32", "runnel_ppo", "runnel_ppo_fp32", "sf", "sf_async", "rllib")
ANCHORS_PYTHON = "/work/anchors-venv/bin/python"
FRAME_SKIP, SMOOTHING = 4, 100
SF_ARGS = ["--algo=APPO", "--env=atari_pong"]
RLLIB_RUNNERS = 2


def worker_runnel(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from pipeline import APPOConfig, PPOConfig
    from pipeline.algorithm_results import lookup
    from pipeline.cli.train_spec import load_train_file

    ppo = a.worker.startswith("runnel_ppo")
    spec = load_train_file(str(ROOT / "tuned" / ("pong-ppo.yaml" if ppo else "pong-appo.yaml")))
    overrides = {"num_gpus_per_learner": 0, "num_env_runners": a.runnel_runners,
                 "num_cpus_for_main_process": os.cpu_count() if a.runnel_runners == 0 else 1}
    precision = "float32" if a.worker.endswith("_fp32") else a.runnel_precision
    if precision != "float32":
        overrides.update(learner_precision=precision, inference_config={"precision": precision})
    t0 = time.perf_counter()
    config = PPOConfig() if ppo else APPOConfig()
    config.update_from_dict({**spec["config"], **overrides})
    config.environment(spec["env"]).debugging(seed=a.seed)
    algo = config.build()
    build_s = time.perf_counter() - t0

    def read(result: dict) -> tuple[int, int, float | None]:
        return (int(lookup(result, "num_env_steps_sampled_lifetime") or 0),
                int(lookup(result, "num_env_steps_trained_lifetime") or 0),
                num(lookup(result, "env_runners/episode_return_mean")))

    train_for(a, t0, build_s, algo.train, read, algo.stop, overrides)


def worker_rllib(a: argparse.Namespace) -> None:
    import ray
    from ray.rllib.algorithms.appo import APPOConfig
    from ray.rllib.connectors.env_to_module.frame_stacking import FrameStackingEnvToModule
    from ray.rllib.connectors.learner.frame_stacking import FrameStackingLearner
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.tune.registry import register_env

    register_env("pong", make_rllib_pong)
    config = (APPOConfig()
              .environment("pong", env_config={"frameskip": 1, "full_action_space": False,
                                               "repeat_action_probability": 0.0}, clip_rewards=True)
              .env_runners(env_to_module_connector=lambda env, spaces, device: FrameStackingEnvToModule(num_frames=4),
                           num_envs_per_env_runner=2, num_env_runners=RLLIB_RUNNERS)
              .learners(num_aggregator_actors_per_learner=2, num_gpus_per_learner=0)
              .training(learner_connector=lambda obs_space, act_space: FrameStackingLearner(num_frames=4),
                        train_batch_size_per_learner=500, target_network_update_freq=2, lr=0.0005,
                        vf_loss_coeff=1.0, entropy_coeff=[[0, 0.01], [3000000, 0.0]], broadcast_interval=5,
                        circular_buffer_num_batches=4, circular_buffer_iterations_per_batch=2)
              .rl_module(model_config=DefaultModelConfig(
                  vf_share_layers=True, conv_filters=[(16, 4, 2), (32, 4, 2), (64, 4, 2), (128, 4, 2)],
                  conv_activation="relu", head_fcnet_hiddens=[256]))
              .framework("torch").resources(num_gpus=0).debugging(seed=a.seed))
    t0 = time.perf_counter()
    # one logical CPU per actor the example asks for (2 runners, 2 aggregators) and one for the driver's learner:
    # with Ray's default of one per core its bundles would never all fit on 2 cores
    ray.init(address="local", ignore_reinit_error=True, num_cpus=RLLIB_RUNNERS + 3, include_dashboard=False)
    algo = config.build_algo()
    build_s = time.perf_counter() - t0

    def read(result: dict) -> tuple[int, int, float | None]:
        env = result.get("env_runners", {})
        learners = result.get("learners", {}).get("__all_modules__", {})
        return (int(env.get("num_env_steps_sampled_lifetime") or 0),
                int(learners.get("num_env_steps_trained_lifetime") or 0), num(env.get("episode_return_mean")))

    def stop() -> None:
        algo.stop()
        ray.shutdown()

    train_for(a, t0, build_s, algo.train, read, stop,
              {"num_env_runners": RLLIB_RUNNERS, "num_envs_per_env_runner": 2, "num_aggregator_actors_per_learner": 2})


def train_for(a: argparse.Namespace, t0: float, build_s: float, train: Callable[[], dict],
              read: Callable[[dict], tuple[int, int, float | None]], stop: Callable[[], None], config: dict) -> None:
    """``train()`` until ``--train-minutes`` of training have passed, each result ``read`` as (env steps sampled, env
    steps trained, mean return), with progress lines; then the ``result`` line, ``stop()`` and the ``teardown`` line."""
    progress = Progress(t0)
    it, steps, trained, ret = 0, 0, 0, None
    try:
        while time.perf_counter() - t0 - build_s < a.train_minutes * 60:
            steps, trained, r = read(train())
            it += 1
            ret = r if r is not None else ret
            progress(steps, ret, it)
    finally:
        end = time.perf_counter()
        emit(bench="result", frames=steps * FRAME_SKIP, frames_passed_to_learner=trained * FRAME_SKIP,
             train_s=round(end - t0 - build_s, 2), build_s=round(build_s, 2), iterations=it, last_return=ret,
             config=config)
        stop()
        emit(bench="teardown", stop_s=round(time.perf_counter() - end, 2))


def make_rllib_pong(cfg):
    """RLlib's Pong env as its example builds it: the ALE env at one frame a step, RLlib's Atari wrappers at 64x64,
    no stacking in the env (a connector stacks)."""
    import ale_py
    import gymnasium as gym
    from ray.rllib.env.wrappers.atari_wrappers import wrap_atari_for_new_api_stack

    gym.register_envs(ale_py)
    return wrap_atari_for_new_api_stack(gym.make("ale_py:ALE/Pong-v5", **cfg), dim=64, framestack=None)


def worker_sf(a: argparse.Namespace) -> None:
    import numpy as np
    from sample_factory.algo.runners.runner import AlgoObserver
    from sample_factory.envs.env_utils import register_env
    from sample_factory.train import make_runner
    from sf_examples.atari.train_atari import parse_atari_args

    register_env("atari_pong", make_pong)
    train_dir = tempfile.mkdtemp(prefix="sf_pong_")
    fast = ["--async_rl=True", f"--num_workers={os.cpu_count()}", "--num_envs_per_worker=4"]
    argv = SF_ARGS + (fast if a.worker == "sf_async" else []) + shlex.split(a.sf_args) + [
        "--device=cpu", f"--seed={a.seed}", f"--train_dir={train_dir}", f"--experiment=pong_seed{a.seed}",
        f"--stats_avg={SMOOTHING}", "--save_every_sec=100000", "--save_best_every_sec=100000", "--keep_checkpoints=1",
        "--train_for_env_steps=10000000000"]
    cfg = parse_atari_args(argv)
    t0 = time.perf_counter()
    state = {"build_s": None, "frames": 0, "ret": None, "iterations": 0, "end": None}
    progress = Progress(t0)

    class StopAfter(AlgoObserver):
        def on_training_step(self, runner, training_iteration_since_resume: int) -> None:
            now = time.perf_counter()
            if state["build_s"] is None:  # its first training step: the set-up is over
                state["build_s"] = now - t0
            state["iterations"] += 1
            state["frames"] = int(runner.total_env_steps_since_resume or 0)
            rewards = runner.policy_avg_stats.get("reward", [[]])[0]
            if len(rewards):
                state["ret"] = float(np.mean(rewards))
            progress(state["frames"] // FRAME_SKIP, state["ret"], state["iterations"])
            if state["end"] is None and now - t0 - state["build_s"] >= a.train_minutes * 60:
                state["end"] = now
                runner.cfg.train_for_env_steps = 0  # its own stop rule ends the run after this step

    cfg, runner = make_runner(cfg)
    runner.register_observer(StopAfter())
    if runner.init() == 0:
        runner.run()
    end = state["end"] or time.perf_counter()
    build_s = state["build_s"] if state["build_s"] is not None else end - t0
    emit(bench="result", frames=state["frames"], train_s=round(end - t0 - build_s, 2), build_s=round(build_s, 2),
         iterations=state["iterations"], last_return=state["ret"],
         config={"num_workers": cfg.num_workers, "num_envs_per_worker": cfg.num_envs_per_worker,
                 "batch_size": cfg.batch_size, "async_rl": cfg.async_rl, "extra": a.sf_args})
    emit(bench="teardown", stop_s=round(time.perf_counter() - end, 2))


def make_pong(full_env_name, cfg=None, env_config=None, render_mode=None):
    """Sample Factory's Atari env factory, after registering ale-py's ids (gymnasium 0.29 does not load them by
    itself). At module level: its rollout processes unpickle it."""
    from ale_py import registration
    from sf_examples.atari.atari_utils import make_atari_env

    registration.register_v0_v4_envs()
    return make_atari_env(full_env_name, cfg, env_config, render_mode=render_mode)


# --- driver -------------------------------------------------------------------------------------------
def run_one(system: str, seed: int, args: argparse.Namespace) -> dict:
    python = args.sf_python if system.startswith("sf") else args.anchors_python if system == "rllib" else sys.executable
    cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--seeds", str(seed),
           "--train-minutes", str(args.train_minutes), "--runnel-runners", str(args.runnel_runners),
           "--runnel-precision", args.runnel_precision, f"--sf-args={args.sf_args}"]
    base = {"bench": "run", "system": system, "seed": seed, "train_minutes": args.train_minutes}
    peer = system.startswith("sf") or system == "rllib"
    out = run_worker(cmd, base, env=worker_env(args.torch_threads, anchor=peer), cwd="/tmp" if peer else str(ROOT),
                     max_minutes=args.train_minutes + 5,
                     verbose=args.verbose, label=f"{system} seed {seed}")
    if out.get("frames") and out.get("train_s"):
        out["frames_per_s"] = round(out["frames"] / out["train_s"])
        out["frames_per_s_per_core"] = round(out["frames_per_s"] / (os.cpu_count() or 1))
    return out


def summarize(runs: list[dict], systems: list[str]) -> None:
    table = {}
    for system in systems:
        rs = [r for r in runs if r["system"] == system and r.get("frames_per_s")]
        table[system] = {"runs": len([r for r in runs if r["system"] == system]), "measured": len(rs),
                         "median_frames_per_s": median_of([r["frames_per_s"] for r in rs]),
                         "median_frames": median_of([r["frames"] for r in rs]),
                         "median_last_return": median_of([r.get("last_return") for r in rs]),
                         "median_build_s": median_of([r.get("build_s") for r in rs])}
    mine = table.get("runnel")
    for system in systems:
        row = dict(table[system])
        peer = system in ("sf", "sf_async", "rllib")
        if peer and mine is not None and mine["median_frames_per_s"] and row["median_frames_per_s"]:
            row["runnel_over_peer_frames_per_s"] = round(mine["median_frames_per_s"] / row["median_frames_per_s"], 3)
        emit(bench="summary", system=system, **row)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="runnel,runnel_fp32,sf,sf_async")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--train-minutes", type=float, default=3.0, help="training time per run after its set-up")
    p.add_argument("--runnel-runners", type=int, default=0, help="runnel's num_env_runners (0: in the driver)")
    p.add_argument("--runnel-precision", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="runnel's learner and acting precision (auto: bfloat16 where the CPU has AVX512-BF16/AMX)")
    p.add_argument("--sf-args", default="", help="extra Sample Factory arguments, e.g. '--num_workers=2'")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="OMP_NUM_THREADS/MKL_NUM_THREADS for every worker (0: each system's own choice)")
    p.add_argument("--sf-python", default=SF_PYTHON, help="Sample Factory's venv's python")
    p.add_argument("--anchors-python", default=ANCHORS_PYTHON, help="the anchors venv's python (RLlib)")
    p.add_argument("--verbose", action="store_true", help="pass the workers' output and progress to stderr")
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = p.parse_args()
    split_lists(p, args, SYSTEMS)
    if args.runnel_precision == "auto":
        args.runnel_precision = "bfloat16" if has_fast_bf16() else "float32"
    return args


def has_fast_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def main() -> None:
    args = parse()
    if args.worker:
        args.seed = args.seeds[0]
        (worker_sf if args.worker.startswith("sf") else worker_rllib if args.worker == "rllib" else
         worker_runnel)(args)
        return
    pythons = {s: args.sf_python if s.startswith("sf") else args.anchors_python if s == "rllib" else sys.executable
               for s in args.systems}
    emit(bench="machine", cpu_count=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
         loadavg=os.getloadavg(), versions={s: {"python": pythons[s], **versions_of(pythons[s])} for s in args.systems},
         systems=args.systems, seeds=args.seeds, train_minutes=args.train_minutes,
         runnel_runners=args.runnel_runners, runnel_precision=args.runnel_precision, sf_args=args.sf_args)
    runs = run_interleaved(args.seeds, args.systems, lambda system, seed: run_one(system, seed, args))
    summarize(runs, args.systems)


if __name__ == "__main__":
    main()
