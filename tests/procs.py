"""Processes on Linux, read from /proc (psutil is not among runnel's dependencies): the processes under
a process, and what each holds -- resident memory, open file descriptors, threads. Used by the soak
benchmark and by tests that check they leave no process behind."""
from __future__ import annotations

import os


def descendants(pid: int) -> list[int]:
    """Every living process under ``pid`` (children, their children...), zombies left out."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _stat(int(entry))
        if stat is not None and stat[0] != "Z":
            parents.setdefault(stat[1], []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid), or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    return fields[0], int(fields[1])


def usage(pid: int) -> dict[str, float] | None:
    """Resident MB, open fds and threads of ``pid``; None if it is gone (or not readable)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kb = int(status.get("VmRSS", "0 kB").split()[0])
    return {"rss_mb": rss_kb / 1024, "fds": fds, "threads": int(status["Threads"]), "cpu_s": cpu_seconds(pid)}


def cpu_seconds(pid: int) -> float:
    """CPU time ``pid`` has used so far (user + system), in seconds; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def machine_cpu_seconds() -> dict[str, float]:
    """The whole machine's CPU time so far (``/proc/stat``): busy (all but idle and iowait) and stolen by
    the hypervisor, in seconds summed over cores."""
    with open("/proc/stat", encoding="ascii") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return {"busy_s": (user + nice + system + irq + softirq + steal) / tick, "steal_s": steal / tick}


def command(pid: int) -> list[str]:
    """The command line of ``pid`` (a Ray worker's is its title, e.g. ``ray::EnvRunner.sample``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    parts = [p.decode(errors="replace") for p in raw.split(b"\0") if p]
    return parts[0].split() + parts[1:] if len(parts) == 1 else parts  # a title set by the process is one string


def with_environment(key: str, value: str) -> list[int]:
    """Living processes whose environment has ``key=value`` -- what a process started, even once orphaned
    (a Ray worker whose raylet died is re-parented, not ended at once)."""
    want = f"{key}={value}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                found = want in f.read().split(b"\0")
        except OSError:
            continue
        stat = _stat(int(entry))
        if found and stat is not None and stat[0] != "Z":
            out.append(int(entry))
    return out
