"""ALE Pong sampled by runnel's env runners (Nature CNN inference included) against a bare stepping loop.

Run: ``.venv/bin/python tests/benchmarks/atari.py [--rounds 5] [--seconds 5] [--no-ray] [--bf16] [--envpool]
[--profile 10]``.
Prints one JSON object per line:

1. ``machine``: CPU count, platform, load average, library versions.
2. ``cnn``: the acting forward pass of the default module (Nature CNN) on 8 observations of 84x84xk uint8,
   k = 1 (what the env gives) and k = 4 (what a 4-frame stack will give), ms per call on one torch thread.
3. ``sampling`` per round and case, in frames/s per core (a frame: one emulator frame; an env step is
   ``frame_skip`` = 4 of them). Cases:
     bare            8 ``ALE/Pong-v5`` envs with runnel's Atari preprocessing (``actors.env.atari.make_atari``)
                     stepped one after the other with random actions, no inference, nothing recorded: the
                     limit a sampler on one core can approach.
     runnel 1x8      one ``EnvRunner`` in this process, 8 envs, ``rollout_fragment_length`` 64, one torch
                     thread: each step one forward pass of the CNN on the 8 observations, the exploration,
                     the vector-env step, and the chunks cut at the end of each fragment.
     runnel 1x8 stack4  the same with 4-frame stacking (``pipeline.connectors.atari_frame_stack``): the CNN
                     gets 84x84x4 stacks; ``cost_over_unstacked`` in the summary is its time per step over
                     the plain runner's (the issue's bar: <= 1.1).
     runnel 2x8      two Ray env runner actors with 8 envs each (``algo.env_runner_group.sample``, chunks
                     encoded in the actors and decoded in the driver), measured at the driver; per core:
                     divided by the two runner processes.
     bare envpool, runnel 1x8 envpool  with ``--envpool`` (the extra ``runnel-rl[envpool]``): EnvPool's vector
                     env of the same game and preprocessing (``actors.env.envpool_atari``, one thread of its
                     own) stepped with random actions, and a runner stepping it (``gym_env_vectorize_mode=
                     "envpool"``). EnvPool steps on its own thread while the caller waits, so these lines
                     also carry ``frames_per_cpu_s`` (the process's threads together); the summary gives
                     ``runnel_over_bare_envpool`` beside ``runnel_over_bare``. ``bare envpool 2 threads``: the
                     same on two threads of its own, per core (its rate per runner is twice that).
   Rounds alternate the cases, so a shared machine's drift spreads over all of them.
   ``shipped_bytes``: bytes per step of the stacking runner's chunks as codec frames (plain and LZ4) against
   chunks that stored the stacks.
4. ``sampling_summary`` per case: the median over rounds, and ``runnel_over_bare`` (the issue's target: >= 0.7).
5. With ``--profile S``: ``profile`` lines, the functions where ``runnel 1x8`` (in bfloat16 with ``--bf16``) spends
   its time over S seconds
   (cProfile, by own time), and the share of the CNN forward pass and of the env steps.
"""
from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workers import emit, versions_of  # noqa: E402

ENV_ID = "ALE/Pong-v5"
NUM_ENVS = 8
FRAGMENT = 64
FRAME_SKIP = 4


def machine() -> None:
    import torch

    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(), processor=platform.processor(),
         load_avg=[round(x, 2) for x in os.getloadavg()], torch_threads=torch.get_num_threads(),
         versions={**versions_of(sys.executable), **{"ale-py": _version("ale-py")}})


def _version(name: str) -> str | None:
    import importlib.metadata as m

    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None


