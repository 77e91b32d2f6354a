"""Exploration: how a stage turns a module's action distribution into the actions it takes.

The env runner (and the driver's ``compute_actions``) call ``actions(dist, explore, timestep)``
once per batched step; the piece decides between sampling, acting greedily or acting at random.
``explore=False`` always means the greedy action. ``timestep`` is the acting stage's count of env
steps, which drives schedules (random warm-up now; epsilon and temperature schedules build on
the same seam). Its state travels in the runner's state, so a recreated runner resumes its
schedule.
"""
from __future__ import annotations

from typing import Any

import torch

from actors.modules.distributions import ActionDistSpec


class Exploration:
    """The interface; ``StochasticSampling`` is the default piece."""

    def __init__(self, dist_spec: ActionDistSpec) -> None:
        self.dist_spec = dist_spec

    def actions(self, dist: Any, explore: bool, timestep: int) -> torch.Tensor:
        raise NotImplementedError

    def get_state(self) -> dict[str, Any]:
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        pass


class StochasticSampling(Exploration):
    """Sample from the distribution; for the first ``random_timesteps`` steps act uniformly at
    random instead (a warm-up that fills the first batches with diverse data)."""

    def __init__(self, dist_spec: ActionDistSpec, random_timesteps: int = 0) -> None:
        super().__init__(dist_spec)
        if not isinstance(random_timesteps, int) or random_timesteps < 0:
            raise ValueError(f"random_timesteps must be an int >= 0, got {random_timesteps!r}")
        self.random_timesteps = random_timesteps

    def actions(self, dist: Any, explore: bool, timestep: int) -> torch.Tensor:
        if not explore:
            return dist.deterministic()
        if timestep < self.random_timesteps:
            return self.dist_spec.random(len(dist))
        return dist.sample()


EXPLORATIONS = {"StochasticSampling": StochasticSampling}


def make_exploration(config: dict[str, Any] | None, dist_spec: ActionDistSpec) -> Exploration:
    """``{"type": "StochasticSampling", **kwargs}`` (or a class as ``type``) -> the piece."""
    config = dict(config or {})
    kind = config.pop("type", "StochasticSampling")
    cls = EXPLORATIONS.get(kind) if isinstance(kind, str) else kind
    if cls is None:
        raise ValueError(f"unknown exploration type {kind!r}; available: {sorted(EXPLORATIONS)} or an "
                         f"Exploration subclass")
    try:
        return cls(dist_spec, **config)
    except TypeError as err:
        raise ValueError(f"exploration_config for {getattr(cls, '__name__', cls)}: {err}") from None
