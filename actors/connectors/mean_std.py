"""MeanStdFilter: observations shifted and scaled by running statistics gathered across all runners.

Each runner's copy keeps the merged statistics the driver last sent (``base``) and what it has seen since
(``delta``), and normalises with both together. After each training iteration the driver takes every
runner's delta (``pop_delta``), merges them into its own copy (``absorb``: Chan et al.'s parallel update of
count, mean and the sum of squared deviations, in float64) and sends the merged statistics back (``sync``).
The driver's copy is what checkpoints hold, bit for bit. The chunks store normalised observations (the
piece records), so learners and replay train on exactly what the policy acted on.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from actors.connectors.base import ConnectorV2


@dataclass
class RunningStats:
    """Count, mean and sum of squared deviations (M2) of a stream of arrays of one shape, in float64."""

    count: float
    mean: np.ndarray
    m2: np.ndarray

    @classmethod
    def empty(cls, shape: tuple[int, ...]) -> "RunningStats":
        return cls(0.0, np.zeros(shape, np.float64), np.zeros(shape, np.float64))

    def add_batch(self, x: np.ndarray) -> None:
        n = x.shape[0]
        if n == 0:
            return
        x = x.astype(np.float64, copy=False)
        mean = x.mean(axis=0)
        m2 = ((x - mean) ** 2).sum(axis=0)
        self.merge(RunningStats(float(n), mean, m2))

    def merge(self, other: "RunningStats") -> None:
        if other.count == 0:
            return
        if self.count == 0:
            self.count, self.mean, self.m2 = other.count, other.mean.copy(), other.m2.copy()
            return
        total = self.count + other.count
        d = other.mean - self.mean
        self.mean = self.mean + d * (other.count / total)
        self.m2 = self.m2 + other.m2 + d * d * (self.count * other.count / total)
        self.count = total

    def merged(self, other: "RunningStats") -> "RunningStats":
        out = RunningStats(self.count, self.mean.copy(), self.m2.copy())
        out.merge(other)
        return out

    @property
    def std(self) -> np.ndarray:
        if self.count < 2:
            return np.ones_like(self.mean)
        return np.sqrt(self.m2 / self.count)

    def to_plain(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean.copy(), "m2": self.m2.copy()}

    @classmethod
    def from_plain(cls, d: dict[str, Any], shape: tuple[int, ...]) -> "RunningStats":
        mean = np.array(d["mean"], np.float64)
        m2 = np.array(d["m2"], np.float64)
        count = float(d["count"])
        if mean.shape != shape or m2.shape != shape or not count >= 0:
            raise ValueError(f"MeanStdFilter state of shape {mean.shape}/{m2.shape} (count {count}) does not fit "
                             f"observations of shape {shape}")
        return cls(count, mean, m2)


class MeanStdFilter(ConnectorV2):
    """``(obs - mean) / (std + epsilon)`` per observation element, clipped to ``[-clip, clip]``, with the
    mean and standard deviation of every observation the training runners have seen so far.

    Box observation spaces only (put ``FlattenObservations`` first for Dict/Tuple spaces). ``clip``: None
    leaves the normalised values unclipped. Until two observations have been seen the scale is 1.
    """

    def __init__(self, input_observation_space: gym.Space | None = None, input_action_space: gym.Space | None = None,
                 *, clip: float | None = 10.0, epsilon: float = 1e-8, multi_agent: bool = False, **kwargs: Any) -> None:
        super().__init__(input_observation_space, input_action_space, **kwargs)
        del multi_agent  # RLlib's flag: a multi-agent run builds one pipeline (and one filter) per module anyway
        if clip is not None and not clip > 0:
            raise ValueError(f"MeanStdFilter clip must be > 0 or None, got {clip!r}")
        self.clip, self.epsilon = clip, float(epsilon)
        self._lock = threading.Lock()  # a streaming runner samples in a thread while the driver syncs
        self._shape: tuple[int, ...] | None = None
        self.base: RunningStats | None = None
        self.delta: RunningStats | None = None
        self._scale: tuple[np.ndarray, np.ndarray] | None = None  # (mean, 1 / (std + eps)), float32

    def _space(self, space: gym.Space) -> gym.spaces.Box:
        if not isinstance(space, gym.spaces.Box):
            raise ValueError(f"MeanStdFilter normalises Box observations, got {space}: put FlattenObservations() "
                             f"before it for Dict/Tuple/Discrete observations")
        return space

    def recompute_output_observation_space(self, input_observation_space: gym.Space,
                                           input_action_space: gym.Space) -> gym.Space:
        space = self._space(input_observation_space)
        self._init(space.shape)
        bound = np.inf if self.clip is None else self.clip
        return gym.spaces.Box(-bound, bound, space.shape, np.float32)

    def _init(self, shape: tuple[int, ...]) -> None:
        if self._shape is None:
            self._shape = tuple(shape)
            self.base, self.delta = RunningStats.empty(self._shape), RunningStats.empty(self._shape)

    def _refresh(self) -> None:
        both = self.base.merged(self.delta)
        self._scale = (both.mean.astype(np.float32), (1.0 / (both.std + self.epsilon)).astype(np.float32))

    def __call__(self, obs: Any, *, episode_starts: np.ndarray, update: bool) -> Any:
        x = np.asarray(obs)
        if self._shape is None:
            self._init(x.shape[1:])
        with self._lock:
            if update:
                self.delta.add_batch(x)
                self._scale = None
            if self._scale is None:
                self._refresh()
            mean, inv = self._scale
        out = (x.astype(np.float32, copy=False) - mean) * inv
        if self.clip is not None:
            np.clip(out, -self.clip, self.clip, out=out)
        return out

    # --- state -----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """The statistics this copy normalises with (base and delta merged)."""
        if self._shape is None:
            return {}
        with self._lock:
            return self.base.merged(self.delta).to_plain()

    def set_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        shape = tuple(np.shape(state["mean"]))
        self._init(shape)
        with self._lock:
            self.base = RunningStats.from_plain(state, self._shape)
            self.delta = RunningStats.empty(self._shape)
            self._scale = None

    def sync(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self._init(tuple(np.shape(state["mean"])))
        with self._lock:
            self.base = RunningStats.from_plain(state, self._shape)
            self._scale = None

    def pop_delta(self) -> Any:
        if self._shape is None:
            return None
        with self._lock:
            delta, self.delta = self.delta, RunningStats.empty(self._shape)
        return delta.to_plain() if delta.count else None

    def absorb(self, deltas: list[Any]) -> None:
        for d in deltas:
            self._init(tuple(np.shape(d["mean"])))
            with self._lock:
                self.base.merge(RunningStats.from_plain(d, self._shape))
                self._scale = None

    def __repr__(self) -> str:
        return f"MeanStdFilter(clip={self.clip})"
