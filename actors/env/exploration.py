"""Exploration: how a stage turns a module's action distribution into the actions it takes.

The env runner (and the driver's ``compute_actions``) call ``actions(dist, explore, timestep)``
once per batched step; the piece decides between sampling, acting greedily or acting at random.
``explore=False`` always means the greedy action. ``timestep`` is the acting stage's count of env
steps, which drives schedules (random warm-up now; epsilon and temperature schedules build on
the same seam). Its state travels in the runner's state, so a recreated runner resumes its
schedule. With action masks the module has already pushed illegal actions to the lowest logit or
Q-value (so sampling and the greedy action stay legal); the random actions here are drawn among
the legal ones (``actors.modules.action_mask.random_legal``).
"""
from __future__ import annotations

from typing import Any

import torch

from actors.imports import import_object
from actors.modules.action_mask import random_legal
from actors.modules.distributions import ActionDistSpec, Categorical
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
            return random_legal(self.dist_spec, dist)
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
        random = random_legal(self.dist_spec, dist)
        return torch.where(pick.view(n, *([1] * (greedy.dim() - 1))), random, greedy)


class SoftQ(Exploration):
    """Sample from softmax(logits / temperature) -- for Q-values, a Boltzmann policy; low
    temperatures approach the greedy action, high ones uniform choice. Discrete actions only."""

    def __init__(self, dist_spec: ActionDistSpec, temperature: float = 1.0) -> None:
        super().__init__(dist_spec)
        if dist_spec.kind not in ("categorical", "multi_categorical"):
            raise ValueError(f"SoftQ needs discrete actions, not the action space {dist_spec.space}")
        if not isinstance(temperature, (int, float)) or temperature <= 0:
            raise ValueError(f"SoftQ temperature must be > 0, got {temperature!r}")
        self.temperature = float(temperature)

    def actions(self, dist: Any, explore: bool, timestep: int) -> torch.Tensor:
        if not explore:
            return dist.deterministic()
        if hasattr(dist, "cats"):  # MultiCategorical: one softmax per branch
            return torch.stack([Categorical(c.logits / self.temperature).sample() for c in dist.cats], -1)
        return Categorical(dist.logits / self.temperature).sample()


class GaussianNoise(Exploration):
    """For deterministic continuous policies: uniformly random actions for ``random_timesteps``,
    then the deterministic action plus N(0, stddev) scaled from ``initial_scale`` to ``final_scale``
    over ``scale_timesteps``, clipped to the policy's action range ([-1, 1] when normalized)."""

    def __init__(self, dist_spec: ActionDistSpec, random_timesteps: int = 1000, stddev: float = 0.1,
                 initial_scale: float = 1.0, final_scale: float = 0.02, scale_timesteps: int = 10_000) -> None:
        super().__init__(dist_spec)
        if dist_spec.kind not in ("gaussian", "squashed_gaussian"):
            raise ValueError(f"{type(self).__name__} needs a continuous (Box) action space, not {dist_spec.space}")
        self.random_timesteps, self.stddev = int(random_timesteps), float(stddev)
        self.schedule = [[random_timesteps, initial_scale], [random_timesteps + max(1, scale_timesteps), final_scale]]

    def scale(self, timestep: int) -> float:
        return piecewise(self.schedule, timestep)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape) * self.stddev

    def actions(self, dist: Any, explore: bool, timestep: int) -> torch.Tensor:
        action = dist.deterministic()
        if not explore:
            return action
        if timestep < self.random_timesteps:
            return self.dist_spec.random(len(dist))
        return (action + self.scale(timestep) * self.noise(action.shape)).clamp(-1.0, 1.0)


class OrnsteinUhlenbeckNoise(GaussianNoise):
    """``GaussianNoise`` with temporally correlated noise: one OU process per sub-env,
    ``x += theta * -x + sigma * N(0, 1)``, added as ``ou_base_scale * scale(t) * x``. Its state is
    part of the runner's state, so a checkpoint continues it."""

    def __init__(self, dist_spec: ActionDistSpec, ou_theta: float = 0.15, ou_sigma: float = 0.2,
                 ou_base_scale: float = 0.1, random_timesteps: int = 1000, initial_scale: float = 1.0,
                 final_scale: float = 0.02, scale_timesteps: int = 10_000) -> None:
        super().__init__(dist_spec, random_timesteps, 1.0, initial_scale, final_scale, scale_timesteps)
        self.theta, self.sigma, self.base_scale = float(ou_theta), float(ou_sigma), float(ou_base_scale)
        self.state = torch.zeros(0)

    def noise(self, shape: torch.Size) -> torch.Tensor:
        if self.state.shape != shape:  # a new number of sub-envs: fresh processes
            self.state = torch.zeros(shape)
        self.state = self.state - self.theta * self.state + self.sigma * torch.randn(shape)
        return self.base_scale * self.state

    def get_state(self) -> dict[str, Any]:
        return {"ou_state": self.state.numpy().copy()}

    def set_state(self, state: dict[str, Any]) -> None:
        if "ou_state" in state:
            self.state = torch.as_tensor(state["ou_state"], dtype=torch.float32)


EXPLORATIONS = {cls.__name__: cls for cls in (StochasticSampling, EpsilonGreedy, SoftQ, GaussianNoise,
                                              OrnsteinUhlenbeckNoise)}


def make_exploration(config: dict[str, Any] | None, dist_spec: ActionDistSpec) -> Exploration:
    """``{"type": ..., **kwargs}`` -> the piece. ``type``: a built-in name (RLlib's dotted paths to
    its built-ins work too), an ``Exploration`` subclass, or ``"pkg.module:Class"``/``"pkg.module.Class"``."""
    config = dict(config or {})
    kind = config.pop("type", "StochasticSampling")
    cls = _resolve(kind) if isinstance(kind, str) else kind
    if not (isinstance(cls, type) and issubclass(cls, Exploration)):
        raise ValueError(f"exploration type {kind!r} must subclass actors.env.exploration.Exploration")
    try:
        return cls(dist_spec, **config)
    except TypeError as err:
        raise ValueError(f"exploration_config for {getattr(cls, '__name__', cls)}: {err}") from None


def _resolve(name: str) -> Any:
    last = name.replace(":", ".").rsplit(".", 1)[-1]
    if name in EXPLORATIONS or (name.startswith("ray.rllib.") and last in EXPLORATIONS):
        return EXPLORATIONS[last]
    try:
        return import_object(name)
    except (ImportError, AttributeError, ValueError, TypeError):
        raise ValueError(f"unknown exploration type {name!r}: not a built-in ({sorted(EXPLORATIONS)}) and not an "
                         f"importable 'package.module:Class'") from None
