"""The ``exploration`` group: which exploration the runners use while sampling.

``exploration_config`` either names a type, which replaces the algorithm's default exploration, or
only gives arguments, which update the default's (as RLlib's did).
"""
from __future__ import annotations

from typing import Any


def exploration_settings(config: Any) -> dict[str, Any]:
    """What runners use: ``exploration_config`` with a ``type`` replaces the algorithm's default; without
    one its keys update the default's arguments."""
    user = dict(config.exploration_config or {})
    if "type" in user:
        return user
    default = config.default_exploration()
    if user.keys() & {"initial_epsilon", "final_epsilon", "epsilon_timesteps"}:
        default.pop("epsilon_schedule", None)  # RLlib's three numbers replace the schedule they describe
    return {**default, **user}


def exploration_problems(config: Any) -> list[str]:
    if not isinstance(config.exploration_config, dict):
        return [f"exploration_config must be a dict like {{'type': 'EpsilonGreedy', ...}}, "
                f"got {config.exploration_config!r}"]
    return []
