"""An env runner stepping EnvPool's vector envs against gymnasium's: which vector env to ask for.

Run: ``.venv/bin/python tests/benchmarks/envpool_sampling.py [--envs CartPole-v1,Acrobot-v1,Pendulum-v1]
[--num-envs 32] [--rounds 3] [--seconds 2]`` (needs the optional extra: ``pip install 'runnel-rl[envpool]'``).
One process, one torch thread; for each env id and each ``gym_env_vectorize_mode`` -- ``auto`` (the id's own
gymnasium vector implementation where it has one, else ``sync``), ``sync`` (separate gymnasium envs) and
``envpool`` -- an in-process ``EnvRunner`` with PPO's default module (acting with numpy) samples fragments for
``--seconds`` of CPU time; rounds alternate the modes. Prints JSON lines: ``machine``, one ``case`` per (env,
mode, round) in env steps per CPU-second of this process (EnvPool's own threads count: it is the process's CPU
time), and one ``summary`` per env with the medians and each round's envpool / auto and envpool / sync ratios.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workers import emit, versions_of  # noqa: E402

MODES = ("auto", "sync", "envpool")


def make_runner(env_id: str, mode: str, num_envs: int):
    from actors.env import EnvRunner, EnvRunnerSettings
    from actors.env.creators import GymMaker
    settings = EnvRunnerSettings(env_creator=GymMaker(env_id), num_envs=num_envs, vectorize_mode=mode,
                                 rollout_fragment_length=64, seed=0)
    return EnvRunner(settings, worker_index=1)


def rate(runner, seconds: float) -> float:
    runner.sample()  # warm: the first reset and the first pass of the module
    steps, c0 = 0, time.process_time()
    while time.process_time() - c0 < seconds:
        steps += sum(len(c) for c in runner.sample())
    return steps / (time.process_time() - c0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--envs", default="CartPole-v1,Acrobot-v1,Pendulum-v1")
    p.add_argument("--num-envs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0, help="CPU seconds per case per round")
    args = p.parse_args()
    import torch
    torch.set_num_threads(1)
    emit(bench="machine", cpu_count=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
         loadavg=os.getloadavg(), versions={**versions_of(sys.executable), **_envpool_version()},
         num_envs=args.num_envs, rounds=args.rounds, seconds=args.seconds)
    for env_id in [e for e in args.envs.split(",") if e]:
        runners = {mode: make_runner(env_id, mode, args.num_envs) for mode in MODES}
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in MODES:
                value = rate(runners[mode], args.seconds)
                rates[mode].append(value)
                emit(bench="case", env=env_id, mode=mode, round=r, env_steps_per_cpu_s=round(value))
        ratios = {f"envpool_over_{m}": [round(e / o, 3) for e, o in zip(rates["envpool"], rates[m])]
                  for m in ("auto", "sync")}
        emit(bench="summary", env=env_id, num_envs=args.num_envs,
             **{f"{m}_median": round(statistics.median(v)) for m, v in rates.items()},
             **{k: {"median": statistics.median(v), "rounds": v} for k, v in ratios.items()},
             auto_is=type(runners["auto"].env).__name__)


def _envpool_version() -> dict:
    try:
        import envpool
        return {"envpool": envpool.__version__}
    except ImportError:
        raise SystemExit("needs EnvPool: pip install 'runnel-rl[envpool]'") from None


if __name__ == "__main__":
    main()
