"""Soak: APPO on CartPole for N minutes with evaluation and periodic checkpoints, watching for leaks.

Run: ``.venv/bin/python tests/benchmarks/soak.py --minutes 60 [--interval-s 60] [--warmup-minutes 10]
[--multi-agent] [--runners 2] [--learners 0] [--central-inference 0] [--checkpoint-every-s 120]
[--plant-leak-mb 0]``. Prints JSON lines:

1. ``machine``: CPU, platform, library versions, load average.
2. ``sample`` every ``--interval-s``: per process -- the driver, each env runner and evaluator actor
   (found by asking them their pid), and Ray's own processes under this driver (raylet, GCS, idle
   workers...) -- resident memory, open file descriptors and threads (read from /proc: Linux only);
   the learner queue's depth and capacity, the stream's counters, Ray's object store use (its memory
   summary), env steps sampled and trained so far and per second since the last sample, the load average.
3. ``summary``: over the samples after ``--warmup-minutes`` (the window), each series' least-squares
   slope per hour, the RSS growth over the window that slope makes (% of the fitted start: the issue's
   "growth after the first 10 minutes") and per hour (% of the mean), fds and threads (their range and
   slope), throughput drift (the window's last quarter against its first, in env steps per CPU-second of
   the run's processes -- what the run gets done with the CPU it gets, which other jobs on a shared
   machine do not change -- the same divided by the host's speed over the same interval, measured by a
   probe process of its own that times a fixed workload four times a second (``HostProbe``; a host that
   slows down moves it as much as the run), and in env steps per wall-clock second;
   ``--drift-basis`` picks the one judged, "probe" by default; each sample also has the CPU the run and the
   whole machine used), and a
   ``verdict``: ``pass`` when every runnel process (the driver and the actors runnel starts) grows its
   RSS by less than ``--max-rss-growth-pct`` over the window (and, if given, less than
   ``--max-rss-growth-pct-per-hour``), holds its fds and threads flat (the median of the window's second
   half at most 1 above the first half's: spikes come and go, a leak raises the floor), and throughput
   drifts less than ``--max-throughput-drift-pct`` -- else ``fail`` with what failed.
   Ray's own processes (raylet, GCS, its agents and idle workers) are reported the same way, under
   ``ray_processes``, and what grows there is listed in ``ray_growth``, outside the verdict.

``--multi-agent``: two-agent CartPole (``make_multi_agent``), one policy per agent. ``--plant-leak-mb``:
the driver keeps that many MB more after every training iteration (to check that the summary catches a
leak). A process that is recreated gets a new series (its pid changes); series present in fewer than
half the window's samples are left out of the verdict.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from actors.env.multi_agent_env import make_multi_agent  # noqa: E402
from pipeline import APPOConfig, Callbacks  # noqa: E402
from tests.benchmarks.appo_cartpole import machine as benchmark_machine  # noqa: E402
from tests.benchmarks.probe import probe_speed  # noqa: E402
from tests.procs import command, descendants, machine_cpu_seconds, usage  # noqa: E402

PLASMA = re.compile(r"Plasma memory usage (\d+) MiB, (\d+) objects")
LEAK: list[bytearray] = []


def emit(kind: str, **fields: Any) -> None:
    print(json.dumps({"kind": kind, **fields}), flush=True)


def machine() -> dict[str, Any]:
    return {**benchmark_machine(), "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


class PlantLeak(Callbacks):
    """Keeps ``--plant-leak-mb`` MB more in the driver after every iteration (a leak the summary must catch)."""

    mb = 0

    def on_train_result(self, *, algorithm: Any, result: dict, **kwargs: Any) -> None:
        if self.mb:
            LEAK.append(bytearray(os.urandom(1024)) * (self.mb * 1024))


def by_agent(agent_id: Any, episode: Any, **kwargs: Any) -> str:
    return f"p{agent_id}"


def build(args: argparse.Namespace) -> Any:
    config = (APPOConfig().env_runners(num_env_runners=args.runners, num_envs_per_env_runner=8)
              .evaluation(evaluation_interval=args.evaluation_interval, evaluation_num_env_runners=1,
                          evaluation_duration=5, evaluation_duration_unit="episodes")
              .callbacks(PlantLeak).debugging(seed=args.seed))
    if args.learners:
        config = config.learners(num_learners=args.learners)
    if args.central_inference:
        config = config.inference(mode="central", num_inference_servers=args.central_inference)
    if args.multi_agent:
        config = (config.environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
                  .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent))
    else:
        config = config.environment("CartPole-v1")
    return config.build(logdir=None)


def actor_pids(algo: Any) -> dict[int, str]:
    """pid -> "env_runner_<i>" / "evaluator_<i>" / "learner_<i>" for the actors that answer (inference
    servers go by their process title, ray::InferenceServer)."""
    out = {}
    if algo.config.num_learners:  # else the learner is the driver
        for i, pid in enumerate(algo.learner_group.foreach_learner(_pid)):
            out[pid] = f"learner_{i}"
    groups = [("env_runner", algo.env_runner_group), ("evaluator", algo.eval_env_runner_group)]
    for label, group in groups:
        if group is None:
            continue
        for res in group.manager.foreach_actor("apply", _pid, timeout_s=30):
            if res.ok:
                out[res.value] = f"{label}_{res.actor_id}"
    return out


def _pid(_runner: Any) -> int:
    return os.getpid()


def processes(labels: dict[int, str], leave_out: tuple[int, ...] = ()) -> dict[str, dict[str, float]]:
    """Resident MB, open fds and threads of the driver and every process under it (but ``leave_out``: the
    host probe), keyed "label#pid"."""
    me = os.getpid()
    out = {}
    for pid in [me] + [p for p in descendants(me) if p not in leave_out]:
        stats = usage(pid)
        if stats is not None:  # gone meanwhile
            label = "driver" if pid == me else labels.get(pid) or title(command(pid))
            out[f"{label}#{pid}"] = stats
    return out


def title(cmd: list[str]) -> str:
    """A short name for a process under the driver: ray::EnvRunner, raylet, python:agent.py..."""
    if not cmd:
        return "?"
    if cmd[0].startswith("ray::"):
        return cmd[0].split(".")[0]  # ray::EnvRunner.sample -> ray::EnvRunner
    name = os.path.basename(cmd[0])
    if name.startswith("python"):  # Ray's python helpers: named by their script
        script = next((os.path.basename(a) for a in cmd[1:] if a.endswith(".py")), "")
        return f"python:{script}" if script else name
    return name


def object_store() -> dict[str, float]:
    from ray._private.internal_api import memory_summary  # Ray's own `ray memory --stats-only`

    try:
        text = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    except Exception as err:  # noqa: BLE001 - reported, the soak goes on
        return {"error": str(err)[:200]}
    m = PLASMA.search(text)
    return {"used_mb": float(m.group(1)), "objects": float(m.group(2))} if m else {"error": text[:200]}


PROBE_PERIOD_S = 0.25
"""How often the host probe process runs one round (~1.5 ms of CPU: well under 1 % of a core)."""

PROBE_SCRIPT = """
import sys, time
sys.path.insert(0, sys.argv[2])
from tests.benchmarks.probe import probe_speed  # numpy only: the probe process stays small
period = float(sys.argv[1])
while True:
    print(time.monotonic(), probe_speed(rounds=1), flush=True)
    time.sleep(period)
