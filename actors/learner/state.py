"""A learner's checkpoint state (Acme's Saveable role): what ``Learner.get_state``/``set_state`` hand to a checkpoint,
which stores it with ``torch.save`` and reads it back with ``weights_only=True``."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def _tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}


def learner_state(learner: Any) -> dict[str, Any]:
    """Everything a learner needs to continue exactly: tensors, optimizer states, named fields, counters, RNGs."""
    return {
        "module": _tensors(learner.module),
        "targets": {name: _tensors(t) for name, t in learner.targets.items()},
        # copies: a torch optimizer's state_dict holds its live moment tensors, and load_state_dict
        # keeps the tensors it is given, so without them two learners would share their moments
        "optimizers": {name: copy.deepcopy(slot.optimizer.state_dict()) for name, slot in learner.optimizers.items()},
        "fields": {name: getattr(learner, name) for name in learner.state_fields},
        "num_updates": learner.num_updates,
        "rng": learner.rng.bit_generator.state,
        "torch_rng": torch.get_rng_state(),
        "learner_connector": None if learner.learner_connector is None else learner.learner_connector.get_state(),
    }


def load_learner_state(learner: Any, state: dict[str, Any]) -> None:
    """Put back what ``learner_state`` took; the optimizers keep the epsilon this learner built them with."""
    learner.module.load_state_dict(state["module"])
    for name, target in learner.targets.items():
        target.load_state_dict(state["targets"][name])
    for name, slot in learner.optimizers.items():
        built = [group.get("eps") for group in slot.optimizer.param_groups]
        slot.optimizer.load_state_dict(copy.deepcopy(state["optimizers"][name]))
        # the saved groups carry the epsilon of the run that saved them (an older default, another
        # adam_epsilon): the one this learner built its optimizer with wins
        for group, eps in zip(slot.optimizer.param_groups, built):
            if eps is not None:
                group["eps"] = eps
    for name in learner.state_fields:
        setattr(learner, name, state["fields"][name])
    learner.num_updates = int(state.get("num_updates", 0))
    if "rng" in state:
        learner.rng.bit_generator.state = state["rng"]
    if "torch_rng" in state:
        torch.set_rng_state(state["torch_rng"])
    if state.get("learner_connector") is not None and learner.learner_connector is not None:
        learner.learner_connector.set_state(state["learner_connector"])
