"""Named pieces the tests hand to Ray actors: policy mapping functions, connector factories, callbacks.

An actor unpickles a named function or class by importing the module that defines it. A test module imports
``pipeline`` (and with it torch and ray.tune, seconds of CPU per process), so a piece defined there makes every
runner and learner actor that receives it pay for that import; defined here, it costs the actor nothing more
than ``actors`` (as ``tests.envs`` does for envs). Keep this module free of ``pipeline`` imports.
"""
from __future__ import annotations

from typing import Any

from actors.callbacks import Callbacks
from actors.connectors import FrameStackingEnvToModule, MeanStdFilter


def by_agent(agent_id: Any, episode: Any = None, **kwargs: Any) -> str:
    """Agent ``k`` acts with module ``"pk"``."""
    return f"p{agent_id}"


def against_snapshot(agent_id: Any, episode: Any, **kwargs: Any) -> str:
    """Self-play: agent 0 plays the learning module, agent 1 the frozen snapshot of it."""
    return "p0" if agent_id == 0 else "p0_v1"


def mean_std(env: Any) -> MeanStdFilter:
    return MeanStdFilter()


def stack4(env: Any) -> FrameStackingEnvToModule:
    return FrameStackingEnvToModule(num_frames=4)


RECREATED: list = []
"""What ``RecordRecreation`` heard in the driver: (env runner indices, is_evaluation) per recreation."""


class RecordRecreation(Callbacks):
    def on_env_runners_recreated(self, *, algorithm, env_runner_group, env_runner_indices, is_evaluation, **kw):
        RECREATED.append((list(env_runner_indices), is_evaluation))


class RecordTrainedChunks(Callbacks):
    """In each learner: the pieces of chunks it trained on, by id."""

    def __init__(self):
        super().__init__()
        self.trained = []

    def on_learn_on_batch(self, *, train_batch, **kwargs):
        self.trained += [(c.episode_id, c.chunk_index, c.t_started, len(c), c.env_runner_index, c.weights_version)
                         for c in train_batch]


def stack3(env: Any) -> FrameStackingEnvToModule:
    return FrameStackingEnvToModule(num_frames=3)


def loaded_modules(_learner: Any = None) -> list[str]:
    """The modules imported in the calling process (run on a learner actor via ``foreach_learner``: this
    module imports nothing of ``pipeline``, so shipping the function adds nothing to the answer)."""
    import sys

    return sorted(sys.modules)