"""


class HostProbe:
    """How fast the host runs a fixed workload, measured all along the run: a process of its own (no GIL
    shared with the driver) times one ``probe_speed`` round every ``PROBE_PERIOD_S``, and ``mean_between``
    averages the rounds of a sampling interval. A probe taken only at each sample sees one instant of a
    host whose speed changes from second to second (a shared VM's neighbours come and go)."""

    def __init__(self, period_s: float = PROBE_PERIOD_S) -> None:
        import subprocess
        import threading

        root = str(Path(__file__).resolve().parents[2])
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE_SCRIPT, str(period_s), root],
                                     stdout=subprocess.PIPE, text=True)
        self.readings: list[tuple[float, float]] = []
        self.changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="host-probe", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        for line in self.proc.stdout:
            t, speed = (float(x) for x in line.split())
            with self.changed:
                self.readings.append((t, speed))
                self.changed.notify_all()

    def wait_for(self, count: int, timeout_s: float) -> bool:
        """True once ``count`` rounds are in (within ``timeout_s``)."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self.readings) >= count, timeout=timeout_s)

    def mean_between(self, t0: float, t1: float) -> float | None:
        """Mean speed of the rounds run in ``(t0, t1]`` (``time.monotonic`` seconds); None if there were none."""
        with self.changed:
            speeds = [v for t, v in self.readings if t0 < t <= t1]
        return float(np.mean(speeds)) if speeds else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - stuck: make sure it goes
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def fit_per_hour(t_s: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` against time, per hour."""
    return fit_line(t_s, values)[0]


