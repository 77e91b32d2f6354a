"""Central vs local inference: env steps sampled per second, and an inference server's round trips.

Prints one JSON object per line:
  {"bench": "machine", ...}
  {"bench": "sampling", "workload": "frames_cnn"|"cartpole_mlp", "mode": "local"|"central"|"central_double",
   "device",
   "runners", "envs", "repeat", "env_steps_per_s"; central: "batch_size_mean" (rows per forward pass),
   "batch_ms_mean" (a server's time per batch: forward pass, exploration, answers), "shm_share" (the share
   of requests whose observations came through shared memory)}
        ``runners`` env runner actors x ``envs`` sub-envs each, sampled through the env runner group (no
        training): "frames_cnn" is an 84x84x4 uint8 frame env that costs next to nothing to step
        (``tests.envs.FrameEnv``) with the default CNN; "cartpole_mlp" CartPole-v1 with PPO's default
        MLP. "local": every runner runs its own module (one torch thread each); "central": ``--servers``
        inference servers (``--server-cpus`` torch threads each) act for them, one request out per runner
        (the default); "central_double": the same with runners double-buffering (half their sub-envs step
        while the other half's actions are inferred; ``--double-buffer off,on`` runs both). Modes alternate
        within each repeat. (Results files of 2026-11-27 named these "central_single" and "central".)
  {"bench": "round_trip", "workload", "device", "batch", "transport", "p50_ms", "p99_ms", "n"}
        one client sending ``batch`` observations at a time to a server actor and waiting for the answer
        (encode, ZeroMQ over loopback, decode, forward pass, exploration, answer); transport "shm": the
        observations through /dev/shm (the client shares the server's node; CartPole's are too small and
        go inline anyway), "inline": in the frame
  {"bench": "cnn_rows", "workload": "frames_cnn", "device": "cpu", "batch", "ms_per_pass", "us_per_row"}
        the frame workload's acting pass on one torch thread at each ``--cnn-batches`` size; then
  {"bench": "cnn_rows_summary", "runner_batch", "runner_us_per_row", "best_batch", "best_us_per_row",
   "runner_row_cost_over_best"}   the most a server's larger batches can save per row over a runner's own
        ``--envs`` rows: on the CPU, what central inference can buy for a CNN-bound workload
  {"bench": "server_parts", "workload": "frames_cnn", "device", "rows", "requests", "read_inline",
   "read_shm", "gather", "forward", "choose", "answers", "host_copies_before", "host_copies_over_before"}
        a server's batch (``--runners`` requests of ``--envs`` frames) piece by piece in this process, median
        ms: where its time goes ("read_shm" maps and checks, "gather" copies; before 2026-12-04 the server
        copied each frame three times on a GPU, twice on a CPU: "host_copies_before", same run)
  {"bench": "summary", ...}          medians, central / local per workload (of the medians, and the median of
                                     each repeat's central / local)
  GPU section (only where torch sees CUDA; runs unchanged on a GPU machine):
  {"bench": "sampling", ..., "mode": "central", "device": "cuda", "servers"}   ``--gpu-servers`` servers
                                     sharing the GPU (each a run)
  {"bench": "round_trip", ..., "device": "cuda"}
  {"bench": "appo_frames", "device": "cuda", "env_steps_per_s", "per_cpu_core", "cpus"}
        APPO end to end on the frame env: runners stream, the server acts on the GPU, the learner trains
        on the GPU; env steps sampled per second over ``--seconds`` after a warm-up, and per CPU core
        (Sample Factory reports about 3.8k frames/s per core for Atari).

    python tests/benchmarks/inference.py [--seconds 8] [--repeats 3] [--runners 8] [--envs 4]
        [--workloads frames_cnn,cartpole_mlp] [--cpu-modes local,central] [--precisions float32,bfloat16]
        [--skip-gpu]
    (tests/benchmarks/gpu_check.sh runs a short pass on a GPU machine: frames_cnn, 2 s a point)
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from actors.env import EnvRunnerSettings  # noqa: E402
from actors.inference.client import RemoteActing  # noqa: E402
from actors.inference.directory import InferenceDirectory  # noqa: E402
from actors.inference.server import InferenceServer  # noqa: E402
from actors.inference.settings import InferenceClientSettings, InferenceSettings  # noqa: E402
from actors.metrics import MetricsLogger  # noqa: E402
from actors.modules import ActorCriticModule  # noqa: E402
from pipeline import APPOConfig, PPOConfig  # noqa: E402
from tests.envs import FrameEnv  # noqa: E402

WORKLOADS = {"frames_cnn": FrameEnv, "cartpole_mlp": "CartPole-v1"}


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def sampling_rate(workload: str, mode: str, device: str, args: argparse.Namespace, gpu_servers: int = 1,
                  double_buffer: bool = False, precision: str = "float32") -> tuple[float, dict]:
    """Env steps per second the runner group samples (median over ``--seconds`` of sample calls), and the
    servers' mean batch size and milliseconds per batch (central)."""
    steps = args.runners * args.envs * args.fragment
    config = (PPOConfig().environment(WORKLOADS[workload])
              .env_runners(num_env_runners=args.runners, num_envs_per_env_runner=args.envs,
                           rollout_fragment_length=args.fragment)
              .training(train_batch_size_per_learner=steps, minibatch_size=min(128, steps))
              .inference(precision=precision))
    if mode == "central":
        cuda = device == "cuda"  # ``gpu_servers`` sharing the GPU; on CPU, a server per core (at most one per runner)
        config.inference(mode="central", num_inference_servers=gpu_servers if cuda else min(args.servers, args.runners),
                         num_cpus_per_inference_server=args.server_cpus, max_batch=args.runners * args.envs,
                         max_wait_s=args.max_wait_s, shared_memory=not args.no_shm, double_buffer=double_buffer,
                         num_gpus_per_inference_server=1 / gpu_servers if cuda else 0)
    algo = config.build(logdir=None)
    try:
        group, metrics = algo.env_runner_group, MetricsLogger()
        for _ in range(2):  # warm-up: first forward passes, socket connections
            group.sample(steps, metrics)
        rates, started = [], time.perf_counter()
        while time.perf_counter() - started < args.seconds:
            t = time.perf_counter()
            got = sum(len(c) for c in group.sample(steps, metrics))
            rates.append(got / (time.perf_counter() - t))
        served_stats = {}
        if group.inference is not None:
            served = [r.value for r in group.inference.manager.foreach_actor("get_metrics") if r.ok]
            actions = sum(m["inference/num_actions"]["value"] for m in served)
            batches = max(1, sum(m["inference/num_batches"]["value"] for m in served))
            requests = max(1, sum(m["inference/num_requests"]["value"] for m in served))
            served_stats = {"batch_size_mean": round(actions / batches, 1),
                            "shm_share": round(sum(m["inference/num_shm_requests"]["value"] for m in served)
                                               / requests, 2),
                            "batch_ms_mean": round(statistics.mean(
                                m["inference/batch_ms_mean"]["sum"] / max(1, m["inference/batch_ms_mean"]["count"])
                                for m in served if "inference/batch_ms_mean" in m), 3)}
        return statistics.median(rates), served_stats
    finally:
        algo.stop()


