"""Action masks: observations that say which discrete actions are legal, honoured in one place.

An observation space that is a gymnasium ``Dict`` with an ``"action_mask"`` key (PettingZoo's classic
games: ``{"observation": ..., "action_mask": Box(0, 1, (n,), int8)}``) marks the legal actions of each
row with a 1. Every module with discrete actions takes the mask out of the observation before its
encoder -- the mask is not a network input (as in RLlib's action-masking example): the legal moves
are a rule of the game, not something to learn -- and sets the outputs of illegal actions
(logits, Q-values) to the dtype's lowest finite value. Finite, not ``-inf``: the distributions
normalise with ``logsumexp`` and compute ``p * log p`` for entropy and KL, where ``-inf`` turns
into NaN and a finite minimum into exact zeros. Because the masking happens in the module's
forward pass, everything downstream sees it: sampling, the greedy argmax, log-probabilities,
entropy and KL in the losses (the gradient of a masked output is zero), the driver's
``compute_single_action``. The exploration pieces read the legal actions back from the masked
inputs (``legal_actions``) to draw their random actions among legal ones only.

A mask with no legal action is a bad value when the module acts on it: ``apply(..., acting=True)``
raises naming the row. While learning, such rows are the closing observations of finished episodes
(a full tic-tac-toe board), which only feed value bootstraps; there the mask is ignored (every action
counts as legal), so no loss ever sees an empty row turn into NaN.

The mask is flat over the action distribution's inputs: ``n`` entries for ``Discrete(n)``,
``sum(nvec)`` for ``MultiDiscrete(nvec)`` (one block per branch, each block needs a legal action).
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

from actors.modules.distributions import ActionDistSpec, Categorical, MultiCategorical

MASK_KEY = "action_mask"


def mask_value(dtype: torch.dtype) -> float:
    """What a masked logit or Q-value becomes: the dtype's lowest finite value."""
    return torch.finfo(dtype).min


def is_masked_space(space: gym.Space) -> bool:
    return isinstance(space, gym.spaces.Dict) and MASK_KEY in space.spaces


class ActionMasking:
    """How one module splits its observations into (features, mask) and masks its outputs."""

    def __init__(self, observation_space: gym.spaces.Dict, dist_spec: ActionDistSpec) -> None:
        mask_space = observation_space.spaces[MASK_KEY]
        if dist_spec.kind == "categorical":
            self.branches = [dist_spec.input_dim]
        elif dist_spec.kind == "multi_categorical":
            self.branches = list(dist_spec.nvec)
        else:
            raise ValueError(f"the observation space has an {MASK_KEY!r} key, but the action space "
                             f"{dist_spec.space} is not discrete: action masks need Discrete or MultiDiscrete "
                             f"actions; rename the key if it is not a mask of legal actions")
        width = sum(self.branches)
        shape = getattr(mask_space, "shape", None)
        if not isinstance(mask_space, (gym.spaces.Box, gym.spaces.MultiBinary)) or shape != (width,):
            raise ValueError(f"observation[{MASK_KEY!r}] has the space {mask_space}; for the action space "
                             f"{dist_spec.space} it must be MultiBinary({width}) or Box(0, 1, ({width},)): one "
                             f"entry per action{' of each branch' if len(self.branches) > 1 else ''}, 1 = legal")
        rest = {k: s for k, s in observation_space.spaces.items() if k != MASK_KEY}
        if not rest:
            raise ValueError(f"the observation space {observation_space} holds only {MASK_KEY!r}: the module "
                             f"needs at least one other key to observe")
        # a lone remaining key (PettingZoo's "observation") is the encoder's whole space, so an image
        # there still gets the CNN encoder
        self.single_key = next(iter(rest)) if len(rest) == 1 else None
        self.features_space = rest[self.single_key] if self.single_key is not None else gym.spaces.Dict(rest)

    def split(self, obs: dict[str, Any]) -> tuple[Any, torch.Tensor]:
        """A batch of observations -> (what the encoder sees, the mask as a bool tensor ``[B, width]``)."""
        if not isinstance(obs, dict) or MASK_KEY not in obs:
            got = sorted(obs) if isinstance(obs, dict) else type(obs).__name__
            raise ValueError(f"the module was built for observations with an {MASK_KEY!r} key, got {got}")
        mask = obs[MASK_KEY]
        if self.single_key is not None:
            features = obs[self.single_key]
        else:
            features = {k: v for k, v in obs.items() if k != MASK_KEY}
        return features, mask.reshape(mask.shape[0], -1) > 0

    def apply(self, inputs: torch.Tensor, mask: torch.Tensor, acting: bool) -> torch.Tensor:
        """``inputs`` ``[B, width]`` (logits or Q-values) with the illegal entries at the lowest value.

        ``acting``: a row (or branch) with no legal action raises; else its mask is ignored (module
        docstring)."""
        empty = torch.stack([m.any(-1) for m in torch.split(mask, self.branches, dim=-1)], -1).logical_not_()
        if bool(empty.any()):
            if acting:
                row, branch = (int(i) for i in empty.nonzero()[0])
                where = f"row {row}" + (f", branch {branch}" if len(self.branches) > 1 else "")
                raise ValueError(f"observation[{MASK_KEY!r}] allows no action ({where} of the batch: "
                                 f"{mask[row].int().tolist()}); an env must offer at least one legal action to an "
                                 f"agent it asks to act -- give finished agents no observation to act on, or "
                                 f"end the episode")
            mask = mask | torch.repeat_interleave(empty, torch.as_tensor(self.branches, device=mask.device), dim=-1)
        return torch.where(mask, inputs, torch.full_like(inputs, mask_value(inputs.dtype)))


def masking_for(observation_space: gym.Space, dist_spec: ActionDistSpec) -> ActionMasking | None:
    """The masking of a module with these spaces, or None when its observations carry no mask."""
    return ActionMasking(observation_space, dist_spec) if is_masked_space(observation_space) else None


def legal_actions(dist: Any) -> list[torch.Tensor] | None:
    """Per branch, which actions a (masked) distribution allows, ``[B, n]`` bools; None when it
    masks nothing (so callers keep their cheaper unmasked path)."""
    if isinstance(dist, Categorical):
        logits = [dist.logits]
    elif isinstance(dist, MultiCategorical):
        logits = [c.logits for c in dist.cats]
    else:
        return None
    # normalising (logits - logsumexp) leaves a masked entry within rounding of the minimum
    legal = [lg > mask_value(lg.dtype) / 2 for lg in logits]
    return legal if any(not bool(ok.all()) for ok in legal) else None


def random_legal(dist_spec: ActionDistSpec, dist: Any) -> torch.Tensor:
    """One uniformly random action per row of ``dist``, among its legal actions."""
    legal = legal_actions(dist)
    if legal is None:
        return dist_spec.random(len(dist))
    draws = [Categorical(torch.where(ok, 0.0, mask_value(torch.float32))).sample() for ok in legal]
    return draws[0] if dist_spec.kind == "categorical" else torch.stack(draws, -1)


def observation_mask(obs: Any) -> np.ndarray | None:
    """The mask of one observation as bools (None when it has none): for envs and tests that check
    whether an action was legal."""
    if isinstance(obs, dict) and MASK_KEY in obs:
        return np.asarray(obs[MASK_KEY]).reshape(-1) > 0
    return None