def cnn_cost(calls: int = 200) -> None:
    import gymnasium as gym
    import numpy as np
    import torch

    from actors.inference.forward import PolicyForward
    from actors.modules import ActorCriticModule

    torch.set_num_threads(1)
    for channels, precision in itertools.product((1, 4), ("float32", "bfloat16")):
        space = gym.spaces.Box(0, 255, (84, 84, channels), np.uint8)
        forward = PolicyForward(ActorCriticModule(space, gym.spaces.Discrete(6), inference_only=True),
                                precision=precision)
        obs = np.random.default_rng(0).integers(0, 256, (NUM_ENVS, 84, 84, channels), dtype=np.uint8)
        times = []
        with torch.inference_mode():
            for _ in range(20):
                forward.dist_inputs(obs, True)
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(calls // 5):
                    forward.dist_inputs(obs, True)
                times.append((time.perf_counter() - t0) / (calls // 5))
        emit(bench="cnn", channels=channels, batch=NUM_ENVS, precision=precision,
             ms_per_forward=round(1e3 * statistics.median(times), 3))


def bare_case():
    """8 preprocessed envs stepped in turn with random actions: env steps per call."""
    import numpy as np

    from actors.env.atari import make_atari

    envs = [make_atari(ENV_ID) for _ in range(NUM_ENVS)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    rng = np.random.default_rng(0)

    def sample() -> int:
        actions = rng.integers(6, size=(FRAGMENT, NUM_ENVS)).tolist()
        for row in actions:
            for env, a in zip(envs, row):
                _, _, terminated, truncated, _ = env.step(a)
                if terminated or truncated:
                    env.reset()
        return FRAGMENT * NUM_ENVS

    return sample, lambda: [env.close() for env in envs], 1


def bare_envpool_case(threads: int = 1):
    """EnvPool's vector env of the same game and preprocessing (``actors.env.envpool_atari``), ``threads`` of its
    own, random actions: env steps per call."""
    import numpy as np

    from actors.env.envpool_atari import make_envpool_atari

    env = make_envpool_atari(ENV_ID, NUM_ENVS, 0, {}, in_evaluation=False, num_threads=threads)
    env.reset()
    rng = np.random.default_rng(0)

    def sample() -> int:
        for row in rng.integers(6, size=(FRAGMENT, NUM_ENVS)):
            env.step(row)  # EnvPool resets ended envs itself
        return FRAGMENT * NUM_ENVS

    return sample, env.close, threads


def runner_case(precision: str = "float32", stack: bool = False, vectorize_mode: str = "auto"):
    """One ``EnvRunner`` in this process; ``stack``: with 4-frame stacking (``FrameStackingEnvToModule``): the CNN
    gets 84x84x4 stacks, the chunks keep one frame per step; ``vectorize_mode`` "envpool": EnvPool steps the
    envs (one thread of its own)."""
    from actors.env import EnvRunner, EnvRunnerSettings
    from pipeline.connectors import atari_frame_stack
    from pipeline.envs import env_creator

    runner = EnvRunner(EnvRunnerSettings(env_creator=env_creator(ENV_ID), num_envs=NUM_ENVS,
                                         rollout_fragment_length=FRAGMENT, seed=0, precision=precision,
                                         env_to_module=atari_frame_stack if stack else None,
                                         vectorize_mode=vectorize_mode),
                       worker_index=1)
    return (lambda: sum(len(c) for c in runner.sample())), runner.stop, 1


def stacked_runner_case(precision: str = "float32"):
    return runner_case(precision, stack=True)


def shipped_bytes() -> None:
    """Bytes per step of the chunks a runner ships (codec frames, uncompressed and LZ4), with 4-frame
    stacking as runnel does it (one frame per step, 3 look-back frames per chunk) against chunks that
    would store the stacks."""
    import dataclasses

    from actors.env import EnvRunner, EnvRunnerSettings
    from pipeline.connectors import FrameStackingEnvToModule, atari_frame_stack
    from pipeline.envs import env_creator
    from protocols.codec import encode

    runner = EnvRunner(EnvRunnerSettings(env_creator=env_creator(ENV_ID), num_envs=NUM_ENVS,
                                         rollout_fragment_length=FRAGMENT, seed=0, env_to_module=atari_frame_stack),
                       worker_index=1)
    chunks = runner.sample() + runner.sample()
    runner.stop()
    steps = sum(len(c) for c in chunks)
    view = FrameStackingEnvToModule(num_frames=4)
    stacked = [dataclasses.replace(c, obs=view.view_of(c.obs, c.look_back), look_back=None) for c in chunks]
    for compress in (False, True):
        one, four = len(encode(chunks, compress=compress)), len(encode(stacked, compress=compress))
        emit(bench="shipped_bytes", compress=compress, steps=steps, frame_bytes=84 * 84,
             bytes_per_step=round(one / steps), bytes_per_step_if_stacks_were_stored=round(four / steps),
             ratio=round(one / four, 3))


def ray_case(precision: str = "float32"):
    from pipeline import PPOConfig

    algo = (PPOConfig().environment(ENV_ID)
            .env_runners(num_env_runners=2, num_envs_per_env_runner=NUM_ENVS, rollout_fragment_length=FRAGMENT)
            .inference(precision=precision).debugging(seed=0).build(logdir=None))
    group = algo.env_runner_group
    return (lambda: sum(len(c) for c in group.sample(2 * NUM_ENVS * FRAGMENT, algo.metrics))), algo.stop, 2


def rate(sample, seconds: float) -> tuple[float, float]:
    """Env steps per second of ``sample()`` over at least ``seconds``, and per CPU-second of this process (its
    threads together: EnvPool's too)."""
    sample()  # warm-up: a fresh runner resets its envs
    steps, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        steps += sample()
    return steps / (time.perf_counter() - t0), steps / max(time.process_time() - c0, 1e-9)


def sampling(args: argparse.Namespace) -> None:
    import ray
    import torch

    torch.set_num_threads(1)
    makers = [("bare", bare_case), ("runnel 1x8", runner_case), ("runnel 1x8 stack4", stacked_runner_case)]
    if args.bf16:
        makers += [("runnel 1x8 bf16", lambda: runner_case("bfloat16")),
                   ("runnel 1x8 stack4 bf16", lambda: stacked_runner_case("bfloat16"))]
    if args.envpool:
        makers += [("bare envpool", bare_envpool_case), ("bare envpool 2 threads", lambda: bare_envpool_case(2)),
                   ("runnel 1x8 envpool", lambda: runner_case(vectorize_mode="envpool"))]
        if args.bf16:
            makers.append(("runnel 1x8 envpool bf16", lambda: runner_case("bfloat16", vectorize_mode="envpool")))
    if not args.no_ray:
        ray.init(address="local", include_dashboard=False, logging_level="ERROR", log_to_driver=False, num_cpus=4)
        makers.append(("runnel 2x8", ray_case))
        if args.bf16:
            makers.append(("runnel 2x8 bf16", lambda: ray_case("bfloat16")))
    figures: dict[str, list[float]] = {}
    built = []
    try:
        built = [(name, *make()) for name, make in makers]
        for rnd in range(args.rounds):
            for name, sample, _, cores in built:
                wall, cpu = rate(sample, args.seconds)
                per_core = FRAME_SKIP * wall / cores
                figures.setdefault(name, []).append(per_core)
                emit(bench="sampling", case=name, round=rnd, frames_per_s_per_core=round(per_core),
                     **({} if "2x8" in name else {"frames_per_cpu_s": round(FRAME_SKIP * cpu)}),  # Ray: the driver only
                     load_avg=round(os.getloadavg()[0], 2))
    finally:
        for _, _, close, _ in built:
            close()
        if ray.is_initialized():
            ray.shutdown()
    bare = statistics.median(figures["bare"])
    for name, rates in figures.items():
        med = statistics.median(rates)
        plain = statistics.median(figures["runnel 1x8 bf16" if "bf16" in name else "runnel 1x8"])
        extra = {"runnel_over_bare_envpool": round(med / statistics.median(figures["bare envpool"]), 3)} \
            if "runnel" in name and "envpool" in name else {}
        emit(bench="sampling_summary", case=name, median_frames_per_s_per_core=round(med),
             runnel_over_bare=round(med / bare, 3), rounds=len(rates), **extra,
             **({"cost_over_unstacked": round(plain / med, 3)} if "stack" in name else {}))


def profile(seconds: float, precision: str = "float32") -> None:
    import torch

    torch.set_num_threads(1)
    sample, close, _ = runner_case(precision)
    sample()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    while time.perf_counter() - t0 < seconds:
        sample()
    prof.disable()
    close()
    stats = pstats.Stats(prof)
    total = sum(row[2] for row in stats.stats.values())  # own times add up to the whole
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)

    def cumulative(match: str) -> float:
        return max((v[3] for (f, _, name), v in stats.stats.items() if match in f"{f}:{name}"), default=0.0)

    emit(bench="profile_share", total_s=round(total, 2),
         cnn_forward=round(cumulative("encoders.py:forward") / total, 3),
         env_steps=round(cumulative("vector_env.py:step") / total, 3),
         emulator=round(cumulative("ale_py/env.py:step") / total, 3),
         resize=round(cumulative("atari_wrappers.py:observation") / total, 3))
    for (f, line, name), (_, calls, own, cum, _) in rows[:15]:
        emit(bench="profile", function=f"{Path(f).name}:{line}({name})", calls=calls, own_s=round(own, 3),
             cum_s=round(cum, 3), own_share=round(own / total, 3))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=5.0, help="measuring time per case and round")
    p.add_argument("--no-ray", action="store_true", help="leave out the two Ray runner actors")
    p.add_argument("--bf16", action="store_true",
                   help="add each runnel case again with inference precision bfloat16 (on CPUs with AMX/AVX512-BF16)")
    p.add_argument("--envpool", action="store_true",
                   help="add EnvPool's Pong (runnel-rl[envpool]): its bare vector loop and a runner stepping it")
    p.add_argument("--profile", type=float, default=0.0, metavar="S",
                   help="also profile the in-process runner for S seconds")
    return p.parse_args()


def main() -> None:
    args = parse()
    machine()
    cnn_cost()
    shipped_bytes()
    sampling(args)
    if args.profile > 0:
        profile(args.profile, "bfloat16" if args.bf16 else "float32")


if __name__ == "__main__":
    main()
