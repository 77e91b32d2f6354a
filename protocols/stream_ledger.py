"""StreamLedger: a chunk stream's accounting -- nothing trained twice, nothing lost without a count.

A stream delivers each sender's chunks in order, once (ZeroMQ over TCP). The ledger holds what the
receiver needs to show that it stays so through failures: per sender, the episodes it has open and the
chunk index each expects next.

* A chunk whose index an episode has already had (a resent or replayed frame) is a duplicate: it is
  dropped and counted, so it is never trained twice.
* An episode's chunk that skips indices means chunks went missing in between: counted (the chunk is
  kept; its steps are as good as any).
* A sender lost mid-episode (its actor or node died: ``sender_lost``) leaves its open episodes without
  their remaining chunks: they are closed and counted as cut, and the fragment it was sampling is
  counted lost -- the steps it never sent are unknowable, the episodes and fragments are not.

An episode's first chunk seen may have any index (a runner that goes on streaming to a new receiver).
Closed episodes are remembered for a while (``remember_closed`` per sender) to catch late duplicates;
open ones are capped per sender (``max_open`` -- a sender that never ends its episodes) and the oldest
beyond it forgotten, counted. A lock guards it: a receiver's loader thread admits chunks while the
driver's thread reports lost senders. Only plain Python here: ``protocols`` stays importable without
torch or Ray.
"""
from __future__ import annotations

import collections
import threading
from typing import Any

LEDGER_COUNTERS = ("num_chunks_dropped_duplicate", "num_chunks_missing", "num_episodes_cut",
                   "num_fragments_lost", "num_episodes_forgotten")


class StreamLedger:
    def __init__(self, counters: collections.Counter | None = None, max_open: int = 10_000,
                 remember_closed: int = 1024) -> None:
        """``counters``: where to count (a receiver's own counters; default a new one)."""
        if max_open < 1 or remember_closed < 0:
            raise ValueError(f"max_open must be >= 1 and remember_closed >= 0, got {max_open}, {remember_closed}")
        self.max_open, self.remember_closed = max_open, remember_closed
        self.open: dict[str, dict[str, int]] = {}
        """sender -> {episode id: the chunk index it expects next}, oldest first."""
        self.closed: dict[str, collections.OrderedDict[str, int]] = {}
        """sender -> {episode id: its last chunk index + 1}, the latest ``remember_closed``."""
        self._lock = threading.Lock()
        self.counters = collections.Counter() if counters is None else counters
        for key in LEDGER_COUNTERS:
            self.counters.setdefault(key, 0)

    def admit(self, sender: str, chunk: Any) -> bool:
        """Whether ``chunk`` (an ``EpisodeChunk``) from ``sender`` is new: False for a duplicate (counted)."""
        with self._lock:
            return self._admit(sender, chunk.episode_id, chunk.chunk_index, chunk.terminated or chunk.truncated)

    def _admit(self, sender: str, episode: str, index: int, ends: bool) -> bool:
        opened = self.open.setdefault(sender, {})
        expected = opened.get(episode)
        if expected is None:
            closed = self.closed.get(sender, {})
            ended = closed.get(episode)
            if ended is not None:  # a late chunk of an episode ended or cut here: never reopened
                if index < ended:
                    self.counters["num_chunks_dropped_duplicate"] += 1
                    return False
                closed[episode] = index + 1
                return True
        elif index < expected:
            self.counters["num_chunks_dropped_duplicate"] += 1
            return False
        elif index > expected:
            self.counters["num_chunks_missing"] += index - expected
        if ends:
            opened.pop(episode, None)
            self._remember(sender, episode, index + 1)
            return True
        if expected is None and len(opened) >= self.max_open:
            opened.pop(next(iter(opened)))
            self.counters["num_episodes_forgotten"] += 1
        opened[episode] = index + 1
        return True

    def _remember(self, sender: str, episode: str, end: int) -> None:
        if not self.remember_closed:
            return
        closed = self.closed.setdefault(sender, collections.OrderedDict())
        closed[episode] = end
        while len(closed) > self.remember_closed:
            closed.popitem(last=False)

    def sender_lost(self, sender: str, mid_fragment: bool = True) -> int:
        """``sender`` is gone (its actor died): its open episodes end here, counted as cut, and -- when it
        was sampling (``mid_fragment``) -- one fragment is counted lost. Returns the episodes cut."""
        with self._lock:
            cut = self.open.pop(sender, {})
            for episode, end in cut.items():
                self._remember(sender, episode, end)
            self.counters["num_episodes_cut"] += len(cut)
            self.counters["num_fragments_lost"] += int(mid_fragment)
            return len(cut)

    def forget(self) -> None:
        """Forget every episode (a restored checkpoint: runners send again chunks this ledger has seen)."""
        with self._lock:
            self.open.clear()
            self.closed.clear()

    def num_open(self) -> int:
        with self._lock:
            return sum(len(v) for v in self.open.values())
