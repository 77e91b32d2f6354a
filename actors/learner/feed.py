"""LearnerFeed: a learner that takes its own share of the chunk streams (remote learners of IMPALA/APPO).

With ``num_learners=0`` the asynchronous plan receives every runner's stream in the driver and hands
batches to the learner there. With ``num_learners=n`` the learners are Ray actors, and each one hosts
its own ``ChunkReceiver`` (bound on its node's address, which goes back to the driver), cuts its own
train batches of ``train_batch_size_per_learner`` steps and keeps its own *batch source* (IMPALA:
each batch once; APPO: its own circular buffer) beside its own target networks. The driver has
runner i stream to learner ``i mod n``; nothing but weights and statistics passes through it.

The learners of a group average their gradients every minibatch (``Learner.apply_gradients``), so
they must update together: a learner asked to update while it has no batch would hold every other
one inside the all-reduce. So an update takes two steps. ``status(timeout)`` asks: can this learner
update now without waiting? It waits up to ``timeout`` for a batch and, if one comes, *holds* it
(``_staged``), so a yes stays true until the update takes it -- only the update consumes batches.
The driver calls ``update(timestep)`` on every learner only once all of them said yes; each answer
also says whether the learner is ready for the next update, so while batches keep up no extra round
trip is made. The alternative -- each learner blocking on its queue inside the update, with the
queue timeout -- would park the others in the all-reduce for as long and leave the driver unable to
poll the runners meanwhile.

``FedByStreams`` is the part of ``Learner`` that the driver calls on a remote learner.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import gymnasium as gym
import numpy as np
import torch

from actors.learner.batch import ChunkBatch
from actors.learner.loader import ChunkReceiver, ModuleBatches

TakeBatch = Callable[[float], "ChunkBatch | ModuleBatches | None"]
"""Takes the next train batch off a learner queue, waiting up to the given seconds (None: none came)."""


class BatchSource(Protocol):
    """Where each update's batch comes from, given a way to take one off the learner queue."""

    metrics_prefix: str
    """Where its ``stats()`` go in the results ("" for none)."""

    def __len__(self) -> int:
        """Batches it can serve now without taking a new one off the queue."""

    def next(self, take: TakeBatch) -> ChunkBatch | ModuleBatches | None: ...

    def stats(self) -> dict[str, int]: ...


class FreshBatches:
    """Each queued batch trains once (IMPALA)."""

    metrics_prefix = ""

    def __len__(self) -> int:
        return 0

    def next(self, take: TakeBatch) -> ChunkBatch | ModuleBatches | None:
        return take(0.1)  # briefly: the plan comes back soon to poll the runners

    def stats(self) -> dict[str, int]:
        return {}


@dataclass
class FeedSettings:
    """How a learner receives its share of the streams (the asynchronous plan's settings)."""

    batch_size: int
    """Env steps per train batch (``train_batch_size_per_learner``)."""
    queue_size: int = 4
    """Train batches the loader thread may hold ready (``learner_queue_size``)."""
    hwm: int = 4
    """ZeroMQ high-water mark per sender, in frames (``stream_hwm``)."""
    rcvbuf: int = 0
    """Kernel receive buffer of the socket (``stream_socket_buffer_bytes``)."""
    max_weights_lag: int | None = None
    """Drop chunks acted by weights more than this many versions old (``max_weights_lag``)."""


@dataclass
class FeedStatus:
    """What a learner's feed says after each call: whether it can update now, and its counters."""

    ready: bool
    stats: dict[str, Any] = field(default_factory=dict)
    """The receiver's counters (``ChunkReceiver.stats``), ``num_env_steps_trained_once`` (env steps of the
    batches this feed has trained on at least once), ``dropped_by_sender`` and ``source`` (the batch
    source's ``stats()``)."""


@dataclass
class FeedUpdate:
    """One learner's part of an update: its statistics and what its batch held."""

    stats: dict[str, float]
    num_steps: int
    versions: np.ndarray
    """``weights_version`` of each chunk of the batch (for the weights lag)."""
    steps: np.ndarray
    """Steps of each chunk of the batch."""
    status: FeedStatus
    """The feed after the update (ready for the next one?)."""


class FedLearner(Protocol):
    """What the feed needs of its learner (``actors.learner.Learner``)."""

    observation_space: gym.Space
    action_space: gym.Space
    device: torch.device
    rank: int

    def update(self, batch: Any, timestep: int) -> dict[str, float]: ...


