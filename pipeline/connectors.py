"""Connector pieces under the names RLlib users import (``ray.rllib.connectors``):
``.env_runners(env_to_module_connector=lambda env: [PrevActionsPrevRewards(), FlattenObservations(), MeanStdFilter()],
module_to_env_connector=lambda env: [YourActionPiece()])`` and ``.training(learner_connector=lambda obs_space,
act_space: [ClipRewards()])``. How each pipeline runs is in ``actors.connectors``' modules."""
from actors.connectors import (ClipRewards, ConnectorPipeline, ConnectorV2, FlattenObservations, FrameStackingEnvToModule,
                               LearnerConnector, MeanStdFilter, ModuleToEnvConnector, PrevActionsPrevRewards)

__all__ = ["ClipRewards", "ConnectorPipeline", "ConnectorV2", "FlattenObservations", "FrameStackingEnvToModule",
           "LearnerConnector", "MeanStdFilter", "ModuleToEnvConnector", "PrevActionsPrevRewards", "atari_frame_stack",
           "mean_std_filter"]


def atari_frame_stack(env: object) -> FrameStackingEnvToModule:
    """The last 4 frames (DQN's and its successors' Atari setting), as a factory a YAML file can name:
    ``env_to_module_connector: pipeline.connectors:atari_frame_stack``."""
    return FrameStackingEnvToModule(num_frames=4)


def mean_std_filter(env: object) -> MeanStdFilter:
    """``MeanStdFilter()`` as a factory a YAML file can name: ``env_to_module_connector: pipeline.connectors:mean_std_filter``."""
    return MeanStdFilter()
