"""A run's ``learner_connector`` built for one set of spaces: a learner's pipeline, or a replay stage's intake.

A single-agent run builds one in the driver (``pipeline.algorithm_setup``); a multi-agent run builds one per
module, for that module's spaces, where the module's learner or replay buffer is made -- a module added while
training gets its own. Algorithms that train on chunks apply it in their learners; those that train on
transitions drawn from a replay buffer (``replay_buffer_config`` set: DQN, SAC, CQL) apply it in the replay
stage, to what it stores (``actors.replay.intake``), and their learners get none.
"""
from __future__ import annotations

from typing import Any, Callable

from actors.connectors.learner import LearnerPipeline, build_learner_pipeline
from actors.replay.intake import ReplayIntake
from pipeline.config.checks import ConfigError
from pipeline.config.plain import resolve_import_path


def learner_connector_factory(config: Any) -> Callable | None:
    """``config.learner_connector`` as a function (an import path, as a checkpoint's config holds it, resolved)."""
    value = getattr(config, "learner_connector", None)
    return resolve_import_path(value, "learner_connector") if isinstance(value, str) else value


def trains_on_replay(config: Any) -> bool:
    return getattr(config, "replay_buffer_config", None) is not None


def learner_side_pipeline(config: Any, observation_space: Any, action_space: Any) -> LearnerPipeline | None:
    """The pipeline a learner applies to its batches' chunks (None for a replay algorithm, or without one)."""
    factory = learner_connector_factory(config)
    if factory is None or trains_on_replay(config):
        return None
    return build_learner_pipeline(factory, observation_space, action_space)


def replay_side_intake(config: Any, observation_space: Any, action_space: Any,
                       pipeline: LearnerPipeline | None = None) -> ReplayIntake | None:
    """The intake a replay algorithm's replay buffer runs on what it stores (None otherwise, or without one).
    ``pipeline``: one built for these spaces already (the driver's), used instead of building another."""
    factory = learner_connector_factory(config)
    if factory is None or not trains_on_replay(config):
        return None
    if pipeline is None:
        pipeline = build_learner_pipeline(factory, observation_space, action_space)
    if pipeline is None:
        return None
    return ReplayIntake(pipeline, observation_space, action_space,
                        config.learner_settings().allow_nonfinite_observations)


def refuse_view(config: Any, view: Any) -> None:
    """A ConfigError when ``view`` (an env-to-module view, e.g. frame stacking) cannot be rebuilt where this
    run's modules learn: a recurrent module's replay (R2D2) stores sequences without the look-back rows. (A
    replay buffer of transitions stores the look-back rows and rebuilds the view at each draw,
    ``actors.replay.storage``; under central inference runners send the servers what the view puts out.)"""
    recurrent = isinstance(config.model_config, dict) and bool(config.model_config.get("use_lstm"))
    if trains_on_replay(config) and recurrent:
        raise ConfigError(f"env_to_module_connector: {view!r} is a view rebuilt where it is used, and a recurrent "
                          f"module's replay (R2D2) keeps sequences, not the look-back rows; stack frames in the env "
                          f"instead (gymnasium.wrappers.FrameStackObservation)")
