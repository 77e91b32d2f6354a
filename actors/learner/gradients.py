"""FlatGrads: one optimizer slot's gradients as views of one flat buffer; and what a learner does with a slot's
gradients after backward (``finish_flat``, ``finish_tensors``: average across learners, clip, measure).

A learner update on a small network is dominated by per-tensor calls, not arithmetic: zeroing every
gradient, a norm per tensor and their norm, a scale per tensor, and (with several learners) a copy into
one buffer for the all-reduce and back. With every parameter's ``.grad`` a view of one contiguous
buffer, each of those is one call on the buffer. Autograd accumulates into an existing ``.grad`` in
place, so the views fill during ``backward()``; ``collect`` checks that they did (anything that replaced
a ``.grad`` -- a ``zero_grad(set_to_none=True)`` elsewhere -- is copied back in) so the buffer always
holds the gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

TOTAL_NORM = getattr(torch.nn.utils, "get_total_norm", None)
"""torch >= 2.6: the global norm of many tensors in one fused call (older: one norm per tensor, stacked)."""


class FlatGrads:
    def __init__(self, params: list[nn.Parameter]) -> None:
        first = params[0]
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            n = p.numel()
            self.views.append(self.flat[offset:offset + n].view_as(p))
            offset += n
        self.params = list(params)
        self.attach()

    @classmethod
    def for_slots(cls, slots: dict[str, list[nn.Parameter]]) -> dict[str, "FlatGrads"]:
        """A buffer for each slot whose parameters are its own (no parameter in two slots) and of one dtype
        and device; the other slots keep per-tensor gradients."""
        counts: dict[int, int] = {}
        for params in slots.values():
            for p in params:
                counts[id(p)] = counts.get(id(p), 0) + 1
        out = {}
        for name, params in slots.items():
            if (params and all(counts[id(p)] == 1 for p in params)
                    and len({(p.dtype, p.device) for p in params}) == 1 and params[0].dtype.is_floating_point):
                out[name] = cls(params)
        return out

    def attach(self) -> None:
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                p.grad = view

    def zero(self) -> None:
        """Every gradient zero, each ``.grad`` a view of the buffer again."""
        self.flat.zero_()
        self.attach()

    def collect(self) -> torch.Tensor:
        """After ``backward()``: the buffer, holding every gradient (a replaced ``.grad`` copied in, a missing
        one zero -- a loss that leaves a head out)."""
        for p, view in zip(self.params, self.views):
            g = p.grad
            if g is not view:
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
                p.grad = view
        return self.flat


def finish_tensors(params: list[nn.Parameter], world_size: int, clip: float | None, by: str) -> torch.Tensor:
    """After backward: average across ``world_size`` learners, clip (``by`` "value", "norm" or "global_norm");
    the global norm before clipping, a tensor."""
    for p in params:  # a loss that leaves a head out (BC's value head): zeros, so every learner reduces alike
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if world_size > 1:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= world_size
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
    if clip is not None and by == "value":
        torch.nn.utils.clip_grad_value_(params, clip)
    elif clip is not None and by == "norm":
        for p in params:
            torch.nn.utils.clip_grad_norm_([p], clip)
    if clip is not None and by == "global_norm":
        return torch.nn.utils.clip_grad_norm_(params, clip)
    if TOTAL_NORM is not None:
        return TOTAL_NORM([p.grad for p in params])
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


def finish_flat(grads: FlatGrads, world_size: int, clip: float | None, by: str) -> torch.Tensor:
    """``finish_tensors`` with the slot's gradients in one buffer: one call each to average, measure and clip
    them (the same rule as ``clip_grad_norm_``: scale by ``clip / (norm + 1e-6)`` when below 1)."""
    flat = grads.collect()
    if world_size > 1:
        dist.all_reduce(flat)
        flat /= world_size
    if clip is not None and by == "value":
        flat.clamp_(-clip, clip)
    elif clip is not None and by == "norm":
        for p in grads.params:  # each .grad is its view of the buffer
            torch.nn.utils.clip_grad_norm_([p], clip)
    norm = torch.linalg.vector_norm(flat)
    if clip is not None and by == "global_norm":
        flat.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))
    return norm


def grad_if(needed: bool) -> torch.autograd.grad_mode.set_grad_enabled:
    """Autograd on for a loss term only when the loss uses it (``needed``) and it is on already: a term a loss only
    reports (an entropy without a bonus, a KL without the KL loss) skips autograd's bookkeeping, a good part of a
    small network's step, and leaves the gradient exactly as it was."""
    return torch.set_grad_enabled(torch.is_grad_enabled() and needed)
