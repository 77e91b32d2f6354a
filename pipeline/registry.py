"""The one algorithm registry: names -> algorithm classes (each knows its config class, and each
config class knows its algorithm). ``pipeline`` registers the built-ins when imported, with Ray Tune too."""
from __future__ import annotations

from typing import Any

from pipeline.config.base import ALGORITHM_OF, AlgorithmConfig, ConfigError
from pipeline.tune.support import register_with_tune

_ALGORITHMS: dict[str, Any] = {}


def register_algorithm(algo_cls: Any, name: str | None = None) -> Any:
    """Make ``algo_cls`` buildable by name (CLI, checkpoints) and from its config (``build()``).
    Usable as a class decorator."""
    config_cls: type[AlgorithmConfig] = algo_cls.config_class
    ALGORITHM_OF[config_cls] = algo_cls
    _ALGORITHMS[name or algo_cls.__name__] = algo_cls
    register_with_tune(name or algo_cls.__name__, algo_cls)  # tune.Tuner("PPO", ...) finds it by name
    return algo_cls


def get_algorithm(name: str) -> tuple[type[AlgorithmConfig], Any]:
    """``"ppo"`` -> ``(PPOConfig, PPO)`` (names are case-insensitive)."""
    key = {k.upper(): k for k in _ALGORITHMS}.get(str(name).upper())
    if key is None:
        raise ConfigError(f"unknown algorithm {name!r}; available: {sorted(_ALGORITHMS)}")
    algo_cls = _ALGORITHMS[key]
    return algo_cls.config_class, algo_cls
