"""The one algorithm registry: names -> algorithm classes (each knows its config class, and each
config class knows its algorithm). The built-ins register themselves, with Ray Tune too, when their
``algorithm`` module is imported: by name here on first use, or all at once by ``register_builtins``
(``pipeline`` calls it when its algorithm names are first used, so ``tune.Tuner("PPO")`` finds them)."""
from __future__ import annotations

import importlib
from typing import Any

from pipeline.config.base import ALGORITHM_OF, AlgorithmConfig, ConfigError
from pipeline.tune.support import register_with_tune

_ALGORITHMS: dict[str, Any] = {}

BUILTINS = {name: f"pipeline.algorithms.{name.lower()}.algorithm"
            for name in ("APPO", "BC", "CQL", "DQN", "IMPALA", "MARWIL", "PPO", "SAC")}
"""Built-in algorithm name -> the module that defines and registers it."""


def register_algorithm(algo_cls: Any, name: str | None = None) -> Any:
    """Make ``algo_cls`` buildable by name (CLI, checkpoints) and from its config (``build()``).
    Usable as a class decorator."""
    config_cls: type[AlgorithmConfig] = algo_cls.config_class
    ALGORITHM_OF[config_cls] = algo_cls
    _ALGORITHMS[name or algo_cls.__name__] = algo_cls
    register_with_tune(name or algo_cls.__name__, algo_cls)  # tune.Tuner("PPO", ...) finds it by name
    return algo_cls


def register_builtins() -> None:
    """Import (and so register) every built-in algorithm."""
    for module in BUILTINS.values():
        importlib.import_module(module)


def get_algorithm(name: str) -> tuple[type[AlgorithmConfig], Any]:
    """``"ppo"`` -> ``(PPOConfig, PPO)`` (names are case-insensitive)."""
    builtin = {k.upper(): v for k, v in BUILTINS.items()}.get(str(name).upper())
    if builtin is not None:
        importlib.import_module(builtin)
    key = {k.upper(): k for k in _ALGORITHMS}.get(str(name).upper())
    if key is None:
        raise ConfigError(f"unknown algorithm {name!r}; available: {sorted(set(_ALGORITHMS) | set(BUILTINS))}")
    algo_cls = _ALGORITHMS[key]
    return algo_cls.config_class, algo_cls
