"""Env-to-module connector pieces (``actors.connectors.base`` says how pipelines work)."""
from actors.connectors.base import ConnectorPipeline, ConnectorV2, EnvSpaces, ObservationView, build_pipeline
from actors.connectors.mean_std import MeanStdFilter, RunningStats
from actors.connectors.observations import FlattenObservations, FrameStackingEnvToModule

__all__ = ["ConnectorPipeline", "ConnectorV2", "EnvSpaces", "ObservationView", "FlattenObservations", "FrameStackingEnvToModule",
           "MeanStdFilter", "RunningStats", "build_pipeline"]
