"""Env-to-module connector pieces under the names RLlib users import (``ray.rllib.connectors.env_to_module``):
``.env_runners(env_to_module_connector=lambda env: [FlattenObservations(), MeanStdFilter()])``.
How pipelines run, record and sync is in ``actors.connectors.base``."""
from actors.connectors import ConnectorPipeline, ConnectorV2, FlattenObservations, FrameStackingEnvToModule, MeanStdFilter

__all__ = ["ConnectorPipeline", "ConnectorV2", "FlattenObservations", "FrameStackingEnvToModule", "MeanStdFilter",
           "atari_frame_stack", "mean_std_filter"]


def atari_frame_stack(env: object) -> FrameStackingEnvToModule:
    """The last 4 frames (DQN's and its successors' Atari setting), as a factory a YAML file can name:
    ``env_to_module_connector: pipeline.connectors:atari_frame_stack``."""
    return FrameStackingEnvToModule(num_frames=4)


def mean_std_filter(env: object) -> MeanStdFilter:
    """``MeanStdFilter()`` as a factory a YAML file can name: ``env_to_module_connector: pipeline.connectors:mean_std_filter``."""
    return MeanStdFilter()
