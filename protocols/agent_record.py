"""AgentRecord: one agent's part of a ``MultiAgentEpisode``, and how its steps become a chunk.

Apart from ``protocols.multi_agent_episode`` because an agent's record is complete on its own: the rows
since its last chunk, where it stands in the observe/act cycle, and its look-back rows. The episode
decides which agents act, step and finish; a record turns what it is handed into rows and cuts them
into an ``EpisodeChunk`` of that agent alone.

With a look-back (its module's ``look_back`` rows, for a view such as frame stacking) a record keeps the
agent's last recorded observations before its open chunk, and every chunk of that agent carries them as
``look_back`` (its first observation repeated before the agent's first step, as a single-agent frame stack
starts). ``recent_rows`` reads the agent's newest rows from the same record, so the stack an agent acts on
and the stack a learner rebuilds from its chunk are one computation.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocols import nested
from protocols.episode import EpisodeChunk, chunk_from_steps

AgentID = Hashable  # str or int, as the env names its agents
STATE_COLUMN = "state_in"
"""The output column a recurrent module's rows carry: the state each action was taken from (``[2, cell]``)."""


@dataclass(slots=True)
class AgentRecord:
    """One agent's part of an episode: its steps since its last chunk and where it stands in the
    observe/act cycle. ``obs`` is one longer than ``rewards`` (the chunk's first observation comes
    first); ``actions`` and ``extra_rows`` are as long as ``rewards``, or one longer while an action
    waits for its next observation."""

    agent_id: AgentID
    module_id: str
    episode_id: str
    """The id its chunks carry: ``"<episode id>.<n>"`` for the n-th agent to join."""
    last_obs: Any
    last_info: dict
    obs: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    extra_rows: list = field(default_factory=list)
    """The policy outputs of each action, a tuple in ``extra_keys`` order."""
    rewards: list = field(default_factory=list)
    infos: list = field(default_factory=list)
    ready: bool = True
    """It holds an observation it has not acted on yet."""
    done: bool = False
    truncated: bool = False
    """How it ended (when done): truncated, or else terminated."""
    pending_reward: float = 0.0
    """Rewards since its last action, credited to that step when the next observation arrives."""
    ret: float = 0.0
    """Its rewards in this episode so far (its return)."""
    extra_keys: tuple[str, ...] | None = None
    chunk_index: int = 0
    t_started: int = 0
    back: list | None = None
    """With a look-back: its recorded observations before ``obs[0]``, oldest first (as many as its module's
    ``look_back``); None without."""
    seq_len: int | None = None
    """A recurrent module's ``max_seq_len``: its chunks are cut into sequences of at most this many steps, each
    carrying the state its first step acted from (the ``STATE_COLUMN`` of its outputs); None: not recurrent."""

    @classmethod
    def joined(cls, agent_id: AgentID, module_id: str, episode_id: str, obs: Any, info: dict | None,
               look_back: int, record_infos: bool) -> AgentRecord:
        """An agent's record at its first observation; a look-back starts as that observation repeated, as a
        single-agent frame stack starts."""
        a = cls(agent_id, module_id, episode_id, obs, info or {}, obs=[obs])
        if look_back:
            a.back = [obs] * look_back
        if record_infos:
            a.infos.append(info or {})
        return a

    def recent_rows(self) -> list[Any]:
        """Its newest recorded observation and, before it, as many earlier ones as its look-back."""
        if self.back is None:
            return self.obs[-1:]
        n = len(self.back) + 1
        return self.obs[-n:] if len(self.obs) >= n else (self.back + self.obs)[-n:]

    def record_step(self, obs: Any, info: dict | None, record_infos: bool) -> None:
        """Its pending action got its next observation: the step's reward is what came in meanwhile."""
        self.rewards.append(self.pending_reward)
        self.obs.append(obs)
        if record_infos:
            self.infos.append(info or {})
        self.pending_reward, self.last_obs, self.last_info = 0.0, obs, info or {}

    def cut(self, weights_version: int, env_runner_index: int, env_index: int) -> list[EpisodeChunk]:
        """Its completed steps since its last chunk as a chunk -- as sequences of ``seq_len`` steps each with its
        ``state_in`` for a recurrent module -- (none: there are no such steps); a pending action stays for the
        next."""
        steps = len(self.rewards)
        if not steps:
            return []
        pending = len(self.actions) > steps
        chunk = chunk_from_steps(self.episode_id, self.chunk_index, self.t_started, self.obs,
                                 self.actions[:steps] if pending else self.actions, self.rewards, self.extra_keys or (),
                                 self.extra_rows[:steps] if pending else self.extra_rows, self.infos,
                                 terminated=self.done and not self.truncated, truncated=self.done and self.truncated,
                                 weights_version=weights_version, env_runner_index=env_runner_index,
                                 env_index=env_index)
        chunk.agent_id, chunk.module_id = str(self.agent_id), self.module_id
        if self.back is not None:
            chunk.look_back = nested.stack(self.back)
            self.back = (self.back + self.obs[:-1])[-len(self.back):]  # the rows before the next chunk's first obs
        pieces = [chunk]
        states = chunk.extra.pop(STATE_COLUMN, None)
        if states is not None:  # sequences for a recurrent module's learner, each from its start state
            length = self.seq_len or steps
            pieces = chunk.split(length)
            for k, piece in enumerate(pieces):
                piece.state_in = np.ascontiguousarray(states[k * length], np.float32)
        self.chunk_index += len(pieces)
        self.t_started += steps
        self.obs, self.rewards = self.obs[-1:], []
        self.actions, self.extra_rows = self.actions[steps:], self.extra_rows[steps:]
        if self.infos:
            self.infos = self.infos[-1:]
        return pieces
