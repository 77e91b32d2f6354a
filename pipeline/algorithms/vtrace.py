"""What IMPALA and APPO share: their V-trace settings and the pass that prepares a batch for
V-trace (the math itself is ``returns.vtrace``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from actors.learner import Batch, Learner, as_batch, step_rows
from actors.learner.sequences import Sequences, chunks_to_sequences, sequence_outputs, sequence_sgd
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

    supports_recurrent: ClassVar[bool] = True
    """``model_config`` ``use_lstm``: batches of whole chunks unrolled from their start states."""

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


def value_pass(learner: Learner, chunks: list[EpisodeChunk]
               ) -> tuple[Batch, torch.Tensor, torch.Tensor, Sequences | None]:
    """The batch, V(x) of every observation (incl. each chunk's closing one) and the current
    policy's action distribution inputs at the action rows -- one forward pass, no gradient -- and, for a
    recurrent module, the chunks as sequences (unrolled from their start states; None otherwise)."""
    b = as_batch(chunks, learner.device)
    if getattr(learner.module, "is_recurrent", False):
        seq = chunks_to_sequences(list(chunks), learner.device)
        with torch.no_grad():
            out = sequence_outputs(learner.module, seq)
        return b, out["vf_all"], out["action_dist_inputs"], seq
    with torch.no_grad():
        out = learner.module.forward_train(b.all_obs)
    rows = torch.as_tensor(step_rows(b.lengths), device=learner.device)
    return b, out["vf_preds"], out["action_dist_inputs"][rows], None


def policy_inputs(module: Any, b: Batch, seq: Sequences | None) -> torch.Tensor:
    """``module``'s action distribution inputs at every step of ``b`` (no gradient): one flat pass, or the
    sequences unrolled from their start states for a recurrent module (APPO's target network)."""
    with torch.no_grad():
        if seq is None:
            return module.forward_inference(b.obs)["action_dist_inputs"]
        return sequence_outputs(module, seq)["action_dist_inputs"]


def vtrace_targets(config: Any, b: Batch, behaviour_logp: torch.Tensor, target_logp: torch.Tensor,
                   values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace value targets and policy-gradient advantages as tensors on the batch's device."""
    vs, pg_adv = vtrace(behaviour_logp.cpu().numpy(), target_logp.cpu().numpy(), b.rewards, values.cpu().numpy(),
                        b.lengths, b.terminated, config.gamma, config.vtrace_clip_rho_threshold,
                        config.vtrace_clip_pg_rho_threshold)
    device = behaviour_logp.device
    return torch.as_tensor(vs, device=device), torch.as_tensor(pg_adv, device=device)


def sgd_epochs(learner: Learner, config: Any, tensors: dict[str, Any], loss_fn: Any, n: int,
               seq: Sequences | None = None) -> dict[str, float]:
    """``num_epochs`` passes of ``minibatch_size``-step minibatches over a batch of ``n`` steps;
    ``loss_fn(minibatch, out)`` gets ``out=None`` (it runs the module itself) or, with ``seq`` (a recurrent
    module), the outputs of the minibatch's sequences at their real steps (``tensors`` minus ``obs``)."""
    mbs = min(config.minibatch_size, n)
    if seq is None:
        return learner.sgd(tensors, lambda mb: loss_fn(mb, None), n, mbs, -(-n // mbs), config.num_epochs)
    # whole chunks make batches of slightly different sizes on different learners; the minibatches per epoch
    # come from the settings instead, so data-parallel learners take the same number of (all-reduced) steps
    steps = {k: v for k, v in tensors.items() if k != "obs"}
    num_minibatches = -(-int(config.train_batch_size_per_learner) // int(config.minibatch_size))
    return sequence_sgd(learner, seq, steps, loss_fn, n, mbs, num_minibatches, config.num_epochs)
