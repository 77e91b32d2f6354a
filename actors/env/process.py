"""Settings of the process a runner lives in: runnel's log level and the OS priority of its threads.

Process-wide rather than per runner, and shared with the policy server and the driver, so they
live apart from the runner that applies them when it starts as a Ray actor.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any


def set_log_level(level: str) -> None:
    """runnel's loggers in this process at ``level``, printing to stderr (Ray forwards it to the driver)."""
    level = "WARNING" if level == "WARN" else level
    for name in ("runnel", "actors", "pipeline"):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)


def lower_priority(niceness: int) -> None:
    """Raise the niceness of every thread of this process (Linux sets it per thread, and Ray's
    threads already run), or of the process where threads cannot be listed."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        os.nice(niceness)
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + niceness))
        except OSError:  # a thread that ended meanwhile
            pass


def prepare_process(settings: Any, worker_index: int, uses_torch: bool = True) -> None:
    """Seed torch for this runner, and set up the process a remote runner (``worker_index > 0``) owns.
    ``uses_torch=False`` (a runner under central inference, or acting with numpy): torch is neither imported nor set up."""
    if uses_torch:
        import torch

        if settings.seed is not None:
            torch.manual_seed(settings.seed + 7919 * worker_index)
        if worker_index > 0:  # a remote actor owns its core; intra-op threads only add contention
            torch.set_num_threads(settings.torch_threads)
    if worker_index > 0:
        set_log_level(settings.log_level)
        if settings.niceness:
            lower_priority(settings.niceness)
