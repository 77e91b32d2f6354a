"""ActorManager: a group of stage instances that survives the death of its members.

A group's members are Ray actors, or -- hosted in-process (``num_env_runners=0``, a local learner)
-- plain objects in this process; the caller's code is the same either way: ``foreach_actor``
calls a method on members and waits, ``submit``/``fetch_ready`` run requests asynchronously.
In-process calls run at once, and an exception in one propagates to the caller with its traceback
(serial mode is for debugging; there is no process to isolate a failure in).

For Ray members the manager tracks, per actor index, whether the actor is healthy and which
requests are in flight. A call that fails (actor died, method raised, no answer within the
timeout) marks the actor unhealthy and is reported to the caller as a failed result -- never
silently dropped. An exception raised by the caller's own code is different: a function run with
``apply`` (``foreach_env_runner``), or an error a stage marks as user code (a callback), is raised
to the caller as that exception, naming the member, and the member -- healthy -- is not restarted
(a restart would only repeat the error). Unhealthy actors are then either recreated at the same index (and their state
restored through ``on_restart``), or, when restarts are off and failures are ignored, left out
while the healthy rest go on; with neither, the first failure raises ``ActorGroupError`` naming
the actor and the cause.

Restarts never hold the caller up: a replacement is created and joins the group (state restored,
counted) at a later call, once it answers (``actors.replacements``); meanwhile the healthy members
go on working, and a replacement for an actor of a lost node waits for room until nodes return.
``wait_for_restarts`` blocks, for a caller with nothing else to do (no member healthy).

A caller with a recovery policy of its own (the learner group, ``pipeline.groups.learner_recovery``)
restarts nothing through ``probe_unhealthy_and_restart``: it marks members healthy again
(``mark_healthy``) and replaces dead ones with ``recreate``, which waits for the new actor -- a
learner group cannot update, nor re-form its gradient all-reduce group, without all its members.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from actors.core import is_user_code_error
from actors.replacements import Replacements, cluster_actors, describe as _describe, kill as _kill, kill_and_wait

log = logging.getLogger(__name__)

READY_FETCH_TIMEOUT_S = 60.0
"""A result ``ray.wait`` called ready is already on this node; the bound only keeps an object lost with
its node from holding the driver up (a timeout fails the member like any other lost answer)."""

STOP_WAIT_S = 10.0
"""``stop()`` waits this long at most for its killed actors to be dead (their resources free again)."""

USER_CODE_METHODS = ("apply",)
"""Methods that run a function the caller gave: whatever it raises is the caller's error."""


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
    probe_timeout_s: float | None = 30.0
    """A call not answered within this fails the actor; None waits as long as it takes."""
    start_timeout_s: float = 120.0
    """How long a new actor -- the first or a replacement -- may take to come up (a process that
    imports torch can take seconds on a busy machine: far longer than a probe should wait)."""
    max_requests_in_flight: int = 2
    actor_resources: dict = field(default_factory=dict)
    """What Ray reserves for each member (``{"CPU": 1.0}``): a replacement that has not started while
    the cluster has less than this free is waiting for room, not failing to start."""
    max_same_failures: int = 3
    """A member whose replacements fail this many times in a row with the same exception, each before
    answering a single call, fails for a reason a restart cannot fix (an env or a module that raises the
    same way every time): the group stops restarting it and, unless failures are ignored, raises that
    error instead of recreating it up to ``max_restarts`` times."""
    fatal_hint: str = ("Set restart_failed_env_runners=True to recreate failed runners, or "
                       "ignore_env_runner_failures=True to go on without them.")
    """Appended to the error raised when a member fails and neither restarts nor ignoring are on."""

    @property
    def build_timeout_s(self) -> float | None:
        """How long a call that builds something in a running member (a module added while training) may
        take: as long as a start may, and never less than a probe (None: probes wait as long as it takes)."""
        return None if self.probe_timeout_s is None else max(self.start_timeout_s, self.probe_timeout_s)


@dataclass
class _Member:
    handle: Any
    healthy: bool = True
    restarts: int = 0
    failed_at: float = 0.0
    in_flight: dict = field(default_factory=dict)  # request -> tag
    methods: dict = field(default_factory=dict)  # request -> method name
    last_error: str = ""
    failed_method: str = ""
    """The method whose call failed last (this incarnation's or its predecessor's)."""
    same_failures: int = 0
    """Incarnations in a row whose call of ``failed_method`` raised the same exception, none of them having
    answered a call of that method first."""


