"""Names a package exports from other modules, each module imported on first use (PEP 562).

``from pipeline.algorithms.ppo import PPO, PPOConfig`` works as RLlib's ``ray.rllib.algorithms.ppo`` does (and
registers PPO, so ``tune.Tuner("PPO")`` finds it), while a learner actor that unpickles
``pipeline.algorithms.ppo.learner`` runs the package's ``__init__`` without importing ``algorithm`` (and with it
Ray Tune). ``pipeline`` itself exports its names this way.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Callable


def lazy_exports(package: str, homes: dict[str, list[str]], *, renamed: dict[str, tuple[str, str]] | None = None,
                 before: Callable[[str], None] | None = None, first: str | None = None
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``. ``homes``: a module (relative to the package
    when it starts with ".") -> the names it exports; ``renamed``: an exported name -> (module, its name
    there); ``before(name)``: runs before a name is first loaded; ``first``: a module imported then too (an
    algorithm package names its ``.algorithm``, whose import registers the algorithm, with Ray Tune too)."""
    home_of = {name: (importlib.util.resolve_name(module, package), name)
               for module, names in homes.items() for name in names}
    home_of |= {name: (importlib.util.resolve_name(module, package), attr)
                for name, (module, attr) in (renamed or {}).items()}

    def __getattr__(name: str) -> Any:
        if name not in home_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if before is not None:
            before(name)
        if first is not None:
            importlib.import_module(importlib.util.resolve_name(first, package))
        module, attr = home_of[name]
        value = getattr(importlib.import_module(module), attr)
        setattr(importlib.import_module(package), name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(home_of))

    return __getattr__, __dir__, sorted(home_of)
