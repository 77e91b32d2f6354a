"""Module-to-env pieces: what happens to a module's actions between the forward pass and the env.

A runner's step: observations -> env-to-module pipeline -> module (actions, log-probabilities,
distribution inputs) -> **module-to-env pipeline** -> the env. Each piece gets the step's batch as a dict
of numpy arrays with one row per sub-env and returns it (changed or not):

* ``"actions"``: the module's actions, in the module's form (before ``normalize_actions``' rescaling and
  ``clip_actions``); what chunks store and learners train on;
* ``"action_logp"``, ``"action_dist_inputs"``: the module's, stored beside the actions;
* ``"actions_for_env"`` (absent unless a piece sets it): what the env gets instead of the converted
  ``"actions"`` -- the env's own form, not converted again.

A piece that changes only what the env does (a safety filter, a translation to the env's own action
format) sets ``"actions_for_env"``; the learner then trains on what the module chose. A piece that
changes ``"actions"`` changes what is recorded too, and must give the ``"action_logp"`` that goes with it
(on-policy losses divide by it). Whatever a piece leaves in ``"actions"`` is still checked against the
action space by the learner before it trains.

In a multi-agent run each module gets its own pipeline (``build_module_pipelines``), built for the spaces that
module acts in, and each step's batch holds that module's agents' rows (``actors.env.multi_agent_sampler``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import gymnasium as gym

from actors.connectors.base import ConnectorV2, EnvSpaces, factory_pieces, per_module, pieces_state, set_pieces_state

COLUMNS = ("actions", "action_logp", "action_dist_inputs")


class ModuleToEnvConnector(ConnectorV2):
    """A module-to-env piece: override ``__call__(batch, *, observations, explore)`` (and ``get_state`` /
    ``set_state`` when it keeps something from step to step: a runner checkpoints its pipeline)."""

    pipeline_kind = "module_to_env"

    def __call__(self, batch: dict[str, Any], *, observations: Any = None, explore: bool = True) -> dict[str, Any]:  # type: ignore[override]
        """``batch``: the columns above, ``[num_envs, ...]`` each; ``observations``: what the module acted on;
        ``explore``: the runner explores (training) or acts greedily (evaluation)."""
        return batch


class ModuleToEnvPipeline:
    """``ModuleToEnvConnector`` pieces applied in order to each step's batch."""

    def __init__(self, pieces: list[Any], observation_space: gym.Space, action_space: gym.Space) -> None:
        for piece in pieces:
            if not isinstance(piece, ModuleToEnvConnector):
                raise TypeError(f"a module-to-env connector must be a ModuleToEnvConnector instance, got "
                                f"{type(piece).__name__}: subclass pipeline.connectors.ModuleToEnvConnector "
                                f"(observation pieces go in env_to_module_connector)")
            if piece.input_observation_space is None:
                piece.input_observation_space = observation_space
            if piece.input_action_space is None:
                piece.input_action_space = action_space
        self.pieces = pieces

    def __call__(self, batch: dict[str, Any], observations: Any, explore: bool) -> dict[str, Any]:
        n = len(batch["actions"])
        for piece in self.pieces:
            out = piece(batch, observations=observations, explore=explore)
            if not isinstance(out, dict) or any(k not in out for k in COLUMNS):
                raise ValueError(f"module-to-env piece {piece!r} returned {type(out).__name__} "
                                 f"{sorted(out) if isinstance(out, dict) else ''}; a piece returns the batch dict "
                                 f"with {list(COLUMNS)} (and optionally 'actions_for_env')")
            for key in (*COLUMNS, "actions_for_env"):
                value = out.get(key)
                if value is not None and len(value) != n:
                    raise ValueError(f"module-to-env piece {piece!r} returned {len(value)} rows of {key!r} for "
                                     f"{n} sub-envs; keep one row per sub-env")
            batch = out
        return batch

    def get_state(self) -> list[dict[str, Any]]:
        return pieces_state(self.pieces)

    def set_state(self, states: list[dict[str, Any]]) -> None:
        set_pieces_state(self.pieces, states, "module-to-env", "module_to_env_connector")

    def __repr__(self) -> str:
        return f"ModuleToEnvPipeline({self.pieces})"


def build_module_to_env(factory: Callable[..., Any] | None, observation_space: gym.Space,
                        action_space: gym.Space) -> ModuleToEnvPipeline | None:
    """``factory(env)`` (RLlib's ``module_to_env_connector``; ``(env, module)`` is accepted too: the module
    is not given, None) -> a pipeline; None without a factory or pieces. ``observation_space``: what the
    module acts on."""
    env = EnvSpaces(observation_space, action_space)
    pieces = factory_pieces(factory, "module_to_env_connector", (env,), (env, None), "lambda env: YourPiece()")
    return ModuleToEnvPipeline(pieces, observation_space, action_space) if pieces else None



def build_module_pipelines(factory: Callable[..., Any] | None, spaces: Mapping[str, tuple[gym.Space, gym.Space]]
                           ) -> dict[str, ModuleToEnvPipeline] | None:
    """A multi-agent run's module-to-env pipelines: one per module, each built by ``factory`` for that module's
    (observation, action) spaces; None without a factory or pieces."""
    if factory is None:
        return None
    return per_module(lambda obs_space, act_space: build_module_to_env(factory, obs_space, act_space), dict(spaces))
