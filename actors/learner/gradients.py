"""FlatGrads: one optimizer slot's gradients as views of one flat buffer.

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
from torch import nn


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


def grad_if(needed: bool) -> torch.autograd.grad_mode.set_grad_enabled:
    """Autograd on for a loss term only when the loss uses it (``needed``) and it is on already: a term a loss only
    reports (an entropy without a bonus, a KL without the KL loss) skips autograd's bookkeeping, a good part of a
    small network's step, and leaves the gradient exactly as it was."""
    return torch.set_grad_enabled(torch.is_grad_enabled() and needed)
