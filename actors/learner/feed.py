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

import collections
import copy
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
    module_spaces: dict[str, tuple[gym.Space, gym.Space]] | None = None
    """A multi-agent run's module id -> (observation, action space): the learner is a ``MultiLearner`` and its
    feed a ``ModuleFeed``, which keeps each module's batches apart (None: a single-agent learner)."""


@dataclass
class FeedStatus:
    """What a learner's feed says after each call: whether it can update now, and its counters."""

    ready: bool
    stats: dict[str, Any] = field(default_factory=dict)
    """The receiver's counters (``ChunkReceiver.stats``), ``num_env_steps_trained_once`` (env steps of the
    batches this feed has trained on at least once), ``dropped_by_sender`` and ``source`` (the batch
    source's ``stats()``)."""
    modules: tuple[str, ...] = ()
    """A ``ModuleFeed``'s trainable modules it can update now (``ready``: any)."""


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
    module_steps: dict[str, int] = field(default_factory=dict)
    """A ``ModuleFeed``'s update: agent steps trained per module."""


class FedLearner(Protocol):
    """What the feed needs of its learner (``actors.learner.Learner``)."""

    observation_space: gym.Space
    action_space: gym.Space
    device: torch.device
    rank: int

    def update(self, batch: Any, timestep: int) -> dict[str, float]: ...


def feed_stats(receiver: ChunkReceiver, trained_once: int, source_stats: dict[str, int]) -> dict[str, Any]:
    """What a feed reports (``FeedStatus.stats``): its receiver's counters and what it trained and holds."""
    stats: dict[str, Any] = receiver.stats()
    stats["num_env_steps_trained_once"] = trained_once
    stats["dropped_by_sender"] = dict(receiver.dropped_by_sender)
    stats["source"] = source_stats
    return stats


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
        return FeedStatus(ready, feed_stats(self.receiver, self.num_env_steps_trained_once, self.source.stats()))

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


class ModuleFeed:
    """The feed of a remote ``MultiLearner`` (multi-agent IMPALA/APPO with ``num_learners > 0``).

    The learners meet at an all-reduce in every SGD step of every module, so an update must step the same
    modules on every learner, each on a batch of the same size. The receiver cuts each module's steps into
    batches of their own (``ChunkReceiver(per_module=True)``); this feed holds them by module, each module
    with its own batch source (APPO: its own circular buffer), and says which modules it could update now
    (``status().modules``). The driver updates the modules every learner can (``update(modules=...)``); the
    others wait for their batches. Batches of frozen modules are dropped here and counted. Holding is bounded:
    once a module holds ``queue_size`` batches this feed takes no more off the queue, and the receiver's
    back-pressure reaches the runners -- a module that only some learners' runners sample then stops the run
    at ``learner_queue_timeout`` with an error naming it, rather than filling memory.
    """

    def __init__(self, learner: Any, settings: FeedSettings, source: BatchSource) -> None:
        self.learner, self.settings, self.template = learner, settings, source
        self.receiver = ChunkReceiver(None, None, settings.batch_size, queue_size=settings.queue_size,
                                      hwm=settings.hwm, rcvbuf=settings.rcvbuf, device=learner.device,
                                      max_weights_lag=settings.max_weights_lag, module_spaces=settings.module_spaces,
                                      module_connector=learner.module_connector, module_view=learner.module_view,
                                      per_module=True).start()
        self.address = self.receiver.address
        self._held: dict[str, list[ChunkBatch]] = {}  # taken off the queue, not handed to a source yet
        self._sources: dict[str, BatchSource] = {}
        self._untrained: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.num_env_steps_trained_once = 0
        """Agent steps of the batches trained on at least once (as ``LearnerFeed``'s)."""
        self.num_frozen_batches_dropped = 0

    def _source(self, module_id: str) -> BatchSource:
        if module_id not in self._sources:
            self._sources[module_id] = copy.deepcopy(self.template)
        return self._sources[module_id]

    def _full(self) -> bool:
        return any(len(held) >= self.settings.queue_size for held in self._held.values())

    def _pull(self, timeout: float) -> None:
        """File what the queue holds by module, waiting up to ``timeout`` for the first when none is ready."""
        wait = timeout if not self.ready_modules() else 0.0
        while not self._full():
            batch = self.receiver.get_batch(timeout=wait)
            if batch is None:
                return
            wait = 0.0
            ((mid, module_batch),) = batch.items()
            if mid not in self.learner.trainable:
                self.num_frozen_batches_dropped += 1
                self.num_env_steps_trained_once += module_batch.num_steps  # used up: not lost with the learner
                continue
            self._held.setdefault(mid, []).append(module_batch)
            self._untrained[id(module_batch)] = module_batch

    def ready_modules(self) -> tuple[str, ...]:
        """The trainable modules with a batch held or in their source now."""
        return tuple(sorted(mid for mid in self.learner.trainable
                            if self._held.get(mid) or len(self._sources.get(mid, ()))))

    def status(self, timeout: float = 0.0) -> FeedStatus:
        self._pull(timeout)
        modules = self.ready_modules()
        source_stats: collections.Counter = collections.Counter()
        for source in self._sources.values():  # summed over the modules, as over the learners
            source_stats.update(source.stats())
        stats = feed_stats(self.receiver, self.num_env_steps_trained_once, dict(source_stats))
        stats["learner_queue_size"] += sum(len(held) for held in self._held.values())
        stats["num_frozen_batches_dropped"] = self.num_frozen_batches_dropped
        return FeedStatus(bool(modules), stats, modules)

    def update(self, timestep: int, weights_version: int | None = None,
               modules: tuple[str, ...] | list[str] = ()) -> FeedUpdate:
        """One update of ``modules`` (every learner of the group is given the same), each on the next batch of
        its own source; the driver names only modules every learner's ``status`` said it can update."""
        if weights_version is not None:
            self.receiver.set_weights_version(weights_version + 1)
        self._pull(0.0)
        batches = ModuleBatches()
        for mid in sorted(modules):
            held = self._held.get(mid, [])
            batch = self._source(mid).next(lambda timeout, held=held: held.pop(0) if held else None)
            if batch is None:  # the driver's protocol rules this out; raising beats entering the all-reduce short
                rank = getattr(self.learner, "rank", 0)
                raise RuntimeError(f"learner {rank} was asked to update module {mid!r} but holds no train batch of "
                                   f"it: update only modules every feed said ready")
            batches[mid] = batch
        versions, steps = batches.weights_versions()
        stats = self.learner.update(batches, timestep)
        for batch in batches.values():
            if self._untrained.pop(id(batch), None) is not None:
                self.num_env_steps_trained_once += batch.num_steps
        module_steps = {mid: int(batch.num_steps) for mid, batch in batches.items()}
        return FeedUpdate(stats, int(steps.sum()), versions, steps, self.status(0.0), module_steps)

    def add_module(self, module_id: str, observation_space: gym.Space, action_space: gym.Space) -> None:
        """A module added while the run goes on: its chunks are taken from now on."""
        self.receiver.add_module(module_id, observation_space, action_space)

    def remove_module(self, module_id: str) -> None:
        """A module removed: its chunks are dropped from now on, and what this feed held of it goes."""
        self.receiver.remove_module(module_id)
        self._held.pop(module_id, None)
        self._sources.pop(module_id, None)

    def close(self) -> None:
        self._held.clear()
        self.receiver.close()


