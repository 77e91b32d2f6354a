"""Observation pieces: ``FlattenObservations`` (records) and ``FrameStackingEnvToModule`` (a view)."""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from actors.connectors.base import ConnectorV2


def _flatten_batch(space: gym.Space, obs: Any, n: int) -> list[np.ndarray]:
    """One ``[n, d]`` float32 block per leaf, in gymnasium's ``flatten`` order (one-hot for discrete leaves)."""
    if isinstance(space, gym.spaces.Box) or isinstance(space, gym.spaces.MultiBinary):
        return [np.asarray(obs, np.float32).reshape(n, -1)]
    if isinstance(space, gym.spaces.Discrete):
        idx = np.asarray(obs, np.int64).reshape(n) - int(space.start)
        out = np.zeros((n, int(space.n)), np.float32)
        out[np.arange(n), np.clip(idx, 0, int(space.n) - 1)] = 1.0
        return [out]
    if isinstance(space, gym.spaces.MultiDiscrete):
        x = np.asarray(obs, np.int64).reshape(n, -1)
        blocks = []
        for i, k in enumerate(np.asarray(space.nvec).ravel()):
            b = np.zeros((n, int(k)), np.float32)
            b[np.arange(n), np.clip(x[:, i], 0, int(k) - 1)] = 1.0
            blocks.append(b)
        return blocks
    if isinstance(space, gym.spaces.Dict):
        return [b for key, sub in space.spaces.items() for b in _flatten_batch(sub, obs[key], n)]
    if isinstance(space, gym.spaces.Tuple):
        return [b for sub, o in zip(space.spaces, obs) for b in _flatten_batch(sub, o, n)]
    raise ValueError(f"FlattenObservations cannot flatten {space}; it takes Box, Discrete, MultiDiscrete, "
                     f"MultiBinary and Dict/Tuple of these")


class FlattenObservations(ConnectorV2):
    """Dict/Tuple/discrete observations -> one flat float32 vector per step (discrete parts one-hot), as
    gymnasium's ``flatten`` lays them out. Chunks store the flat vectors."""

    def __init__(self, input_observation_space: gym.Space | None = None, input_action_space: gym.Space | None = None,
                 *, multi_agent: bool = False, **kwargs: Any) -> None:
        super().__init__(input_observation_space, input_action_space, **kwargs)
        del multi_agent  # RLlib's flag: a multi-agent run builds one pipeline per module anyway

    def recompute_output_observation_space(self, input_observation_space: gym.Space,
                                           input_action_space: gym.Space) -> gym.Space:
        flat = gym.spaces.flatten_space(input_observation_space)
        return gym.spaces.Box(flat.low.astype(np.float32), flat.high.astype(np.float32), flat.shape, np.float32)

    def __call__(self, obs: Any, *, episode_starts: np.ndarray, update: bool) -> Any:
        n = len(episode_starts)
        blocks = _flatten_batch(self.input_observation_space, obs, n)
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)