def round_trips(workload: str, device: str, batch: int, args: argparse.Namespace, transport: str = "shm") -> dict:
    """p50/p99 of one client's act round trips at ``batch`` rows against a server actor; ``transport`` "shm":
    observations through shared memory (the client shares the server's node), "inline": in the frame."""
    env = FrameEnv() if workload == "frames_cnn" else __import__("gymnasium").make("CartPole-v1")
    obs_space, act_space = env.observation_space, env.action_space
    settings = EnvRunnerSettings(env_creator=None, observation_space=obs_space, action_space=act_space)
    inference = InferenceSettings("central", max_batch=max(batch, 256),
                                  num_gpus_per_inference_server=1 if device == "cuda" else 0)
    server = ray.remote(num_cpus=args.server_cpus, num_gpus=1 if device == "cuda" else 0)(InferenceServer).remote(
        settings, inference, 0, torch_threads=args.server_cpus)
    directory = InferenceDirectory()
    directory.publish(0, ray.get(server.address.remote()))
    weights = ActorCriticModule(obs_space, act_space, inference_only=True).get_state()
    ray.get(server.set_weights.remote(weights, 1))
    client = RemoteActing(InferenceClientSettings(1, directory, shared_memory=transport == "shm"), 1)
    obs = np.stack([obs_space.sample() for _ in range(batch)])
    try:
        for _ in range(10):
            client.act(obs, True, 0)
        times, started = [], time.perf_counter()
        while time.perf_counter() - started < args.seconds / 2 or len(times) < 50:
            t = time.perf_counter()
            client.act(obs, True, 0)
            times.append(time.perf_counter() - t)
    finally:
        client.close()
        ray.kill(server)
    ms = np.array(times) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 3), "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "n": len(times)}


