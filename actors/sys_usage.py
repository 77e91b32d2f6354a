"""CPU and memory of this process, for ``log_sys_usage`` (no psutil needed: /proc on Linux, rusage elsewhere)."""
from __future__ import annotations

import os
import resource
import sys
import time


class SysUsage:
    """CPU utilisation since the previous ``sample()`` (percent of one core) and resident memory."""

    def __init__(self) -> None:
        self._wall, self._cpu = time.monotonic(), time.process_time()

    def sample(self) -> dict[str, float]:
        wall, cpu = time.monotonic(), time.process_time()
        dt = wall - self._wall
        util = 100.0 * (cpu - self._cpu) / dt if dt > 0 else 0.0
        self._wall, self._cpu = wall, cpu
        return {"cpu_util_percent": util, "rss_mb": rss_bytes() / 2**20}


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the peak, not the current size
        return peak if sys.platform == "darwin" else peak * 1024
