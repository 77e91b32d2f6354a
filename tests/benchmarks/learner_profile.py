"""Where a learner update's time goes: wall time per update, and torch's profiler over a few updates.

The Pong run on an H200 (2026-12-04) was bound by its learner: 61 ms per APPO update of a 500-step batch
(8 SGD steps of 125 frames), far more than the GPU's arithmetic. This script says how much of an update is
the device working and how much is the host launching, copying and waiting. One algorithm is built in this
process with the learner on ``--device`` (the GPU when there is one), one batch is sampled once, and the
learner updates on it again and again. Prints one JSON object per line:

  {"bench": "machine", ...}
  {"bench": "update_ms", "workload", "algo", "device", "precision", "p50", "min", "max", "n"}   wall time per update
  {"bench": "profile", ..., "updates", "wall_ms_per_update", "device_busy_ms_per_update", "device_busy_share",
   "ops_per_update", "syncs_per_update"}   from the profiled updates: the device's kernel time beside the
        wall time (a share far below 1: host-bound), aten ops called and host-device syncs per update
        (``aten::_local_scalar_dense``, ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``)
  {"bench": "top_op", ..., "by", "rank", "name", "calls_per_update", "self_cpu_ms_per_update",
   "self_device_ms_per_update"}   the ``--top`` ops by host time and by device time

    python tests/benchmarks/learner_profile.py [--algos appo,ppo] [--workloads frames_cnn,cartpole_mlp]
        [--device cuda] [--precision bfloat16] [--updates 10] [--profile-updates 3]

Workloads as in ``learner_precision.py``: "frames_cnn" (84x84x4 uint8 frames, the Nature CNN) and
"cartpole_mlp"; 500 steps a batch in minibatches of 125, 2 epochs (the Pong file's sizes).
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

from workers import emit  # noqa: E402

WORKLOADS = {"frames_cnn": "tests.envs:FrameEnv", "cartpole_mlp": "CartPole-v1"}
BATCH, MINIBATCH = 500, 125
SYNC_OPS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def build(algo: str, env: str, device: str, precision: str):
    from pipeline import APPOConfig, PPOConfig

    config = (PPOConfig() if algo == "ppo" else APPOConfig()).environment(env)
    config.env_runners(num_env_runners=0, num_envs_per_env_runner=4, rollout_fragment_length=BATCH // 4)
    config.training(train_batch_size_per_learner=BATCH, minibatch_size=MINIBATCH, num_epochs=2)
    config.learners(learner_precision=precision, num_gpus_per_learner=1 if device == "cuda" else 0)
    return config.debugging(seed=0).build(logdir=None)


def device_ms(event) -> float:
    """An op's own time on the device, in ms (the attribute's name moved between torch releases)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return value / 1e3
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algos", default="appo")
    p.add_argument("--workloads", default="frames_cnn")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when torch sees one)")
    p.add_argument("--precision", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--updates", type=int, default=10, help="timed updates (after two to warm up)")
    p.add_argument("--profile-updates", type=int, default=3)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from actors.metrics import MetricsLogger

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(), torch=torch.__version__,
         cuda=torch.cuda.get_device_name(0) if cuda else None, torch_threads=torch.get_num_threads(),
         load_avg=[round(x, 2) for x in os.getloadavg()])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for workload in args.workloads.split(","):
        for algo_name in args.algos.split(","):
            algo = build(algo_name, WORKLOADS[workload], device, args.precision)
            tags = dict(workload=workload, algo=algo_name, device=device, precision=args.precision)
            try:
                chunks = algo.env_runner_group.sample(BATCH, MetricsLogger())
                learner = algo.learner_group.local
                times = []
                for i in range(2 + args.updates):
                    sync()
                    t0 = time.perf_counter()
                    learner.update(list(chunks), BATCH)
                    sync()
                    if i >= 2:
                        times.append(1e3 * (time.perf_counter() - t0))
                emit(bench="update_ms", **tags, p50=round(statistics.median(times), 2), min=round(min(times), 2),
                     max=round(max(times), 2), n=len(times))
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                n = args.profile_updates
                with profile(activities=activities) as prof:
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        learner.update(list(chunks), BATCH)
                    sync()
                    wall = 1e3 * (time.perf_counter() - t0) / n
                events = prof.key_averages()
                # the kernels' own rows (an op's row also counts the kernels it launched: summing both would count twice)
                kernels = sum(device_ms(e) for e in events if "CUDA" in str(getattr(e, "device_type", ""))) / n
                emit(bench="profile", **tags, updates=n, wall_ms_per_update=round(wall, 2),
                     device_busy_ms_per_update=round(kernels, 2) if cuda else None,
                     device_busy_share=round(kernels / wall, 3) if cuda else None,
                     ops_per_update=round(sum(e.count for e in events if e.key.startswith("aten::")) / n, 1),
                     syncs_per_update=round(sum(e.count for e in events if e.key in SYNC_OPS) / n, 1))
                rankings = [("self_cpu", lambda e: e.self_cpu_time_total)]
                if cuda:
                    rankings.append(("self_device", device_ms))
                for by, key in rankings:
                    for rank, e in enumerate(sorted(events, key=key, reverse=True)[:args.top]):
                        emit(bench="top_op", **tags, by=by, rank=rank, name=e.key,
                             calls_per_update=round(e.count / n, 1),
                             self_cpu_ms_per_update=round(e.self_cpu_time_total / 1e3 / n, 3),
                             self_device_ms_per_update=round(device_ms(e) / n, 3) if cuda else None)
            finally:
                algo.stop()


if __name__ == "__main__":
    main()