def cnn_rows(batches: list[int], seconds: float = 1.0) -> list[dict]:
    """The frame workload's acting pass (``PolicyForward``, as runners and servers hold it) on one torch thread
    at several batch sizes: ms per pass and microseconds per row. A server that batches many runners' rows can
    only be as much cheaper per row as this curve falls from a runner's own batch (``--envs``) to the
    server's; on the CPU nothing else in central inference removes the CNN's arithmetic."""
    from actors.inference.forward import PolicyForward

    env = FrameEnv()
    forward = PolicyForward(ActorCriticModule(env.observation_space, env.action_space, inference_only=True))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        with torch.inference_mode():
            for batch in batches:
                obs = np.stack([env.observation_space.sample() for _ in range(batch)])
                for _ in range(3):
                    forward.dist_inputs(obs, True)
                times, started = [], time.perf_counter()
                while time.perf_counter() - started < seconds or len(times) < 5:
                    t = time.perf_counter()
                    forward.dist_inputs(obs, True)
                    times.append(time.perf_counter() - t)
                ms = 1e3 * statistics.median(times)
                rows.append({"batch": batch, "ms_per_pass": round(ms, 3), "us_per_row": round(1e3 * ms / batch, 1)})
    finally:
        torch.set_num_threads(threads)
    return rows


def server_parts(device: str, args: argparse.Namespace) -> dict:
    """Where a central server's batch of the frame workload goes, timed piece by piece in this process
    (median ms over repeats): ``args.runners`` requests of ``args.envs`` frames each -- reading them (inline
    frames decoded and checked; shm requests' blocks mapped and checked, not copied), gathering them into the
    batch's host buffer (``gather_blocks``: from the decoded frames or straight from the segments, as the
    server does), the forward pass (to the distribution inputs on the CPU), the batch-wide choice, and the
    answers encoded. ``host_copies_before``: the same batch's observations as the server copied them until
    2026-12-04 (each shm block into a buffer of its runner's, those stacked into a new array and, on a GPU,
    that copied into the pinned upload buffer), timed in the same run for the ratio."""
    from actors.env.exploration import make_exploration
    from actors.inference.batching import gather_blocks, stack_blocks
    from actors.inference.forward import PolicyForward
    from actors.inference.shared_obs import ObsSegment, SegmentMaps
    from protocols import inference as wire
    from protocols.schema import ChunkSchema

    env = FrameEnv()
    obs_space, act_space = env.observation_space, env.action_space
    module = ActorCriticModule(obs_space, act_space, inference_only=True)
    forward = PolicyForward(module, device, graphs=True)  # as the server holds it (graphs: CUDA only)
    exploration = make_exploration({}, forward.dist_spec)
    schema = ChunkSchema.for_spaces(obs_space, None)
    blocks = [np.stack([obs_space.sample() for _ in range(args.envs)]) for _ in range(args.runners)]
    frames = [wire.act_request(i, 1, b, True, 0) for i, b in enumerate(blocks)]
    segments = [ObsSegment(i) for i in range(args.runners)]
    shm_frames = [wire.act_request(i, 1, None, True, 0, seg.write(b)) for i, (seg, b) in enumerate(zip(segments, blocks))]
    maps = SegmentMaps()
    rows = args.runners * args.envs
    staging = torch.empty((rows, *obs_space.shape), dtype=torch.uint8)
    if forward.cuda:
        staging = staging.pin_memory()
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append((time.perf_counter() - t) * 1000)
        return out

    def read(requests):
        out = []
        for f in requests:
            r = wire.read_request(f)
            obs = r.obs if r.shared is None else maps.view(r.runner, r.shared)
            schema.check_observation_rows(obs, r.rows)
            out.append(obs)
        return out

    def gather(obs):
        return gather_blocks(obs, lambda shape, dtype: forward.host_array(("batch", True), shape, dtype))

    def copies_before(views):
        own = []
        for i, view in enumerate(views):
            a = forward.host_array(("runner", i), view.shape, view.dtype)
            np.copyto(a, view)
            own.append(a)
        batch = stack_blocks(own)
        if forward.cuda:  # the pass's copy into its pinned upload buffer
            staging.numpy()[:len(batch)] = batch
        return batch

    try:
        with torch.inference_mode():
            for _ in range(60):
                timed("read_inline", lambda: read(frames))
                views = timed("read_shm", lambda: read(shm_frames))
                timed("host_copies_before", lambda: copies_before(views))
                obs = timed("gather", lambda: gather(views))
                inputs = timed("forward", lambda: forward.dist_inputs(obs, True))
                actions, logp = timed("choose", lambda: forward.choose(inputs, exploration, True, 0))
                timed("answers", lambda: [wire.actions_reply(1, 1, actions[i:i + 1].numpy(), logp[i:i + 1].numpy(),
                                                             inputs[i:i + 1].numpy()) for i in range(args.runners)])
    finally:
        views = obs = None
        for seg in segments:
            seg.close()
        maps.close()
    out = {k: round(statistics.median(v[10:]), 3) for k, v in times.items()}
    out["host_copies_over_before"] = round(out["gather"] / out["host_copies_before"], 2)
    return out


