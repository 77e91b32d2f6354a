"""The ``callbacks`` group: the callbacks classes and per-hook functions, as the learner and runners get them.

``callbacks_class`` may be one class, an import path or a list of them; a hook's functions may be
import paths too (what a saved config holds), resolved here.
"""
from __future__ import annotations

from typing import Any

from actors.callbacks import CallbacksSpec
from pipeline.config.plain import resolve_import_path


def callbacks_spec(config: Any) -> CallbacksSpec:
    classes = config.callbacks_class
    classes = [] if classes is None else list(classes) if isinstance(classes, (list, tuple)) else [classes]
    functions = {h: [resolve_import_path(f, f"callback function for {h}") if isinstance(f, str) else f
                     for f in fns if f is not None] for h, fns in config.callbacks_functions.items()}
    return CallbacksSpec(classes, {h: fns for h, fns in functions.items() if fns})
