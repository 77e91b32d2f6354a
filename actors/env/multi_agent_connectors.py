"""AgentObservations: a multi-agent sampler's side of ``actors.connectors.multi_agent.ModuleConnectors``.

The envs' observation dicts pass through it before their episodes record them: each agent's observation is
checked against the space the env declares for its module's agents (when observations are checked), then
goes through that module's pipeline with the other observations of the same module in the same step, one
batch per module. The episodes then record, and the modules act on, what the pipelines put out.

Pipelines with memory per agent (``ModuleConnectors.keyed``: ``PrevActionsPrevRewards``) get each row's
(env index, agent id) key, whether the agent's episode starts with it, and -- before its next observation --
the action the agent took last and the rewards it got since (summed over the env steps in between). The
sampler tells this class what it needs for that: ``new_episode`` when an env resets, ``note_actions`` after
each group acts, ``add_rewards`` (``add_reward_rows``: the lockstep sampler's rows) after the envs step.

Pipelines with a view (``look_back``: frame stacking) record through their recording pieces only; the
sampler makes each episode with the modules' ``look_back`` and, before every forward pass, replaces the
waiting agents' recorded observations by their views (``view_waiting``), built from the episodes' rows.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from actors.connectors.multi_agent import ModuleConnectors
from actors.env.multi_agent_checks import MultiAgentEnvError
from actors.env.space_values import BatchProblemFinder, batch_problem_finder
from protocols import nested
from protocols.multi_agent_episode import MultiAgentEpisode


class AgentObservations:
    def __init__(self, connectors: ModuleConnectors, update: bool, check_observations: bool) -> None:
        """``update``: the pipelines may learn from what they see (training runners; evaluators do not)."""
        self.connectors, self.update = connectors, update
        self.check_observations = check_observations
        self._checks: dict[str, BatchProblemFinder] = {}
        self.keyed = connectors.keyed
        self.look_back = connectors.look_back
        self._view_only = {mid for mid in connectors.pipelines if not connectors.records(mid)}
        """Modules whose pipeline is a view alone: the episodes record the env's observations as they are."""
        """Module id -> the rows its view looks back on, for modules whose pipeline has a view (empty: none)."""
        """Some pipeline keeps memory per agent: the sampler reports episodes, actions and rewards."""
        self._seen: dict[int, dict[Any, str]] = {}  # env index -> the agents observed in its episode -> module
        self._acted: dict[tuple[int, Any], Any] = {}  # (env, agent) -> its action since its last observation
        self._earned: dict[tuple[int, Any], float] = {}  # (env, agent) -> rewards since its last observation

    def new_episode(self, index: int) -> None:
        """Env ``index`` resets: its agents' memory goes."""
        if not self.keyed:
            return
        by_module: dict[str, list[tuple[int, Any]]] = {}
        for aid, mid in self._seen.pop(index, {}).items():
            by_module.setdefault(mid, []).append((index, aid))
            self._acted.pop((index, aid), None)
            self._earned.pop((index, aid), None)
        for mid, keys in by_module.items():
            self.connectors.forget_keys(mid, keys)

    def note_actions(self, who: list[tuple[int, Any]], actions: Any) -> None:
        """The module-form actions ``who`` (env index, agent id) took this step, a row each."""
        if self.keyed:
            self._acted.update(zip(who, actions))

    def add_reward_rows(self, keys: list[tuple[int, Any]], rewards: Any) -> None:
        """The step's reward of each (env index, agent id) in ``keys``, in order (the lockstep sampler's rows)."""
        earned = self._earned
        for key, r in zip(keys, rewards):
            if isinstance(r, numbers.Real):  # anything else is the episode's check to report, not this memory's
                earned[key] = earned.get(key, 0.0) + float(r)

    def add_rewards(self, rewards: list[tuple[int, Any]]) -> None:
        """``(env index, its step's reward dict)`` of every env that stepped."""
        if not self.keyed:
            return
        earned = self._earned
        for i, by_agent in rewards:
            if isinstance(by_agent, Mapping):
                for aid, r in by_agent.items():
                    if isinstance(r, numbers.Real):  # anything else is the episode's check to report
                        earned[(i, aid)] = earned.get((i, aid), 0.0) + float(r)

    def view_waiting(self, waiting: dict[str, tuple], episodes: list[MultiAgentEpisode]) -> None:
        """``waiting`` (module id -> (rows (episode index, agent id), their recorded observations)): for each
        module with a view, the observations replaced by the views its agents act on, in place."""
        for mid in self.look_back:
            part = waiting.get(mid)
            if part is not None:
                who = part[0]
                waiting[mid] = (who, self.connectors.view_rows(mid, [episodes[i].recent_rows(aid) for i, aid in who]))

    def transform(self, items: list[tuple[int, MultiAgentEpisode, Any]]) -> list[Any]:
        """``items``: (env index, its episode, the observation dict its env returned) -> the dicts with each
        agent's observation as its module gets it. A value that is not a dict is left to the episode's
        own check."""
        rows: list[tuple[int, Any, str, Any]] = []
        for i, ep, obs in items:
            if isinstance(obs, Mapping):
                rows.extend((i, aid, ep.module_for(aid), value) for aid, value in obs.items())
        done = iter(self.transform_rows(rows))
        return [{aid: next(done) for aid in obs} if isinstance(obs, Mapping) else obs for _, _, obs in items]

    def transform_rows(self, rows: list[tuple[int, Any, str, Any]]) -> list[Any]:
        """(env index, agent id, module id, observation) rows -> each row's observation as its module gets it,
        in the same order; one pipeline call per module."""
        by_module: dict[str, list[int]] = {}
        for r, row in enumerate(rows):
            by_module.setdefault(row[2], []).append(r)
        out: list[Any] = [None] * len(rows)
        for mid, picked in by_module.items():
            values = [rows[r][3] for r in picked]
            if self.check_observations:
                self._check(mid, values, [(rows[r][0], rows[r][1]) for r in picked])
            if mid in self._view_only:
                for j, r in enumerate(picked):
                    out[r] = values[j]
                continue
            if self.keyed:
                batch = self._record_keyed(mid, [(rows[r][0], rows[r][1]) for r in picked], nested.stack(values))
            else:
                batch = self.connectors.record(mid, nested.stack(values), self.update)
            for j, r in enumerate(picked):
                out[r] = nested.map_structure(lambda a, j=j: a[j], batch)
        return out

    def _record_keyed(self, mid: str, keys: list[tuple[int, Any]], batch: Any) -> Any:
        """One module's rows through its pipeline with their keys: the agents that acted since their last
        observation first hear that action and what it earned; an agent new to its episode starts afresh."""
        stepped = [k for k in keys if k in self._acted]
        if stepped:
            self.connectors.step_keyed(mid, stepped, np.stack([np.asarray(self._acted.pop(k)) for k in stepped]),
                                       np.array([self._earned.pop(k, 0.0) for k in stepped], np.float32))
        starts = np.zeros(len(keys), bool)
        for r, (i, aid) in enumerate(keys):
            seen = self._seen.setdefault(i, {})
            if aid not in seen:
                seen[aid] = mid
                starts[r] = True
            self._earned.pop((i, aid), None)  # earned before acting at all: nothing to pair it with
        return self.connectors.record(mid, batch, self.update, keys=keys, starts=starts)

    def _check(self, mid: str, values: list[Any], who: list[tuple[int, Any]]) -> None:
        check = self._checks.get(mid)
        if check is None:
            check = self._checks[mid] = batch_problem_finder(self.connectors.input_space(mid))
        try:
            batch = nested.stack_leaves(values)
        except (ValueError, TypeError):
            batch = None
        bad = check(batch, values)
        if bad is not None:
            row, why = bad
            i, aid = who[row]
            raise MultiAgentEnvError(f"env {i}: the observation of agent {aid!r} {why}; it must lie in "
                                     f"{self.connectors.input_space(mid)}, the observation space of the agents of "
                                     f"module {mid!r} (the input of its env-to-module pipeline)", aid)