def fit_line(t_s: list[float], values: list[float]) -> tuple[float, float]:
    """(slope per hour, value at ``t_s[0]``) of the least-squares line through ``values``."""
    if len(t_s) < 3 or max(t_s) - min(t_s) <= 0:
        return 0.0, float(values[0])
    hours = (np.asarray(t_s) - t_s[0]) / 3600.0
    slope, start = np.polyfit(hours, np.asarray(values, float), 1)
    return float(slope), float(start)


RAY_OWN = ("raylet", "gcs_server", "python:", "ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")
"""Labels of Ray's own processes (the rest under the driver are runnel's: its actors)."""


def flat(values: list[float]) -> bool:
    """The second half's median at most 1 above the first half's: a leak raises the floor, while what comes
    and goes (a checkpoint's open files, an evaluation's threads) only makes spikes."""
    half = len(values) // 2
    return float(np.median(values[half:])) <= float(np.median(values[:half])) + 1


def cpu_since(prev: dict[str, dict] | None, now: dict[str, dict]) -> float:
    """CPU seconds the processes of ``now`` used since ``prev`` (a process new since then: all of its time)."""
    prev = prev or {}
    return sum(max(0.0, p.get("cpu_s", 0.0) - prev.get(k, {}).get("cpu_s", 0.0)) for k, p in now.items())


