"""MultiRLModule: several modules keyed by module id, for multi-agent training.

Its weights are one flat ``{"<module_id>/<param>": array}`` dict, so the same broadcast, codec and
checkpoint paths carry it as they carry a single module's weights; ``get_state(inference_only=True)``
is every member's inference-only export.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
from torch import nn

from actors.modules.rl_module import RLModule

SEP = "/"


class MultiRLModule(nn.Module):
    def __init__(self, modules: dict[str, RLModule]) -> None:
        super().__init__()
        bad = [k for k in modules if not isinstance(k, str) or not k or SEP in k or "." in k]
        if bad:
            raise ValueError(f"module ids must be non-empty str without '{SEP}' or '.', got {bad}")
        self.members = nn.ModuleDict(modules)

    def __getitem__(self, module_id: str) -> RLModule:
        if module_id not in self.members:
            raise KeyError(f"no module {module_id!r}; this MultiRLModule holds {sorted(self.members)}")
        return self.members[module_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    def get_state(self, inference_only: bool = False) -> dict[str, np.ndarray]:
        return {f"{mid}{SEP}{k}": v for mid, m in self.members.items()
                for k, v in m.get_state(inference_only=inference_only).items()}

    def set_state(self, state: dict[str, Any]) -> None:
        for mid, m in self.members.items():
            prefix = f"{mid}{SEP}"
            m.set_state({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