class FrameStackingEnvToModule(ConnectorV2):
    """The module sees the last ``num_frames`` observations concatenated along their last axis (an
    ``84x84x1`` frame becomes ``84x84x4``; a CartPole vector of 4 becomes 16). An episode's first
    observation fills every slot. A view: chunks keep one frame per step plus ``num_frames - 1`` look-back
    frames, and the learner rebuilds the stacks (``view_of``) -- stored and shipped bytes stay one frame per
    step. Box observations of at least one dimension. In a multi-agent run each agent has its own stack, built
from its own observations (``actors.connectors.multi_agent``)."""

    records = False

    def __init__(self, input_observation_space: gym.Space | None = None, input_action_space: gym.Space | None = None,
                 *, num_frames: int = 4, multi_agent: bool = False, **kwargs: Any) -> None:
        super().__init__(input_observation_space, input_action_space, **kwargs)
        del multi_agent  # RLlib's flag: a multi-agent run builds one pipeline per module, its agents' stacks apart
        if not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"num_frames must be an int >= 1, got {num_frames!r}")
        self.num_frames = num_frames
        self.look_back = num_frames - 1
        self.frames: np.ndarray | None = None
        """``[num_frames, num_envs, ...]``: each sub-env's recent frames, a ring whose newest is at ``head`` (a
        step writes one frame instead of shifting the others)."""
        self.head = 0

    def recompute_output_observation_space(self, input_observation_space: gym.Space,
                                           input_action_space: gym.Space) -> gym.Space:
        s = input_observation_space
        if not isinstance(s, gym.spaces.Box) or len(s.shape) < 1:
            raise ValueError(f"FrameStackingEnvToModule stacks Box observations of at least one dimension, got {s}")
        k = self.num_frames
        return gym.spaces.Box(np.concatenate([s.low] * k, axis=-1), np.concatenate([s.high] * k, axis=-1),
                              s.shape[:-1] + (s.shape[-1] * k,), s.dtype)

    def reset_stack(self, num_envs: int) -> None:
        self.frames = None

    def __call__(self, obs: Any, *, episode_starts: np.ndarray, update: bool) -> Any:
        x = np.asarray(obs)
        k = self.num_frames
        if self.frames is None or self.frames.shape[1] != x.shape[0] or self.frames.dtype != x.dtype:
            self.frames = np.repeat(x[None], k, axis=0)
            self.head = k - 1
        else:
            self.head = (self.head + 1) % k
            self.frames[self.head] = x
            starts = np.flatnonzero(episode_starts)
            if len(starts):  # an episode's first frame fills its whole stack
                self.frames[:, starts] = x[starts]
        return np.concatenate([self.frames[i] for i in self._oldest_first()], axis=-1)

    def _oldest_first(self) -> list[int]:
        k = self.num_frames
        return [(self.head + 1 + j) % k for j in range(k)]

    def recent(self) -> np.ndarray:
        """Each sub-env's ``num_frames - 1`` frames before its newest one: ``[num_envs, num_frames - 1, ...]``
        (the look-back of a chunk that starts at the newest frame)."""
        order = self._oldest_first()[:-1]
        if not order:
            return np.empty((self.frames.shape[1], 0) + self.frames.shape[2:], self.frames.dtype)
        return np.stack([self.frames[i] for i in order], axis=1)

    def view_of(self, rows: np.ndarray, look_back: np.ndarray | None) -> np.ndarray:
        k = self.num_frames
        t1 = rows.shape[0]
        if k > 1 and (look_back is None or len(look_back) < k - 1):
            raise ValueError(f"frame stacking needs {k - 1} look-back frames before each chunk, got "
                             f"{0 if look_back is None else len(look_back)}")
        frames = np.concatenate([look_back[len(look_back) - (k - 1):], rows]) if k > 1 else rows
        return np.concatenate([frames[i : i + t1] for i in range(k)], axis=-1)

    def view_rows(self, frames: np.ndarray) -> np.ndarray:
        k = self.num_frames
        if frames.shape[1] < k:
            raise ValueError(f"frame stacking needs {k} frames per row, got {frames.shape[1]}")
        return np.concatenate([frames[:, frames.shape[1] - k + i] for i in range(k)], axis=-1)

    def view_gather(self, source: np.ndarray, idx: np.ndarray) -> np.ndarray:
        k, c = self.num_frames, source.shape[-1]
        if idx.shape[1] < k:
            raise ValueError(f"frame stacking needs {k} frames per row, got {idx.shape[1]}")
        out = np.empty((len(idx),) + source.shape[1:-1] + (k * c,), source.dtype)
        for i, j in enumerate(range(idx.shape[1] - k, idx.shape[1])):  # one frame of every stack at a time
            out[..., i * c: (i + 1) * c] = source.take(idx[:, j], axis=0)
        return out

    def __repr__(self) -> str:
        return f"FrameStackingEnvToModule(num_frames={self.num_frames})"