class LearnerFeed:
    def __init__(self, learner: FedLearner, settings: FeedSettings, source: BatchSource) -> None:
        self.learner, self.source = learner, source
        self.receiver = ChunkReceiver(learner.observation_space, learner.action_space, settings.batch_size,
                                      queue_size=settings.queue_size, hwm=settings.hwm, rcvbuf=settings.rcvbuf,
                                      device=learner.device, max_weights_lag=settings.max_weights_lag,
                                      observation_view=getattr(learner, "observation_view", None),
                                      learner_connector=getattr(learner, "learner_connector", None)).start()
        self.address = self.receiver.address
        self._staged: ChunkBatch | ModuleBatches | None = None  # taken off the queue by a "ready" answer
        # batches taken off the queue and not trained on yet (a circular buffer may evict one unused:
        # weak references, so such a batch leaves this map with its last reference)
        self._untrained: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.num_env_steps_trained_once = 0
        """Env steps of the batches trained on at least once: what a learner that dies has used of what
        its runners sent it (the learner group counts the rest as lost)."""

    def _dequeue(self, timeout: float) -> ChunkBatch | ModuleBatches | None:
        batch = self.receiver.get_batch(timeout=timeout)
        if batch is not None:
            self._untrained[id(batch)] = batch
        return batch

    def _take(self, timeout: float) -> ChunkBatch | ModuleBatches | None:
        if self._staged is not None:
            batch, self._staged = self._staged, None
            return batch
        return self._dequeue(timeout)

    def ready(self, timeout: float) -> bool:
        """Whether an update can start now; waits up to ``timeout`` s for a batch, and holds it."""
        if len(self.source) or self._staged is not None:
            return True
        self._staged = self._dequeue(timeout)
        return self._staged is not None

    def status(self, timeout: float = 0.0) -> FeedStatus:
        ready = self.ready(timeout)
        stats: dict[str, Any] = self.receiver.stats()
        stats["num_env_steps_trained_once"] = self.num_env_steps_trained_once
        stats["dropped_by_sender"] = dict(self.receiver.dropped_by_sender)
        stats["source"] = self.source.stats()
        return FeedStatus(ready, stats)

    def update(self, timestep: int, weights_version: int | None = None) -> FeedUpdate:
        """One update on the next batch of the source; the driver calls it only after ``ready``.
        ``weights_version``: the group's version before this update (the reference for stale chunks)."""
        if weights_version is not None:
            self.receiver.set_weights_version(weights_version + 1)  # what the runners get after this update
        batch = self.source.next(self._take) if self.ready(0.0) else None
        if batch is None:  # the driver's protocol rules this out; raising beats entering the all-reduce empty
            raise RuntimeError(f"learner {self.learner.rank} was asked to update but holds no train batch: "
                               f"update only learners whose feed said ready")
        versions, steps = batch.weights_versions()
        stats = self.learner.update(batch, timestep)
        if self._untrained.pop(id(batch), None) is not None:
            self.num_env_steps_trained_once += int(steps.sum())
        return FeedUpdate(stats, int(steps.sum()), versions, steps, self.status(0.0))

    def close(self) -> None:
        self._staged = None
        self.receiver.close()


class FedByStreams:
    """Mixin of ``Learner``: host a ``LearnerFeed`` and update from it (what the asynchronous plan
    calls on remote learners)."""

    feed: LearnerFeed | None = None

    def open_feed(self, settings: FeedSettings, source: BatchSource) -> str:
        """Start receiving (a new feed replaces an old one); returns the address runners push to."""
        self.close_feed()
        self.feed = LearnerFeed(self, settings, source)  # type: ignore[arg-type]  # a Learner is a FedLearner
        return self.feed.address

    def feed_status(self, timeout: float = 0.0) -> FeedStatus:
        return self._open_feed().status(timeout)

    def update_from_feed(self, timestep: int, weights_version: int | None = None) -> FeedUpdate:
        return self._open_feed().update(timestep, weights_version)

    def close_feed(self) -> None:
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    def _open_feed(self) -> LearnerFeed:
        if self.feed is None:
            raise RuntimeError("this learner has no feed: call open_feed(settings, source) first")
        return self.feed