def appo_frames(args: argparse.Namespace, device: str = "cuda") -> dict:
    """APPO on the frame env, inference and learner on ``device`` (the GPU: half of it each): env steps
    sampled per second."""
    servers = min(args.appo_servers, args.runners)
    gpus = 0.5 if device == "cuda" else 0
    config = (APPOConfig().environment(FrameEnv)
              .env_runners(num_env_runners=args.runners, num_envs_per_env_runner=args.envs)
              .inference(mode="central", num_inference_servers=servers, num_cpus_per_inference_server=1,
                         num_gpus_per_inference_server=gpus / servers, max_batch=args.runners * args.envs)
              .learners(num_gpus_per_learner=gpus).reporting(min_time_s_per_iteration=1.0))
    algo = config.build(logdir=None)
    try:
        started = time.perf_counter()
        while time.perf_counter() - started < args.seconds:  # warm-up
            algo.train()
        before, t = algo.train()["num_env_steps_sampled_lifetime"], time.perf_counter()
        while time.perf_counter() - t < args.seconds:
            after = algo.train()["num_env_steps_sampled_lifetime"]
        rate = (after - before) / (time.perf_counter() - t)
    finally:
        algo.stop()
    cpus = os.cpu_count() or 1
    return {"env_steps_per_s": round(rate, 1), "per_cpu_core": round(rate / cpus, 1), "cpus": cpus, "servers": servers}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=8.0, help="measuring time per sampling run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runners", type=int, default=8)
    p.add_argument("--envs", type=int, default=4)
    p.add_argument("--fragment", type=int, default=50, help="steps per sub-env in one sample call")
    p.add_argument("--servers", type=int, default=os.cpu_count() or 1,
                   help="inference servers on CPU (central mode); one on the GPU")
    p.add_argument("--server-cpus", type=int, default=1, help="CPUs (torch threads) of each inference server")
    p.add_argument("--max-wait-s", type=float, default=0.0, help="the servers' max_wait_s")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--cpu-modes", default="local,central",
                   help="the CPU sampling runs: local inference, central inference on CPU servers, or both")
    p.add_argument("--skip-gpu", action="store_true")
    p.add_argument("--gpu-servers", default="1,2,4", help="inference servers sharing the GPU (each a run)")
    p.add_argument("--appo-servers", type=int, default=2, help="inference servers of the APPO run (half the GPU)")
    p.add_argument("--no-shm", action="store_true", help="sampling runs send observations inline, not through /dev/shm")
    p.add_argument("--double-buffer", default="off",
                   help="central sampling runs with one request out per runner (off, the default), runners "
                        "double-buffering (on, reported as mode central_double), or both (off,on: each a run)")
    p.add_argument("--gpu-precisions", default="float32",
                   help="GPU sampling runs acting in these precisions (each a run; bfloat16 modes named with _bf16), "
                        "each against float32 local CPU inference")
    p.add_argument("--precisions", default="float32",
                   help="CPU sampling runs acting in these precisions (float32,bfloat16: each a run, bfloat16 modes "
                        "named with _bf16; bfloat16 pays on CPUs with AMX/AVX512-BF16)")
    p.add_argument("--cnn-batches", default="1,4,8,16,32,64,128,256",
                   help="batch sizes of the cnn_rows curve (empty: none)")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.skip_gpu
    ray.init(address="local", num_cpus=args.runners + (args.servers + 1) * args.server_cpus + 2,
             num_gpus=1 if cuda else 0, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
         torch=torch.__version__, ray=ray.__version__, cuda=torch.cuda.get_device_name(0) if cuda else None,
         load_avg=os.getloadavg(), runners=args.runners, envs=args.envs, servers=args.servers,
         server_cpus=args.server_cpus, max_wait_s=args.max_wait_s)
    workloads = args.workloads.split(",")
    rates: dict = {}
    buffering = [b == "on" for b in args.double_buffer.split(",")]

    def central_modes(modes: list[str]) -> list[tuple[str, bool]]:
        """(mode name, double_buffer) runs: "central" one request at a time, "central_double" double-buffered."""
        out = []
        for mode in modes:
            out += [(mode, False)] if mode != "central" else [("central_double" if b else "central", b)
                                                               for b in buffering]
        return out

    precisions = args.precisions.split(",")
    suffix = {"float32": "", "bfloat16": "_bf16"}
    for r in range(args.repeats):
        for workload in workloads:
            for precision in precisions:
                for mode, buffered in central_modes(args.cpu_modes.split(",")):
                    rate, served = sampling_rate(workload, mode.split("_")[0], "cpu", args, double_buffer=buffered,
                                                 precision=precision)
                    name = mode + suffix[precision]
                    rates.setdefault((workload, name, "cpu"), []).append(rate)
                    emit(bench="sampling", workload=workload, mode=name, device="cpu", runners=args.runners,
                         envs=args.envs, precision=precision, repeat=r, env_steps_per_s=round(rate, 1), **served)
    devices = ["cpu"] + (["cuda"] if cuda else [])
    if "frames_cnn" in workloads:
        curve = cnn_rows([int(b) for b in args.cnn_batches.split(",")] if args.cnn_batches else [])
        for row in curve:
            emit(bench="cnn_rows", workload="frames_cnn", device="cpu", threads=1, **row)
        at_runner = [r["us_per_row"] for r in curve if r["batch"] == args.envs]
        if at_runner:
            best = min(curve, key=lambda r: r["us_per_row"])
            emit(bench="cnn_rows_summary", runner_batch=args.envs, runner_us_per_row=at_runner[0],
                 best_batch=best["batch"], best_us_per_row=best["us_per_row"],
                 runner_row_cost_over_best=round(at_runner[0] / best["us_per_row"], 2))
        for device in devices:
            emit(bench="server_parts", workload="frames_cnn", device=device, rows=args.runners * args.envs,
                 requests=args.runners, **server_parts(device, args))
    trips: dict = {}
    for device in devices:
        for workload in workloads:
            for batch in (32, 256):
                for transport in ("shm", "inline"):
                    row = round_trips(workload, device, batch, args, transport)
                    trips[(workload, device, batch, transport)] = row
                    emit(bench="round_trip", workload=workload, device=device, batch=batch, transport=transport, **row)
    if cuda:
        for r in range(args.repeats):
            for workload in workloads:
                for n, precision in itertools.product([int(n) for n in args.gpu_servers.split(",")],
                                                      args.gpu_precisions.split(",")):
                    for mode, buffered in central_modes(["central"]):
                        rate, served = sampling_rate(workload, "central", "cuda", args, n, buffered, precision)
                        name = mode + suffix[precision]
                        rates.setdefault((workload, name, f"cuda{n}"), []).append(rate)
                        emit(bench="sampling", workload=workload, mode=name, device="cuda", servers=n,
                             runners=args.runners, envs=args.envs, precision=precision, repeat=r,
                             env_steps_per_s=round(rate, 1), **served)
        emit(bench="appo_frames", device="cuda", **appo_frames(args))
    summary = {f"{w}_{m}_{d}_env_steps_per_s": round(statistics.median(v), 1) for (w, m, d), v in rates.items()}
    for workload, end in itertools.product(workloads, [suffix[p] for p in precisions]):
        local = rates.get((workload, "local" + end, "cpu"))
        if not local:
            continue
        for mode in ("central" + end, "central_double" + end):
            central = rates.get((workload, mode, "cpu"))
            if central:
                summary[f"{workload}_{mode}_cpu_over_local"] = round(statistics.median(central)
                                                                     / statistics.median(local), 2)
        if (workload, "central" + end, "cpu") in rates:
            # each repeat's central run beside the local run just before it: less exposed to a load that drifts
            summary[f"{workload}_central{end}_cpu_over_local_paired"] = round(statistics.median(
                c / l for c, l in zip(rates[(workload, "central" + end, "cpu")], local)), 2)
        if end:  # bfloat16 against float32 acting, local and central
            for mode in ("local", "central"):
                low, full = rates.get((workload, mode + end, "cpu")), rates.get((workload, mode, "cpu"))
                if low and full:
                    summary[f"{workload}_{mode}{end}_over_float32"] = round(statistics.median(low)
                                                                            / statistics.median(full), 2)
    for (workload, mode, device), v in rates.items():  # the GPU runs, each against float32 local CPU inference
        if device.startswith("cuda") and rates.get((workload, "local", "cpu")):
            summary[f"{workload}_{mode}_{device}_over_local"] = round(statistics.median(v) / statistics.median(
                rates[(workload, "local", "cpu")]), 2)
    emit(bench="summary", **summary)


if __name__ == "__main__":
    main()
