"""Replacements: new actors for the failed members of a stage group, started without waiting for them.

A replacement is created at once, but a process that imports torch takes seconds to come up, and one
for an actor of a lost node may have to wait until the cluster has room again (a node coming back).
So the group (``actors.manager.ActorManager``) only asks, at each of its calls, which replacements have
answered their first ping (``take_ready``) and goes on with its healthy members meanwhile. A replacement
not up within the start timeout counts as a failed start only while the cluster has the resources it
asks for free: without them it is queued by Ray, waiting for room, and stays so -- which is how a group
grows back to its configured size when nodes return.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayError


@dataclass
class Replacement:
    """A new actor for a failed member's index: created, not yet answering its first ping."""

    handle: Any
    ready: Any
    """The object ref of its first ping."""
    since: float
    """When the start timeout began (moved on while the cluster has no room for it)."""


@dataclass
class StartOutcome:
    """What ``take_ready`` found: replacements up (index -> handle) and failed starts (index -> why)."""

    up: dict[int, Any]
    failed: dict[int, str]


class Replacements:
    def __init__(self, make_actor: Callable[[int, bool], Any], start_timeout_s: float,
                 actor_resources: dict[str, float]) -> None:
        """``make_actor(index, True)`` creates a replacement; ``actor_resources``: what Ray reserves for
        each (``{"CPU": 1.0}``), to tell a replacement waiting for room from one that fails to start."""
        self.make_actor, self.start_timeout_s = make_actor, start_timeout_s
        self.actor_resources = {k: float(v) for k, v in actor_resources.items() if v > 0}
        self.pending: dict[int, Replacement] = {}

    def __len__(self) -> int:
        return len(self.pending)

    def __contains__(self, index: int) -> bool:
        return index in self.pending

    def start(self, index: int) -> None:
        handle = self.make_actor(index, True)
        self.pending[index] = Replacement(handle, handle.ping.remote(), time.monotonic())

    def ready_refs(self) -> list[Any]:
        """The first-ping refs still outstanding (to ``ray.wait`` on)."""
        return [r.ready for r in self.pending.values()]

    def take_ready(self, answer_timeout_s: float | None) -> StartOutcome:
        """Take the replacements that answered (or failed) -- without waiting for those still starting."""
        out = StartOutcome({}, {})
        if not self.pending:
            return out
        refs = {r.ready: i for i, r in self.pending.items()}
        ready, waiting = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in ready:
            i = refs[ref]
            new = self.pending.pop(i)
            try:
                ray.get(ref, timeout=answer_timeout_s)  # ready: the answer (or the actor's death) is here
                out.up[i] = new.handle
            except (RayError, GetTimeoutError) as err:
                kill(new.handle)
                out.failed[i] = describe(err)
        now = time.monotonic()
        overdue = [refs[r] for r in waiting if now - self.pending[refs[r]].since > self.start_timeout_s]
        if overdue and self.room_for_one():
            for i in overdue:
                kill(self.pending.pop(i).handle)  # free its resources before the next try
                out.failed[i] = f"did not start within {self.start_timeout_s:.0f} s"
        else:  # queued for resources the cluster does not have free: it starts when a node comes back
            for i in overdue:
                self.pending[i].since = now
        return out

    def room_for_one(self) -> bool:
        """Whether the cluster has one replacement's resources free (in all: which node has them is not
        known here, so a fragmented cluster reads as room)."""
        if not self.actor_resources:
            return True
        free = ray.available_resources()
        return all(free.get(k, 0.0) >= v for k, v in self.actor_resources.items())

    def cancel(self, index: int) -> None:
        """Kill the replacement for ``index``, if one is starting (its caller replaces the member itself)."""
        new = self.pending.pop(index, None)
        if new is not None:
            kill(new.handle)

    def take_all(self) -> list[Any]:
        """The replacements not yet up, handed to the caller (who kills them) and forgotten here."""
        handles = [new.handle for new in self.pending.values()]
        self.pending.clear()
        return handles

    def stop(self) -> None:
        for new in self.pending.values():
            kill(new.handle)
        self.pending.clear()


def kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def kill_and_wait(handles: list[Any], wait_s: float) -> list[Any]:
    """Kill ``handles`` and wait, up to ``wait_s``, until Ray reports each one dead, so that what they held
    (CPUs, GPUs) is free again when this returns: ``ray.kill`` only asks, and a group built right after in
    the same Ray would otherwise wait for those resources (for long on a loaded machine). Returns the handles
    not confirmed dead in time. An actor's death shows as ``ActorDiedError`` on a call made after it; a
    call that still gets an answer went out before the kill arrived, so it is made again."""
    for handle in handles:
        kill(handle)
    deadline, alive = time.monotonic() + wait_s, list(handles)
    while alive:
        refs = {}
        for handle in alive:
            try:
                refs[handle.ping.remote()] = handle
            except Exception:  # noqa: BLE001 - a handle that cannot even take a call is gone
                continue
        left = deadline - time.monotonic()
        if not refs or left <= 0:
            return list(refs.values())
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=left)
        alive = [refs[r] for r in pending]
        for ref in ready:
            try:
                ray.get(ref)
            except ActorDiedError:
                continue
            except Exception:  # noqa: BLE001 - unavailable for now, or its ping failed: not known dead yet
                pass
            alive.append(refs[ref])
        if pending:  # the deadline passed with calls unanswered
            return alive
        if alive:
            time.sleep(0.02)  # the kill is on its way: ask again shortly, not in a tight loop
    return []


def describe(err: BaseException) -> str:
    if isinstance(err, RayActorError):
        return f"actor died ({type(err).__name__})"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}"


def cluster_actors() -> str:
    """Ray's actors that are not dead, by state and class ("ALIVE: PPO x1, EnvRunner x2; PENDING_CREATION:
    ..."), for an error about actors that did not start: it tells an actor that is only slow to come up from
    CPUs held by others (a Tune trial's process still exiting, another algorithm). Reads the GCS directly,
    because Ray's state API needs the dashboard, which runnel's Ray does not start; "" when it cannot."""
    try:
        from ray._private import state  # no public reader without the dashboard

        table = state.actors()
    except Exception:  # noqa: BLE001 - a diagnostic only: never the reason an error is not raised
        return ""
    counts: dict[str, dict[str, int]] = {}
    for info in table.values():
        if info.get("State") != "DEAD":
            by_class = counts.setdefault(str(info.get("State")), {})
            name = str(info.get("ActorClassName")).rsplit(".", 1)[-1]  # a class defined in a function: its own name
            by_class[name] = by_class.get(name, 0) + 1
    return "; ".join(f"{s}: " + ", ".join(f"{n} x{c}" for n, c in sorted(by.items()))
                     for s, by in sorted(counts.items()))
