"""Action distributions, built from a module's flat ``action_dist_inputs``.

Written by hand instead of using ``torch.distributions`` because sampling sits on the env
runner's per-step path, where torch.distributions' argument validation and broadcasting cost more
than the small MLP itself.
"""
from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0


class Categorical:
    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits.log_softmax(-1)  # the same numbers as logits - logsumexp, at a fraction of its cost

    def __len__(self) -> int:
        return self.logits.shape[0]

    def sample(self) -> torch.Tensor:
        # Gumbel-max: one uniform draw per logit, no normalisation pass, no validation.
        u = torch.rand_like(self.logits).clamp_(1e-20, 1.0)
        return (self.logits - (-u.log()).log()).argmax(-1)

    def deterministic(self) -> torch.Tensor:
        return self.logits.argmax(-1)

    def logp(self, actions: torch.Tensor) -> torch.Tensor:
        return self.logits.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)

    def entropy(self) -> torch.Tensor:
        return -(self.logits.exp() * self.logits).sum(-1)

    def kl(self, other: "Categorical") -> torch.Tensor:
        return (self.logits.exp() * (self.logits - other.logits)).sum(-1)


class MultiCategorical:
    def __init__(self, inputs: torch.Tensor, nvec: list[int]) -> None:
        self.nvec = list(nvec)
        self.cats = [Categorical(x) for x in torch.split(inputs, self.nvec, dim=-1)]

    def __len__(self) -> int:
        return len(self.cats[0])

    def sample(self) -> torch.Tensor:
        return torch.stack([c.sample() for c in self.cats], -1)

    def deterministic(self) -> torch.Tensor:
        return torch.stack([c.deterministic() for c in self.cats], -1)

    def logp(self, actions: torch.Tensor) -> torch.Tensor:
        return sum(c.logp(actions[..., i]) for i, c in enumerate(self.cats))

    def entropy(self) -> torch.Tensor:
        return sum(c.entropy() for c in self.cats)

    def kl(self, other: "MultiCategorical") -> torch.Tensor:
        return sum(a.kl(b) for a, b in zip(self.cats, other.cats))


class DiagGaussian:
    """Inputs are ``[mean, log_std]`` concatenated on the last axis."""

    def __init__(self, inputs: torch.Tensor) -> None:
        self.mean, log_std = inputs.chunk(2, dim=-1)
        self.log_std = log_std.clamp(LOG_STD_MIN, LOG_STD_MAX)
        self.std = self.log_std.exp()

    def __len__(self) -> int:
        return self.mean.shape[0]

    def sample(self) -> torch.Tensor:
        return (self.mean + self.std * torch.randn_like(self.mean)).detach()

    def deterministic(self) -> torch.Tensor:
        return self.mean

    def logp(self, actions: torch.Tensor) -> torch.Tensor:
        z = (actions - self.mean) / self.std
        return (-0.5 * z.pow(2) - self.log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    def entropy(self) -> torch.Tensor:
        return (self.log_std + 0.5 * (1.0 + math.log(2 * math.pi))).sum(-1)

    def kl(self, other: "DiagGaussian") -> torch.Tensor:
        var_ratio = (self.std / other.std).pow(2)
        t1 = ((self.mean - other.mean) / other.std).pow(2)
        return 0.5 * (var_ratio + t1 - 1 - var_ratio.log()).sum(-1)


class SquashedGaussian:
    """``tanh`` of a diagonal Gaussian (SAC's policy): actions in (-1, 1), the normalized range the
    runners rescale to the space's bounds; log-probabilities include the tanh change of variables.
    Inputs are ``[mean, log_std]``."""

    def __init__(self, inputs: torch.Tensor) -> None:
        self.base = DiagGaussian(inputs)  # the Gaussian before tanh
        self.mean, self.log_std, self.std = self.base.mean, self.base.log_std, self.base.std

    def __len__(self) -> int:
        return len(self.base)

    def _logp_pre_tanh(self, z: torch.Tensor) -> torch.Tensor:
        # log(1 - tanh(z)^2), in a form that stays finite for large |z|
        return self.base.logp(z) - (2.0 * (math.log(2.0) - z - torch.nn.functional.softplus(-2.0 * z))).sum(-1)

    def _draw(self) -> torch.Tensor:
        return self.mean + self.std * torch.randn_like(self.mean)

    def rsample_with_logp(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterized sample (gradients flow to the inputs) and its log-probability."""
        z = self._draw()
        return torch.tanh(z), self._logp_pre_tanh(z)

    def sample(self) -> torch.Tensor:
        return torch.tanh(self._draw()).detach()

    def deterministic(self) -> torch.Tensor:
        return torch.tanh(self.mean)

    def logp(self, actions: torch.Tensor) -> torch.Tensor:
        z = torch.atanh(actions.clamp(-1.0 + 1e-6, 1.0 - 1e-6))
        return self._logp_pre_tanh(z)


class ActionDistSpec:
    """Which distribution an action space needs and how wide its inputs are. ``squashed=True``
    gives Box actions a tanh-squashed Gaussian (SAC) instead of a plain one."""

    SUPPORTED = "Discrete, MultiDiscrete, MultiBinary or 1-d Box"

    def __init__(self, space: gym.Space, squashed: bool = False) -> None:
        self.space = space
        if isinstance(space, gym.spaces.Discrete):
            self.kind, self.input_dim = "categorical", int(space.n)
        elif isinstance(space, gym.spaces.MultiDiscrete) and space.nvec.ndim == 1:
            self.kind, self.nvec = "multi_categorical", [int(n) for n in space.nvec]
            self.input_dim = sum(self.nvec)
        elif isinstance(space, gym.spaces.MultiBinary) and np.ndim(space.n) == 0:
            self.kind, self.nvec = "multi_categorical", [2] * int(space.n)
            self.input_dim = 2 * int(space.n)
        elif isinstance(space, gym.spaces.Box) and len(space.shape) == 1 and np.issubdtype(space.dtype, np.floating):
            self.kind, self.input_dim = "squashed_gaussian" if squashed else "gaussian", 2 * int(space.shape[0])
        else:
            raise ValueError(
                f"runnel's default module cannot produce actions for the action space {space}; "
                f"supported: {self.SUPPORTED}. Wrap the env to flatten its action space."
            )

    def build(self, inputs: torch.Tensor):
        if self.kind == "categorical":
            return Categorical(inputs)
        if self.kind == "multi_categorical":
            return MultiCategorical(inputs, self.nvec)
        if self.kind == "squashed_gaussian":
            return SquashedGaussian(inputs)
        return DiagGaussian(inputs)

    def to_env(self, actions: np.ndarray) -> np.ndarray:
        """Model actions -> the dtype the env's space declares."""
        return actions.astype(self.space.dtype, copy=False)

    def random(self, n: int) -> torch.Tensor:
        """``n`` uniformly random actions in the module's action space, drawn in one call
        (Box: uniform in [-1, 1], the normalized range the policy acts in)."""
        if self.kind == "categorical":
            return torch.randint(0, self.input_dim, (n,))
        if self.kind == "multi_categorical":
            return torch.stack([torch.randint(0, k, (n,)) for k in self.nvec], -1)
        return torch.rand(n, self.input_dim // 2) * 2.0 - 1.0


def apply_log_std_init(bias: torch.Tensor, spec: ActionDistSpec, log_std_init: float) -> None:
    if spec.kind in ("gaussian", "squashed_gaussian"):
        with torch.no_grad():
            bias[spec.input_dim // 2 :] = log_std_init