class FedByStreams:
    """Mixin of ``Learner``: host a ``LearnerFeed`` and update from it (what the asynchronous plan
    calls on remote learners)."""

    feed: LearnerFeed | ModuleFeed | None = None

    def open_feed(self, settings: FeedSettings, source: BatchSource) -> str:
        """Start receiving (a new feed replaces an old one); returns the address runners push to."""
        self.close_feed()
        if settings.module_spaces is not None:
            self.feed = ModuleFeed(self, settings, source)
        else:
            self.feed = LearnerFeed(self, settings, source)  # type: ignore[arg-type]  # a Learner is a FedLearner
        return self.feed.address

    def feed_status(self, timeout: float = 0.0) -> FeedStatus:
        return self._open_feed().status(timeout)

    def update_from_feed(self, timestep: int, weights_version: int | None = None,
                         modules: tuple[str, ...] | list[str] | None = None) -> FeedUpdate:
        """One update from the feed; ``modules``: which modules (a ``ModuleFeed``; None for a ``LearnerFeed``)."""
        feed = self._open_feed()
        if isinstance(feed, ModuleFeed):
            if modules is None:
                raise ValueError("a multi-agent learner's feed updates the modules it is told: pass modules=[...]")
            return feed.update(timestep, weights_version, modules)
        return feed.update(timestep, weights_version)

    def feed_add_module(self, module_id: str, observation_space: gym.Space, action_space: gym.Space) -> None:
        """A module added to a multi-agent run: this learner's feed takes its chunks from now on."""
        feed = self._open_feed()
        if not isinstance(feed, ModuleFeed):
            raise ValueError(f"feed_add_module({module_id!r}): this learner's feed takes a single-agent stream")
        feed.add_module(module_id, observation_space, action_space)

    def feed_remove_module(self, module_id: str) -> None:
        feed = self._open_feed()
        if isinstance(feed, ModuleFeed):
            feed.remove_module(module_id)

    def close_feed(self) -> None:
        if self.feed is not None:
            self.feed.close()
            self.feed = None

    def _open_feed(self) -> LearnerFeed | ModuleFeed:
        if self.feed is None:
            raise RuntimeError("this learner has no feed: call open_feed(settings, source) first")
        return self.feed
