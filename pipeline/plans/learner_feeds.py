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

A learner that fails ends the run with an error naming it (``LearnerGroup``: learners are not
restarted). A learner that dies mid-update breaks the others' all-reduce, and their errors may come
back first; so the error names the learners whose actors are gone, with the first error after it. One
that has no batch for ``learner_queue_timeout`` seconds ends the run naming the learner, its env runners
and what its receiver got.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError

from actors.learner.feed import BatchSource, FeedSettings, FeedStatus, FeedUpdate
from actors.manager import ActorGroupError, CallResult
from actors.metrics import MetricsLogger
from pipeline.groups.learner_group import LearnerGroup


class LearnerFeeds:
    def __init__(self, learners: LearnerGroup, settings: FeedSettings, source: BatchSource,
                 queue_timeout_s: float) -> None:
        """``source``: the batch source each learner gets a copy of (a fresh one: it is sent empty)."""
        self.learners, self.queue_timeout_s = learners, queue_timeout_s
        self.manager = learners.manager
        self.ids = self.manager.healthy_ids()
        results = self.manager.foreach_actor("open_feed", settings, source)
        self.addresses: list[str] = [r.value for r in results if r.ok]
        """Learner k's receiver address, in learner order: runner i streams to ``addresses[i % n]``."""
        self._status: dict[int, FeedStatus] = {i: FeedStatus(False) for i in self.ids}
        self._waiting_since = time.monotonic()
        self.closed = False

    @property
    def num_learners(self) -> int:
        return len(self.ids)

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every learner can update now; those not known to be ready are asked, and wait up to
        ``timeout_s`` for a batch (all at once)."""
        ask = [i for i in self.ids if not self._status[i].ready]
        if ask:
            for res in self._call("feed_status", timeout_s, actor_ids=ask):
                self._status[res.actor_id] = res.value  # a failed learner raised ActorGroupError already
        if all(self._status[i].ready for i in self.ids):
            return True
        waited = time.monotonic() - self._waiting_since
        if waited > self.queue_timeout_s:
            raise RuntimeError(f"no train batch arrived for {waited:.0f} s (learner_queue_timeout={self.queue_timeout_s}) "
                               f"at {self._not_ready()}")
        return False

    def _not_ready(self) -> str:
        parts = []
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
        results = self._call("update_from_feed", timestep)
        updates: list[FeedUpdate] = [r.value for r in results]  # a failed learner raised ActorGroupError already
        for r, u in zip(results, updates):
            self._status[r.actor_id] = u.status
        self._waiting_since = time.monotonic()
        versions = np.concatenate([u.versions for u in updates])
        steps = np.concatenate([u.steps for u in updates])
        lag = weights_version - versions
        metrics.log_value("stream/weights_lag_mean", float((lag * steps).sum() / steps.sum()))
        metrics.log_value("stream/weights_lag_max", int(lag.max()), reduce="max")
        metrics.log_value("learner_queue/size_mean", self.stats()["learner_queue_size"])
        self.learners.record_update([u.stats for u in updates], sum(u.num_steps for u in updates), metrics)

    def _call(self, method: str, *args: Any, actor_ids: list[int] | None = None) -> list[CallResult]:
        try:
            return self.manager.foreach_actor(method, *args, actor_ids=actor_ids)
        except ActorGroupError as err:
            dead = [i for i in self.ids if not _alive(self.manager.handle(i))]
            if not dead or f"learner {dead[0]} failed" in str(err):
                raise
            raise ActorGroupError(f"learner {dead[0]} failed: its actor is gone ({len(dead)} of {self.num_learners} "
                                  f"learners are), and the others' gradient all-reduce broke with it. First error "
                                  f"reported: {err}") from err

    def stats(self) -> dict[str, Any]:
        """The feeds' latest counters, summed over the learners (``dropped_by_sender`` and ``source``:
        summed per key)."""
        out: Counter = Counter()
        dropped: Counter = Counter()
        source: Counter = Counter()
        for status in self._status.values():
            for key, value in status.stats.items():
                if key == "dropped_by_sender":
                    dropped.update(value)
                elif key == "source":
                    source.update(value)
                else:
                    out[key] += value
        return {**out, "dropped_by_sender": dict(dropped), "source": dict(source)}

    def close(self) -> None:
        """Stop every learner's loader thread and socket (best effort: shutting down)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.manager.foreach_actor("close_feed", timeout_s=15.0)
        except Exception:  # noqa: BLE001 - the learners are killed next anyway
            pass


def _alive(handle: Any) -> bool:
    try:
        ray.get(handle.ping.remote(), timeout=30)
        return True
    except (RayError, GetTimeoutError):
        return False
