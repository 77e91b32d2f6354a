"""AgentObservations: a multi-agent sampler's side of ``actors.connectors.multi_agent.ModuleConnectors``.

The envs' observation dicts pass through it before their episodes record them: each agent's observation is
checked against the space the env declares for its module's agents (when observations are checked), then
goes through that module's pipeline with the other observations of the same module in the same step, one
batch per module. The episodes then record, and the modules act on, what the pipelines put out.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
            batch = self.connectors.record(mid, nested.stack(values), self.update)
            for j, r in enumerate(picked):
                out[r] = nested.map_structure(lambda a, j=j: a[j], batch)
        return out

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
