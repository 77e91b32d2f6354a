"""Connector pieces and pipelines: what happens to an env's observations before a module sees them.

An env-to-module pipeline is a list of pieces (``ConnectorV2`` subclasses) that an env runner applies,
in order, to each batch of observations its vector env returns (``[num_envs, ...]``), before acting. A
piece says two things about itself:

* ``records``: True (the default) when its output is what the episode chunks store -- a running
  normaliser (``MeanStdFilter``), flattening -- so learners, replay and recordings see exactly what the
  module saw and need nothing more. False for a *view*: the chunks keep the piece's input and the view is
  built again where it is used (frame stacking: one frame per stored step, the stack rebuilt by the
  learner from the chunk and its look-back rows).
* its state: ``get_state``/``set_state`` for checkpoints, and -- for pieces that learn from the data, like
  running statistics -- ``pop_delta`` (what this copy gathered since it last gave it away) and ``absorb``
  (the driver's copy merging the runners' deltas). The driver merges every runner's delta after each
  training iteration and hands the merged state back (``sync``), so all runners normalise alike.

Pieces are written against numpy batches, not episodes: the runner's per-step loop passes a whole
vector of observations and a boolean ``episode_starts`` row (True where the observation opens an episode).
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any, Callable

import gymnasium as gym
import numpy as np


class ConnectorV2:
    """One piece of a pipeline. Subclass it and override ``__call__`` (and the space, state methods as needed).

    ``input_observation_space``/``input_action_space``: the spaces this piece receives (filled in by the
    pipeline when the piece was built without them)."""

    pipeline_kind: str = "env_to_module"
    """Which pipeline the piece belongs in: env_to_module (here), module_to_env (``ModuleToEnvConnector``) or
    learner (``LearnerConnector``); each pipeline refuses the others' pieces."""
    records: bool = True
    """The piece's output is what chunks store (False: a view rebuilt where it is used)."""
    look_back: int = 0
    """Rows of earlier observations a view needs beside each step's own (frame stacking: frames - 1)."""
    watches_steps: bool = False
    """The piece hears every step's actions and rewards (``on_step``): ``PrevActionsPrevRewards``."""
    keyed: bool = False
    """A recording piece with memory per sub-env that can keep it per key instead: a multi-agent runner, whose
    rows are agents coming and going, calls ``call_keyed``/``step_keyed``/``forget_keys`` with an
    ``(env index, agent id)`` key per row (``PrevActionsPrevRewards``: each agent's own last actions and
    rewards)."""

    def __init__(self, input_observation_space: gym.Space | None = None,
                 input_action_space: gym.Space | None = None, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unknown settings {sorted(kwargs)}")
        self.input_observation_space = input_observation_space
        self.input_action_space = input_action_space

    def recompute_output_observation_space(self, input_observation_space: gym.Space,
                                           input_action_space: gym.Space) -> gym.Space:
        """The observation space this piece puts out, given what it gets (default: unchanged)."""
        return input_observation_space

    def __call__(self, obs: Any, *, episode_starts: np.ndarray, update: bool) -> Any:
        """A batch of observations in, a batch out. ``update``: the piece may learn from this batch (training
        runners; evaluation and ``compute_single_action`` pass False)."""
        return obs

    def on_step(self, actions: Any, rewards: np.ndarray) -> None:
        """With ``watches_steps``: the module's actions of the step just taken (``[num_envs, ...]``) and the
        rewards it brought, before the piece gets the observations that step returned."""

    def call_keyed(self, obs: Any, keys: list[Any], starts: np.ndarray, update: bool) -> Any:
        """``keyed``: a batch of observations whose rows belong to ``keys`` (``starts``: True where a key's
        episode starts with this row), each row from its own key's memory."""
        raise NotImplementedError(f"{type(self).__name__} sets keyed but has no call_keyed()")

    def step_keyed(self, keys: list[Any], actions: Any, rewards: np.ndarray) -> None:
        """``keyed`` and ``watches_steps``: the actions ``keys`` took last (module form, a row each) and the
        rewards they got since, heard before their next observations."""
        raise NotImplementedError(f"{type(self).__name__} sets keyed but has no step_keyed()")

    def forget_keys(self, keys: list[Any]) -> None:
        """``keyed``: these keys' episodes are over; drop their memory."""
        raise NotImplementedError(f"{type(self).__name__} sets keyed but has no forget_keys()")

    def final_observation(self, obs: Any, env_index: int) -> Any:
        """A recording piece's output for the final observation of sub-env ``env_index``'s episode (a batch of
        one row), learning nothing from it. Default: ``__call__`` without an episode start."""
        return self(obs, episode_starts=np.zeros(1, bool), update=False)

    def get_state(self) -> dict[str, Any]:
        """Plain data and arrays (checkpointed)."""
        return {}

    def set_state(self, state: dict[str, Any]) -> None:
        """The state ``get_state`` returned; whatever this copy had gathered is replaced."""

    def sync(self, state: dict[str, Any]) -> None:
        """The merged state from the driver: take it, keeping what was gathered since ``pop_delta``."""
        self.set_state(state)

    def pop_delta(self) -> Any:
        """What this copy learned since the last call (None: nothing to share), then forget it."""
        return None

    def absorb(self, deltas: list[Any]) -> None:
        """Merge the deltas of the runners' copies into this (the driver's) copy."""

    def reset_stack(self, num_envs: int) -> None:
        """A runner's vector of ``num_envs`` sub-envs starts afresh (pieces with per-env memory size it)."""

    def recent(self) -> np.ndarray:
        """A view that looks back: the recorded rows before each sub-env's newest (see ``ConnectorPipeline.recent``)."""
        raise NotImplementedError(f"{type(self).__name__} looks back {self.look_back} rows but has no recent()")

    def view_of(self, rows: np.ndarray, look_back: np.ndarray) -> np.ndarray:
        """A view piece: its output for each row of one episode segment (``rows`` ``[T, ...]``), given the
        ``look_back`` rows before the first (``[look_back, ...]``). Recording pieces never get this call."""
        raise NotImplementedError(f"{type(self).__name__} is a view (records=False) but has no view_of()")

    def view_rows(self, frames: np.ndarray) -> np.ndarray:
        """A view piece, for a batch of agents each at its newest step: ``frames`` ``[n, look_back + 1, ...]``
        (each agent's look-back rows, then its newest) -> each agent's output, ``[n, ...]``. By default one
        ``view_of`` call per agent; a piece may do the batch at once."""
        return np.stack([self.view_of(f[-1:], f[:-1])[0] for f in frames])

    def view_gather(self, source: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """``view_rows`` of the rows ``idx`` (``[n, look_back + 1]``, oldest first) of ``source`` (a replay
        ring): a piece may gather straight into its output instead of copying the frames twice."""
        return self.view_rows(source.take(idx.reshape(-1), axis=0).reshape(idx.shape + source.shape[1:]))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ConnectorPipeline:
    """Pieces applied in order; built from the user's factory by ``build_pipeline``."""

    def __init__(self, pieces: list[ConnectorV2], observation_space: gym.Space, action_space: gym.Space) -> None:
        self.pieces = pieces
        self.input_observation_space = observation_space
        space = observation_space
        views_seen = False
        for piece in pieces:
            if not isinstance(piece, ConnectorV2) or piece.pipeline_kind != "env_to_module":
                raise TypeError(f"an env-to-module connector must be a ConnectorV2 instance that acts on "
                                f"observations, got {type(piece).__name__}: subclass pipeline.connectors.ConnectorV2 "
                                f"(ModuleToEnvConnector pieces go in module_to_env_connector, LearnerConnector "
                                f"pieces in learner_connector)")
            if piece.input_observation_space is None:
                piece.input_observation_space = space
            if piece.input_action_space is None:
                piece.input_action_space = action_space
            if piece.records and views_seen:
                raise ValueError(f"{piece!r} changes what chunks store, but comes after a view "
                                 f"({[p for p in pieces if not p.records]}): put views last")
            if not piece.records and views_seen:
                raise ValueError(f"at most one view per pipeline, got {[p for p in pieces if not p.records]}")
            views_seen = views_seen or not piece.records
            space = piece.recompute_output_observation_space(space, action_space)
        self.observation_space = space
        """What the module gets."""
        self.recorded_space = observation_space
        """What chunks store: the output of the recording pieces (the views come after them)."""
        for piece in self.recording_pieces:
            self.recorded_space = piece.recompute_output_observation_space(self.recorded_space, action_space)
        self.views = [p for p in pieces if not p.records]
        self.step_watchers = [p for p in pieces if p.watches_steps]
        """Pieces that hear each step's actions and rewards (``after_step``); the runner skips the call without."""
        self.look_back = max((p.look_back for p in self.views), default=0)
        """Rows of earlier observations each chunk carries for the views (0: none)."""

    @property
    def recording_pieces(self) -> list[ConnectorV2]:
        return [p for p in self.pieces if p.records]

    def record(self, obs: Any, episode_starts: np.ndarray, update: bool) -> Any:
        """The recording pieces: what chunks store."""
        for piece in self.pieces:
            if not piece.records:
                break
            obs = piece(obs, episode_starts=episode_starts, update=update)
        return obs

    def record_final(self, obs: Any, env_index: int) -> Any:
        """The recording pieces on the final observation of sub-env ``env_index``'s episode (a batch of one)."""
        for piece in self.pieces:
            if not piece.records:
                break
            obs = piece.final_observation(obs, env_index)
        return obs

    @property
    def keyed(self) -> bool:
        """Some recording piece keeps memory per key (``ConnectorV2.keyed``): a multi-agent runner records
        through ``record_keyed``."""
        return any(p.keyed for p in self.recording_pieces)

    def record_keyed(self, obs: Any, keys: list[Any], starts: np.ndarray, update: bool) -> Any:
        """``record`` for rows that belong to keys (a multi-agent runner's agents): keyed pieces read and keep
        each key's memory, the others see the rows as a batch with ``starts`` as its episode starts."""
        for piece in self.recording_pieces:
            obs = piece.call_keyed(obs, keys, starts, update) if piece.keyed else \
                piece(obs, episode_starts=starts, update=update)
        return obs

    def step_keyed(self, keys: list[Any], actions: Any, rewards: np.ndarray) -> None:
        for piece in self.step_watchers:
            piece.step_keyed(keys, actions, rewards)

    def forget_keys(self, keys: list[Any]) -> None:
        for piece in self.recording_pieces:
            if piece.keyed:
                piece.forget_keys(keys)

    def after_step(self, actions: Any, rewards: np.ndarray) -> None:
        """Every piece that watches steps hears the step's actions and rewards."""
        for piece in self.step_watchers:
            piece.on_step(actions, rewards)

    def view(self, recorded: Any, episode_starts: np.ndarray, update: bool) -> Any:
        """The views on top of recorded observations: what the module gets."""
        for piece in self.views:
            recorded = piece(recorded, episode_starts=episode_starts, update=update)
        return recorded

    def view_of(self, rows: Any, look_back: Any) -> Any:
        """The views rebuilt for one episode segment (a learner's side of a view)."""
        for piece in self.views:
            rows = piece.view_of(rows, look_back)
        return rows

    def reset_stack(self, num_envs: int) -> None:
        """The views' memory starts afresh (a resumed runner: the recording pieces keep their restored state)."""
        for piece in self.views:
            piece.reset_stack(num_envs)

    def reset_memory(self, num_envs: int) -> None:
        """Every sub-env starts a fresh episode: every piece's per-sub-env memory starts afresh."""
        for piece in self.pieces:
            piece.reset_stack(num_envs)

    def recent(self) -> Any:
        """Each sub-env's ``look_back`` recorded observations before its newest, ``[num_envs, look_back, ...]``:
        the look-back of chunks that start at the newest (from the view that looks furthest back)."""
        deepest = max(self.views, key=lambda p: p.look_back)
        return deepest.recent()

    def observation_view(self) -> "ObservationView | None":
        """What a learner needs to rebuild this pipeline's view from chunks (None: no view)."""
        if not self.views:
            return None
        return ObservationView(copy.deepcopy(self.views[0]), self.recorded_space, self.observation_space)

    @property
    def stateful(self) -> bool:
        return any(type(p).pop_delta is not ConnectorV2.pop_delta for p in self.pieces)

    def get_state(self) -> list[dict[str, Any]]:
        return pieces_state(self.pieces)

    def set_state(self, states: list[dict[str, Any]]) -> None:
        set_pieces_state(self.pieces, states, "connector", "env_to_module_connector")

    def sync(self, states: list[dict[str, Any]]) -> None:
        check_saved_pieces(self.pieces, states, "connector", "env_to_module_connector")
        for piece, s in zip(self.pieces, states):
            piece.sync(s["state"])

    def pop_deltas(self) -> list[Any]:
        return [p.pop_delta() for p in self.pieces]

    def absorb(self, deltas: list[list[Any]]) -> None:
        """``deltas``: one ``pop_deltas()`` list per runner."""
        for i, piece in enumerate(self.pieces):
            got = [d[i] for d in deltas if d is not None and d[i] is not None]
            if got:
                piece.absorb(got)

    def __repr__(self) -> str:
        return f"ConnectorPipeline({self.pieces})"


class ObservationView:
    """A view's learner side: chunks arrive with recorded observations (checked against ``recorded_space``)
    and their look-back rows; ``rebuild`` gives each chunk the observations the module acted on (checked
    against ``module_space`` afterwards)."""

    def __init__(self, piece: ConnectorV2, recorded_space: gym.Space, module_space: gym.Space) -> None:
        self.piece, self.recorded_space, self.module_space = piece, recorded_space, module_space

    def rebuild(self, chunks: list[Any]) -> list[Any]:
        """Each chunk with its view rebuilt (``look_back`` used up: None). A chunk without the look-back the
        view needs raises ValueError, naming it."""
        out = []
        for c in chunks:
            if c.look_back is None and self.piece.look_back:
                raise ValueError(f"chunk {c.chunk_index} of episode {c.episode_id} has no look-back rows, which "
                                 f"{self.piece!r} needs to rebuild what the module saw")
            out.append(dataclasses.replace(c, obs=self.piece.view_of(c.obs, c.look_back), look_back=None))
        return out

    def __repr__(self) -> str:
        return f"ObservationView({self.piece!r})"


class EnvSpaces:
    """What a connector factory gets as its ``env``: the env's spaces (RLlib passes the env; factories read
    its spaces). Given instead of an env so the driver need not build one to learn its module's space."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        self.observation_space = self.single_observation_space = observation_space
        self.action_space = self.single_action_space = action_space

    def __repr__(self) -> str:
        return f"EnvSpaces({self.observation_space}, {self.action_space})"


def pieces_state(pieces: list[ConnectorV2]) -> list[dict[str, Any]]:
    """A pipeline's state: each piece's name and ``get_state()``, in order (plain data, checkpointed)."""
    return [{"piece": type(p).__name__, "state": p.get_state()} for p in pieces]


def check_saved_pieces(pieces: list[ConnectorV2], states: Any, kind: str, setting: str) -> None:
    """A saved pipeline state fits ``pieces`` (the same pieces in the same order), or ValueError naming both."""
    names = [s.get("piece") for s in states] if isinstance(states, list) else states
    mine = [type(p).__name__ for p in pieces]
    if names != mine:
        raise ValueError(f"the saved {kind} pipeline is {names}, this one is {mine}: restore with the {setting} "
                         f"the state was saved with")


def set_pieces_state(pieces: list[ConnectorV2], states: Any, kind: str, setting: str) -> None:
    """Each piece gets its saved state, after ``check_saved_pieces``."""
    check_saved_pieces(pieces, states, kind, setting)
    for piece, s in zip(pieces, states):
        piece.set_state(s["state"])


def build_pipeline(factory: Callable[..., Any] | None, observation_space: gym.Space,
                   action_space: gym.Space) -> ConnectorPipeline | None:
    """``factory(env)`` (RLlib's ``env_to_module_connector``; ``(env, spaces, device)`` is accepted too)
    -> a piece or a list of pieces -> a pipeline; None when there is no factory or it gives no pieces."""
    env = EnvSpaces(observation_space, action_space)
    pieces = factory_pieces(factory, "env_to_module_connector", (env,), (env, None, None),
                            "lambda env: MeanStdFilter()")
    return ConnectorPipeline(pieces, observation_space, action_space) if pieces else None


def per_module(build: Callable[[gym.Space, gym.Space], Any], spaces: dict[str, tuple[gym.Space, gym.Space]]
               ) -> dict[str, Any] | None:
    """A multi-agent run's pipelines: ``build(observation_space, action_space)`` for each module's spaces, in
    module id order; None when it builds none (the factory gives no pieces)."""
    pipelines = {}
    for mid, (obs_space, act_space) in sorted(spaces.items()):
        pipeline = build(obs_space, act_space)
        if pipeline is None:
            return None
        pipelines[mid] = pipeline
    return pipelines


def factory_pieces(factory: Callable[..., Any] | None, name: str, args: tuple, more_args: tuple,
                   example: str) -> list[Any]:
    """The pieces a connector factory gives: ``factory(*args)``, or ``factory(*more_args)`` when it takes more
    positional arguments (RLlib's longer signatures); a piece, a list of pieces or a pipeline; [] for None."""
    if factory is None:
        return []
    if isinstance(factory, ConnectorV2):
        raise TypeError(f"{name} takes a function that builds the pieces, as in {name}={example}, "
                        f"not a piece: each runner or learner builds its own")
    if not callable(factory):
        raise TypeError(f"{name} must be a function that returns piece(s), got {type(factory).__name__}")
    try:
        params = [p for p in inspect.signature(factory).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = [None] * len(args)
    pieces = factory(*args) if len(params) <= len(args) else factory(*more_args)
    if pieces is None:
        return []
    if hasattr(pieces, "pieces") and not isinstance(pieces, ConnectorV2):  # a pipeline
        pieces = pieces.pieces
    return list(pieces) if isinstance(pieces, (list, tuple)) else [pieces]
