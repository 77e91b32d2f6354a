"""Fail fast, naming the holders, when Ray cannot place an algorithm's actors.

On the embedded local Ray nothing frees CPUs by itself: a second algorithm built while the first
still holds every CPU would wait for its env runners until a timeout (RLlib hangs the same way,
ray#36761). Here the algorithms of this process that hold CPUs are known, so the error can say
which to stop.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any

import ray

_LIVE: "weakref.WeakKeyDictionary[Any, tuple[float, float]]" = weakref.WeakKeyDictionary()
"""Algorithm -> (CPUs its actors reserve, when it was built); removed at ``stop()``."""
_LOCK = threading.Lock()


def actor_cpus(config: Any) -> float:
    """CPUs the actors of ``config`` reserve (runners, learners, evaluators, inference servers; not the driver)."""
    from pipeline.config.inference import inference_settings

    inference = inference_settings(config) if config.num_env_runners > 0 else None  # else servers run in the driver
    servers = 0.0 if inference is None else inference.num_inference_servers * inference.num_cpus_per_inference_server
    return ((config.num_env_runners + config.evaluation_num_env_runners * bool(config.evaluation_interval))
            * config.num_cpus_per_env_runner + config.num_learners * config.num_cpus_per_learner + servers)


def held(algorithm: Any, cpus: float) -> None:
    with _LOCK:
        _LIVE[algorithm] = (cpus, time.time())


def released(algorithm: Any) -> None:
    with _LOCK:
        _LIVE.pop(algorithm, None)


def check_room(name: str, config: Any) -> None:
    """Raise now when ``config``'s actors cannot be placed: the local cluster is too small, or the
    CPUs are held by other algorithms of this process that are still running."""
    need = actor_cpus(config)
    if need <= 0 or not ray.is_initialized():
        return
    free = ray.available_resources().get("CPU", 0.0)
    if free + 1e-9 >= need:
        return
    total = ray.cluster_resources().get("CPU", 0.0)
    with _LOCK:
        holders = [(type(a).__name__, cpus, t) for a, (cpus, t) in _LIVE.items() if cpus > 0]
    fix = ("ask for fewer (num_env_runners=0 samples in the driver process; num_cpus_per_env_runner=0.5 "
           "shares CPUs), or give Ray more CPUs (ray.init(address=\"local\", num_cpus=...) before building)")
    if holders and free + sum(h[1] for h in holders) + 1e-9 >= need:
        names = "; ".join(f"{n} built at {time.strftime('%H:%M:%S', time.localtime(t))} holds {c:g}"
                          for n, c, t in holders)
        raise RuntimeError(
            f"{name} needs {need:g} CPUs for its actors but Ray has {free:g} of {total:g} free: {names} (still "
            f"running in this process). Call .stop() on it first (e.g. before Algorithm.from_checkpoint), or {fix}")
    if total + 1e-9 < need and not os.environ.get("RAY_ADDRESS"):
        raise RuntimeError(f"{name} needs {need:g} CPUs for its actors but the local Ray has {total:g} in all; {fix}")
