"""MultiAgentReplay: one replay buffer per trainable module, fed by routing chunks on their module id.

Off-policy multi-agent training replays each module's experience on its own, as RLlib's multi-agent
episode replay buffer does in its independent mode: every trainable module samples its own batch
from its own buffer, with its own priorities. Multi-agent chunks are per agent (each agent's
chunks carry an episode id of their own), so a buffer strings together exactly one agent's steps
per episode: n-step returns run over that agent's own step sequence -- a turn-based agent's n
steps are its next n turns, each with the rewards it collected in between -- and never across
two agents that share a module.

Each module's buffer is a whole ``ReplayBuffer`` stage (its own ring, sum tree, generator and
seed), not a table inside one shared buffer: modules share nothing at sampling time, so separate
stages can later be placed and restarted one by one (a module's replay as its own Ray actor, on
its own node) without one lock or one process serializing every module's inserts and samples.
Here they live in the driver, for the synchronous off-policy plan.

Chunks of modules that have no buffer here (frozen modules: never trained, so never sampled for)
are dropped and counted in ``num_steps_dropped``, rather than spending capacity on them.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import replace
from typing import Any

from actors.replay.intake import ReplayIntake
from actors.replay.replay import ReplayBuffer, ReplaySettings
from protocols.episode import EpisodeChunk


class MultiAgentReplay:
    def __init__(self, settings: ReplaySettings, module_ids: Collection[str],
                 keeps: Callable[[str], bool] | None = None,
                 intake_for: Callable[[str], ReplayIntake | None] | None = None,
                 view_for: Callable[[str], Any] | None = None) -> None:
        """``settings``: each module's buffer's; the n-th buffer made (first the ``module_ids`` in sorted
        order) draws with seed ``settings.seed + n`` so that modules sample apart. ``module_ids``: the
        modules to replay for. ``keeps`` (optional): whether a module replays *now* -- a module it accepts
        gets a buffer with its first chunk (one added while training), and only modules it accepts are
        sampled for (a module frozen later keeps its buffer, unsampled). ``intake_for`` (optional): module id ->
        the intake its buffer runs on what it stores (``actors.replay.intake``; the run's learner pipeline).
        ``view_for`` (optional): module id -> its env-to-module view (frame stacking; None without), which its
        buffer rebuilds at each draw from the one frame per step it stores (``ReplayBuffer``)."""
        if isinstance(module_ids, str):
            raise TypeError(f"module_ids must be a collection of module ids, got the str {module_ids!r}; "
                            f"write [{module_ids!r}]")
        if not module_ids and keeps is None:
            raise ValueError("MultiAgentReplay needs at least one module id to keep a buffer for, got none")
        self.settings, self.keeps, self.intake_for, self.view_for = settings, keeps, intake_for, view_for
        self.buffers: dict[str, ReplayBuffer] = {}
        self.num_buffers_made = 0
        for mid in sorted(module_ids):
            self._make(mid)
        self.num_steps_dropped = 0
        """Steps of chunks for modules without a buffer (frozen), over this replay's life."""

    def _make(self, module_id: str) -> None:
        seed = None if self.settings.seed is None else self.settings.seed + self.num_buffers_made
        self.num_buffers_made += 1
        intake = self.intake_for(module_id) if self.intake_for is not None else None
        view = self.view_for(module_id) if self.view_for is not None else None
        self.buffers[module_id] = ReplayBuffer(replace(self.settings, seed=seed), intake, view)

    def drop(self, module_id: str) -> None:
        """Forget a module's buffer (the module was removed from the run)."""
        buffer = self.buffers.pop(module_id, None)
        if buffer is not None:
            buffer.stop()

    @property
    def module_ids(self) -> list[str]:
        return sorted(self.buffers)

    def add(self, chunks: Iterable[EpisodeChunk]) -> dict[str, int]:
        """Store each chunk in its module's buffer; returns the steps stored per module."""
        by_module: dict[str, list[EpisodeChunk]] = {}
        for chunk in chunks:
            if chunk.module_id is None:
                raise ValueError(f"chunk {chunk.episode_id!r}/{chunk.chunk_index} has no module_id: multi-agent "
                                 f"replay routes chunks by module; give single-agent chunks to a ReplayBuffer")
            by_module.setdefault(chunk.module_id, []).append(chunk)
        stored = {}
        for mid, module_chunks in sorted(by_module.items()):
            steps = sum(len(c) for c in module_chunks)
            if mid not in self.buffers:
                if self.keeps is None or not self.keeps(mid):
                    self.num_steps_dropped += steps
                    continue
                self._make(mid)
            self.buffers[mid].add(module_chunks)
            stored[mid] = steps
        return stored

    def ready(self, batch_size: int) -> list[str]:
        """The modules whose buffer holds at least ``batch_size`` transitions, sorted."""
        return [mid for mid in self.module_ids
                if len(self.buffers[mid]) >= batch_size and (self.keeps is None or self.keeps(mid))]

    def sample(self, batch_size: int, module_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """One batch of ``batch_size`` n-step transitions from each named module's own buffer."""
        return {mid: self.buffer(mid).sample(batch_size) for mid in sorted(module_ids)}

    def update_priorities(self, module_id: str, indices: Any, priorities: Any) -> None:
        """Priorities (TD errors) of rows that ``sample`` drew from ``module_id``'s buffer."""
        self.buffer(module_id).update_priorities(indices, priorities)

    def buffer(self, module_id: str) -> ReplayBuffer:
        if module_id not in self.buffers:
            raise KeyError(f"no replay buffer for module {module_id!r}; buffers are kept for the trainable "
                           f"modules {self.module_ids}")
        return self.buffers[module_id]

    def __len__(self) -> int:
        """Transitions stored, all modules together."""
        return sum(len(b) for b in self.buffers.values())

    def get_metrics(self) -> dict[str, dict[str, Any]]:
        """Each module's buffer's metrics since the last call (``ReplayBuffer.get_metrics``), by module id."""
        return {mid: self.buffers[mid].get_metrics() for mid in self.module_ids}

    def get_state(self) -> dict[str, Any]:
        return {"modules": {mid: self.buffers[mid].get_state() for mid in self.module_ids},
                "num_steps_dropped": self.num_steps_dropped}

    def get_intake_states(self) -> dict[str, Any]:
        """Each buffer's intake state (the modules without an intake left out)."""
        states = {mid: self.buffers[mid].get_intake_state() for mid in self.module_ids}
        return {mid: s for mid, s in states.items() if s is not None}

    def set_intake_states(self, states: dict[str, Any]) -> None:
        """Intake states by module, into the buffers this replay keeps (a module it keeps none for is skipped)."""
        for mid, state in states.items():
            if mid in self.buffers:
                self.buffers[mid].set_intake_state(state)

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state["modules"]
        if self.keeps is not None:  # modules added while training: a buffer for each the state holds
            for mid in sorted(set(saved) - set(self.buffers)):
                self._make(mid)
        if self.keeps is None and set(saved) != set(self.buffers):
            raise ValueError(f"the replay state holds buffers for modules {sorted(saved)}, this replay keeps "
                             f"{self.module_ids}: restore it into a run with the same trainable modules")
        for mid in sorted(saved):
            self.buffers[mid].set_state(saved[mid])
        self.num_steps_dropped = int(state.get("num_steps_dropped", 0))

    def stop(self) -> None:
        for mid in self.module_ids:
            self.buffers[mid].stop()
