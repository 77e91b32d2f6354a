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
from actors.schedules import piecewise


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


class EpsilonGreedy(Exploration):
    """The greedy action, or with probability epsilon a uniformly random one (per row, drawn
    vectorized). Epsilon follows ``epsilon_schedule`` (``[[timestep, epsilon], ...]``, linear in
    between), or RLlib's ``initial_epsilon`` -> ``final_epsilon`` over ``epsilon_timesteps``."""

    def __init__(self, dist_spec: ActionDistSpec, initial_epsilon: float = 1.0, final_epsilon: float = 0.05,
                 epsilon_timesteps: int = 10_000, epsilon_schedule: list | None = None) -> None:
        super().__init__(dist_spec)
        self.schedule = (epsilon_schedule if epsilon_schedule is not None
                         else [[0, initial_epsilon], [epsilon_timesteps, final_epsilon]])
        bad = [p for p in self.schedule if not 0.0 <= float(p[1]) <= 1.0]
        if bad:
            raise ValueError(f"epsilon values must be in [0, 1], got {bad} in {self.schedule}")

    def epsilon(self, timestep: int) -> float:
        return piecewise(self.schedule, timestep)

    def actions(self, dist: Any, explore: bool, timestep: int) -> torch.Tensor:
        greedy = dist.deterministic()
        if not explore:
            return greedy
        n = len(dist)
        pick = torch.rand(n) < self.epsilon(timestep)
        if not bool(pick.any()):
            return greedy
        random = self.dist_spec.random(n)
        return torch.where(pick.view(n, *([1] * (greedy.dim() - 1))), random, greedy)


EXPLORATIONS = {"StochasticSampling": StochasticSampling, "EpsilonGreedy": EpsilonGreedy}


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
