"""Learner pieces: what happens to the experience a learner trains on, before its loss sees it.

A learner pipeline (``.training(learner_connector=lambda obs_space, act_space: [...])``) runs inside the
learner, on the episode chunks of each train batch, after a view's rebuild (frame stacks) and before the
batch check and the loss: what it returns is what is checked and trained on. Each piece gets a list of
``EpisodeChunk``s and returns one -- new chunks (``dataclasses.replace``) with changed rewards, added
``extra`` columns, observations rewritten; the arrays it was given are the batch's own, so a piece copies
before it writes. Chunks must keep their lengths (values, advantages and V-trace line up with the steps).

It runs where chunks reach a learner: PPO's and the offline algorithms' ``update``, and IMPALA/APPO's stream
loader (each batch as it is cut). Replay algorithms (DQN, SAC, CQL) train on transitions drawn from a
buffer, not on chunks; they refuse a learner pipeline.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import gymnasium as gym
import numpy as np

from actors.connectors.base import ConnectorV2, factory_pieces, pieces_state, set_pieces_state


class LearnerConnector(ConnectorV2):
    """A learner piece: override ``__call__(chunks)`` (and ``get_state``/``set_state`` if it keeps something:
    learners checkpoint their pipeline)."""

    pipeline_kind = "learner"

    def __call__(self, chunks: list[Any]) -> list[Any]:  # type: ignore[override]
        return chunks


class ClipRewards(LearnerConnector):
    """Rewards clipped to ``[-limit, limit]``, or to their sign (-1, 0, 1) with ``sign=True`` (DQN's Atari
    setting), in what the learner trains on; episode returns in the results stay the env's."""

    def __init__(self, input_observation_space: gym.Space | None = None, input_action_space: gym.Space | None = None,
                 *, limit: float = 1.0, sign: bool = False, **kwargs: Any) -> None:
        super().__init__(input_observation_space, input_action_space, **kwargs)
        if not sign and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
            raise ValueError(f"ClipRewards(limit={limit!r}): the limit is a number > 0 (or sign=True)")
        self.limit, self.sign = float(limit), bool(sign)

    def __call__(self, chunks: list[Any]) -> list[Any]:  # type: ignore[override]
        clip = np.sign if self.sign else (lambda r: np.clip(r, -self.limit, self.limit))
        return [dataclasses.replace(c, rewards=clip(c.rewards).astype(np.float32)) for c in chunks]

    def __repr__(self) -> str:
        return "ClipRewards(sign=True)" if self.sign else f"ClipRewards(limit={self.limit})"


class LearnerPipeline:
    """``LearnerConnector`` pieces applied in order to a batch's chunks."""

    def __init__(self, pieces: list[Any], observation_space: gym.Space, action_space: gym.Space) -> None:
        for piece in pieces:
            if not isinstance(piece, LearnerConnector):
                raise TypeError(f"a learner connector must be a LearnerConnector instance, got {type(piece).__name__}: "
                                f"subclass pipeline.connectors.LearnerConnector (observation pieces go in "
                                f"env_to_module_connector)")
            if piece.input_observation_space is None:
                piece.input_observation_space = observation_space
            if piece.input_action_space is None:
                piece.input_action_space = action_space
        self.pieces = pieces

    def __call__(self, chunks: list[Any]) -> list[Any]:
        """The pieces' output, or ValueError naming the piece whose output is not chunks of the same lengths."""
        lengths = [len(c) for c in chunks]
        for piece in self.pieces:
            out = piece(list(chunks))
            if not isinstance(out, list) or [len(c) if hasattr(c, "rewards") else None for c in out] != lengths:
                raise ValueError(f"learner piece {piece!r} returned {type(out).__name__} of "
                                 f"{len(out) if isinstance(out, list) else '?'} items; a learner piece returns the "
                                 f"list of chunks it got, each with its length ({len(lengths)} chunks)")
            chunks = out
        return chunks

    def get_state(self) -> list[dict[str, Any]]:
        return pieces_state(self.pieces)

    def set_state(self, states: list[dict[str, Any]]) -> None:
        set_pieces_state(self.pieces, states, "learner", "learner_connector")

    def __repr__(self) -> str:
        return f"LearnerPipeline({self.pieces})"


def build_learner_pipeline(factory: Callable[..., Any] | None, observation_space: gym.Space,
                           action_space: gym.Space) -> LearnerPipeline | None:
    """``factory(observation_space, action_space)`` (RLlib's ``learner_connector``) -> a pipeline; None without
    a factory or pieces. The spaces are what chunks hold (the env-to-module pipeline's recorded output)."""
    pieces = factory_pieces(factory, "learner_connector", (observation_space, action_space),
                            (observation_space, action_space), "lambda obs_space, act_space: ClipRewards()")
    return LearnerPipeline(pieces, observation_space, action_space) if pieces else None
