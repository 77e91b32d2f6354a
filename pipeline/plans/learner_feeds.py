"""LearnerFeeds: the driver's side of remote learners that receive the chunk streams themselves.

IMPALA and APPO with ``num_learners=n > 0``: each learner actor hosts a ``LearnerFeed``
(``actors.learner.feed``: its own receiver, batch source and target networks); env runner i streams to
learner ``i mod n``. This class opens the feeds, runs the two-step update that keeps the gradient
all-reduce from waiting on a learner without a batch (ask the learners not known to be ready whether
they are, waiting briefly; update all of them only once every one is), and adds up what the feeds
report so that the results read as with one learner in the driver:

* counters (frames, chunks, env steps received, drops) are sums over the learners, and so are the
  learner queue's size and capacity (``learner_queue_size`` per learner) and the batch sources' stats;
* an update's statistics are the learners' means (``LearnerGroup.record_update``), its env steps
  trained the sum of their batches, its weights lag taken over every learner's batch.

A learner that dies is rebuilt by the learner group (``pipeline.groups.learner_recovery``): the update
(or readiness question) that found it dead is dropped -- the survivors may have trained part of it --
and the recreated learner opens a new feed on a new address (``moved``), which the plan hands to the
runners that streamed to the dead one. What those runners had sent it and it never trained on (in
sockets, its queue, a held batch or its circular buffer) is lost and counted, never sent again: no
chunk is trained twice. The dead feed's counters stay in the sums, so the stream counters never go
back. A learner method that raises ends the run naming the learner; one that has no batch for
``learner_queue_timeout`` seconds ends it naming the learner, its env runners and what its receiver got.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Any, Callable

import numpy as np

from actors.learner.feed import BatchSource, FeedSettings, FeedStatus, FeedUpdate
from actors.manager import CallResult
from actors.metrics import MetricsLogger
from pipeline.groups.learner_group import LearnerGroup


class LearnerFeeds:
    def __init__(self, learners: LearnerGroup, settings: FeedSettings, source: BatchSource,
                 queue_timeout_s: float, env_steps_of: Callable[[int], int] | None = None) -> None:
        """``source``: the batch source each learner gets a copy of (a fresh one: it is sent empty).
        ``settings.module_spaces`` given: the learners are ``MultiLearner``s of a ``MultiLearnerGroup`` with
        ``ModuleFeed``s, and ``env_steps_of`` turns the agent steps an update trained into env steps."""
        self.learners, self.queue_timeout_s = learners, queue_timeout_s
        self.multi_module = settings.module_spaces is not None
        self.env_steps_of = env_steps_of
        self._modules: list[str] = []  # what the next update steps on every learner (multi-module)
        self._frozen_dropped = 0  # batches of frozen modules the feeds dropped, as of the last update
        self.settings, self.source = settings, source
        self.manager = learners.manager
        self.ids = self.manager.healthy_ids()
        results = learners.call("open_feed", settings, source)
        self.addresses: list[str] = [r.value for r in results if r.ok]
        """Learner k's receiver address, in learner order: runner i streams to ``addresses[i % n]``."""
        self._status: dict[int, FeedStatus] = {i: FeedStatus(False) for i in self.ids}
        self._retired: dict[str, Any] = _sum_stats([])
        """The summed counters of feeds whose learners died (their last report)."""
        self.moved: dict[str, int] = {}
        """Addresses of dead learners' feeds not yet handed on -> env steps of theirs trained at least once
        (``take_moved``)."""
        self._waiting_since = time.monotonic()
        self.closed = False

    @property
    def num_learners(self) -> int:
        return len(self.ids)

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every learner can update now; those not known to be ready are asked, and wait up to
        ``timeout_s`` for a batch (all at once). Multi-module feeds: whether some trainable module has a batch
        on every learner (all are asked when none is known to)."""
        if self.multi_module:
            return self._wait_modules_ready(timeout_s)
        ask = [i for i in self.ids if not self._status[i].ready]
        if ask:
            results = self._call("feed_status", timeout_s, actor_ids=ask)
            if results is None:
                return False
            for res in results:
                self._status[res.actor_id] = res.value
        if all(self._status[i].ready for i in self.ids):
            return True
        return self._check_waited()

    def _common_modules(self) -> list[str]:
        common = set.intersection(*(set(self._status[i].modules) for i in self.ids))
        return sorted(common)

    def _wait_modules_ready(self, timeout_s: float) -> bool:
        self._modules = self._common_modules()
        if not self._modules:
            results = self._call("feed_status", timeout_s)
            if results is None:
                return False
            for res in results:
                self._status[res.actor_id] = res.value
            self._modules = self._common_modules()
        if self._modules:
            return True
        return self._check_waited()

    def _check_waited(self) -> bool:
        """False, or the run's end once no update could start for ``learner_queue_timeout`` seconds."""
        waited = time.monotonic() - self._waiting_since
        if waited > self.queue_timeout_s:
            raise RuntimeError(f"no train batch arrived for {waited:.0f} s (learner_queue_timeout={self.queue_timeout_s}) "
                               f"at {self._not_ready()}")
        return False

    def _not_ready(self) -> str:
        parts = []
        if self.multi_module:  # which modules each learner could update: the missing ones name the problem
            held = {i: sorted(self._status[i].modules) for i in self.ids}
            return "; ".join(f"learner {i} (fed by env runners with index % {self.num_learners} == {k}) holds "
                             f"batches of modules {held[i]}" for k, i in enumerate(self.ids)) + \
                " -- every learner's env runners must sample each trainable module (an update steps a module on " \
                "every learner at once)"
        for k, i in enumerate(self.ids):
            s = self._status[i]
            if s.ready:
                continue
            st = s.stats
            dropped = st.get("num_frames_dropped_decode_error", 0) + st.get("num_frames_dropped_bad_envelope", 0)
            parts.append(f"learner {i} (fed by env runners with index % {self.num_learners} == {k}; frames "
                         f"received: {st.get('num_frames_received', 0)}, dropped: {dropped} frames and "
                         f"{st.get('num_chunks_dropped_invalid', 0)} chunks, see the learner's log for why)")
        return "; ".join(parts)

    def update(self, timestep: int, weights_version: int, metrics: MetricsLogger) -> None:
        """One update of every learner, each on its own batch (call after ``wait_ready`` said yes);
        logs the weights lag, the queue depth and the update's statistics."""
        args = (timestep, weights_version, list(self._modules)) if self.multi_module else (timestep, weights_version)
        results = self._call("update_from_feed", *args)
        if results is None:  # a learner died in it: this update is dropped, the group rebuilt
            return
        updates: list[FeedUpdate] = [r.value for r in results]
        for r, u in zip(results, updates):
            self._status[r.actor_id] = u.status
        self._waiting_since = time.monotonic()
        versions = np.concatenate([u.versions for u in updates])
        steps = np.concatenate([u.steps for u in updates])
        lag = weights_version - versions
        metrics.log_value("stream/weights_lag_mean", float((lag * steps).sum() / steps.sum()))
        metrics.log_value("stream/weights_lag_max", int(lag.max()), reduce="max")
        summed = self.stats()  # once per update: it adds up every learner's counters
        metrics.log_value("learner_queue/size_mean", summed["learner_queue_size"])
        agent_steps = sum(u.num_steps for u in updates)
        if self.multi_module:
            module_steps: Counter = Counter()
            for u in updates:
                module_steps.update(u.module_steps)
            env_steps = agent_steps if self.env_steps_of is None else self.env_steps_of(agent_steps)
            dropped = int(summed.get("num_frozen_batches_dropped", 0))  # the feeds drop them, not the learners
            self.learners.record_module_update([u.stats for u in updates], module_steps, metrics, env_steps,
                                               refused=dropped - self._frozen_dropped)
            self._frozen_dropped = dropped
            return
        self.learners.record_update([u.stats for u in updates], agent_steps, metrics)

    def _call(self, method: str, *args: Any, actor_ids: list[int] | None = None) -> list[CallResult] | None:
        """The learners' answers; None when learners died in the call (the group is rebuilt, the
        recreated learners' feeds opened, and the call's answers are void: ask again)."""
        results = self.manager.foreach_actor(method, *args, actor_ids=actor_ids)
        recovery = self.learners.recover(results)
        if recovery is None:
            return results
        for i in self.ids:  # survivors keep their feeds (and counters); whether they are ready is asked again
            self._status[i] = FeedStatus(False, self._status[i].stats)
        for i in recovery.recreated:
            dead = self._status[i].stats
            self._retired = _sum_stats([self._retired, _without_gauges(dead)])
            k = self.ids.index(i)
            self.moved[self.addresses[k]] = int(dead.get("num_env_steps_trained_once", 0))
            address = self.learners.call("open_feed", self.settings, self.source, actor_ids=[i])[0].value
            self.addresses = [address if j == k else a for j, a in enumerate(self.addresses)]
            self._status[i] = FeedStatus(False)
        self._waiting_since = time.monotonic()  # the new learners need time for their first batch
        return None

    def add_module(self, module_id: str, observation_space: Any, action_space: Any) -> None:
        """Every learner's feed takes ``module_id``'s chunks from now on (so do feeds opened later, for learners
        rebuilt after a death)."""
        spaces = dict(self.settings.module_spaces or {})
        spaces[module_id] = (observation_space, action_space)
        self.settings = dataclasses.replace(self.settings, module_spaces=spaces)
        self.learners.call("feed_add_module", module_id, observation_space, action_space)

    def remove_module(self, module_id: str) -> None:
        """Every learner's feed drops ``module_id`` (what it held of it too); no update names it again -- the
        answers known so far that it was ready are forgotten."""
        spaces = {k: v for k, v in (self.settings.module_spaces or {}).items() if k != module_id}
        self.settings = dataclasses.replace(self.settings, module_spaces=spaces)
        self.learners.call("feed_remove_module", module_id)
        for i, status in self._status.items():
            modules = tuple(m for m in status.modules if m != module_id)
            self._status[i] = dataclasses.replace(status, ready=bool(modules), modules=modules)
        self._modules = [m for m in self._modules if m != module_id]

    def take_moved(self) -> dict[str, int]:
        """The dead feeds' addresses (each with the env steps its learner trained at least once) since the
        last call; the caller re-points their runners to ``addresses`` and counts what was lost."""
        moved, self.moved = self.moved, {}
        return moved

    def stats(self) -> dict[str, Any]:
        """The feeds' latest counters, summed over the learners -- those that died included, as last
        reported (``dropped_by_sender`` and ``source``: summed per key)."""
        return _sum_stats([self._retired, *(status.stats for status in self._status.values())])

    def close(self) -> None:
        """Stop every learner's loader thread and socket (best effort: shutting down)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.manager.foreach_actor("close_feed", timeout_s=15.0)
        except Exception:  # noqa: BLE001 - the learners are killed next anyway
            pass


GAUGES = ("learner_queue_size", "num_env_steps_pending")
"""Feed stats that describe the moment, not a count: a dead feed's are left out of the sums."""


def _without_gauges(stats: dict[str, Any]) -> dict[str, Any]:
    """A dead feed's last counters, as they stay in the sums: its gauges (and its buffer's size) gone."""
    out = {k: v for k, v in stats.items() if k not in GAUGES}
    out["source"] = {k: v for k, v in stats.get("source", {}).items() if k != "size"}
    return out


def _sum_stats(all_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Feed counters added up key by key (``dropped_by_sender`` and ``source`` are dicts: per key)."""
    out: Counter = Counter()
    dropped: Counter = Counter()
    source: Counter = Counter()
    for stats in all_stats:
        for key, value in stats.items():
            if key == "dropped_by_sender":
                dropped.update(value)
            elif key == "source":
                source.update(value)
            else:
                out[key] += value
    return {**out, "dropped_by_sender": dict(dropped), "source": dict(source)}
