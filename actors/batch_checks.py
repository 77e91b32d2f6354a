"""BatchCheck: a learner refuses a train batch holding a value its spaces do not, instead of training on it.

Defence in depth. Policy servers check what clients send and stream intakes check shapes, but a bug
anywhere upstream -- an env or its wrapper, a recording, a replay buffer, a server check that missed
a case -- must not end a long job: an action outside a Discrete space makes the loss's ``gather``
raise (on a GPU, a device-side assert, after which the process cannot use the GPU), and one NaN or infinity turns every
weight into NaN at the next gradient step, silently. So ``Learner.update`` checks each batch once,
before it becomes tensors, with whole-array numpy operations (``protocols.space_checks``): actions
in the action space, observations in the observation space (finite unless allowed), rewards and
other float columns finite. A refused batch is dropped, counted and logged with the field at fault;
training goes on with the next one.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from protocols.episode import EpisodeChunk
from protocols.errors import ProtocolError
from protocols.space_checks import check_finite, check_values, value_spec
from protocols.spaces import space_to_dict


def _values_of(space: Any, actions: bool = False) -> Any:
    """The value spec of a gymnasium space, or None for one ``protocols.spaces`` cannot describe (unchecked)."""
    try:
        return value_spec(space_to_dict(space), actions)
    except ProtocolError:
        return None


class BatchCheck:
    def __init__(self, observation_space: Any, action_space: Any, allow_nonfinite_observations: bool = False) -> None:
        self.obs, self.actions = _values_of(observation_space), _values_of(action_space, actions=True)
        self.finite_obs = not allow_nonfinite_observations

    def problem(self, batch: Any) -> str | None:
        """Why ``batch`` -- a list of chunks, or a replayed batch of transitions (a dict of arrays) -- must
        not be trained on (naming the chunk and the field), or None."""
        try:
            if isinstance(batch, dict):
                self._transitions(batch)
            elif isinstance(batch, list):
                for chunk in batch:
                    if isinstance(chunk, EpisodeChunk):
                        self._chunk(chunk)
        except ValueError as err:  # space_checks.BadValue; numpy's, for an array the space's shape does not fit
            return str(err)
        except TypeError:  # not numpy arrays (tensors someone built by hand): not checked here
            return None
        return None

    def _chunk(self, chunk: EpisodeChunk) -> None:
        try:
            check_values("obs", self.obs, chunk.obs, self.finite_obs)
            check_values("actions", self.actions, chunk.actions)
            check_finite("rewards", chunk.rewards)
            for key, value in chunk.extra.items():
                check_finite(f"extra[{key!r}]", value)
        except ValueError as err:
            raise ValueError(f"chunk {chunk.episode_id!r} #{chunk.chunk_index}: {err}") from None

    def _transitions(self, batch: dict[str, Any]) -> None:
        for key, value in batch.items():
            if key in ("obs", "next_obs"):
                check_values(key, self.obs, value, self.finite_obs)
            elif key == "actions":
                check_values(key, self.actions, value)
            elif isinstance(value, np.ndarray):
                check_finite(key, value)
