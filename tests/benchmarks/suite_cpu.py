"""Where the test suite's CPU goes: process starts, Ray starts and torch imports, counted over a real run.

    python tests/benchmarks/suite_cpu.py                      # unit costs, then the whole suite (as make test runs it)
    python tests/benchmarks/suite_cpu.py --costs-only         # the unit costs alone (a minute)
    python tests/benchmarks/suite_cpu.py --pytest-args "-m 'not learning' tests/test_connectors.py"

The suite runs with a ``sitecustomize`` on PYTHONPATH (which Ray's workers and the tests' subprocesses inherit)
that logs each Python process's start and, for a process that imports torch, the CPU time of that import and
the modules that led to it. The machine's busy CPU over the run comes from /proc/stat. The unit costs (an
``import torch``, an ``import ray``, a local Ray's start and shutdown, an actor's process) are measured in fresh
processes, medians of ``--repeats`` (the imports by the process's own accounting, Ray's by the machine's busy CPU:
run that part on a quiet machine). Prints JSON lines; nothing here is a test.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]

HOOK = textwrap.dedent('''
    # written by tests/benchmarks/suite_cpu.py: logs this process's start and the cost of its torch import
    import builtins, json, os, resource, sys, time, traceback
    _LOG = os.environ["RUNNEL_SUITE_CPU_LOG"]
    def _write(entry):
        try:
            with open(_LOG, "a") as f:
                f.write(json.dumps(entry) + "\\n")
        except OSError:
            pass
    _write({"ev": "start", "pid": os.getpid(), "argv": sys.argv[:2], "t": time.time()})
    _import = builtins.__import__
    _seen = [False]
    def _timed_import(name, *args, **kwargs):
        if not _seen[0] and name.split(".")[0] == "torch" and "torch" not in sys.modules:
            _seen[0] = True
            before = resource.getrusage(resource.RUSAGE_SELF)
            try:
                return _import(name, *args, **kwargs)
            finally:
                after = resource.getrusage(resource.RUSAGE_SELF)
                frames = [f.filename for f in traceback.extract_stack(limit=80)
                          if "importlib" not in f.filename and "sitecustomize" not in f.filename]
                _write({"ev": "torch", "pid": os.getpid(), "argv": sys.argv[:2],
                        "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
                        "via": [f.split("site-packages/")[-1].replace(str(os.environ.get("RUNNEL_ROOT", "")) + "/", "")
                                for f in frames][-8:]})
        return _import(name, *args, **kwargs)
    builtins.__import__ = _timed_import
''')


def busy_cpu_s() -> float:
    """Busy CPU-seconds of the whole machine since boot (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def measured(code: str, whole_machine: bool = False) -> float:
    """CPU-seconds of a fresh interpreter running ``code``: its own and its waited children's, or with
    ``whole_machine`` the machine's busy CPU meanwhile (Ray's processes are not all waited children: run it quiet)."""
    before, machine_before = resource.getrusage(resource.RUSAGE_CHILDREN), busy_cpu_s()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    if whole_machine:
        return busy_cpu_s() - machine_before
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


RAY_START = ("import ray; ray.init(address='local', num_cpus=4, include_dashboard=False, logging_level='ERROR', "
             "log_to_driver=False)")
ACTORS = "\n".join([RAY_START, "@ray.remote(num_cpus=1)", "class A:", "    def ping(self): return 1",
                    "acts = [A.remote() for _ in range({n})]", "ray.get([a.ping.remote() for a in acts])",
                    "ray.shutdown()"])


def unit_costs(repeats: int) -> dict[str, float]:
    runs: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(repeats):  # interleaved, so a noisy minute touches every measure alike
        runs["python_bare"].append(measured("pass"))
        runs["import_torch"].append(measured("import torch"))
        runs["import_ray"].append(measured("import ray"))
        runs["ray_start_and_shutdown"].append(measured(RAY_START + "; ray.shutdown()", whole_machine=True))
        runs["ray_with_4_actors"].append(measured(ACTORS.format(n=4), whole_machine=True))
    costs = {name: statistics.median(v) for name, v in runs.items()}
    costs["actor_process"] = (costs.pop("ray_with_4_actors") - costs["ray_start_and_shutdown"]) / 4
    for name, value in costs.items():
        print(json.dumps({"what": "unit_cost", "name": name, "cpu_s": round(value, 3), "repeats": repeats,
                          "runs": [round(x, 3) for x in runs.get(name, [])]}), flush=True)
    return costs


def role_of(argv: list[str]) -> str:
    first = argv[0] if argv else "?"
    if "default_worker" in first:
        return "ray worker (actor or task)"
    for name, role in (("dashboard/agent.py", "ray dashboard agent"), ("runtime_env/agent", "ray runtime-env agent"),
                       ("log_monitor.py", "ray log monitor"), ("autoscaler/_private/monitor.py", "ray autoscaler monitor"),
                       ("dashboard/dashboard.py", "ray api server"), ("setup_worker.py", "ray runtime-env setup")):
        if name in first:
            return role
    return "other python: " + os.path.basename(first)


def run_suite(pytest_args: str, workers: int) -> None:
    with tempfile.TemporaryDirectory(prefix="runnel-suite-cpu-") as tmp:
        (pathlib.Path(tmp) / "sitecustomize.py").write_text(HOOK)
        log = pathlib.Path(tmp) / "procs.jsonl"
        env = dict(os.environ, RUNNEL_SUITE_CPU_LOG=str(log), RUNNEL_ROOT=str(ROOT),
                   PYTHONPATH=os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH", "")) if p))
        xdist = [] if workers == 1 else ["-n", str(workers), "--dist", "loadfile"]
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist, *shlex.split(pytest_args)]
        cpu0, t0 = busy_cpu_s(), time.monotonic()
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall, cpu = time.monotonic() - t0, busy_cpu_s() - cpu0
        tail = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
        print(json.dumps({"what": "suite", "pytest_args": pytest_args, "workers": workers, "exit_status": run.returncode,
                          "summary": tail, "wall_s": round(wall, 1), "busy_cpu_s": round(cpu, 1),
                          "cores": os.cpu_count(), "busy_fraction": round(cpu / (wall * os.cpu_count()), 3)}), flush=True)
        entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    starts = collections.Counter(role_of(e["argv"]) for e in entries if e["ev"] == "start")
    for role, n in starts.most_common():
        print(json.dumps({"what": "process_starts", "role": role, "n": n}), flush=True)
    torch_by: dict[str, list[float]] = collections.defaultdict(list)
    for e in entries:
        if e["ev"] == "torch":
            importer = next((f for f in reversed(e["via"]) if not f.startswith(("ray/", "<"))), "?")
            torch_by[f"{role_of(e['argv'])} <- {importer}"].append(e["cpu_s"])
    print(json.dumps({"what": "torch_imports", "n": sum(len(v) for v in torch_by.values()),
                      "cpu_s": round(sum(sum(v) for v in torch_by.values()), 1)}), flush=True)
    for who, cpus in sorted(torch_by.items(), key=lambda kv: -sum(kv[1])):
        print(json.dumps({"what": "torch_imports_by", "who": who, "n": len(cpus), "cpu_s": round(sum(cpus), 1)}),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pytest-args", default="tests", help="what pytest runs (default: the suite, as make test)")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers, as make test's TEST_WORKERS")
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each unit cost (median)")
    parser.add_argument("--costs-only", action="store_true", help="measure the unit costs and stop")
    args = parser.parse_args()
    unit_costs(args.repeats)
    if not args.costs_only:
        run_suite(args.pytest_args, args.workers)


if __name__ == "__main__":
    main()
