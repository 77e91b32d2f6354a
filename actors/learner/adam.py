"""``torch.optim.Adam`` without the import of ``torch._dynamo`` that its first use costs.

torch wraps the optimizer's ``add_param_group``, ``zero_grad``, ``state_dict`` and ``load_state_dict``
in ``torch._disable_dynamo`` and its ``step`` in a graph-break guard; each imports ``torch._dynamo``
on its first call -- as much CPU again as ``import torch`` itself (about 1.5 s on this project's
2-core machines), paid by every process that builds a learner: the driver, each learner actor, each
Tune trial. Those wrappers only matter while dynamo is compiling, and nothing can be compiling in a
process that has not imported it. So while ``torch._dynamo`` is not imported, this Adam calls the
methods' undecorated bodies (what the wrappers call when no compilation runs); once anything has
imported it (a user's ``torch.compile``), it takes torch's own path. The arithmetic is torch's in both
cases -- the same functional ``adam`` kernels, state and ``state_dict`` format.
"""
from __future__ import annotations

import sys
from typing import Any

import torch


def _dynamo_loaded() -> bool:
    return "torch._dynamo" in sys.modules


def _body(method: Any) -> Any:
    """The function a torch decorator wrapped (``functools.wraps`` keeps it as ``__wrapped__``); None where a
    torch release stops wrapping the method this way, and then torch's own method runs."""
    return getattr(method, "__wrapped__", None)


_ADD_PARAM_GROUP = _body(torch.optim.Optimizer.add_param_group)
_ZERO_GRAD = _body(torch.optim.Optimizer.zero_grad)
_STATE_DICT = _body(torch.optim.Optimizer.state_dict)
_LOAD_STATE_DICT = _body(torch.optim.Optimizer.load_state_dict)
_GUARDED_STEP = torch.optim.Adam.step.__wrapped__ if getattr(torch.optim.Adam.step, "hooked", False) \
    else torch.optim.Adam.step
"""Adam's step inside torch's guard, without the profiler hook that the first ``torch.optim.Adam`` built puts
around every optimizer class's step (this class gets its own: running both would call hooks twice)."""
_STEP = _body(_GUARDED_STEP)


class Adam(torch.optim.Adam):
    """``torch.optim.Adam`` (same arguments, arithmetic and state), minus the ``torch._dynamo`` import."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if _ADD_PARAM_GROUP is None or _dynamo_loaded():
            return super().add_param_group(param_group)
        return _ADD_PARAM_GROUP(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _ZERO_GRAD is None or _dynamo_loaded():
            return super().zero_grad(set_to_none)
        return _ZERO_GRAD(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        if _STATE_DICT is None or _dynamo_loaded():
            return super().state_dict()
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if _LOAD_STATE_DICT is None or _dynamo_loaded():
            return super().load_state_dict(state_dict)
        return _LOAD_STATE_DICT(self, state_dict)

    def step(self, closure: Any = None) -> Any:
        if _STEP is None or _dynamo_loaded() or self.defaults.get("differentiable"):
            return _GUARDED_STEP(self, closure)
        # what torch's guard does around the body when nothing compiles: gradients off for the update
        with torch.no_grad():
            return _STEP(self, closure)
