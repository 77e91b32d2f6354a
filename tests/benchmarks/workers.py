"""What the time-to-target benchmarks share: JSON lines out, workers in subprocesses, progress lines.

A benchmark's driver runs each (system, seed) in its own process (``run_worker``): its own session, so a
run past ``--max-minutes`` is ended with its whole process group (Ray's processes included) and
reported ``stop: timeout`` with the last progress it printed. Workers print ``progress`` lines as they
go (``Progress``), one ``result`` line (``finish``) and a ``teardown`` line.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import argparse
import time
from typing import Callable


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def median_of(xs) -> float | None:
    """The median of the values that are not None, to 2 places (None when there are none): a summary's cell."""
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 2) if xs else None


def num(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return None if x != x else x  # NaN -> None


class Progress:
    """A worker's ``progress`` line, at most every 5 s (or when forced)."""

    def __init__(self, t0: float) -> None:
        self.t0, self.last = t0, 0.0

    def __call__(self, env_steps: int, ret, iterations: int, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self.last >= 5:
            self.last = now
            emit(bench="progress", env_steps=int(env_steps), last_return=num(ret), iterations=iterations,
                 wall_s=round(now - self.t0, 2))


def finish(budget: int, t0: float, build_s: float, reached: bool, env_steps: int, ret, iterations: int,
           **extra) -> None:
    """The worker's ``result`` line: wall time from ``t0`` (before the build) to now."""
    wall = time.perf_counter() - t0
    stop = "target" if reached else "budget" if env_steps >= budget else "interrupted"
    emit(bench="result", reached=bool(reached), env_steps=int(env_steps), wall_s=round(wall, 2),
         build_s=round(build_s, 2), train_s=round(wall - build_s, 2), iterations=iterations,
         last_return=num(ret), stop=stop, **extra)


def versions_of(python: str) -> dict:
    code = ("import importlib.metadata as m, json\nout = {}\n"
            "for p in ('runnel-rl', 'ray', 'torch', 'stable-baselines3', 'sample-factory', 'gymnasium', 'numpy',\n"
            "          'pettingzoo'):\n"
            "    try: out[p] = m.version(p)\n    except Exception: pass\nprint(json.dumps(out))")
    try:
        # from /tmp: "-c" puts the working directory on the path, and a checkout there would show as installed
        python = os.path.abspath(python) if os.sep in python else python
        return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60,
                                         cwd="/tmp").stdout)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def worker_env(torch_threads: int, anchor: bool) -> dict:
    """The environment of a worker process: torch's thread count, and no PYTHONPATH for an anchor
    (its venv must not see runnel's tree)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if torch_threads > 0:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(torch_threads)
    if anchor:
        env.pop("PYTHONPATH", None)
    return env


def run_worker(cmd: list[str], base: dict, *, env: dict, cwd: str, max_minutes: float, verbose: bool,
               label: str) -> dict:
    """Run one worker to its end or ``max_minutes``; its ``result`` fields over ``base``."""
    last: dict = {}
    result: dict = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None if verbose else subprocess.DEVNULL,
                            text=True, env=env, cwd=cwd, start_new_session=True)

    def reader() -> None:
        for line in proc.stdout:
            try:
                obj = json.loads(line)
            except ValueError:
                if verbose:
                    print(f"[{label}] {line.rstrip()}", file=sys.stderr, flush=True)
                continue
            kind = obj.pop("bench", None) if isinstance(obj, dict) else None
            if kind == "progress":
                last.update(obj)
                if verbose:
                    print(f"[{label}] {json.dumps(obj)}", file=sys.stderr, flush=True)
            elif kind == "result":
                result.update(obj)
            elif kind == "teardown":
                result["teardown_s"] = obj.get("stop_s")

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        proc.wait(timeout=max_minutes * 60)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        th.join(timeout=5)
        # A worker that catches SIGTERM (Ray's driver does) may still print its result: keep its
        # figures, but the run did not reach the target in time.
        got = result or {k: last.get(k) for k in ("env_steps", "last_return", "iterations")}
        return {**base, **got, "reached": False, "wall_s": round(time.perf_counter() - t0, 2), "stop": "timeout",
                "note": f"killed after --max-minutes {max_minutes:g}; wall_s: until the kill"}
    th.join(timeout=30)
    if not result:
        return {**base, "reached": False, "env_steps": last.get("env_steps"),
                "wall_s": round(time.perf_counter() - t0, 2), "last_return": last.get("last_return"),
                "stop": "error", "note": f"worker exited with status {proc.returncode} and no result "
                                         "(rerun with --verbose to see its output)"}
    return {**base, **result, "process_s": round(time.perf_counter() - t0, 2)}


def train_to_target(budget: int, target: float, t0: float, train: Callable[[], dict], stop: Callable[[], None],
                    read: Callable[[dict], tuple[int, "float | None"]], also_at: float | None = None,
                    **extra) -> None:
    """``train()`` until ``read(result)``'s return reaches ``target`` or its env steps ``budget``; then the
    ``result`` and ``teardown`` lines. ``read``: result -> (env steps sampled, smoothed return or None when
    no episode has ended yet). ``also_at``: a lower return whose first crossing is reported too
    (``t<also_at>_s``, ``t<also_at>_env_steps``)."""
    build_s = time.perf_counter() - t0
    progress = Progress(t0)
    it, steps, last, reached, crossed = 0, 0, None, False, {}
    try:
        while True:
            steps, ret = read(train())
            it += 1
            last = ret if ret is not None else last
            progress(steps, last, it)
            if also_at is not None and ret is not None and ret >= also_at and not crossed:
                crossed = {f"t{also_at:g}_s": round(time.perf_counter() - t0, 2), f"t{also_at:g}_env_steps": steps}
            if ret is not None and ret >= target:
                reached = True
                break
            if steps >= budget:
                break
    finally:
        stop_t = time.perf_counter()
        finish(budget, t0, build_s, reached, steps, last, it, **crossed, **extra)
        stop()
        emit(bench="teardown", stop_s=round(time.perf_counter() - stop_t, 2))


def run_interleaved(seeds: list[int], systems: list[str], run_one: Callable[[str, int], dict]) -> list[dict]:
    """``run_one(system, seed)`` for every pair, the systems taking turns seed by seed (so a host that slows down
    slows them alike); each ``run`` line is printed as it ends."""
    runs = []
    for seed in seeds:
        for system in systems:
            r = run_one(system, seed)
            emit(**r)
            runs.append(r)
    return runs


def split_lists(parser: argparse.ArgumentParser, args: argparse.Namespace, systems: tuple[str, ...]) -> None:
    """``--systems`` and ``--seeds`` (comma-separated) as lists; a system not in ``systems`` is a usage error."""
    args.systems = [s for s in args.systems.split(",") if s]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if not args.systems or set(args.systems) - set(systems):
        parser.error(f"--systems takes a comma-separated subset of {list(systems)}, got {args.systems}")
