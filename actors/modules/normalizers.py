"""Running statistics that live inside a module as buffers, so they travel with its weights to runners and
inference servers and into checkpoints: per-pixel input statistics (``model_config normalize_input``) and the
value targets' statistics (``model_config normalize_returns``). Only learners change them."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn


class RunningMoments(nn.Module):
    """Running per-element mean and (population) variance of what a learner folds in, as three buffers named
    ``<prefix>_mean``, ``<prefix>_var`` and ``<prefix>_count`` (float64 count). ``moments`` of a batch, then
    ``merge`` (Chan et al.'s parallel update); ``fold_in`` does both, pooling data-parallel learners' moments
    first so that every learner keeps the same statistics."""

    prefix = "moments"

    def __init__(self, shape: tuple[int, ...], initial_var: float = 1.0) -> None:
        super().__init__()
        self.register_buffer(f"{self.prefix}_mean", torch.zeros(shape))
        self.register_buffer(f"{self.prefix}_var", torch.full(shape, float(initial_var)))
        self.register_buffer(f"{self.prefix}_count", torch.zeros((), dtype=torch.float64))

    @property
    def mean(self) -> torch.Tensor:
        return getattr(self, f"{self.prefix}_mean")

    @property
    def var(self) -> torch.Tensor:
        return getattr(self, f"{self.prefix}_var")

    @property
    def count(self) -> torch.Tensor:
        return getattr(self, f"{self.prefix}_count")

    @staticmethod
    def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch's per-element mean and (population) variance over its first axis, as float64 (computed in
        float32: pixels and their squares are exact there, and a float64 copy of a batch of frames would
        double its memory)."""
        var, mean = torch.var_mean(x.detach().float(), 0, unbiased=False)
        return mean.double(), var.double()

    def fold_in(self, x: torch.Tensor, pool: Any = None, world_size: int = 1) -> None:
        """Merge a batch's moments. ``pool`` (data-parallel learners: their ``allreduce_mean``) averages each
        learner's row count and sums of x and x^2 first, so every learner folds in the moments of all their rows."""
        mean, var = self.moments(x)
        count = float(x.shape[0])
        if pool is not None:
            sums = np.concatenate([[count], (count * mean).cpu().numpy().ravel(),
                                   (count * (var + mean.square())).cpu().numpy().ravel()])
            pooled = pool(sums)
            rows, size = float(pooled[0]), mean.numel()
            mean = torch.as_tensor(pooled[1:1 + size] / rows).reshape(mean.shape)
            var = torch.as_tensor(pooled[1 + size:] / rows).reshape(mean.shape) - mean.square()
            count = rows * world_size
        self.merge(mean, var.clamp(min=0.0), int(count))

    @torch.no_grad()
    def merge(self, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        """Fold in ``count`` rows' moments (Chan et al.'s parallel update)."""
        if count < 1:
            return
        old_n = float(self.count)
        total = old_n + count
        old_mean = self.mean.to(torch.float64)
        delta = mean.to(old_mean.device) - old_mean
        new_mean = old_mean + delta * (count / total)
        new_var = (self.var.to(torch.float64) * old_n + var.to(old_mean.device) * count
                   + delta.square() * (old_n * count / total)) / total
        self.mean.copy_(new_mean)
        self.var.copy_(new_var)
        self.count.fill_(total)


class InputNormalizer(RunningMoments):
    """Per-element running mean and variance of a module's observations (``model_config normalize_input``),
    and the standardisation by them: ``clip((x - mean) / sqrt(var + 1e-5), -5, 5)``.

    The statistics are the buffers ``input_mean``, ``input_var``, ``input_count``, so a restored module normalises
    bit for bit as the saved one did. Learners fold in each train batch after its update. Before the first merge
    the mean is 0 and the standard deviation ``1 / scale``: an untrained module sees its pixels scaled as without
    normalisation (by 1/255)."""

    prefix = "input"
    EPSILON, CLIP = 1e-5, 5.0

    def __init__(self, shape: tuple[int, ...], scale: float = 1.0) -> None:
        super().__init__(shape, 1.0 / scale ** 2)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.to(self.input_mean.dtype) - self.input_mean
        return x.mul_(torch.rsqrt(self.input_var + self.EPSILON)).clamp_(-self.CLIP, self.CLIP)


class ReturnNormalizer(RunningMoments):
    """The running mean and variance of a module's value targets (``model_config normalize_returns``, as Sample
    Factory's ``--normalize_returns``). The value head learns targets standardised by them: it outputs
    ``(v - mean) / std`` and the module reports ``v`` (``denormalize``), so GAE, V-trace and every reader of
    ``vf_preds`` see returns in the env's units, while the value loss, divided by the variance
    (``scale``), is the squared error of standardised values whatever the rewards' scale. The statistics are
    the buffers ``return_mean``, ``return_var``, ``return_count`` of the value side (inference-only copies
    carry neither); before the first merge mean 0 and variance 1, the identity."""

    prefix = "return"
    EPSILON = 1e-5

    def __init__(self) -> None:
        super().__init__((), 1.0)

    def scale(self) -> torch.Tensor:
        """The standard deviation the value head's outputs are multiplied by."""
        return torch.sqrt(self.return_var + self.EPSILON).float()

    def denormalize(self, head_out: torch.Tensor) -> torch.Tensor:
        return head_out * self.scale().to(head_out.dtype) + self.return_mean.to(head_out.dtype)


def input_normalizers(module: nn.Module) -> list[InputNormalizer]:
    """The ``InputNormalizer``s in ``module`` (one per image encoder with ``normalize_input``)."""
    return [m for m in module.modules() if isinstance(m, InputNormalizer)]


def return_normalizers(module: nn.Module) -> list[ReturnNormalizer]:
    """The ``ReturnNormalizer``s in ``module`` (one per value head with ``normalize_returns``)."""
    return [m for m in module.modules() if isinstance(m, ReturnNormalizer)]


def value_error(module: nn.Module, values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``values - targets`` as a value loss squares it: divided by the value targets' running standard deviation
    with ``normalize_returns`` (the module's own ``ReturnNormalizer``), else as it is (no extra op on the hot path)."""
    norm = getattr(module, "return_normalizer", None)
    err = values - targets
    return err / norm.scale().detach() if isinstance(norm, ReturnNormalizer) else err
