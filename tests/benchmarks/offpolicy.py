"""Time to target: runnel's DQN, SAC and PPO vs RLlib 2.60's and Stable-Baselines3's tuned settings.

Run: ``.venv/bin/python tests/benchmarks/offpolicy.py [--systems runnel,rllib,sb3] [--algos dqn,sac]
[--seeds 0,1,2] [--max-minutes 30] [--quick] [--runnel-config JSON]``. ``--runnel-config`` puts config
keys over runnel's tuned file per algo, e.g. SAC with SB3's 256x256 networks:
``'{"sac": {"model_config": {"fcnet_hiddens": [256, 256], "fcnet_activation": "relu"}}}'``.
Prints one JSON object per line:

1. ``machine``: CPU count, platform, library versions (runnel's venv and the anchors venv), and
   the task of each algo (env, target, env-step budget, smoothing window) as read from the tuned files.
2. ``run`` per (seed, algo, system), in that order (systems interleaved, so that drift of a shared
   machine spreads over all of them): ``reached`` (bool), ``env_steps`` (sampled when it stopped),
   ``wall_s`` (from before building the algorithm -- Ray start included where there is one -- to
   the stop), ``build_s`` (that build alone), ``train_s``, ``iterations``, ``last_return``
   (the smoothed return last seen), ``stop`` (``target``, ``budget``, ``timeout`` or ``error``).
3. ``summary`` per (system, algo): runs, runs that reached the target, medians of ``wall_s`` and
   ``env_steps`` over the runs that reached it (and of ``wall_s`` over all runs), and for the
   other systems ``runnel_over_<system>``: runnel's median / theirs (< 1: runnel needs less).

Tasks (target, budget and smoothing come from runnel's tuned files, read when the run starts):
  dqn  CartPole-v1, ``env_runners/episode_return_mean >= 450`` within 200_000 env steps
       (``tuned/cartpole-dqn.yaml``; mean of the last 100 episodes).
  sac  Pendulum-v1, ``>= -250`` within 20_000 env steps (``tuned/pendulum-sac.yaml``; last 5 episodes).
  ppo  CartPole-v1, ``>= 450`` within 400_000 env steps (``tuned/cartpole-ppo.yaml``; last 100 episodes);
       runnel and sb3 only.

Systems, each run in its own subprocess (killed, with its process group, after ``--max-minutes``;
then reported ``reached: false``, ``stop: timeout``, with the last progress it printed):
  runnel  ``pipeline.get_algorithm(algo)[0]()``, ``.environment(env)``,
          ``.update_from_dict(tuned["config"])``, ``.debugging(seed=s)``, ``.build()``, then
          ``algo.train()`` until the tuned file's stop criteria; this venv's Python.
  rllib   RLlib 2.60's tuned examples, written here as ray-project/ray's
          ``rllib/examples/algorithms/dqn/cartpole_dqn.py`` and ``.../sac/pendulum_sac.py`` (formerly
          ``rllib/tuned_examples/...``; not shipped in the wheel) configure them, plus what their
          ``run_rllib_example_script_experiment`` adds with default arguments (torch, no GPUs);
          new API stack, ``num_env_runners`` left at the example's (the default, 0: sampling in the
          driver); ``algo.train()`` until ``env_runners/episode_return_mean >= target`` or
          ``env_runners/num_env_steps_sampled_lifetime >= budget``; the anchors venv's Python.
  sb3     Stable-Baselines3's DQN and SAC with RL-Baselines3-Zoo's hyperparameters (see ``ZOO``),
          ``learn(total_timesteps=budget)`` with a callback that stops when the mean return of the
          last N finished training episodes (N: the smoothing window above; fewer while fewer have
          finished, as RLlib and runnel do) reaches the target. SB3 checks after every env step,
          runnel and RLlib after each ``train()`` iteration. The anchors venv's Python.

``--quick`` (smoke test): budgets of 2_000 (dqn) / 1_200 (sac) env steps and 3 minutes per run;
targets unchanged, so runs end ``stop: budget``.

``--torch-threads`` (default 1) sets ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` for every worker (all
three systems alike; 0 leaves the libraries' defaults). On this 2-core machine, shared with other
work, torch's default of 2 intra-op threads made SB3's and runnel's SAC updates 3-10x slower
(OpenMP threads waiting on busy cores) than one thread.

How to set up the anchors (a separate venv outside the repository; RLlib, SB3 and this torch
are never runnel dependencies)::

    python3 -m venv /work/anchors-venv
    # torch first and by itself: the local CPU wheel of exactly this version
    /work/anchors-venv/bin/pip install "torch==2.13.0"
    # then the rest, with torch pinned so pip can never pick another (CUDA) build
    echo "torch==2.13.0" > /work/anchors-constraints.txt
    /work/anchors-venv/bin/pip install -c /work/anchors-constraints.txt \\
        "ray[rllib]==2.60.0" "stable-baselines3>=2.3,<3" "gymnasium>=1.0,<2"
    /work/anchors-venv/bin/python -c "import ray.rllib, stable_baselines3, torch; print(torch.__version__)"
    # resolved here: torch 2.13.0+cpu, ray 2.60.0, stable-baselines3 2.9.2, gymnasium 1.2.2, numpy 2.4.6

    .venv/bin/python tests/benchmarks/offpolicy.py --quick --seeds 0     # smoke test, a few minutes
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from workers import Progress, emit, finish, median_of, num, run_worker, train_to_target, versions_of, worker_env

ROOT = Path(__file__).resolve().parents[2]
ANCHORS_PYTHON = "/work/anchors-venv/bin/python"
TUNED = {"dqn": ROOT / "tuned" / "cartpole-dqn.yaml", "sac": ROOT / "tuned" / "pendulum-sac.yaml",
         "ppo": ROOT / "tuned" / "cartpole-ppo.yaml"}
RETURN_KEY = "env_runners/episode_return_mean"
QUICK_BUDGET = {"dqn": 2_000, "sac": 1_200, "ppo": 4_000}

# RL-Baselines3-Zoo's hyperparameters, from DLR-RM/rl-baselines3-zoo hyperparams/dqn.yml
# ("CartPole-v1", marked "Almost Tuned") and hyperparams/sac.yml ("Pendulum-v1": only n_timesteps
# and learning_rate set, everything else SB3's SAC defaults: buffer 1e6, batch 256, tau 0.005,
# gamma 0.99, train_freq 1, gradient_steps 1, learning_starts 100, ent_coef "auto", net_arch [256, 256]).
ZOO = {
    "dqn": {"env": "CartPole-v1", "cls": "DQN", "n_timesteps": 5e4, "policy": "MlpPolicy",
            "kwargs": dict(learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1000,
                           gamma=0.99, target_update_interval=10, train_freq=256, gradient_steps=128,
                           exploration_fraction=0.16, exploration_final_eps=0.04,
                           policy_kwargs=dict(net_arch=[256, 256]))},
    "sac": {"env": "Pendulum-v1", "cls": "SAC", "n_timesteps": 20_000, "policy": "MlpPolicy",
            "kwargs": dict(learning_rate=1e-3)},
    # hyperparams/ppo.yml, "CartPole-v1" (marked "Tuned"); learning_rate and clip_range are "lin_0.001" and
    # "lin_0.2": linear from that value to 0 over the zoo's n_timesteps (``linear`` below keeps them so in env steps)
    "ppo": {"env": "CartPole-v1", "cls": "PPO", "n_timesteps": 1e5, "policy": "MlpPolicy", "n_envs": 8,
            "linear": {"learning_rate": 1e-3, "clip_range": 0.2},
            "kwargs": dict(n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20, ent_coef=0.0)},
}


def worker_runnel(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    import yaml

    from pipeline import get_algorithm
    from pipeline.algorithm_results import lookup

    spec = yaml.safe_load(Path(a.tuned).read_text())
    t0 = time.perf_counter()
    config = get_algorithm(spec["algo"])[0]().environment(spec["env"])
    config.update_from_dict(spec["config"])
    if a.runnel_config:
        config.update_from_dict(a.runnel_config)
    config.debugging(seed=a.seed)
    algo = config.build()

    def read(result: dict) -> tuple[int, float | None]:
        return int(lookup(result, "num_env_steps_sampled_lifetime") or 0), num(lookup(result, RETURN_KEY))
    train_to_target(a.budget, a.target, t0, algo.train, algo.stop, read)


def rllib_config(algo: str, seed: int):
    """The tuned examples' configs (ray 2.60's ``rllib/examples/algorithms/...``), ``args`` at defaults."""
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    num_learners = None  # the example's --num-learners default
    if algo == "dqn":
        # rllib/examples/algorithms/dqn/cartpole_dqn.py (default_reward=450, default_timesteps=200_000).
        # Its stored copies differ only in the epsilon schedule's end (10_000 in an older one,
        # 25_000 in the newest one found, whose docstring still says 10,000): 25_000 here.
        from ray.rllib.algorithms.dqn import DQNConfig

        config = (
            DQNConfig()
            .environment(env="CartPole-v1")
            .training(
                lr=0.0005 * (num_learners or 1) ** 0.5,
                train_batch_size_per_learner=32,
                replay_buffer_config={
                    "type": "PrioritizedEpisodeReplayBuffer",
                    "capacity": 50_000,
                    "alpha": 0.6,
                    "beta": 0.4,
                },
                n_step=(2, 5),
                double_q=True,
                dueling=True,
                epsilon=[(0, 1.0), (25_000, 0.02)],
            )
            .rl_module(
                model_config=DefaultModelConfig(
                    fcnet_hiddens=[256],
                    fcnet_activation="tanh",
                    fcnet_bias_initializer="zeros_",
                    head_fcnet_hiddens=[256],
                    head_fcnet_bias_initializer="zeros_",
                ),
            )
        )
    else:
        # rllib/examples/algorithms/sac/pendulum_sac.py (default_reward=-250, default_timesteps=20_000).
        from torch import nn
        from ray.rllib.algorithms.sac.sac import SACConfig

        config = (
            SACConfig()
            .environment("Pendulum-v1")
            .training(
                initial_alpha=1.001,
                actor_lr=2e-4 * (num_learners or 1) ** 0.5,
                critic_lr=8e-4 * (num_learners or 1) ** 0.5,
                alpha_lr=9e-4 * (num_learners or 1) ** 0.5,
                lr=None,
                target_entropy="auto",
                n_step=(2, 5),
                tau=0.005,
                train_batch_size_per_learner=256,
                target_network_update_freq=1,
                replay_buffer_config={
                    "type": "PrioritizedEpisodeReplayBuffer",
                    "capacity": 100000,
                    "alpha": 1.0,
                    "beta": 0.0,
                },
                num_steps_sampled_before_learning_starts=256 * (num_learners or 1),
            )
            .rl_module(
                model_config=DefaultModelConfig(
                    fcnet_hiddens=[256, 256],
                    fcnet_activation="relu",
                    fcnet_kernel_initializer=nn.init.xavier_uniform_,
                    head_fcnet_hiddens=[],
                    head_fcnet_activation=None,
                    head_fcnet_kernel_initializer="orthogonal_",
                    head_fcnet_kernel_initializer_kwargs={"gain": 0.01},
                    fusionnet_hiddens=[256, 256, 256],
                    fusionnet_activation="relu",
                ),
            )
            .reporting(metrics_num_episodes_for_smoothing=5)
        )
    # What run_rllib_example_script_experiment does with its default arguments on a CPU machine.
    config.framework("torch")
    config.resources(num_gpus=0)
    config.learners(num_gpus_per_learner=0)
    config.debugging(seed=seed)
    return config


def worker_rllib(a: argparse.Namespace) -> None:
    import ray

    config = rllib_config(a.algo, a.seed)
    t0 = time.perf_counter()
    ray.init(address="local", ignore_reinit_error=True)
    algo = config.build_algo()

    def read(result: dict) -> tuple[int, float | None]:
        env = result.get("env_runners", {})
        steps = int(env.get("num_env_steps_sampled_lifetime") or result.get("num_env_steps_sampled_lifetime") or 0)
        return steps, num(env.get("episode_return_mean"))  # absent in iterations that finished no episode

    def stop() -> None:
        algo.stop()
        ray.shutdown()
    train_to_target(a.budget, a.target, t0, algo.train, stop, read, num_env_runners=config.num_env_runners)


def worker_sb3(a: argparse.Namespace) -> None:
    import numpy as np
    import stable_baselines3
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env

    zoo = ZOO[a.algo]
    kwargs = dict(zoo["kwargs"])
    if "exploration_fraction" in kwargs:
        # A fraction of learn()'s total_timesteps: keep the zoo's schedule in env steps
        # (0.16 * 50_000 = 8_000) however long the budget here is.
        kwargs["exploration_fraction"] = min(1.0, kwargs["exploration_fraction"] * zoo["n_timesteps"] / a.budget)

    class StopAtMeanReturn(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.returns: list[float] = []
            self.reached = False

        def _on_step(self) -> bool:
            for info in self.locals.get("infos", ()):
                ep = info.get("episode")
                if ep is not None:
                    self.returns.append(float(ep["r"]))
                    mean = float(np.mean(self.returns[-a.smoothing:]))
                    progress(self.num_timesteps, mean, len(self.returns))
                    if mean >= a.target:
                        self.reached = True
                        return False
            return True

    for key, start in zoo.get("linear", {}).items():
        # SB3 calls schedules with the fraction of learn()'s total_timesteps left; the zoo's reach 0 at its own
        # n_timesteps, so that is where they reach 0 here too, whatever the budget
        kwargs[key] = lambda left, start=start: start * max(0.0, 1.0 - (1.0 - left) * a.budget / zoo["n_timesteps"])

    t0 = time.perf_counter()
    env = make_vec_env(zoo["env"], n_envs=zoo.get("n_envs", 1), seed=a.seed)  # Monitor-wrapped: infos carry "episode"
    model = getattr(stable_baselines3, zoo["cls"])(zoo["policy"], env, seed=a.seed, device="cpu", verbose=0, **kwargs)
    build_s = time.perf_counter() - t0
    progress = Progress(t0)
    cb = StopAtMeanReturn()
    model.learn(total_timesteps=a.budget, callback=cb)
    ret = float(np.mean(cb.returns[-a.smoothing:])) if cb.returns else None
    finish(a.budget, t0, build_s, cb.reached, model.num_timesteps, ret, len(cb.returns), episodes=len(cb.returns),
           sb3_kwargs={k: v for k, v in kwargs.items() if k != "policy_kwargs" and not callable(v)})
    env.close()


# --- driver -------------------------------------------------------------------------------------------
def task(algo: str, quick: bool) -> dict:
    import yaml

    spec = yaml.safe_load(TUNED[algo].read_text())
    stop = spec.get("stop") or {}

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    stop = flat(stop)
    budget = int(stop["num_env_steps_sampled_lifetime"])
    if quick:
        budget = min(budget, QUICK_BUDGET[algo])
    return {"algo": algo, "env": spec["env"], "tuned": str(TUNED[algo]), "target": float(stop[RETURN_KEY]),
            "budget": budget, "smoothing": int(spec.get("config", {}).get("metrics_num_episodes_for_smoothing", 100))}


def run_one(system: str, t: dict, seed: int, args: argparse.Namespace) -> dict:
    python = sys.executable if system == "runnel" else args.anchors_python
    cmd = [python, str(Path(__file__).resolve()), "--worker", system, "--algos", t["algo"], "--seeds", str(seed),
           "--worker-target", str(t["target"]), "--budget", str(t["budget"]), "--smoothing", str(t["smoothing"]),
           "--tuned", t["tuned"]]
    if system == "runnel" and t["algo"] in args.runnel_config:
        cmd += ["--runnel-config", json.dumps(args.runnel_config[t["algo"]])]
    base = {"bench": "run", "system": system, "algo": t["algo"], "env": t["env"], "seed": seed,
            "target": t["target"], "budget": t["budget"], "smoothing": t["smoothing"]}
    return run_worker(cmd, base, env=worker_env(args.torch_threads, anchor=system != "runnel"),
                      cwd=str(ROOT) if system == "runnel" else "/tmp", max_minutes=args.max_minutes,
                      verbose=args.verbose, label=f"{system} {t['algo']} seed {seed}")


def summarize(runs: list[dict], systems: list[str], algos: list[str]) -> None:
    table = {}
    for algo in algos:
        for system in systems:
            rs = [r for r in runs if r["system"] == system and r["algo"] == algo]
            ok = [r for r in rs if r.get("reached")]
            table[(system, algo)] = {
                "runs": len(rs), "reached": len(ok),
                "median_wall_s": median_of([r.get("wall_s") for r in ok]),
                "median_env_steps": median_of([r.get("env_steps") for r in ok]),
                "median_wall_s_all_runs": median_of([r.get("wall_s") for r in rs]),
                "median_build_s": median_of([r.get("build_s") for r in rs]),
            }
    for algo in algos:
        mine = table.get(("runnel", algo))
        for system in systems:
            row = dict(table[(system, algo)])
            if system != "runnel" and mine is not None:
                for fig in ("median_wall_s", "median_env_steps"):
                    a, b = mine[fig], row[fig]
                    row[f"runnel_over_{system}_{fig[7:]}"] = round(a / b, 3) if a and b else None
            emit(bench="summary", system=system, algo=algo, **row)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="runnel,rllib,sb3")
    p.add_argument("--algos", default="dqn,sac")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="per run; a run still going is killed and reported not reached (default 30, --quick 3)")
    p.add_argument("--quick", action="store_true", help="smoke test: budgets 2_000/1_200 env steps, 3 minutes a run")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="OMP_NUM_THREADS/MKL_NUM_THREADS for every worker (0: libraries' defaults)")
    p.add_argument("--anchors-python", default=ANCHORS_PYTHON, help="the anchors venv's python (rllib, sb3)")
    p.add_argument("--targets", default="",
                   help="override targets for a smoke test of the reached path, e.g. dqn=25,sac=-1400")
    p.add_argument("--runnel-config", default="",
                   help='JSON config keys over the tuned file for runnel, per algo, e.g. '
                        '\'{"sac": {"model_config": {"fcnet_hiddens": [256, 256]}}}\'')
    p.add_argument("--verbose", action="store_true", help="pass the workers' output and progress to stderr")
    # internal: one run in a worker process
    p.add_argument("--worker", choices=["runnel", "rllib", "sb3"], help=argparse.SUPPRESS)
    p.add_argument("--worker-target", dest="target", type=float, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--smoothing", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tuned", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.systems = [s for s in args.systems.split(",") if s]
    args.algos = [s for s in args.algos.split(",") if s]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    for name, vals, ok in (("--systems", args.systems, {"runnel", "rllib", "sb3"}), ("--algos", args.algos, set(TUNED))):
        if not vals or set(vals) - ok:
            p.error(f"{name} takes a comma-separated subset of {sorted(ok)}, got {vals}")
    try:
        args.targets = {k: float(v) for k, v in (kv.split("=") for kv in args.targets.split(",") if kv)}
    except ValueError:
        p.error(f"--targets takes algo=value pairs like dqn=25,sac=-1400, got {args.targets!r}")
    if set(args.targets) - set(TUNED):
        p.error(f"--targets: unknown algo(s) {sorted(set(args.targets) - set(TUNED))}")
    try:
        args.runnel_config = json.loads(args.runnel_config) if args.runnel_config else {}
    except json.JSONDecodeError as err:
        p.error(f"--runnel-config takes JSON like {{\"sac\": {{...}}}}: {err}")
    if not isinstance(args.runnel_config, dict) or (not args.worker and set(args.runnel_config) - set(TUNED)):
        p.error(f"--runnel-config takes {{algo: {{key: value}}}} with algo in {sorted(TUNED)}, got {args.runnel_config!r}")
    if args.max_minutes is None:
        args.max_minutes = 3.0 if args.quick else 30.0
    return args


def main() -> None:
    args = parse()
    if args.worker:
        args.algo, args.seed = args.algos[0], args.seeds[0]
        {"runnel": worker_runnel, "rllib": worker_rllib, "sb3": worker_sb3}[args.worker](args)
        return
    tasks = {algo: task(algo, args.quick) for algo in args.algos}
    for algo, target in args.targets.items():
        if algo in tasks:
            tasks[algo]["target"], tasks[algo]["target_overridden"] = target, True
    if "ppo" in args.algos and "rllib" in args.systems:
        raise SystemExit("--algos ppo runs with --systems runnel,sb3 (RLlib's PPO example asks for 4 env runners "
                         "and a learner: more CPUs than this benchmark's machines have)")
    anchors = any(s != "runnel" for s in args.systems)
    emit(bench="machine", cpu_count=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
         loadavg=os.getloadavg(), versions=versions_of(sys.executable),
         anchors={"python": args.anchors_python, **versions_of(args.anchors_python)} if anchors else None,
         tasks=tasks, runnel_config=args.runnel_config, systems=args.systems, seeds=args.seeds, max_minutes=args.max_minutes, quick=args.quick,
         torch_threads=args.torch_threads or "library default")
    runs = []
    for seed in args.seeds:
        for algo in args.algos:
            for system in args.systems:
                r = run_one(system, tasks[algo], seed, args)
                emit(**r)
                runs.append(r)
    summarize(runs, args.systems, args.algos)


if __name__ == "__main__":
    main()
