"""The soak benchmark's leak check (tests/benchmarks/soak.py): its summary catches what grows -- planted
in made-up samples, and, in a short real run, in the driver -- and passes what only fluctuates."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.benchmarks.soak import summarize

ROOT = pathlib.Path(__file__).resolve().parents[1]


def samples(runner_mb_per_hour=0.0, runner_fds_per_sample=0, raylet_mb_per_hour=0.0, n=40, every_s=30.0):
    """``n`` samples of a driver, an env runner and a raylet: flat but noisy, unless told to grow."""
    rng = np.random.default_rng(0)
    out = []
    for k in range(n):
        t = k * every_s
        hours = t / 3600
        out.append({"t_s": t, "env_steps_per_s": 5000 * (1 + 0.01 * rng.normal()), "object_store": {"used_mb": 0.0},
                    "processes": {
                        "driver#1": {"rss_mb": 900 + 3 * rng.normal(), "fds": 60 + int(rng.integers(0, 3)),
                                     "threads": 40 + int(rng.integers(0, 2))},
                        "env_runner_1#2": {"rss_mb": 400 + runner_mb_per_hour * hours + rng.normal(),
                                           "fds": 49 + runner_fds_per_sample * k, "threads": 27},
                        "raylet#3": {"rss_mb": 30 + raylet_mb_per_hour * hours, "fds": 63, "threads": 28}}})
    return out


def test_flat_noisy_series_pass_and_rays_own_growth_is_reported_outside_the_verdict():
    out = summarize(samples(raylet_mb_per_hour=20.0), warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0)
    assert out["verdict"] == "pass", out["failures"]
    assert set(out["processes"]) == {"driver#1", "env_runner_1#2"} and set(out["ray_processes"]) == {"raylet#3"}
    assert out["ray_growth"] and out["ray_growth"][0].startswith("raylet#3: RSS grows")
    assert abs(out["processes"]["env_runner_1#2"]["rss_mb_per_hour"]) < 10


def test_a_planted_rss_leak_and_an_fd_leak_fail_naming_the_process():
    out = summarize(samples(runner_mb_per_hour=200.0), warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0)
    assert out["verdict"] == "fail"
    [failure] = out["failures"]
    assert failure.startswith("env_runner_1#2: RSS grows") and "% over the window" in failure
    assert 180 < out["processes"]["env_runner_1#2"]["rss_mb_per_hour"] < 220
    assert 11 < out["processes"]["env_runner_1#2"]["rss_growth_pct"] < 14  # 50 MB in the 15-minute window
    slow = summarize(samples(runner_mb_per_hour=40.0), warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0)
    assert slow["verdict"] == "pass"  # 2.5 % over the window: the per-hour bar, if asked for, catches it
    per_hour = summarize(samples(runner_mb_per_hour=40.0), warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0,
                         max_rss_pct_per_hour=5.0)
    assert per_hour["failures"] and "%/h" in per_hour["failures"][0]
    fds = summarize(samples(runner_fds_per_sample=1), warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0)
    assert fds["verdict"] == "fail" and fds["failures"][0].startswith("env_runner_1#2: fds grow")


def with_rates(per_cpu_s_over_time, cpu_share_over_time=lambda k: 1.0, probe=None):
    """``samples()`` with the run's env steps per CPU-second, its CPU share and (optionally) the probe's
    speed given as functions of the sample index; steps per wall-clock second follow from the first two."""
    out = samples()
    for k, s in enumerate(out):
        cpu = 60.0 * cpu_share_over_time(k)
        s["env_steps_per_cpu_s"] = per_cpu_s_over_time(k)
        s["env_steps_per_s"] = s["env_steps_per_cpu_s"] * cpu / 30.0
        s["cpu"] = {"run_s": cpu, "machine_busy_s": 60.0, "steal_s": 0.0}
        if probe is not None:
            s["probe_per_cpu_s"] = probe(k)
    return out


def test_throughput_is_judged_per_cpu_second_so_other_jobs_taking_the_cpu_do_not_fail_it():
    """The run's CPU share falls by 40 % in the second half (another job on the machine): steps per wall-clock
    second fall with it, steps per CPU-second of the run do not -- the "cpu" basis passes, "wall" fails; a run
    that needs more CPU per step over time (what a leak in the hot path does) fails on either."""
    crowded = with_rates(lambda k: 100.0, lambda k: 1.0 if k < 20 else 0.6)
    out = summarize(crowded, warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0)
    assert out["verdict"] == "pass" and out["throughput_drift_pct"] < -30 and out["throughput_per_cpu_drift_pct"] == 0
    wall = summarize(crowded, warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0, drift_basis="wall")
    assert wall["verdict"] == "fail" and "env steps/s" in wall["failures"][0]
    slower = with_rates(lambda k: 100.0 if k < 20 else 80.0)
    out = summarize(slower, warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0)
    assert out["verdict"] == "fail" and "per CPU-second" in out["failures"][0]


def test_a_host_that_slows_down_fails_the_cpu_basis_but_not_the_probe_basis_and_a_slower_run_fails_both():
    """The host slows by 25 % in the second half (its clock, or neighbours on its memory): the run gets 25 %
    fewer env steps per CPU-second and the probe 25 % fewer rounds -- "cpu" fails, "probe" (the default)
    passes. A run that needs more CPU per step on an unchanged host fails the probe basis."""
    slow_host = with_rates(lambda k: 100.0 if k < 20 else 75.0, probe=lambda k: 400.0 if k < 20 else 300.0)
    out = summarize(slow_host, warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0)
    assert out["verdict"] == "pass" and out["throughput_per_probe_drift_pct"] == 0
    assert out["probe_drift_pct"] == -25 and out["throughput_per_cpu_drift_pct"] == -25
    cpu = summarize(slow_host, warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0, drift_basis="cpu")
    assert cpu["verdict"] == "fail" and "per CPU-second of the run" in cpu["failures"][0]
    slow_run = with_rates(lambda k: 100.0 if k < 20 else 80.0, probe=lambda k: 400.0)
    out = summarize(slow_run, warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0)
    assert out["verdict"] == "fail" and "per probe round" in out["failures"][0]


def test_the_probe_measures_a_positive_speed():
    from tests.benchmarks.soak import probe_speed

    assert probe_speed(rounds=2) > 0


def test_a_run_too_short_for_its_warm_up_says_so():
    out = summarize(samples(n=4), warmup_s=300, max_rss_pct=5.0, max_drift_pct=5.0)
    assert out["verdict"] == "too short" and "warm-up" in out["why"]


@pytest.mark.slow
@pytest.mark.long  # ~3 min: make test-long
def test_a_short_soak_samples_every_process_and_catches_a_leak_planted_in_the_driver(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tests/benchmarks/soak.py"), "--minutes", "2", "--interval-s", "10",
                           "--warmup-minutes", "0.5", "--checkpoint-every-s", "30", "--plant-leak-mb", "2"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    kinds = [line["kind"] for line in lines]
    assert kinds[0] == "machine" and kinds[-1] == "summary" and kinds.count("sample") >= 8, proc.stderr[-3000:]
    summary = lines[-1]
    assert proc.returncode == 1 and summary["verdict"] == "fail"
    assert any(f.startswith("driver#") and "RSS grows" in f for f in summary["failures"]), summary["failures"]
    labels = {key.split("#")[0] for key in summary["processes"]}
    assert {"driver", "env_runner_1", "env_runner_2", "evaluator_1"} <= labels
    assert "raylet" in {key.split("#")[0] for key in summary["ray_processes"]}
    assert summary["checkpoints"] >= 2 and summary["iterations"] > 0
    last = [line for line in lines if line["kind"] == "sample"][-1]
    assert "used_mb" in last["object_store"] and last["learner_queue"]["capacity"] > 0


def test_the_host_probe_runs_in_its_own_process_until_stopped():
    import time

    from tests.benchmarks.soak import HostProbe

    host = HostProbe(period_s=0.01)
    try:
        assert host.wait_for(3, timeout_s=60), "the probe process reported nothing"
        assert host.pid != os.getpid()
        assert host.mean_between(0.0, time.monotonic()) > 0
        assert host.mean_between(time.monotonic() + 100, time.monotonic() + 200) is None
    finally:
        host.stop()
    assert host.proc.poll() is not None  # no process left behind

