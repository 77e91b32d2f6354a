"""ActorManager: a group of Ray actors that survives the death of its members.

It tracks, per actor index, whether the actor is healthy and which requests are in flight. A call
that fails (actor died, method raised, no answer within the timeout) marks the actor unhealthy
and is reported to the caller as a failed result — never silently dropped. Unhealthy actors are
then either recreated at the same index (and their state restored through ``on_restart``), or,
when restarts are off and failures are ignored, left out while the healthy rest go on; with
neither, the first failure raises ``ActorGroupError`` naming the actor and the cause.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

log = logging.getLogger(__name__)


class ActorGroupError(RuntimeError):
    """An actor failed and the group is configured neither to restart it nor to go on without it."""


@dataclass
class CallResult:
    actor_id: int
    ok: bool
    value: Any = None
    error: BaseException | None = None
    tag: Any = None


@dataclass
class FaultToleranceSettings:
    restart_failed: bool = True
    ignore_failures: bool = False
    max_restarts: int = 1000
    restart_delay_s: float = 1.0
    probe_timeout_s: float = 30.0
    max_requests_in_flight: int = 2


@dataclass
class _Member:
    handle: Any
    healthy: bool = True
    restarts: int = 0
    failed_at: float = 0.0
    in_flight: dict = field(default_factory=dict)  # ObjectRef -> tag
    last_error: str = ""


class ActorManager:
    def __init__(self, make_actor: Callable[[int, bool], Any], num_actors: int, settings: FaultToleranceSettings,
                 on_restart: Callable[[int, Any], None] | None = None, name: str = "env runner") -> None:
        """``make_actor(index, recreated)`` creates the Ray actor for an index (1-based, as RLlib numbers
        runners); ``on_restart(index, handle)`` restores state into a recreated actor before it is used."""
        self.make_actor, self.settings, self.on_restart, self.name = make_actor, settings, on_restart, name
        self.members: dict[int, _Member] = {i: _Member(make_actor(i, False)) for i in range(1, num_actors + 1)}
        self.num_restarts = 0
        self.num_failures = 0
        self.num_dropped_results = 0
        self.recently_restarted: list[int] = []

    # --- views --------------------------------------------------------------------------------
    def healthy_ids(self) -> list[int]:
        return [i for i, m in self.members.items() if m.healthy]

    def num_healthy(self) -> int:
        return len(self.healthy_ids())

    def handle(self, actor_id: int) -> Any:
        return self.members[actor_id].handle

    def num_in_flight(self, actor_id: int) -> int:
        return len(self.members[actor_id].in_flight)

    # --- synchronous calls --------------------------------------------------------------------
    def foreach_actor(self, method: str, *args: Any, actor_ids: list[int] | None = None,
                      timeout_s: float | None = None, **kwargs: Any) -> list[CallResult]:
        """Call ``method`` on every (given) healthy actor and wait; failed calls come back with ok=False."""
        ids = [i for i in (actor_ids or self.healthy_ids()) if self.members[i].healthy]
        refs = {getattr(self.members[i].handle, method).remote(*args, **kwargs): i for i in ids}
        return self._collect(refs, timeout_s if timeout_s is not None else self.settings.probe_timeout_s)

    def _collect(self, refs: dict, timeout_s: float) -> list[CallResult]:
        results: dict[int, CallResult] = {}
        ready, not_ready = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            i = refs[ref]
            try:
                results[i] = CallResult(i, True, ray.get(ref))
            except RayError as err:
                results[i] = CallResult(i, False, error=err)
                self._mark_failed(i, err)
        for ref in not_ready:
            i = refs[ref]
            err = GetTimeoutError(f"{self.name} {i} did not answer within {timeout_s:.1f} s")
            results[i] = CallResult(i, False, error=err)
            self._mark_failed(i, err, kill=True)
        return [results[i] for i in sorted(results)]

    # --- asynchronous calls -------------------------------------------------------------------
    def submit(self, method: str, *args: Any, actor_ids: list[int] | None = None, tag: Any = None,
               **kwargs: Any) -> int:
        """Start ``method`` on healthy actors that have room under ``max_requests_in_flight``.
        Returns how many requests were started; collect them with ``fetch_ready``."""
        started = 0
        for i in actor_ids or self.healthy_ids():
            m = self.members[i]
            if m.healthy and len(m.in_flight) < self.settings.max_requests_in_flight:
                m.in_flight[getattr(m.handle, method).remote(*args, **kwargs)] = tag
                started += 1
        return started

    def fetch_ready(self, timeout_s: float = 0.0) -> list[CallResult]:
        refs = {ref: i for i, m in self.members.items() for ref in m.in_flight}
        if not refs:
            return []
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        out = []
        for ref in ready:
            i = refs[ref]
            tag = self.members[i].in_flight.pop(ref, None)
            try:
                out.append(CallResult(i, True, ray.get(ref), tag=tag))
            except RayError as err:
                out.append(CallResult(i, False, error=err, tag=tag))
                self._mark_failed(i, err)
        return out

    # --- failure handling ---------------------------------------------------------------------
    def _mark_failed(self, actor_id: int, err: BaseException, kill: bool = False) -> None:
        m = self.members[actor_id]
        if not m.healthy:
            return
        m.healthy, m.failed_at, m.last_error = False, time.monotonic(), _describe(err)
        self.num_failures += 1
        self.num_dropped_results += len(m.in_flight)
        m.in_flight.clear()
        log.warning("%s %d failed: %s", self.name, actor_id, m.last_error)
        if kill:  # a hung actor would hold its resources (and maybe a half-sent request) forever
            try:
                ray.kill(m.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        s = self.settings
        if not s.restart_failed and not s.ignore_failures:
            raise ActorGroupError(
                f"{self.name} {actor_id} failed: {m.last_error}. Set restart_failed_env_runners=True to recreate "
                f"failed runners, or ignore_env_runner_failures=True to go on without them."
            ) from err

    def probe_unhealthy_and_restart(self, force: bool = False) -> list[int]:
        """Recreate failed actors whose restart delay has passed; returns the indices recreated."""
        s = self.settings
        restarted = []
        if not s.restart_failed:
            if not s.ignore_failures and any(not m.healthy for m in self.members.values()):
                bad = [i for i, m in self.members.items() if not m.healthy]
                raise ActorGroupError(f"{self.name}(s) {bad} failed: {self.members[bad[0]].last_error}")
            if self.members and not self.healthy_ids():
                raise ActorGroupError(f"all {self.name}s failed; last error: {self._last_error()}")
            return restarted
        for i, m in self.members.items():
            if m.healthy or (not force and time.monotonic() - m.failed_at < s.restart_delay_s):
                continue
            if m.restarts >= s.max_restarts:
                if not s.ignore_failures and not self.healthy_ids():
                    raise ActorGroupError(f"{self.name} {i} exceeded max restarts ({s.max_restarts}): {m.last_error}")
                continue
            try:
                ray.kill(m.handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
            handle = self.make_actor(i, True)
            try:
                ray.get(handle.ping.remote(), timeout=s.probe_timeout_s)
                if self.on_restart is not None:
                    self.on_restart(i, handle)
            except (RayError, GetTimeoutError) as err:
                try:  # the replacement did not come up: free its resources before the next try
                    ray.kill(handle, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
                m.failed_at, m.last_error = time.monotonic(), _describe(err)
                m.restarts += 1
                continue
            self.members[i] = _Member(handle, restarts=m.restarts + 1)
            self.num_restarts += 1
            restarted.append(i)
            log.warning("%s %d recreated (restart #%d)", self.name, i, m.restarts + 1)
        self.recently_restarted.extend(restarted)
        return restarted

    def probe_health(self) -> list[int]:
        """Ping every healthy actor; those that fail or time out are marked failed. Returns failures."""
        before = set(self.healthy_ids())
        self.foreach_actor("ping", timeout_s=self.settings.probe_timeout_s)
        return sorted(before - set(self.healthy_ids()))

    def _last_error(self) -> str:
        return next((m.last_error for m in self.members.values() if m.last_error), "unknown")

    def stop(self) -> None:
        for m in self.members.values():
            try:
                ray.kill(m.handle, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.members.clear()


def _describe(err: BaseException) -> str:
    if isinstance(err, RayActorError):
        return f"actor died ({type(err).__name__})"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}"
