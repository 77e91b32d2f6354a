"""Model actions -> actions an environment accepts, in one place for runners and the driver."""
from __future__ import annotations

import gymnasium as gym
import numpy as np


class EnvActions:
    """Box actions: the policy acts in [-1, 1] and ``normalize_actions`` rescales to the space's
    bounds (else ``clip_actions`` clips into them); other spaces get the dtype their space declares."""

    def __init__(self, space: gym.Space, normalize_actions: bool = True, clip_actions: bool = False) -> None:
        self.space, self.normalize, self.clip = space, normalize_actions, clip_actions
        self.box = isinstance(space, gym.spaces.Box)

    def __call__(self, actions: np.ndarray) -> np.ndarray:
        if not self.box:  # torch-free: a runner under central inference converts actions too
            return actions.astype(self.space.dtype, copy=False)
        low, high = self.space.low, self.space.high
        if self.normalize:
            actions = low + (np.clip(actions, -1.0, 1.0) + 1.0) * 0.5 * (high - low)
        elif self.clip:
            actions = np.clip(actions, low, high)
        return actions.astype(self.space.dtype, copy=False)
