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

``fused_step`` is ``step()`` for a fused Adam in its common case, straight to the fused kernel (see there).
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.optim.optimizer as optimizer_module


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
        self._fused_plan = None  # the state's tensors are new ones
        if _LOAD_STATE_DICT is None or _dynamo_loaded():
            return super().load_state_dict(state_dict)
        return _LOAD_STATE_DICT(self, state_dict)

    def fused_step(self) -> None:
        """``step()`` of a fused Adam whose state exists, as torch's fused path runs it -- the step counts up,
        the fused kernel over every tensor, and with ``found_inf`` the counts of a skipped step back down --
        without the Python around it: the per-tensor state lookups and checks, the grouping by device, the
        profiler's ``record_function``, about 130 us a step on these 2-core machines (a tenth of a small
        network's SGD step). Any other case takes ``step()``: no state yet, a missing gradient, amsgrad or
        another option the fast path leaves out, several devices or dtypes, step hooks, or an instance whose
        ``step`` something wrapped (a torch LR scheduler)."""
        plan = self._plan_fused()
        if plan is None:
            self.step()
            return
        params, exp_avgs, exp_avg_sqs, steps, group = plan
        grads = [p.grad for p in params]
        if any(g is None for g in grads):
            self.step()
            return
        found_inf = getattr(self, "found_inf", None)
        beta1, beta2 = group["betas"]
        with torch.no_grad():  # the kernel writes the parameters in place
            torch._foreach_add_(steps, 1)
            torch._fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"],
                               beta1=float(beta1), beta2=float(beta2), weight_decay=group["weight_decay"],
                               eps=group["eps"], maximize=group["maximize"],
                               grad_scale=getattr(self, "grad_scale", None), found_inf=found_inf)
            if found_inf is not None:
                torch._foreach_sub_(steps, [found_inf] * len(steps))

    def _plan_fused(self) -> tuple | None:
        """(params, exp_avgs, exp_avg_sqs, steps, group) when ``fused_step`` may take its fast path, else None.
        Kept between steps (the state's tensors are updated in place) until ``load_state_dict``."""
        if ("step" in self.__dict__ or len(self.param_groups) != 1
                or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                or getattr(optimizer_module, "_global_optimizer_pre_hooks", None)
                or getattr(optimizer_module, "_global_optimizer_post_hooks", None)):
            return None
        plan = getattr(self, "_fused_plan", None)
        group = self.param_groups[0]
        if plan is not None and plan[4] is group and len(plan[0]) == len(group["params"]):
            return plan
        if (not group.get("fused") or group.get("amsgrad") or group.get("capturable") or group.get("differentiable")
                or group.get("decoupled_weight_decay") or torch.is_tensor(group["lr"])):
            return None
        params = list(group["params"])
        states = [self.state.get(p) for p in params]
        if not params or any(not st or not torch.is_tensor(st.get("step")) for st in states):
            return None  # the first step: torch's path builds the state
        if len({(p.device, p.dtype) for p in params}) != 1 or any(p.is_complex() for p in params):
            return None
        device = params[0].device
        if any(st["step"].device != device for st in states):
            return None
        self._fused_plan = (params, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                            [st["step"] for st in states], group)
        return self._fused_plan

    def step(self, closure: Any = None) -> Any:
        if _STEP is None or _dynamo_loaded() or self.defaults.get("differentiable"):
            return _GUARDED_STEP(self, closure)
        # what torch's guard does around the body when nothing compiles: gradients off for the update
        with torch.no_grad():
            return _STEP(self, closure)
