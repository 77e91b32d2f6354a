"""ModuleConnectors: a multi-agent run's env-to-module pipelines, one per module.

Each module gets its own copy of the pipeline the user's ``env_to_module_connector`` factory builds, for
that module's spaces (the factory is called once per module with an ``EnvSpaces`` of them). A multi-agent
runner's sampler (either: ``actors.env.multi_agent_connectors``) passes every observation an agent gets
through the pipeline of the module the agent is mapped to, one batch per module and step, before it records
it: chunks hold what the module saw, as in single-agent runs, so learners need nothing more. A module's
``MeanStdFilter`` gathers statistics over every agent mapped to it (RLlib's ``multi_agent=True`` filter keeps
them per agent; here agents that share a module share its normalisation, as they share its weights).

The state methods mirror ``ConnectorPipeline``'s, keyed by module id, so the driver merges the runners'
deltas, syncs runners and evaluators and checkpoints the state the same way for both kinds of run.

Recording pieces fit here: those without memory per sub-env (``MeanStdFilter``, ``FlattenObservations``, a
user's stateless or statistics-gathering piece) and those that can keep it per agent (``keyed``:
``PrevActionsPrevRewards``, whose rows the sampler keys by (env index, agent id), telling each agent's episode
start, its last action and the rewards it got since). A piece with per-sub-env memory that cannot be keyed
would need memory per agent that is not built; it is refused naming the piece.

A view (``FrameStackingEnvToModule``, at most one per pipeline, last) keeps no memory here at all: each
agent's episode keeps the module's ``look_back`` recorded rows before its open chunk
(``MultiAgentEpisode(look_back=...)``), the sampler builds each waiting agent's input from the episode's
newest rows (``view_rows``), and the chunks carry the same rows as ``look_back``, so the module's learner
rebuilds what the module saw (``observation_view``) from one stored frame per step.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from actors.connectors.base import ConnectorPipeline, ConnectorV2, ObservationView, build_pipeline, per_module
from protocols import nested


class ModuleConnectors:
    """One ``ConnectorPipeline`` per module id, built by ``build`` (which gives None for no factory)."""

    def __init__(self, pipelines: Mapping[str, ConnectorPipeline]) -> None:
        self.pipelines = dict(pipelines)

    @classmethod
    def build(cls, factory: Callable[..., Any] | None, spaces: Mapping[str, tuple[gym.Space, gym.Space]]
              ) -> "ModuleConnectors | None":
        """``spaces``: each module's (observation space as the env gives it, action space). None without a
        factory, or when it gives no pieces."""
        if factory is None:
            return None

        def build(obs_space: gym.Space, act_space: gym.Space) -> ConnectorPipeline | None:
            pipeline = build_pipeline(factory, obs_space, act_space)
            for piece in pipeline.pieces if pipeline is not None else ():
                refuse_per_env_memory(piece)
            return pipeline

        pipelines = per_module(build, dict(spaces))
        return None if pipelines is None else cls(pipelines)

    def observation_space(self, module_id: str) -> gym.Space:
        """What module ``module_id`` gets: its pipeline's output space."""
        return self.pipelines[module_id].observation_space

    def recorded_space(self, module_id: str) -> gym.Space:
        """What chunks of module ``module_id``'s agents store: the output of its recording pieces (its view's input)."""
        return self.pipelines[module_id].recorded_space

    def records(self, module_id: str) -> bool:
        """Module ``module_id``'s pipeline has recording pieces (False: a view alone, or nothing)."""
        return bool(self.pipelines[module_id].recording_pieces)

    @property
    def look_back(self) -> dict[str, int]:
        """Module id -> the recorded rows before each chunk its view needs, for the modules whose pipeline has a
        view (frame stacking); empty without views."""
        return {mid: p.look_back for mid, p in self.pipelines.items() if p.views}

    def views(self, module_id: str) -> list[ConnectorV2]:
        """Module ``module_id``'s view pieces (empty without)."""
        return self.pipelines[module_id].views

    def observation_view(self, module_id: str) -> ObservationView | None:
        """What module ``module_id``'s learner needs to rebuild its view from chunks (None: no view)."""
        return self.pipelines[module_id].observation_view()

    def view_rows(self, module_id: str, recent: list[list[Any]]) -> list[Any]:
        """Each agent's input to module ``module_id`` from its recorded rows (``MultiAgentEpisode.recent_rows``:
        the newest last, the look-back before it): the view the learner rebuilds from the agent's chunk."""
        pipeline = self.pipelines[module_id]
        if type(recent[0][0]) is np.ndarray:  # array observations: the view does the whole batch at once
            batch = pipeline.views[0].view_rows(np.array(recent))
            return list(batch)
        out = []
        for rows in recent:
            frames = nested.stack(rows)
            newest = nested.map_structure(lambda a: a[-1:], frames)
            back = nested.map_structure(lambda a: a[:-1], frames) if len(rows) > 1 else None
            out.append(nested.map_structure(lambda a: a[0], pipeline.view_of(newest, back)))
        return out

    def input_space(self, module_id: str) -> gym.Space:
        """What the env gives the agents of module ``module_id``: its pipeline's input space."""
        return self.pipelines[module_id].input_observation_space

    def record(self, module_id: str, batch: Any, update: bool, keys: list[Any] | None = None,
               starts: np.ndarray | None = None) -> Any:
        """A batch of module ``module_id``'s observations through its pipeline (``update``: the pieces may
        learn from it). ``keys``: each row's (env index, agent id), with ``starts`` True where the agent's
        episode starts: keyed pieces answer from each agent's memory. Without keys every row is taken as
        mid-episode with fresh memory (``compute_single_action``)."""
        pipeline = self.pipelines.get(module_id)
        if pipeline is None:
            raise KeyError(f"no env-to-module pipeline for module {module_id!r}; the modules with one are "
                           f"{sorted(self.pipelines)}")
        if keys is not None and pipeline.keyed:
            return pipeline.record_keyed(batch, keys, starts, update)
        return pipeline.record(batch, np.zeros(nested.batch_len(batch), bool) if starts is None else starts, update)

    @property
    def keyed(self) -> bool:
        """Some module's pipeline keeps memory per agent (the sampler tells it actions, rewards and ends)."""
        return any(p.keyed for p in self.pipelines.values())

    def step_keyed(self, module_id: str, keys: list[Any], actions: Any, rewards: np.ndarray) -> None:
        """The last actions of module ``module_id``'s agents ``keys`` and the rewards they got since."""
        self.pipelines[module_id].step_keyed(keys, actions, rewards)

    def forget_keys(self, module_id: str, keys: list[Any]) -> None:
        self.pipelines[module_id].forget_keys(keys)

    @property
    def stateful(self) -> bool:
        return any(p.stateful for p in self.pipelines.values())

    def get_state(self) -> dict[str, list[dict[str, Any]]]:
        return {mid: p.get_state() for mid, p in self.pipelines.items()}

    def set_state(self, states: Mapping[str, Any]) -> None:
        self._check_modules(states)
        for mid, p in self.pipelines.items():
            p.set_state(states[mid])

    def sync(self, states: Mapping[str, Any]) -> None:
        self._check_modules(states)
        for mid, p in self.pipelines.items():
            p.sync(states[mid])

    def pop_deltas(self) -> dict[str, list[Any]]:
        return {mid: p.pop_deltas() for mid, p in self.pipelines.items()}

    def absorb(self, deltas: list[Mapping[str, list[Any]] | None]) -> None:
        """``deltas``: one ``pop_deltas()`` dict per runner."""
        for mid, p in self.pipelines.items():
            p.absorb([d[mid] for d in deltas if d is not None and d.get(mid) is not None])

    def _check_modules(self, states: Any) -> None:
        if not isinstance(states, Mapping) or set(states) != set(self.pipelines):
            saved = sorted(states) if isinstance(states, Mapping) else type(states).__name__
            raise ValueError(f"the saved env-to-module connector state is for modules {saved}, this run's "
                             f"pipelines are for {sorted(self.pipelines)}: restore with the modules and the "
                             f"env_to_module_connector the state was saved with")

    def __repr__(self) -> str:
        return f"ModuleConnectors({self.pipelines})"


def refuse_per_env_memory(piece: ConnectorV2) -> None:
    """ValueError for a piece a multi-agent runner cannot host yet (it keeps memory per sub-env and cannot
    keep it per agent: not ``keyed``). Views pass: the agents' episodes hold what they look back on."""
    why = (None if not piece.records or piece.keyed else
           "hears each sub-env's actions and rewards" if piece.watches_steps else
           "keeps memory per sub-env (it overrides reset_stack)"
           if type(piece).reset_stack is not ConnectorV2.reset_stack else None)
    if why is not None:
        raise ValueError(f"{piece!r} {why}; multi-agent runs hold per-module pipelines of pieces without such "
                         f"memory or with memory per agent (MeanStdFilter, FlattenObservations, PrevActionsPrevRewards, "
                         f"FrameStackingEnvToModule, pieces of your own): keep that memory in the MultiAgentEnv "
                         f"instead")

