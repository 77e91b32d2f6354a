"""Import paths for user code named in settings: ``"pkg.module:Name"`` or RLlib's dotted ``"pkg.module.Name"``."""
from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str) -> Any:
    """The object at ``path``; ImportError/AttributeError/ValueError when there is none."""
    module, _, qualname = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not qualname:
        raise ValueError(f"{path!r} is not an import path like 'package.module:Name'")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
