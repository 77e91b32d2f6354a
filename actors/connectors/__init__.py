"""Connector pieces and pipelines: env-to-module (``base``), module-to-env (``module_to_env``) and learner
(``learner``); ``actors.connectors.base`` says how the env-to-module pipelines run, record and sync."""
from actors.connectors.base import ConnectorPipeline, ConnectorV2, EnvSpaces, ObservationView, build_pipeline
from actors.connectors.learner import ClipRewards, LearnerConnector, LearnerPipeline
from actors.connectors.mean_std import MeanStdFilter, RunningStats
from actors.connectors.module_to_env import ModuleToEnvConnector, ModuleToEnvPipeline
from actors.connectors.observations import FlattenObservations, FrameStackingEnvToModule
from actors.connectors.prev_actions import PrevActionsPrevRewards

__all__ = ["ClipRewards", "ConnectorPipeline", "ConnectorV2", "EnvSpaces", "ObservationView", "FlattenObservations",
           "FrameStackingEnvToModule", "LearnerConnector", "LearnerPipeline", "MeanStdFilter", "ModuleToEnvConnector",
           "ModuleToEnvPipeline", "PrevActionsPrevRewards", "RunningStats", "build_pipeline"]