class _Done:
    """An in-process call's result, standing where a Ray ObjectRef would."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class ActorManager:
    def __init__(self, make_actor: Callable[[int, bool], Any], actor_ids: list[int], settings: FaultToleranceSettings,
                 on_restart: Callable[[int, Any], None] | None = None, name: str = "env runner",
                 in_process: bool = False) -> None:
        """``make_actor(index, recreated)`` creates the member for an index (remote env runners are
        numbered from 1, as RLlib numbers them; an in-process one is 0); ``on_restart(index,
        handle)`` restores state into a recreated actor before it is used."""
        self.make_actor, self.settings, self.on_restart, self.name = make_actor, settings, on_restart, name
        self.in_process = in_process
        self.members: dict[int, _Member] = {i: _Member(make_actor(i, False)) for i in actor_ids}
        self.starting = Replacements(make_actor, max(settings.start_timeout_s, settings.probe_timeout_s or 0.0),
                                     settings.actor_resources)
        """Replacements created and not yet up (starting, or waiting for room on the cluster)."""
        self.num_restarts = 0
        self.num_failures = 0
        self.num_dropped_results = 0
        self.restart_wait_s = 0.0
        """Seconds callers spent in restart handling (creating replacements, restoring their state)."""

    # --- views --------------------------------------------------------------------------------
    def healthy_ids(self) -> list[int]:
        return [i for i, m in self.members.items() if m.healthy]

    def num_healthy(self) -> int:
        return len(self.healthy_ids())

    def handle(self, actor_id: int) -> Any:
        """The Ray actor handle, or the object itself when hosted in-process."""
        return self.members[actor_id].handle

    def num_starting(self) -> int:
        """Replacements created and not yet up."""
        return len(self.starting)

    def num_in_flight(self, actor_id: int) -> int:
        return len(self.members[actor_id].in_flight)

    def share(self, value: Any) -> Any:
        """``value`` as members should receive it when many read it: one ``ray.put`` (the object
        ref goes to each), or the value itself in-process."""
        return value if self.in_process else ray.put(value)

    def _start(self, member: _Member, method: str, args: tuple, kwargs: dict, actor_id: int | None = None) -> Any:
        if self.in_process:
            try:
                return _Done(getattr(member.handle, method)(*args, **kwargs))
            except Exception as err:
                if method in USER_CODE_METHODS:
                    err.add_note(self._user_error_note(actor_id))
                raise
        return getattr(member.handle, method).remote(*args, **kwargs)

    def _user_error_note(self, actor_id: int | None) -> str:
        where = f"{self.name} {actor_id}" if actor_id is not None else f"an in-process {self.name}"
        return (f"(raised by user code run in {where}; it is the caller's error, not a failure of the "
                f"{self.name}, which was not restarted)")

    # --- synchronous calls --------------------------------------------------------------------
    def foreach_actor(self, method: str, *args: Any, actor_ids: list[int] | None = None,
                      per_actor_args: dict[int, tuple] | None = None, timeout_s: float | None = None,
                      **kwargs: Any) -> list[CallResult]:
        """Call ``method`` on every (given) healthy actor and wait; failed calls come back with
        ok=False. ``per_actor_args`` gives some actors their own positional arguments."""
        ids = [i for i in (actor_ids or self.healthy_ids()) if self.members[i].healthy]
        per_actor_args = per_actor_args or {}
        refs = {}
        for i in ids:
            refs[self._start(self.members[i], method, per_actor_args.get(i, args), kwargs, actor_id=i)] = i
        return self._collect(refs, timeout_s if timeout_s is not None else self.settings.probe_timeout_s,
                             user_code=method in USER_CODE_METHODS, method=method)

    def _collect(self, refs: dict, timeout_s: float | None, user_code: bool = False, method: str = ""
                 ) -> list[CallResult]:
        """Wait for ``refs``; members that died or did not answer are marked failed. An exception raised
        in user code (``user_code``: the method runs the caller's function) is raised to the caller
        once every answer is in -- the first by member index -- and leaves its member healthy."""
        results: dict[int, CallResult] = {}
        user_errors: dict[int, RayTaskError] = {}
        remote = [r for r in refs if not isinstance(r, _Done)]
        ready, not_ready = ray.wait(remote, num_returns=len(remote), timeout=timeout_s) if remote else ([], [])
        for ref in refs:
            if isinstance(ref, _Done):
                results[refs[ref]] = CallResult(refs[ref], True, ref.value)
        for ref in ready:
            i = refs[ref]
            try:
                results[i] = CallResult(i, True, ray.get(ref, timeout=READY_FETCH_TIMEOUT_S))
                self._answered(i, method)
            except RayError as err:
                results[i] = CallResult(i, False, error=err)
                if _is_user_error(err, user_code):
                    user_errors[i] = err
                else:
                    self._mark_failed(i, err, method=method)
        for ref in not_ready:
            i = refs[ref]
            err = GetTimeoutError(f"{self.name} {i} did not answer within {timeout_s:.1f} s")
            results[i] = CallResult(i, False, error=err)
            self._mark_failed(i, err, kill=True)
        if user_errors:
            i = min(user_errors)
            raise self._caller_error(i, user_errors[i]) from None
        return [results[i] for i in sorted(results)]

    def _caller_error(self, actor_id: int, err: RayTaskError) -> BaseException:
        """The exception user code raised in a member, as the caller should see it: an instance of its own
        class (``except ValueError`` catches it), whose message holds the remote traceback."""
        out = err.as_instanceof_cause()
        out.add_note(self._user_error_note(actor_id))
        return out

    # --- asynchronous calls -------------------------------------------------------------------
    def submit(self, method: str, *args: Any, actor_ids: list[int] | None = None, tag: Any = None,
               **kwargs: Any) -> int:
        """Start ``method`` on healthy actors that have room under ``max_requests_in_flight``.
        Returns how many requests were started; collect them with ``fetch_ready``."""
        started = 0
        for i in actor_ids or self.healthy_ids():
            m = self.members[i]
            # in-process requests are done when submitted: they hold no slot
            if m.healthy and (self.in_process or len(m.in_flight) < self.settings.max_requests_in_flight):
                ref = self._start(m, method, args, kwargs)
                m.in_flight[ref], m.methods[ref] = tag, method
                started += 1
        return started

    def fetch_ready(self, timeout_s: float = 0.0) -> list[CallResult]:
        refs = {ref: i for i, m in self.members.items() for ref in m.in_flight}
        if not refs:
            return []
        remote = [r for r in refs if not isinstance(r, _Done)]
        ready = [r for r in refs if isinstance(r, _Done)]
        if remote:
            ready += ray.wait(remote, num_returns=len(remote), timeout=timeout_s)[0]
        out = []
        for ref in ready:
            i = refs[ref]
            tag = self.members[i].in_flight.pop(ref, None)
            method = self.members[i].methods.pop(ref, "")
            if isinstance(ref, _Done):
                out.append(CallResult(i, True, ref.value, tag=tag))
                continue
            try:
                out.append(CallResult(i, True, ray.get(ref, timeout=READY_FETCH_TIMEOUT_S), tag=tag))
                self._answered(i, method)
            except RayError as err:
                if _is_user_error(err):
                    raise self._caller_error(i, err) from None
                out.append(CallResult(i, False, error=err, tag=tag))
                self._mark_failed(i, err, method=method)
        return out

    # --- start-up and failure handling --------------------------------------------------------
    def check_started(self, timeout_s: float, what: str) -> None:
        """Surface construction errors (a broken env creator, unplaceable actors) at build time,
        as one clear error, instead of as a loop of restarts. ``what`` says what each member
        needs (named in the error when they cannot be placed)."""
        if self.in_process:
            return
        refs = {m.handle.ping.remote(): i for i, m in self.members.items()}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        try:
            if pending:
                raise RuntimeError(
                    f"{self.name}(s) {sorted(refs[r] for r in pending)} did not start within {timeout_s:.0f} s; "
                    f"the cluster has {ray.available_resources()} available for {len(refs)} {self.name}s needing "
                    f"{what} each (Ray's live actors: {cluster_actors() or 'unknown'}). Lower their number or "
                    f"resources, or add nodes.")
            for ref in ready:
                try:
                    ray.get(ref, timeout=READY_FETCH_TIMEOUT_S)
                except RayError as err:
                    cause = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                    raise RuntimeError(f"{self.name} {refs[ref]} failed to start: {cause}") from None
        except RuntimeError:
            self.stop()
            raise

    def _answered(self, actor_id: int, method: str) -> None:
        m = self.members[actor_id]
        if method == m.failed_method:
            m.same_failures = 0  # this incarnation does what the last one failed at: not a repeating fault

    def _mark_failed(self, actor_id: int, err: BaseException, kill: bool = False, method: str = "") -> None:
        m = self.members[actor_id]
        if not m.healthy:
            return
        described = _describe(err)
        repeated = (isinstance(err, RayTaskError) and m.same_failures > 0 and described == m.last_error
                    and method == m.failed_method)
        m.same_failures = m.same_failures + 1 if repeated else (1 if isinstance(err, RayTaskError) else 0)
        m.healthy, m.failed_at, m.last_error, m.failed_method = False, time.monotonic(), described, method
        self.num_failures += 1
        self.num_dropped_results += len(m.in_flight)
        m.in_flight.clear()
        m.methods.clear()
        trace = _remote_traceback(err)
        log.warning("%s %d failed: %s%s", self.name, actor_id, m.last_error, trace)
        if kill:  # a hung actor would hold its resources (and maybe a half-sent request) forever
            _kill(m.handle)
        s = self.settings
        if not s.restart_failed and not s.ignore_failures:
            raise ActorGroupError(f"{self.name} {actor_id} failed: {m.last_error}. {s.fatal_hint}".rstrip() + trace) from err
        if s.restart_failed and 0 < s.max_same_failures <= m.same_failures:
            m.restarts = max(m.restarts, s.max_restarts)  # restarting repeats the error: no more replacements
            message = (f"{self.name} {actor_id} failed {m.same_failures} times in a row with the same error, each "
                       f"time before a replacement answered anything: {m.last_error}. Restarting cannot fix that: "
                       f"the cause is in the code it runs (its env, module or settings); fix it and run again")
            if not s.ignore_failures:
                raise ActorGroupError(message + trace) from err
            log.error("%s; going on without it (failures are ignored)", message)

    def probe_unhealthy_and_restart(self, force: bool = False) -> list[int]:
        """Swap in the replacements that came up (their state restored through ``on_restart``), and create
        replacements for failed actors whose restart delay has passed (``force``: at once). Returns the
        indices that rejoined the group now; never waits for a replacement to start."""
        s = self.settings
        if not s.restart_failed:
            if not s.ignore_failures and any(not m.healthy for m in self.members.values()):
                bad = [i for i, m in self.members.items() if not m.healthy]
                raise ActorGroupError(f"{self.name}(s) {bad} failed: {self.members[bad[0]].last_error}")
            if self.members and not self.healthy_ids():
                raise ActorGroupError(f"all {self.name}s failed; last error: {self._last_error()}")
            return []
        t0 = time.perf_counter()
        try:
            restarted = self._take_started()
            for i, m in self.members.items():
                if m.healthy or i in self.starting or (not force and time.monotonic() - m.failed_at < s.restart_delay_s):
                    continue
                if m.restarts >= s.max_restarts:
                    if not s.ignore_failures and not self.healthy_ids() and not self.starting:
                        raise ActorGroupError(f"{self.name} {i} exceeded max restarts ({s.max_restarts}): {m.last_error}")
                    continue
                _kill(m.handle)
                self.starting.start(i)
            return restarted
        finally:
            self.restart_wait_s += time.perf_counter() - t0

    def _take_started(self) -> list[int]:
        outcome = self.starting.take_ready(self.settings.probe_timeout_s)
        for i, why in outcome.failed.items():
            self._failed_start(i, why)
        restarted: list[int] = []
        for i, handle in outcome.up.items():
            m = self.members[i]
            try:
                if self.on_restart is not None:
                    self.on_restart(i, handle)
            except (RayError, GetTimeoutError) as err:
                _kill(handle)
                self._failed_start(i, _describe(err))
                continue
            self.members[i] = _Member(handle, restarts=m.restarts + 1, last_error=m.last_error,
                                      failed_method=m.failed_method, same_failures=m.same_failures)
            self.num_restarts += 1
            restarted.append(i)
            log.warning("%s %d recreated (restart #%d)", self.name, i, m.restarts + 1)
        return restarted

    def _failed_start(self, actor_id: int, why: str) -> None:
        m = self.members[actor_id]
        m.failed_at, m.last_error = time.monotonic(), why
        m.restarts += 1
        log.warning("%s %d: its replacement failed to start: %s", self.name, actor_id, why)

    def wait_for_restarts(self, timeout_s: float) -> list[int]:
        """Create what is due, then wait up to ``timeout_s`` for a replacement to come up (for a caller
        with no healthy member to work with); returns the indices that rejoined."""
        restarted = self.probe_unhealthy_and_restart(force=True)
        deadline = time.monotonic() + timeout_s
        while not restarted and len(self.starting) and time.monotonic() < deadline:
            ray.wait(self.starting.ready_refs(), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            restarted = self.probe_unhealthy_and_restart(force=True)
        return restarted

    # --- for callers with a recovery policy of their own (the learner group) ------------------
    def mark_healthy(self, actor_id: int) -> None:
        """Count a member that a failed call marked failed as healthy again: for a caller that knows it
        is alive and sound (a learner whose gradient all-reduce broke because a peer died)."""
        self.members[actor_id].healthy = True

    def recreate(self, actor_id: int, timeout_s: float) -> Any:
        """Replace member ``actor_id`` now, whatever the restart settings say, waiting for it (unlike
        ``probe_unhealthy_and_restart``: for a caller that cannot go on without it): the old actor is
        killed, a new one made at its index and, once it answers a ping within ``timeout_s``, restored
        (``on_restart``), counted as a restart and healthy. Returns its handle; raises ActorGroupError
        naming the member when the new one does not come up (its resources are freed first)."""
        old = self.members[actor_id]
        _kill(old.handle)
        self.starting.cancel(actor_id)  # a replacement started for it by ``probe_unhealthy_and_restart``
        t0 = time.perf_counter()
        handle = self.make_actor(actor_id, True)
        try:
            ray.get(handle.ping.remote(), timeout=timeout_s)
            if self.on_restart is not None:
                self.on_restart(actor_id, handle)
        except (RayError, GetTimeoutError) as err:
            _kill(handle)
            raise ActorGroupError(f"{self.name} {actor_id} could not be recreated within {timeout_s:.0f} s: "
                                  f"{_describe(err)}; the cluster has {ray.available_resources()} available") from err
        finally:
            self.restart_wait_s += time.perf_counter() - t0
        self.members[actor_id] = _Member(handle, restarts=old.restarts + 1)
        self.num_restarts += 1
        log.warning("%s %d recreated (restart #%d)", self.name, actor_id, old.restarts + 1)
        return handle

    def probe_health(self) -> list[int]:
        """Ping every healthy actor; those that fail or time out are marked failed. Returns failures."""
        before = set(self.healthy_ids())
        self.foreach_actor("ping", timeout_s=self.settings.probe_timeout_s)
        return sorted(before - set(self.healthy_ids()))

    def _last_error(self) -> str:
        return next((m.last_error for m in self.members.values() if m.last_error), "unknown")

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """In-process members are stopped (``stop()``); Ray actors are killed, and their deaths awaited up to
        ``wait_s`` (``kill_and_wait``), so that the resources they held are free when this returns."""
        if self.in_process:
            for m in self.members.values():
                m.handle.stop()
            self.starting.stop()
        else:
            left = kill_and_wait([m.handle for m in self.members.values()] + self.starting.take_all(), wait_s)
            if left:
                log.info("%s: %d killed actor(s) not confirmed dead within %.0f s; Ray frees their resources once "
                         "they are", self.name, len(left), wait_s)
        self.members.clear()


def _is_user_error(err: RayError, user_code: bool = False) -> bool:
    """Whether a failed call raised in user code (the caller's error) rather than failed the member.
    A method that ran and raised is a ``RayTaskError``; a member that died or was lost raises another
    ``RayError`` (``ActorDiedError``...), always a member failure. A method running the caller's
    function (``user_code``) hands over anything it raised; others only what a stage marks as user
    code (``UserCodeError``, or an exception with ``runnel_user_code`` set)."""
    if not isinstance(err, RayTaskError):
        return False
    return user_code or is_user_code_error(err.cause)


def _remote_traceback(err: BaseException) -> str:
    """The stack trace of an exception raised inside a member's process ("" when it died without one)."""
    if isinstance(err, RayTaskError):
        return "\n--- where it was raised (" + str(err).strip() + ")"
    return ""
