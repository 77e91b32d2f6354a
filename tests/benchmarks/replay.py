"""Replay-stage benchmark: runnel's ReplayBuffer vs RLlib 2.60's episode replay buffers.

Run: ``.venv/bin/python tests/benchmarks/replay.py [--cases cartpole,frames] [--seconds 10]
[--sample-seconds 3] [--skip-rllib] [--quick]``. Prints one JSON object per line:

1. ``machine``: CPU count, platform, memory, library versions (runnel's venv and the anchors venv).
2. ``replay`` per (system, case, buffer): ``system`` is ``runnel`` or ``rllib``; ``buffer`` is
   ``uniform`` or ``prioritized``. Fields: ``insert_steps_per_s`` (transitions per second of
   ``add`` time while filling), ``sample_steps_per_s`` (transitions per second at ``--batch-size``
   256, the median of ``--repeats`` windows after ``--warmup-seconds`` untimed), for prioritized buffers also
   ``sample_update_steps_per_s`` (each batch followed by one priority update of the whole batch),
   ``stored`` / ``capacity`` / ``filled_fraction``, ``rss_bytes_per_transition`` (resident memory
   the buffer added, per stored transition) and, for runnel, ``bytes_per_transition`` (the
   buffer's array ``nbytes`` / capacity: observations are stored once, so about one observation
   per transition, plus the columns and the sum tree).
3. ``summary``: runnel / RLlib ratios per case and figure (> 1: runnel is faster).

Data: ``--num-envs`` (8) interleaved synthetic episodes of 200..500 steps (length drawn per
episode; < 500 ends ``terminated``, 500 ``truncated``), cut into chunks of ``--chunk-len`` (64)
steps per env and round, as env runners deliver them; one ``add`` call per round (a list of
about 8 chunks). Observations are random, taken from a preallocated pool so that generating
them costs nothing; only ``add``/``sample``/``update_priorities`` are timed.

Cases:
  cartpole  float32 obs (4,), 2 actions, capacity 1_000_000.
  frames    Atari-like uint8 frames, 6 actions: by default single (84, 84) frames at capacity
            1_000_000 (7.1 GB for runnel's ring; 1M stacked (84, 84, 4) frames would be 28 GB, more
            than the 24 GB machine). ``--frames-layout stacked`` uses (84, 84, 4) at capacity
            200_000 (5.6 GB) instead. The ``frames`` lines say which in ``obs_shape``.
Buffers are built one at a time and freed before the next (never two large ones at once).

runnel fills each buffer to capacity (so bytes/transition and RSS describe a full buffer), one
fill per buffer (not repeated: a 7 GB fill is not cheap). Its ring is preallocated, so the fill
rate includes the OS's first-touch page faults (zeroing fresh pages): the first large buffer of a
process filled ~10x slower per byte than later ones in the smoke test. ``insert_full_steps_per_s``
(about 1 s of adds into the full buffer, evicting the oldest rows) has no page faults.
RLlib's buffers are far slower: their fill stops at ``--seconds`` (10) of ``add`` time, and
sampling is measured on what was stored (``stored``/``filled_fraction`` say how much; at the
smoke test's rates 10 s fill about 1M CartPole steps uniform but only ~0.3M prioritized: raise
``--seconds`` to fill more). A buffer counts as full once ``capacity`` steps were added (RLlib
evicts whole episodes, so it then holds a little less). RLlib's
``sample`` is called as its DQN/SAC training step calls it (``sample_episodes=True``, ``n_step``,
``gamma``, ``beta``) and returns a list of 256 one-step ``SingleAgentEpisode`` objects that its
learner connector still has to batch; runnel's ``sample`` returns the finished arrays (n-step
returns, discounts, weights). RLlib's ``update_priorities`` takes the priorities of the last
sample, runnel's the sampled row indices and priorities. Both use ``--n-step`` (3) and
gamma 0.99; prioritized: alpha 0.6, beta 0.4.

RLlib runs in a subprocess with the anchors venv's Python (``--rllib-python``): this same file
with ``--rllib-worker`` (it imports only numpy and ray there, nothing of runnel; the adapters are in
``replay_adapters.py``), whose JSON lines are re-emitted here tagged ``"system": "rllib"``.

``--quick`` (smoke test): capacities 20_000 (cartpole) / 5_000 (frames) unless given, 1 s fill
cap, 0.3 s sampling measurements of 2 windows; about 20 s in all.

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

    .venv/bin/python tests/benchmarks/replay.py --quick          # smoke test, seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from replay_adapters import RLlibAdapter, RunnelAdapter
from workers import versions_of

ROOT = Path(__file__).resolve().parents[2]
ANCHORS_PYTHON = "/work/anchors-venv/bin/python"
SYSTEM = "runnel"  # "rllib" in the worker subprocess
PAGE = os.sysconf("SC_PAGE_SIZE")


def emit(**fields) -> None:
    print(json.dumps({"bench": fields.pop("bench"), "system": SYSTEM, **fields}), flush=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def trim() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so that the next buffer's growth
    shows in RSS instead of reusing what the previous one freed."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def mem_available_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


# --- cases and synthetic data (shared by both systems) ----------------------------------------------
def case_specs(args: argparse.Namespace) -> dict[str, dict]:
    stacked = args.frames_layout == "stacked"
    specs = {
        "cartpole": {"obs_shape": (4,), "obs_dtype": "float32", "num_actions": 2,
                     "capacity": args.capacity_cartpole or 1_000_000},
        "frames": {"obs_shape": (84, 84, 4) if stacked else (84, 84), "obs_dtype": "uint8", "num_actions": 6,
                   "capacity": args.capacity_frames or (200_000 if stacked else 1_000_000)},
    }
    if args.quick:  # tiny capacities unless given
        for name, cap in (("cartpole", 20_000), ("frames", 5_000)):
            if not getattr(args, f"capacity_{name}"):
                specs[name]["capacity"] = cap
    return specs


class Synth:
    """Interleaved synthetic episodes cut into chunks, as ``num_envs`` env runners' sub-envs send them.

    ``round()`` returns, per env, ``chunk_len`` more steps: one chunk, or two when an episode ends
    inside the round (the tail of the old one, the start of a new one). A chunk is a dict of numpy
    views into preallocated random pools (obs ``T + 1`` rows, consecutive chunks of one episode
    share their boundary observation), ready to wrap in either system's chunk type.
    """

    MAX_LEN = 500

    def __init__(self, spec: dict, num_envs: int, chunk_len: int, seed: int, pool_rows: int = 4096) -> None:
        self.rng = np.random.default_rng(seed)
        self.chunk_len = chunk_len
        self.pool_rows = pool_rows
        rows = pool_rows + self.MAX_LEN + 1
        shape, dtype = tuple(spec["obs_shape"]), np.dtype(spec["obs_dtype"])
        if dtype == np.uint8:
            self.obs = self.rng.integers(0, 256, (rows, *shape), dtype=np.uint8)
        else:
            self.obs = self.rng.normal(0, 1, (rows, *shape)).astype(dtype)
        self.actions = self.rng.integers(0, spec["num_actions"], rows).astype(np.int64)
        self.rewards = self.rng.normal(0, 1, rows).astype(np.float32)
        self.envs = [self._new_episode() for _ in range(num_envs)]

    def _new_episode(self) -> dict:
        return {"id": uuid.uuid4().hex, "len": int(self.rng.integers(200, self.MAX_LEN + 1)), "t": 0,
                "off": int(self.rng.integers(0, self.pool_rows)), "chunk_index": 0}

    def round(self) -> list[dict]:
        out = []
        for i, ep in enumerate(self.envs):
            left = self.chunk_len
            while left > 0:
                n = min(left, ep["len"] - ep["t"])
                a = ep["off"] + ep["t"]
                done = ep["t"] + n == ep["len"]
                out.append({
                    "episode_id": ep["id"], "chunk_index": ep["chunk_index"], "t_started": ep["t"],
                    "obs": self.obs[a : a + n + 1], "actions": self.actions[a : a + n],
                    "rewards": self.rewards[a : a + n],
                    "terminated": done and ep["len"] < self.MAX_LEN, "truncated": done and ep["len"] == self.MAX_LEN,
                    "env_index": i,
                })
                ep["t"] += n
                ep["chunk_index"] += 1
                left -= n
                if done:
                    ep = self.envs[i] = self._new_episode()
        return out


def throughput(fn, batch_size: int, seconds: float, repeats: int, warmup: float) -> tuple[float, list[float]]:
    """Median transitions/s of ``fn`` (one batch per call) over ``repeats`` windows of seconds/repeats,
    after ``warmup`` seconds of untimed calls (right after a multi-GB fill the kernel is still
    settling the fresh pages, and the first windows ran at a third of the steady rate)."""
    t_end = time.perf_counter() + warmup
    fn()
    while time.perf_counter() < t_end:
        fn()
    window = seconds / repeats
    rates = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= window:
                break
        rates.append(n * batch_size / dt)
    return statistics.median(rates), [round(r) for r in rates]


def bench_buffer(adapter_cls, case: str, spec: dict, prioritized: bool, args: argparse.Namespace,
                 fill_cap_s: float | None) -> dict:
    synth = Synth(spec, args.num_envs, args.chunk_len, args.seed)
    adapter_cls.load()  # imports before the RSS baseline
    trim()
    rss0 = rss_bytes()
    ad = adapter_cls(spec, prioritized, args)
    # Fill: only add() is timed (building the chunk objects is not).
    add_s, added, calls = 0.0, 0, 0
    while not ad.full() and (fill_cap_s is None or add_s < fill_cap_s):
        chunks = synth.round()
        items = ad.make(chunks)
        t0 = time.perf_counter()
        ad.add(items)
        add_s += time.perf_counter() - t0
        added += sum(len(c["rewards"]) for c in chunks)
        calls += 1
    rss_fill = rss_bytes() - rss0
    stored = ad.stored()
    out = {
        "case": case, "buffer": "prioritized" if prioritized else "uniform",
        "obs_shape": list(spec["obs_shape"]), "obs_dtype": spec["obs_dtype"], "capacity": ad.capacity,
        "stored": stored, "filled_fraction": round(stored / ad.capacity, 4), "full": ad.full(),
        "fill_time_cap_s": fill_cap_s, "add_calls": calls, "steps_added": added, "add_s": round(add_s, 3),
        "insert_steps_per_s": round(added / add_s) if add_s else None,
        "rss_bytes_per_transition": round(rss_fill / max(1, stored), 1),
    }
    nbytes = ad.nbytes()
    if nbytes is not None:
        out["nbytes"] = nbytes
        out["bytes_per_transition"] = round(nbytes / ad.capacity, 1)
        out["obs_bytes"] = int(np.prod(spec["obs_shape"])) * np.dtype(spec["obs_dtype"]).itemsize
    if ad.full():  # inserting into a full buffer (evicting the oldest): a short window
        n, t, t_end = 0, 0.0, min(1.0, args.sample_seconds)
        while t < t_end:
            chunks = synth.round()
            items = ad.make(chunks)
            t0 = time.perf_counter()
            ad.add(items)
            t += time.perf_counter() - t0
            n += sum(len(c["rewards"]) for c in chunks)
        out["insert_full_steps_per_s"] = round(n / t)
    bs, rng = args.batch_size, np.random.default_rng(args.seed + 1)
    med, all_ = throughput(lambda: ad.sample(bs), bs, args.sample_seconds, args.repeats, args.warmup_seconds)
    out["batch_size"], out["n_step"] = bs, args.n_step
    out["sample_steps_per_s"], out["sample_windows"] = round(med), all_
    if prioritized:
        def sample_update() -> None:
            batch = ad.sample(bs)
            ad.update(batch, np.abs(rng.normal(0, 1, bs)) + 0.01)
        med, all_ = throughput(sample_update, bs, args.sample_seconds, args.repeats, args.warmup_seconds)
        out["sample_update_steps_per_s"], out["sample_update_windows"] = round(med), all_
    return out  # the buffer goes with this frame: run_cases trims before the next


def run_cases(adapter_cls, args: argparse.Namespace, fill_cap_s: float | None) -> list[dict]:
    specs, results = case_specs(args), []
    for case in args.cases:
        for prioritized in (False, True):
            try:
                res = bench_buffer(adapter_cls, case, specs[case], prioritized, args, fill_cap_s)
            except Exception as err:  # report and go on with the other cases
                res = {"case": case, "buffer": "prioritized" if prioritized else "uniform",
                       "error": f"{type(err).__name__}: {err}"}
            trim()  # free the buffer before building the next
            emit(bench="replay", **res)
            results.append(res)
    return results


# --- driver -------------------------------------------------------------------------------------------
def machine_line(args: argparse.Namespace) -> None:
    import importlib.metadata as md

    versions = {}
    for p in ("runnel-rl", "numpy", "ray", "torch", "gymnasium"):
        try:
            versions[p] = md.version(p)
        except md.PackageNotFoundError:
            versions[p] = None
    m = __import__("re").search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), __import__("re").M)
    versions["runnel_pyproject"] = m.group(1) if m else None
    emit(bench="machine", cpu_count=os.cpu_count(), affinity=len(os.sched_getaffinity(0)),
         platform=platform.platform(), python=platform.python_version(), mem_available_gb=mem_available_gb(),
         loadavg=os.getloadavg(), versions=versions,
         anchors=None if args.skip_rllib else {"python": args.rllib_python, **versions_of(args.rllib_python)},
         quick=args.quick, cases=args.cases, seconds=args.seconds, sample_seconds=args.sample_seconds,
         repeats=args.repeats, warmup_seconds=args.warmup_seconds, n_step=args.n_step, batch_size=args.batch_size,
         frames_layout=args.frames_layout)


def run_rllib_subprocess(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    cmd = [args.rllib_python, str(Path(__file__).resolve()), "--rllib-worker", *argv]
    per_buffer = args.seconds + (2 * (args.sample_seconds + args.warmup_seconds) + 1) * 1.5 + 60
    timeout = 120 + len(args.cases) * 2 * per_buffer
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RAY_DEDUP_LOGS": "0"}
    results = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
    t0 = time.monotonic()
    try:
        for line in proc.stdout:
            line = line.strip()
            try:
                obj = json.loads(line)
            except ValueError:
                if line:
                    print(f"[rllib] {line}", file=sys.stderr, flush=True)
                continue
            if not isinstance(obj, dict) or "bench" not in obj:
                continue
            obj["system"] = "rllib"
            print(json.dumps(obj), flush=True)
            if obj["bench"] == "replay":
                results.append(obj)
            if time.monotonic() - t0 > timeout:
                raise subprocess.TimeoutExpired(cmd, timeout)
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        emit(bench="error", where="rllib subprocess", error=f"timed out after {timeout:.0f} s")
    if proc.returncode:
        emit(bench="error", where="rllib subprocess", error=f"exit status {proc.returncode}")
    return results


def summary(runnel: list[dict], rllib: list[dict]) -> None:
    ratios = {}
    index = {(r["case"], r["buffer"]): r for r in rllib if "error" not in r}
    for r in runnel:
        o = index.get((r.get("case"), r.get("buffer")))
        if "error" in r or o is None:
            continue
        key = f"{r['case']}/{r['buffer']}"
        ratios[key] = {}
        for fig in ("insert_steps_per_s", "sample_steps_per_s", "sample_update_steps_per_s"):
            if r.get(fig) and o.get(fig):
                ratios[key][fig] = round(r[fig] / o[fig], 2)
        ratios[key]["rss_bytes_per_transition"] = round(
            r["rss_bytes_per_transition"] / o["rss_bytes_per_transition"], 3) if o["rss_bytes_per_transition"] else None
        ratios[key]["rllib_stored"] = o["stored"]
        ratios[key]["runnel_stored"] = r["stored"]
    emit(bench="summary", ratio="runnel / rllib (throughputs: > 1 is runnel faster; rss: < 1 is runnel smaller)",
         ratios=ratios, runnel={f"{r['case']}/{r['buffer']}": {k: r.get(k) for k in (
             "insert_steps_per_s", "sample_steps_per_s", "sample_update_steps_per_s", "bytes_per_transition")}
             for r in runnel if "error" not in r})


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="cartpole,frames", help="comma-separated: cartpole,frames")
    p.add_argument("--seconds", type=float, default=10.0,
                   help="RLlib's fill cap: seconds of add() time per buffer (runnel always fills to capacity)")
    p.add_argument("--sample-seconds", type=float, default=3.0, help="seconds per sampling measurement")
    p.add_argument("--repeats", type=int, default=5, help="sampling windows per measurement (median reported)")
    p.add_argument("--warmup-seconds", type=float, default=1.0, help="untimed sampling before each measurement")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--n-step", type=int, default=3)
    p.add_argument("--num-envs", type=int, default=8, help="interleaved episodes (one chunk each per add call)")
    p.add_argument("--chunk-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames-layout", choices=["single", "stacked"], default="single",
                   help="single: (84, 84) frames at capacity 1M (7.1 GB); stacked: (84, 84, 4) at 200k (5.6 GB)")
    p.add_argument("--capacity-cartpole", type=int, default=None, help="default 1_000_000")
    p.add_argument("--capacity-frames", type=int, default=None, help="default per --frames-layout")
    p.add_argument("--skip-rllib", action="store_true")
    p.add_argument("--rllib-python", default=ANCHORS_PYTHON, help="the anchors venv's python")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: capacities 20k/5k, 1 s fill cap, 0.3 s sampling, 2 repeats")
    p.add_argument("--rllib-worker", action="store_true", help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw)
    args.cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in args.cases if c not in ("cartpole", "frames")]
    if bad:
        p.error(f"unknown case(s) {bad}; choose from cartpole,frames")
    if args.quick:
        given = {a.split("=")[0] for a in raw}
        if "--seconds" not in given:
            args.seconds = 1.0
        if "--sample-seconds" not in given:
            args.sample_seconds = 0.3
        if "--repeats" not in given:
            args.repeats = 2
        if "--warmup-seconds" not in given:
            args.warmup_seconds = 0.1
    return args, [a for a in raw if a != "--rllib-worker"]


def main() -> None:
    global SYSTEM
    args, argv = parse()
    if args.rllib_worker:
        SYSTEM = "rllib"
        import importlib.metadata as md

        emit(bench="worker", python=sys.executable, ray=md.version("ray"), numpy=np.__version__)
        run_cases(RLlibAdapter, args, fill_cap_s=args.seconds)
        return
    machine_line(args)
    runnel = run_cases(RunnelAdapter, args, fill_cap_s=None)
    rllib = [] if args.skip_rllib else run_rllib_subprocess(args, argv)
    summary(runnel, rllib)


if __name__ == "__main__":
    main()
