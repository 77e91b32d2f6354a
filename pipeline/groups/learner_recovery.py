"""LearnerRecovery: rebuilding dead learner actors inside the running job.

RLlib ends the job when a learner dies; a days-long run should not. When a call to the learner group
finds a learner actor gone (its process died, its node was lost), the group is rebuilt and the job goes
on in the same ``train()`` loop:

1. Which learners are dead: those whose call failed with anything but an exception raised by the method.
   A learner that *raised* is alive -- typically its gradient all-reduce broke because a peer died
   (gloo reports the closed connection at once). If every failure was a raise, nothing died: that error
   ends the run, as before.
2. The state to rebuild from: the first surviving learner's ``get_state`` (weights, optimizer moments,
   target networks, algorithm fields). All learners hold identical weights after every update, so one
   survivor speaks for all; a survivor interrupted mid-update may hold a few minibatch steps of that
   update, which every learner then gets. With no survivor, the latest in-memory *snapshot*: taken every
   ``learner_snapshot_interval_s`` after an update, and at every checkpoint save and restore (those
   states are fetched anyway). With no snapshot yet, the recreated learner 0's fresh state -- the run's
   initial weights when seeded -- and the updates so far are lost. Each learner keeps its own minibatch
   shuffling generator (its seed differs by rank).
3. Every surviving learner leaves the gradient all-reduce group: a gloo group cannot take a replacement
   member, so the group is re-formed, never patched.
4. Each dead learner is recreated at its index (same rank, same resources) and every learner but the
   donor is given the state; then all join a new group on a fresh port of learner 0's node.

A snapshot costs one ``get_state`` round trip (about three times the weights: parameters and Adam's two
moments) and that much driver memory; one is kept. ``max_num_learner_restarts`` bounds the learner
actors recreated in all; the next failure ends the run naming the learner, the count and the setting.
A failure while recovering (a survivor dying too, a learner that cannot be placed) ends the run as well.
What the caller does with the interrupted call is its own choice (``LearnerGroup`` calls it again;
the streaming feeds drop that update and re-point runners, see ``pipeline.plans.learner_feeds``).
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayTaskError

from actors.manager import ActorGroupError, ActorManager, CallResult

log = logging.getLogger("runnel")


@dataclass
class RecoverySettings:
    """How a learner group recovers from dead learners (the config's fault-tolerance settings)."""

    max_restarts: int = 10
    """Learner actors that may be recreated in all over the job (``max_num_learner_restarts``)."""
    snapshot_interval_s: float | None = 60.0
    """Seconds between in-memory state snapshots (``learner_snapshot_interval_s``); None: only the
    states of checkpoints."""
    start_timeout_s: float = 300.0
    """How long a recreated learner may take to be placed and start (``learner_placement_timeout_s``)."""


@dataclass
class Snapshot:
    state: dict[str, Any]
    what: str
    """Which state it is, for the log line of a recovery that falls back on it."""
    taken_at: float


@dataclass
class Recovery:
    """What one recovery did."""

    recreated: list[int]
    donor: int | None
    """The surviving learner whose state the others got; None: no learner survived, every learner went back
    to the snapshot (or, with none yet, to recreated learner 0's initial state) and the updates since are lost."""


class LearnerRecovery:
    def __init__(self, manager: ActorManager, settings: RecoverySettings, distributed: bool) -> None:
        """``distributed``: the learners meet in a gradient all-reduce group (more than one learner)."""
        self.manager, self.settings, self.distributed = manager, settings, distributed
        self.snapshot: Snapshot | None = None
        self.num_recoveries = 0
        self.num_restarts = 0
        """Learner actors recreated so far (several may die at once: one recovery)."""

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot_due(self) -> bool:
        interval = self.settings.snapshot_interval_s
        if interval is None:
            return False
        return self.snapshot is None or time.monotonic() - self.snapshot.taken_at >= interval

    def keep(self, state: dict[str, Any], what: str) -> None:
        """Keep ``state`` (a learner's ``get_state``; ``what`` says which) as the snapshot to rebuild from."""
        self.snapshot = Snapshot(state, what, time.monotonic())

    # --- failures -----------------------------------------------------------------------------
    def dead_among(self, results: list[CallResult]) -> list[int]:
        """The learners whose actors died in a call (empty: the call went through). Raises the first
        failure when some failed and none died: a learner method raised, which a restart would repeat."""
        failed = [r for r in results if not r.ok]
        dead = sorted(r.actor_id for r in failed if not isinstance(r.error, RayTaskError))
        if failed and not dead:
            first = failed[0]
            raise ActorGroupError(f"learner {first.actor_id} failed: {_describe(first.error)}") from first.error
        return dead

    def recover(self, results: list[CallResult]) -> Recovery:
        """Rebuild the group after a call in which the learners of ``dead_among(results)`` died."""
        dead = self.dead_among(results)
        errors = {r.actor_id: r.error for r in results if not r.ok}
        alive = [i for i in sorted(self.manager.members) if i not in dead]
        for i in alive:  # alive, but their call raised (a broken all-reduce): healthy as far as we know
            self.manager.mark_healthy(i)
        donor, state = None, None
        for i in alive:
            res = self.manager.foreach_actor("get_state", actor_ids=[i])[0]
            if res.ok:
                donor, state = i, res.value
                break
            dead.append(i)
            errors[i] = res.error
        dead = sorted(dead)
        self._check_budget(dead, errors)
        survivors = [i for i in alive if i not in dead]
        try:
            if self.distributed and survivors:
                self._all_ok(self.manager.foreach_actor("leave_distributed", actor_ids=survivors), "leaving the group")
            for i in dead:
                self.manager.recreate(i, self.settings.start_timeout_s)
                self.num_restarts += 1
            survivor = donor
            if state is not None:
                source = f"learner {donor}'s state"
            elif self.snapshot is not None:
                state, source = self.snapshot.state, f"{self.snapshot.what} (the updates since are lost)"
            else:  # nothing to copy: learner 0 starts over and the others take its state
                donor = sorted(self.manager.members)[0]
                state = self._all_ok(self.manager.foreach_actor("get_state", actor_ids=[donor]), "reading its state")[0]
                source = "the initial state (no learner survived and no snapshot was taken yet: every update is lost)"
            targets = [i for i in sorted(self.manager.members) if i != donor]
            if targets:
                shared = self.manager.share(peer_state(state))
                self._all_ok(self.manager.foreach_actor("set_state", shared, actor_ids=targets), "restoring its state")
            if self.distributed:
                self._join_new_group()
        except ActorGroupError as err:
            raise ActorGroupError(f"learner(s) {dead} died ({_describe(errors[dead[0]])}) and rebuilding the "
                                  f"learner group failed: {err}. The run ends here; resume it from its last "
                                  f"checkpoint") from err
        self.num_recoveries += 1
        log.warning("learner(s) %s died (%s); recreated from %s%s; %d of max_num_learner_restarts=%d used",
                    dead, _describe(errors[dead[0]]), source,
                    f", gradient group re-formed with {len(self.manager.members)} learners" if self.distributed else "",
                    self.num_restarts, self.settings.max_restarts)
        return Recovery(dead, survivor)

    def _check_budget(self, dead: list[int], errors: dict[int, BaseException]) -> None:
        limit = self.settings.max_restarts
        if self.num_restarts + len(dead) <= limit:
            return
        err = errors[dead[0]]
        raise ActorGroupError(
            f"learner {dead[0]} failed ({_describe(err)}) and cannot be recreated: the job has recreated "
            f"{self.num_restarts} learner(s) already and max_num_learner_restarts={limit} allows "
            f"{'none' if limit == 0 else f'{limit} in all'}. Raise it with .fault_tolerance("
            f"max_num_learner_restarts=N) to recover more often; resume this run from its last checkpoint") from err

    def _all_ok(self, results: list[CallResult], doing: str) -> list[Any]:
        bad = [r for r in results if not r.ok]
        if bad:
            raise ActorGroupError(f"learner {bad[0].actor_id} failed while {doing}: {_describe(bad[0].error)}")
        return [r.value for r in results]

    def _join_new_group(self) -> None:
        """Every learner joins a new all-reduce group, meeting on a free port of learner 0's node."""
        first = self.manager.handle(sorted(self.manager.members)[0])
        addr, port = ray.get(first.apply.remote(free_address), timeout=self.settings.start_timeout_s)
        self._all_ok(self.manager.foreach_actor("setup_distributed", addr, port, timeout_s=self.settings.start_timeout_s),
                     "joining the new gradient group")


def peer_state(state: dict[str, Any]) -> dict[str, Any]:
    """A learner's state as another learner takes it: without the minibatch shuffling generator, which
    each learner keeps its own (seeded by rank); a multi-agent learner's per module."""
    if isinstance(state.get("modules"), dict):
        return {**state, "modules": {mid: peer_state(s) for mid, s in state["modules"].items()}}
    return {k: v for k, v in state.items() if k != "rng"}


def free_address(_learner: Any) -> tuple[str, int]:
    """A free TCP port on the calling learner's node (run inside the learner with ``apply``)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def _describe(err: BaseException | None) -> str:
    if err is None:
        return "unknown error"
    text = str(err).strip().splitlines()
    last = text[-1] if text else ""
    return f"{type(err).__name__}: {last}" if last else type(err).__name__
