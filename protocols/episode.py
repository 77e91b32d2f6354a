"""The experience data model: single-agent episodes and the chunks they travel in.

An *episode chunk* is a contiguous slice of one episode. It holds ``T`` steps: ``T + 1``
observations (the observation after the last action closes the chunk, so a next observation is
never stored twice inside a chunk), ``T`` actions, rewards and extra model outputs. Consecutive
chunks of one episode share their boundary observation: the last row of chunk ``k`` is the
first row of chunk ``k + 1``.

``EpisodeBuilder`` collects one episode step by step (appending to lists is cheap) and cuts
finalized numpy chunks from it: the builder for producers that see one step at a time, such as a
simulator that drives an external client. Env runners, which step many sub-envs at once, cut
chunks from their own time-major buffers instead. ``EpisodeChunk.concat`` glues chunks back
together.

Multi-agent episodes will hold one single-agent episode per agent (``agent_id``/``module_id``
are already carried by each chunk) plus the step pattern that interleaves them.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from protocols import nested
from protocols.errors import ProtocolError


def new_episode_id() -> str:
    return uuid.uuid4().hex


_COLUMNS = frozenset({"obs", "actions", "rewards", "infos"})


@dataclass
class EpisodeChunk:
    """A finalized slice of one episode: numpy arrays with a shared leading time dimension."""

    episode_id: str
    """Unique id of the episode this chunk belongs to."""
    chunk_index: int
    """0 for the episode's first chunk, then 1, 2, ... in order."""
    obs: Any
    """Observations, ``T + 1`` rows; an array or a nested dict/tuple of arrays."""
    actions: Any
    """Actions, ``T`` rows; an array or a nested dict/tuple of arrays."""
    rewards: np.ndarray
    """float32 rewards, shape ``(T,)``."""
    terminated: bool = False
    """The episode ended in a terminal state at this chunk's last step."""
    truncated: bool = False
    """The episode was cut (time limit, crashed env) at this chunk's last step."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Model outputs per step, ``T`` rows each: ``action_logp``, ``vf_preds``,
    ``action_dist_inputs``, recurrent ``state_in``..."""
    infos: list = field(default_factory=list)
    """Env info dicts, ``T + 1`` entries, or empty when infos were not recorded."""
    t_started: int = 0
    """Env steps of the episode that came before this chunk's first observation."""
    weights_version: int = 0
    """Version of the policy weights that chose these actions."""
    env_runner_index: int = 0
    """Index of the env runner that sampled this chunk (0 = local)."""
    env_index: int = 0
    """Index of the sub-environment inside its runner's vector env."""
    agent_id: str | None = None
    """Agent that acted (multi-agent); None for single-agent episodes."""
    module_id: str | None = None
    """Module (policy) that acted (multi-agent); None for the default module."""
    look_back: Any = None
    """Observations of the episode before this chunk's first, oldest first (``[L, ...]``, the first
    observation repeated where the episode had fewer): carried only for views that look back, such as
    frame stacking, so a learner can rebuild them; None otherwise. Not steps of this chunk."""
    state_in: Any = None
    """A recurrent policy's state when it acted this chunk's first step (float32, e.g. ``[2, cell]``), so a
    learner can unroll the chunk from there; None for stateless policies."""

    def __len__(self) -> int:
        return len(self.rewards)

    def __getitem__(self, key: str) -> Any:
        """Column access as on a sample batch (``chunk["rewards"]``): a field, or an ``extra`` entry."""
        if key in self.extra:
            return self.extra[key]
        if key in _COLUMNS:
            return getattr(self, key)
        raise KeyError(f"episode chunk has no column {key!r}; columns: {sorted(_COLUMNS | set(self.extra))}")

    def __setitem__(self, key: str, value: Any) -> None:
        """Replace a column (``on_postprocess_trajectory`` rewriting rewards); the length must not change."""
        if key in _COLUMNS:
            if key == "rewards":
                value = np.asarray(value, np.float32)
                if value.shape != self.rewards.shape:
                    raise ValueError(f"new rewards have shape {value.shape}, the chunk's {self.rewards.shape}")
            setattr(self, key, value)
        else:
            self.extra[key] = value

    @property
    def is_done(self) -> bool:
        return self.terminated or self.truncated

    @property
    def ret(self) -> float:
        """Sum of this chunk's rewards."""
        return float(self.rewards.sum(dtype=np.float64))

    def get_return(self) -> float:
        """RLlib's episode method: the sum of the rewards (of the whole episode, for a whole-episode chunk)."""
        return self.ret

    def validate(self) -> "EpisodeChunk":
        """Check the internal consistency; raise ProtocolError naming the first problem."""
        if not isinstance(self.episode_id, str) or not self.episode_id:
            raise ProtocolError(f"episode_id must be a non-empty str, got {self.episode_id!r}")
        for name in ("chunk_index", "t_started", "weights_version", "env_runner_index", "env_index"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ProtocolError(f"{name} must be an int >= 0, got {value!r}")
        if self.terminated and self.truncated:
            raise ProtocolError("a chunk cannot be both terminated and truncated")
        if not isinstance(self.rewards, np.ndarray) or self.rewards.ndim != 1:
            raise ProtocolError(f"rewards must be a 1-d array, got {type(self.rewards).__name__}")
        steps = len(self.rewards)
        _check_rows("obs", self.obs, steps + 1)
        _check_rows("actions", self.actions, steps)
        if not isinstance(self.extra, dict):
            raise ProtocolError(f"extra must be a dict, got {type(self.extra).__name__}")
        for key, value in self.extra.items():
            _check_rows(f"extra[{key!r}]", value, steps)
        if self.infos and len(self.infos) != steps + 1:
            raise ProtocolError(f"infos has {len(self.infos)} entries; expected 0 or {steps + 1}")
        if self.look_back is not None:
            first = self.obs[0] if isinstance(self.obs, np.ndarray) else None
            lb = self.look_back
            if (first is None or not isinstance(lb, np.ndarray) or lb.ndim != first.ndim + 1
                    or lb.shape[1:] != first.shape or lb.dtype != first.dtype):
                raise ProtocolError(f"look_back must be an array of observation rows like obs "
                                    f"({'nested' if first is None else first.shape}, "
                                    f"{'-' if first is None else first.dtype}), got "
                                    f"{getattr(lb, 'shape', type(lb).__name__)} {getattr(lb, 'dtype', '')}")
        if self.state_in is not None:
            st = self.state_in
            if not isinstance(st, np.ndarray) or st.dtype != np.float32 or st.ndim < 1:
                raise ProtocolError(f"state_in must be a float32 array, got {getattr(st, 'dtype', type(st).__name__)}")
            if not np.isfinite(st).all():
                raise ProtocolError("state_in holds NaN or infinite values")
        return self

    def slice(self, start: int, stop: int, chunk_index: int | None = None) -> "EpisodeChunk":
        """Steps ``[start, stop)`` as a chunk (observations ``[start, stop]``).

        Array data are views, not copies. Only a slice that reaches this chunk's end keeps
        its terminated/truncated flags.
        """
        steps = len(self)
        if not 0 <= start < stop <= steps:
            raise ValueError(f"slice [{start}, {stop}) is outside a chunk of {steps} steps")
        at_end = stop == steps
        return replace(
            self,
            chunk_index=self.chunk_index if chunk_index is None else chunk_index,
            obs=nested.map_structure(lambda a: a[start : stop + 1], self.obs),
            actions=nested.map_structure(lambda a: a[start:stop], self.actions),
            rewards=self.rewards[start:stop],
            terminated=self.terminated and at_end,
            truncated=self.truncated and at_end,
            extra={k: nested.map_structure(lambda a: a[start:stop], v) for k, v in self.extra.items()},
            infos=self.infos[start : stop + 1] if self.infos else [],
            t_started=self.t_started + start,
            look_back=(self.look_back if self.look_back is None or start == 0 else
                       np.concatenate([self.look_back, self.obs[:start]])[-len(self.look_back):]),
            # the recurrent state mid-chunk was never stored: a later slice has none
            state_in=self.state_in if start == 0 else None,
        )

    def split(self, max_len: int) -> list["EpisodeChunk"]:
        """Cut into consecutive chunks of at most ``max_len`` steps, renumbered in order."""
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        starts = range(0, len(self), max_len)
        return [
            self.slice(s, min(s + max_len, len(self)), chunk_index=self.chunk_index + i)
            for i, s in enumerate(starts)
        ]

    @staticmethod
    def concat(chunks: list["EpisodeChunk"]) -> "EpisodeChunk":
        """Glue consecutive chunks of one episode back together.

        Raises ValueError when they do not fit: different episodes, a gap or a repeat in
        ``chunk_index``/``t_started``, a done flag before the last chunk, or boundary
        observations that differ.
        """
        if not chunks:
            raise ValueError("concat needs at least one chunk")
        first = chunks[0]
        for prev, nxt in zip(chunks, chunks[1:]):
            if nxt.episode_id != first.episode_id:
                raise ValueError(
                    f"cannot concat chunks of different episodes: {first.episode_id} and {nxt.episode_id}"
                )
            if nxt.chunk_index != prev.chunk_index + 1:
                raise ValueError(
                    f"chunk_index {nxt.chunk_index} does not follow {prev.chunk_index} "
                    f"in episode {first.episode_id}: sort the chunks or fill the gap"
                )
            if nxt.t_started != prev.t_started + len(prev):
                raise ValueError(
                    f"chunk {nxt.chunk_index} starts at step {nxt.t_started}, but chunk "
                    f"{prev.chunk_index} ends at step {prev.t_started + len(prev)}"
                )
            if prev.is_done:
                raise ValueError(f"chunk {prev.chunk_index} ends the episode but is not the last chunk")
            last_obs = nested.map_structure(lambda a: a[-1], prev.obs)
            first_obs = nested.map_structure(lambda a: a[0], nxt.obs)
            if not all(np.array_equal(a, b) for a, b in zip(nested.flatten(last_obs), nested.flatten(first_obs))):
                raise ValueError(
                    f"the last observation of chunk {prev.chunk_index} differs from the first of "
                    f"chunk {nxt.chunk_index}: these chunks are not consecutive"
                )
        if len(chunks) == 1:
            return first
        if any(set(c.extra) != set(first.extra) for c in chunks):
            raise ValueError("chunks carry different `extra` keys and cannot be concatenated")
        last = chunks[-1]
        with_infos = all(c.infos for c in chunks)
        return replace(
            first,
            obs=nested.concat([first.obs] + [nested.map_structure(lambda a: a[1:], c.obs) for c in chunks[1:]]),
            actions=nested.concat([c.actions for c in chunks]),
            rewards=np.concatenate([c.rewards for c in chunks]),
            terminated=last.terminated,
            truncated=last.truncated,
            extra={k: nested.concat([c.extra[k] for c in chunks]) for k in first.extra},
            infos=(first.infos + [i for c in chunks[1:] for i in c.infos[1:]]) if with_infos else [],
            weights_version=min(c.weights_version for c in chunks),
        )


def _check_rows(name: str, struct: Any, expected: int) -> None:
    leaves = (struct,) if type(struct) is np.ndarray else nested.flatten(struct)  # the common case: one array
    for leaf in leaves:
        if not isinstance(leaf, np.ndarray):
            raise ProtocolError(f"{name} must hold numpy arrays, got {type(leaf).__name__}")
        if leaf.ndim == 0 or len(leaf) != expected:
            got = "a 0-d array" if leaf.ndim == 0 else f"{len(leaf)} rows"
            raise ProtocolError(f"{name} must have {expected} rows, got {got}")


class EpisodeBuilder:
    """Collects one episode step by step and cuts finalized chunks from it.

    Usage::

        b = EpisodeBuilder()
        b.add_reset(obs)
        b.add_step(action, reward, next_obs, terminated=..., truncated=..., extra={...})
        chunk = b.cut()        # steps so far as a chunk; the builder goes on from next_obs
    """

    def __init__(
        self,
        episode_id: str | None = None,
        *,
        env_runner_index: int = 0,
        env_index: int = 0,
        weights_version: int = 0,
        record_infos: bool = False,
    ) -> None:
        self.episode_id = episode_id or new_episode_id()
        self.env_runner_index = env_runner_index
        self.env_index = env_index
        self.weights_version = weights_version
        self.record_infos = record_infos
        self.terminated = False
        self.truncated = False
        self.total_return = 0.0
        self.total_length = 0
        self._chunk_index = 0
        self._t_started = 0
        self._obs: list[Any] = []
        self._actions: list[Any] = []
        self._rewards: list[float] = []
        self._extra_keys: tuple[str, ...] = ()
        self._extra_rows: list[tuple] = []  # one tuple of values per step, in _extra_keys order
        self._infos: list[dict] = []

    @property
    def is_done(self) -> bool:
        return self.terminated or self.truncated

    @property
    def started(self) -> bool:
        """The episode's first observation is in (``add_reset`` was called)."""
        return bool(self._obs)

    def __len__(self) -> int:
        """Steps collected since the last cut."""
        return len(self._actions)

    def add_reset(self, obs: Any, info: dict | None = None) -> None:
        if self._obs:
            raise ValueError("add_reset called twice; an episode starts once")
        self._obs.append(obs)
        if self.record_infos:
            self._infos.append(info or {})

    def add_step(
        self,
        action: Any,
        reward: float,
        next_obs: Any,
        *,
        terminated: bool = False,
        truncated: bool = False,
        info: dict | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        if not self._obs:
            raise ValueError("add_step before add_reset: give the episode its first observation")
        if self.is_done:
            raise ValueError(f"episode {self.episode_id} is already done; start a new EpisodeBuilder")
        extra = extra or {}
        self.add_step_values(action, reward, next_obs, terminated, truncated, info, tuple(extra), tuple(extra.values()))

    def add_step_values(self, action: Any, reward: float, next_obs: Any, terminated: bool, truncated: bool,
                        info: dict | None, extra_keys: tuple[str, ...], extra_values: tuple) -> None:
        """``add_step`` with the extras as a row of values under ``extra_keys``: what a recorder that
        holds its policy outputs as columns hands over without building a dict per step."""
        if not self._obs:
            raise ValueError("add_step before add_reset: give the episode its first observation")
        if self.terminated or self.truncated:
            raise ValueError(f"episode {self.episode_id} is already done; start a new EpisodeBuilder")
        if extra_keys != self._extra_keys:  # check before changing any state
            if self._actions and set(extra_keys) != set(self._extra_keys):
                raise ValueError(f"extra keys changed mid-episode: {sorted(self._extra_keys)} -> {sorted(extra_keys)}")
            if self._actions:  # the same keys in another order
                order = {k: i for i, k in enumerate(extra_keys)}
                extra_values = tuple(extra_values[order[k]] for k in self._extra_keys)
            else:
                self._extra_keys = extra_keys
        self._actions.append(action)
        reward = float(reward)
        self._rewards.append(reward)
        self._obs.append(next_obs)
        if extra_keys:
            self._extra_rows.append(extra_values)
        if self.record_infos:
            self._infos.append(info or {})
        self.terminated = bool(terminated)
        self.truncated = bool(truncated)
        self.total_return += reward
        self.total_length += 1

    def cut(self) -> EpisodeChunk:
        """Finalize the steps collected since the last cut into a numpy chunk."""
        if not self._actions:
            raise ValueError("nothing to cut: the builder holds no steps since the last cut")
        chunk = chunk_from_steps(self.episode_id, self._chunk_index, self._t_started, self._obs, self._actions,
                                 self._rewards, self._extra_keys, self._extra_rows, self._infos,
                                 terminated=self.terminated, truncated=self.truncated,
                                 weights_version=self.weights_version, env_runner_index=self.env_runner_index,
                                 env_index=self.env_index)
        self._chunk_index += 1
        self._t_started += len(self._actions)
        self._obs = self._obs[-1:]
        self._infos = self._infos[-1:]
        self._actions, self._rewards, self._extra_rows = [], [], []
        return chunk


def chunk_from_steps(episode_id: str, chunk_index: int, t_started: int, obs: list, actions: list,
                     rewards: list[float], extra_keys: tuple[str, ...], extra_rows: list[tuple], infos: list, *,
                     terminated: bool = False, truncated: bool = False, weights_version: int = 0,
                     env_runner_index: int = 0, env_index: int = 0) -> EpisodeChunk:
    """A chunk from per-step lists as recorders collect them: ``obs`` one longer than ``actions`` and
    ``rewards``, ``extra_rows`` one tuple of values per step in ``extra_keys`` order, ``infos`` empty or
    as long as ``obs``."""
    return EpisodeChunk(
        episode_id=episode_id,
        chunk_index=chunk_index,
        obs=nested.stack(obs),
        actions=nested.stack(actions),
        rewards=np.asarray(rewards, dtype=np.float32),
        terminated=terminated,
        truncated=truncated,
        extra={k: nested.stack(column) for k, column in zip(extra_keys, zip(*extra_rows))},
        infos=list(infos),
        t_started=t_started,
        weights_version=weights_version,
        env_runner_index=env_runner_index,
        env_index=env_index,
    )