def drift_of(values: list[float]) -> tuple[float, float, float]:
    """(mean of the first quarter, of the last quarter, drift of the last against the first in %)."""
    quarter = max(1, len(values) // 4)
    first, last = float(np.mean(values[:quarter])), float(np.mean(values[-quarter:]))
    return first, last, 100.0 * (last - first) / first if first > 0 else 0.0


def summarize(samples: list[dict], warmup_s: float, max_rss_pct: float, max_drift_pct: float,
              max_rss_pct_per_hour: float | None = None, drift_basis: str = "probe") -> dict[str, Any]:
    """``drift_basis``: "probe" judges env steps per CPU-second of the run's processes divided by the
    probe's speed in the same sample (``probe_speed``: what the run gets done with the CPU it gets, on the
    machine as fast as it is then; samples without a probe fall back to "cpu"); "cpu" the same without the
    probe (on a shared machine other jobs change how much CPU the run gets, not this, but a host that
    slows down moves it); "wall" env steps per second of wall-clock time. All three are reported."""
    window = [s for s in samples if s["t_s"] >= warmup_s]
    if len(window) < 3:
        return {"verdict": "too short", "why": f"{len(window)} samples after the warm-up of {warmup_s:.0f} s; "
                                               f"run longer or lower --warmup-minutes/--interval-s"}
    failures: list[str] = []
    ray_growth: list[str] = []
    series: dict[str, dict[str, Any]] = {}
    ray_series: dict[str, dict[str, Any]] = {}
    keys = sorted({k for s in window for k in s["processes"]})
    for key in keys:
        points = [(s["t_s"], s["processes"][key]) for s in window if key in s["processes"]]
        if len(points) < max(3, len(window) // 2):
            continue  # a process that came or went within the window (an idle worker, a restart)
        t = [p[0] for p in points]
        rss = [p[1]["rss_mb"] for p in points]
        fds = [p[1]["fds"] for p in points]
        threads = [p[1]["threads"] for p in points]
        slope, start = fit_line(t, rss)
        growth = 100.0 * slope * (t[-1] - t[0]) / 3600.0 / start
        pct = 100.0 * slope / float(np.mean(rss))
        entry = {"rss_mb_first_last": [round(rss[0], 1), round(rss[-1], 1)], "rss_mb_per_hour": round(slope, 2),
                 "rss_growth_pct": round(growth, 2), "rss_growth_pct_per_hour": round(pct, 2),
                 "fds_min_max": [min(fds), max(fds)],
                 "fds_per_hour": round(fit_per_hour(t, fds), 2), "threads_min_max": [min(threads), max(threads)],
                 "threads_per_hour": round(fit_per_hour(t, threads), 2), "samples": len(points)}
        ray_own = key.startswith(RAY_OWN)
        (ray_series if ray_own else series)[key] = entry
        found = ray_growth if ray_own else failures
        if growth > max_rss_pct:
            found.append(f"{key}: RSS grows {growth:.2f} % over the window ({slope:.1f} MB/h) > {max_rss_pct} %")
        elif max_rss_pct_per_hour is not None and pct > max_rss_pct_per_hour:
            found.append(f"{key}: RSS grows {pct:.2f} %/h ({slope:.1f} MB/h) > {max_rss_pct_per_hour} %/h")
        for what, values in (("fds", fds), ("threads", threads)):
            if not flat(values):
                found.append(f"{key}: {what} grow {entry[f'{what}_per_hour']:.1f}/h (range {entry[f'{what}_min_max']})")
    t = [s["t_s"] for s in window]
    store = [s["object_store"].get("used_mb", 0.0) for s in window]
    rates = [s["env_steps_per_s"] for s in window if s["env_steps_per_s"] is not None]
    first, last, drift = drift_of(rates)
    per_cpu = [s["env_steps_per_cpu_s"] for s in window if s.get("env_steps_per_cpu_s") is not None]
    cpu_first, cpu_last, cpu_drift = drift_of(per_cpu) if per_cpu else (0.0, 0.0, 0.0)
    per_probe = [s["env_steps_per_cpu_s"] / s["probe_per_cpu_s"] for s in window
                 if s.get("env_steps_per_cpu_s") is not None and s.get("probe_per_cpu_s")]
    probe_first, probe_last, probe_drift = drift_of(per_probe) if per_probe else (0.0, 0.0, 0.0)
    probes = [s["probe_per_cpu_s"] for s in window if s.get("probe_per_cpu_s")]
    if drift_basis == "probe" and per_probe:
        judged, a, b = probe_drift, probe_first, probe_last
        unit = "env steps per CPU-second of the run, per probe round per CPU-second"
    elif drift_basis in ("cpu", "probe") and per_cpu:
        judged, a, b, unit = cpu_drift, cpu_first, cpu_last, "env steps per CPU-second of the run"
    else:
        judged, a, b, unit = drift, first, last, "env steps/s"
    if abs(judged) > max_drift_pct:
        failures.append(f"throughput drifts {judged:+.1f} % ({unit} {a:.0f} -> {b:.0f}) beyond +-{max_drift_pct} %")
    other = [s["cpu"]["machine_busy_s"] - s["cpu"]["run_s"] for s in window if s.get("cpu")]
    return {"window_s": [t[0], t[-1]], "samples": len(window), "processes": series, "ray_processes": ray_series,
            "ray_growth": ray_growth,
            "object_store_mb_per_hour": round(fit_per_hour(t, store), 2),
            "object_store_mb_min_max": [min(store), max(store)],
            "env_steps_per_s_first_last_quarter": [round(first, 1), round(last, 1)],
            "throughput_drift_pct": round(drift, 2),
            "env_steps_per_cpu_s_first_last_quarter": [round(cpu_first, 1), round(cpu_last, 1)],
            "throughput_per_cpu_drift_pct": round(cpu_drift, 2),
            "env_steps_per_probe_round_first_last_quarter": [round(probe_first, 2), round(probe_last, 2)],
            "throughput_per_probe_drift_pct": round(probe_drift, 2),
            "probe_drift_pct": round(drift_of(probes)[2], 2) if probes else None, "drift_basis": drift_basis,
            "other_processes_cpu_s_per_interval_min_max": [round(min(other), 1), round(max(other), 1)] if other else None,
            "verdict": "fail" if failures else "pass", "failures": failures}


def run(args: argparse.Namespace) -> int:
    emit("machine", **machine())
    PlantLeak.mb = args.plant_leak_mb
    num_cpus = args.runners + 2 + args.learners + args.central_inference  # + the evaluator and the driver
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    algo = build(args)
    host = HostProbe()
    ckpt_root = tempfile.mkdtemp(prefix="runnel-soak-")
    samples: list[dict] = []
    t0 = time.monotonic()
    end = t0 + 60 * args.minutes
    next_sample, next_ckpt = t0, t0 + args.checkpoint_every_s
    last = {"t": t0, "sampled": 0, "trained": 0}
    checkpoint, num_checkpoints, result = None, 0, {}
    try:
        while True:
            now = time.monotonic()
            if now >= next_sample:
                labels = actor_pids(algo)
                procs = processes(labels, leave_out=(host.pid,))
                machine_cpu = machine_cpu_seconds()
                run_cpu = cpu_since(last.get("procs"), procs)
                sampled = int(result.get("num_env_steps_sampled_lifetime", 0))
                trained = int(result.get("num_env_steps_trained_lifetime", 0))
                dt = now - last["t"]
                # the host's mean speed over the interval; at the first sample (no interval yet) one instant's
                probe = host.mean_between(last["t"], now) if samples else None
                probe = probe or probe_speed()
                sample = {"t_s": round(now - t0, 1), "iteration": int(result.get("training_iteration", 0)),
                          "env_steps_sampled": sampled, "env_steps_trained": trained,
                          "env_steps_per_s": (sampled - last["sampled"]) / dt if samples and dt > 0 else None,
                          "learner_queue": result.get("learner_queue", {}),
                          "stream": {k: v for k, v in result.get("stream", {}).items() if isinstance(v, (int, float))},
                          "episode_return_mean": result.get("env_runners", {}).get("episode_return_mean"),
                          "evaluation_return_mean": (result.get("evaluation") or {}).get(
                              "env_runners", {}).get("episode_return_mean"),
                          "checkpoints": num_checkpoints, "object_store": object_store(),
                          "loadavg_1m": os.getloadavg()[0], "probe_per_cpu_s": probe, "processes": procs}
                if samples:  # CPU used since the last sample: by this run's processes, and by the whole machine
                    sample["cpu"] = {"run_s": round(run_cpu, 2),
                                     "machine_busy_s": round(machine_cpu["busy_s"] - last["machine"]["busy_s"], 2),
                                     "steal_s": round(machine_cpu["steal_s"] - last["machine"]["steal_s"], 2)}
                    sample["env_steps_per_cpu_s"] = (sampled - last["sampled"]) / run_cpu if run_cpu > 0 else None
                samples.append(sample)
                emit("sample", **sample)
                last = {"t": now, "sampled": sampled, "trained": trained, "procs": procs, "machine": machine_cpu}
                next_sample += args.interval_s
            if now >= end:
                break
            if now >= next_ckpt:
                path = algo.save(os.path.join(ckpt_root, f"checkpoint_{num_checkpoints:04d}"))
                if checkpoint is not None:
                    shutil.rmtree(checkpoint, ignore_errors=True)  # keep one: disk use stays flat
                checkpoint, num_checkpoints = path, num_checkpoints + 1
                next_ckpt += args.checkpoint_every_s
            result = algo.train()
    finally:
        host.stop()
        algo.stop()
        ray.shutdown()
        shutil.rmtree(ckpt_root, ignore_errors=True)
    summary = summarize(samples, 60 * args.warmup_minutes, args.max_rss_growth_pct, args.max_throughput_drift_pct,
                        args.max_rss_growth_pct_per_hour, args.drift_basis)
    emit("summary", minutes=args.minutes, multi_agent=args.multi_agent, learners=args.learners,
         central_inference=args.central_inference, iterations=int(result.get("training_iteration", 0)),
         checkpoints=num_checkpoints, **summary)
    return 0 if summary["verdict"] == "pass" else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, required=True, help="how long to train")
    p.add_argument("--interval-s", type=float, default=60.0, help="seconds between samples")
    p.add_argument("--warmup-minutes", type=float, default=None,
                   help="samples before this are left out of the summary (default: 10, or half a shorter run)")
    p.add_argument("--multi-agent", action="store_true", help="two-agent CartPole, one policy per agent")
    p.add_argument("--runners", type=int, default=2)
    p.add_argument("--learners", type=int, default=0, help="num_learners: 0 trains in the driver")
    p.add_argument("--central-inference", type=int, default=0, metavar="N",
                   help="N central inference servers act for the env runners (0: each runner acts itself)")
    p.add_argument("--evaluation-interval", type=int, default=5, help="evaluate every this many iterations")
    p.add_argument("--checkpoint-every-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth-pct", type=float, default=5.0, help="over the window after the warm-up")
    p.add_argument("--max-rss-growth-pct-per-hour", type=float, default=None,
                   help="also judge the growth per hour (noisy on short runs: a one-off step reads as a trend)")
    p.add_argument("--max-throughput-drift-pct", type=float, default=5.0)
    p.add_argument("--drift-basis", choices=["probe", "cpu", "wall"], default="probe",
                   help="judge throughput per CPU-second of the run on the machine's speed of the moment (default: "
                        "robust to other jobs and to a host that slows down), per CPU-second, or per wall-clock second")
    p.add_argument("--plant-leak-mb", type=int, default=0, help="MB the driver keeps after every iteration")
    args = p.parse_args(argv)
    if args.warmup_minutes is None:
        args.warmup_minutes = min(10.0, args.minutes / 2)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
