"""What IMPALA and APPO share: their V-trace settings and the pass that prepares a batch for
V-trace (the math itself is ``returns.vtrace``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from actors.learner import Batch, Learner, as_batch, step_rows
from pipeline.algorithms.returns import vtrace
from pipeline.config.checks import check_schedule, is_int, is_number
from protocols.episode import EpisodeChunk


@dataclass
class VTraceSettings:
    """Settings of the V-trace learners, mixed into IMPALA's and APPO's configs."""

    lr: float | list = 1e-3
    """Learning rate, or a piecewise-linear schedule ``[[timestep, lr], ...]``."""
    grad_clip: float | None = 40.0
    """Clip threshold for gradients (by ``grad_clip_by``, global norm by default)."""
    train_batch_size_per_learner: int = 500
    """Env steps per train batch (per update)."""
    minibatch_size: int = 500
    """Steps per SGD step; equal to the train batch (the default) makes one step per batch."""
    vtrace_clip_rho_threshold: float = 1.0
    """V-trace: clip the importance ratio of the value targets at this (rho-bar)."""
    vtrace_clip_pg_rho_threshold: float = 1.0
    """V-trace: clip the importance ratio of the policy-gradient advantages at this."""
    vf_loss_coeff: float = 0.5
    """Weight of the value loss (``0.5 * mean squared error to the V-trace targets``)."""
    entropy_coeff: float | list = 0.01
    """Weight of the entropy bonus, or a schedule ``[[timestep, coeff], ...]``."""

    def vtrace_problems(self) -> list[str]:
        problems = []
        for key in ("vtrace_clip_rho_threshold", "vtrace_clip_pg_rho_threshold"):
            if not is_number(getattr(self, key)) or getattr(self, key) <= 0:
                problems.append(f"{key} must be a number > 0, got {getattr(self, key)!r}")
        if not is_number(self.vf_loss_coeff) or self.vf_loss_coeff < 0:
            problems.append(f"vf_loss_coeff must be >= 0, got {self.vf_loss_coeff!r}")
        problems += check_schedule("entropy_coeff", self.entropy_coeff)
        if is_int(self.minibatch_size) and is_int(self.train_batch_size_per_learner) \
                and self.minibatch_size > self.train_batch_size_per_learner:
            problems.append(f"minibatch_size ({self.minibatch_size}) must not exceed train_batch_size_per_learner "
                            f"({self.train_batch_size_per_learner})")
        return problems


def value_pass(learner: Learner, chunks: list[EpisodeChunk]) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """The batch, V(x) of every observation (incl. each chunk's closing one) and the current
    policy's action distribution inputs at the action rows -- one forward pass, no gradient."""
    b = as_batch(chunks, learner.device)
    with torch.no_grad():
        out = learner.module.forward_train(b.all_obs)
    rows = torch.as_tensor(step_rows(b.lengths), device=learner.device)
    return b, out["vf_preds"], out["action_dist_inputs"][rows]


def vtrace_targets(config: Any, b: Batch, behaviour_logp: torch.Tensor, target_logp: torch.Tensor,
                   values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace value targets and policy-gradient advantages as tensors on the batch's device."""
    vs, pg_adv = vtrace(behaviour_logp.cpu().numpy(), target_logp.cpu().numpy(), b.rewards, values.cpu().numpy(),
                        b.lengths, b.terminated, config.gamma, config.vtrace_clip_rho_threshold,
                        config.vtrace_clip_pg_rho_threshold)
    device = behaviour_logp.device
    return torch.as_tensor(vs, device=device), torch.as_tensor(pg_adv, device=device)


def sgd_epochs(learner: Learner, config: Any, tensors: dict[str, Any], loss_fn: Any, n: int) -> dict[str, float]:
    """``num_epochs`` passes of ``minibatch_size``-step minibatches over a batch of ``n`` steps."""
    mbs = min(config.minibatch_size, n)
    return learner.sgd(tensors, loss_fn, n, mbs, -(-n // mbs), config.num_epochs)
