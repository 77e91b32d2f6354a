"""The multi-agent plan: every module's complete ``ModuleSpec``, resolved from a built config and an env.

``multi_agent_plan(config, env)`` is what env runners and learners consume: for each module id the
class, spaces, model config and module kwargs to build it with, the mapping fn in the one form the
episode calls (``fn(agent_id, episode) -> module_id``), which modules train, and how steps are counted.
A single-agent config on a single-agent env resolves to the one module ``default_policy``, so one code
path serves both.

Spaces come from the module's ``RLModuleSpec`` or ``PolicySpec`` where given; otherwise from the agents
mapped to it. As RLlib does at setup, the mapping fn is asked once per possible agent, with a throwaway
episode; agents of one module must share their spaces. A module no agent was mapped to there (a
mapping that depends on the episode, as in self-play) takes the spaces all agents share, or needs them
in its spec.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

from actors.modules import ModuleSpec
from actors.modules.rl_module_spec import MultiRLModuleSpec, RLModuleSpec
from pipeline.config.checks import ConfigError
from pipeline.config.multi_agent import (PolicySpec, as_rl_module_spec, is_multi_agent, mapping_function, module_ids,
                                         normalize_policies)
from pipeline.config.plain import resolve_import_path
from protocols.multi_agent_episode import MultiAgentEpisode


@dataclass(frozen=True)
class MultiAgentPlan:
    """What the stages build and how they route agents; see the module docstring."""

    module_specs: dict[str, ModuleSpec]
    """Every module id -> the spec its stages build it from (runners inference-only, learners in full)."""
    policy_mapping_fn: Callable[[Any, Any], str]
    """``fn(agent_id, episode) -> module_id``, ready for ``MultiAgentEpisode(policy_mapping_fn, ...)``."""
    trainable: frozenset[str] | None
    """The modules learners update; None: ``policies_to_train`` is a function that decides per batch
    (ask ``is_trainable(module_id, batch)``)."""
    policies_to_train: Callable[[str, Any], bool] | None = None
    """The user's function when it decides per batch, else None."""
    count_steps_by: str = "env_steps"
    """"env_steps" or "agent_steps": what ``train_batch_size_per_learner`` and the sampling counts count."""
    agent_modules: dict[Any, str] = field(default_factory=dict)
    """Each possible agent -> the module it was mapped to at setup (empty for a single-agent env)."""
    config_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Module id -> its ``PolicySpec.config`` settings other than ``model_config`` (e.g. ``lr``)."""
    is_multi_agent: bool = False
    """The env is multi-agent or the config names modules other than ``default_policy``: runners record
    ``MultiAgentEpisode``s."""

    @property
    def module_ids(self) -> list[str]:
        return list(self.module_specs)

    def is_trainable(self, module_id: str, batch: Any = None) -> bool:
        """Whether learners update ``module_id`` (on ``batch``, for a per-batch ``policies_to_train``)."""
        if module_id not in self.module_specs:
            raise KeyError(f"no module {module_id!r}; the modules are {self.module_ids}")
        if self.trainable is not None:
            return module_id in self.trainable
        return bool(self.policies_to_train(module_id, batch))


def multi_agent_plan(config: Any, env: Any, recorded: dict[str, tuple[Any, Any]] | None = None) -> MultiAgentPlan:
    """Resolve ``config``'s modules on ``env`` (a multi-agent env: ``possible_agents`` and per-agent spaces;
    or a single-agent gymnasium env), or -- ``env`` None, training from a multi-agent recording with no env --
    on each module's ``recorded`` (observation, action) spaces. Raises ConfigError naming the module, agent
    and spaces at fault."""
    ids = module_ids(config)
    mapping_fn = mapping_function(config.policy_mapping_fn)
    policies = normalize_policies(config.policies) or {}
    rl_spec = as_rl_module_spec(config.rl_module_spec)
    if env is None:
        agent_modules, single = {}, (None, None)
    elif is_multi_agent_env(env):
        agent_modules = _map_agents(env, mapping_fn, ids)
        agent_spaces = {aid: agent_space_pair(env, aid) for aid in agent_modules}
    elif is_multi_agent(config):
        raise ConfigError(f"the config names modules {ids} but the env {type(env).__name__} is single-agent (it has no "
                          f"possible_agents): use a MultiAgentEnv (e.g. make_multi_agent(...)), or leave "
                          f"multi_agent(policies=...) out")
    else:
        agent_modules = {}
        single = (_given(config.observation_space, env.observation_space), _given(config.action_space, env.action_space))
    specs, overrides = {}, {}
    for mid in ids:
        pspec = policies.get(mid) or PolicySpec()
        mspec = _rl_module_spec_for(rl_spec, mid)
        if env is None:
            spaces = (_given(mspec.observation_space, pspec.observation_space, recorded[mid][0]),
                      _given(mspec.action_space, pspec.action_space, recorded[mid][1]))
        elif agent_modules or is_multi_agent_env(env):
            spaces = _module_spaces(mid, pspec, mspec, agent_modules, agent_spaces)
        else:
            spaces = (_given(mspec.observation_space, pspec.observation_space, single[0]),
                      _given(mspec.action_space, pspec.action_space, single[1]))
        specs[mid] = _module_spec(config, mid, spaces, pspec, mspec)
        overrides[mid] = {k: v for k, v in (pspec.config or {}).items() if k != "model_config"}
    to_train = config.policies_to_train
    if isinstance(to_train, str):
        to_train = resolve_import_path(to_train, "policies_to_train")
    per_batch = callable(to_train)
    trainable = None if per_batch else frozenset(ids if to_train is None else to_train)
    return MultiAgentPlan(specs, mapping_fn, trainable, to_train if per_batch else None, config.count_steps_by,
                          agent_modules, {m: o for m, o in overrides.items() if o},
                          env is None or bool(is_multi_agent(config)) or is_multi_agent_env(env))


# --- the env, duck-typed ---------------------------------------------------------------------------------
def is_multi_agent_env(env: Any) -> bool:
    return hasattr(env, "possible_agents") or hasattr(env, "get_agent_ids")


def possible_agents(env: Any) -> list[Any]:
    agents = getattr(env, "possible_agents", None)
    if agents is None:
        agents = env.get_agent_ids()
    return list(agents)


def agent_space_pair(env: Any, agent_id: Any) -> tuple[gym.Space, gym.Space]:
    """An agent's (observation space, action space): ``get_observation_space(agent_id)`` or the
    ``observation_spaces`` dict (likewise for actions)."""
    out = []
    for kind in ("observation", "action"):
        getter = getattr(env, f"get_{kind}_space", None)
        if getter is not None:
            out.append(getter(agent_id))
        else:
            spaces = getattr(env, f"{kind}_spaces", None)
            if spaces is None or agent_id not in spaces:
                raise ConfigError(f"the env {type(env).__name__} gives no {kind} space for agent {agent_id!r}: a "
                                  f"multi-agent env needs get_{kind}_space(agent_id) or a {kind}_spaces dict")
            out.append(spaces[agent_id])
    return out[0], out[1]


def _map_agents(env: Any, mapping_fn: Callable[[Any, Any], str], ids: list[str]) -> dict[Any, str]:
    agents = possible_agents(env)
    if not agents:
        raise ConfigError(f"the env {type(env).__name__} lists no possible_agents; a multi-agent env names every "
                          f"agent that may act in possible_agents")
    episode = MultiAgentEpisode(mapping_fn, module_ids=ids)  # throwaway: for mapping fns that read the episode
    out = {}
    for aid in agents:
        mid = mapping_fn(aid, episode)
        if mid not in ids:
            raise ConfigError(f"policy_mapping_fn mapped agent {aid!r} to {mid!r}, which is not a module; the "
                              f"modules are {ids} (add it to multi_agent(policies=...) or fix the mapping)")
        out[aid] = mid
    return out


# --- one module ------------------------------------------------------------------------------------------
def _rl_module_spec_for(rl_spec: Any, module_id: str) -> RLModuleSpec:
    if isinstance(rl_spec, MultiRLModuleSpec):
        return rl_spec.spec_for(module_id) or RLModuleSpec()
    if isinstance(rl_spec, RLModuleSpec):
        return rl_spec
    return RLModuleSpec()


def _module_spaces(module_id: str, pspec: PolicySpec, mspec: RLModuleSpec, agent_modules: dict[Any, str],
                   agent_spaces: dict[Any, tuple]) -> tuple[gym.Space, gym.Space]:
    """The spec's spaces where given, else those of the agents mapped to the module (which must agree)."""
    given = (_given(mspec.observation_space, pspec.observation_space), _given(mspec.action_space, pspec.action_space))
    if given[0] is not None and given[1] is not None:
        return given
    mine = [aid for aid, mid in agent_modules.items() if mid == module_id]
    if mine:
        first = mine[0]
        for other in mine[1:]:
            for i, kind in enumerate(("observation", "action")):
                if given[i] is None and agent_spaces[other][i] != agent_spaces[first][i]:
                    raise ConfigError(
                        f"module {module_id!r} is mapped agents with different {kind} spaces: agent {first!r} has "
                        f"{agent_spaces[first][i]} and agent {other!r} has {agent_spaces[other][i]}; map them to "
                        f"different modules, or give the module one {kind}_space in its RLModuleSpec")
        found = agent_spaces[first]
    else:
        distinct = {(repr(o), repr(a)): (o, a) for o, a in agent_spaces.values()}
        if len(distinct) != 1:
            raise ConfigError(f"no agent was mapped to module {module_id!r} at setup and the agents' spaces differ, so "
                              f"its spaces are unknown: give them, RLModuleSpec(observation_space=..., "
                              f"action_space=...) or PolicySpec(observation_space=..., action_space=...)")
        found = next(iter(distinct.values()))
    return _given(given[0], found[0]), _given(given[1], found[1])


def _given(*values: Any) -> Any:
    """The first value that is not None (a space may be falsy: an empty Dict or Tuple space)."""
    return next((v for v in values if v is not None), None)


def _module_spec(config: Any, module_id: str, spaces: tuple, pspec: PolicySpec, mspec: RLModuleSpec) -> ModuleSpec:
    default_class = config.get_default_learner_class().module_class
    cls = _given(mspec.module_class, pspec.policy_class, default_class)
    if isinstance(cls, str):
        cls = resolve_import_path(cls, f"module class of {module_id!r}")
    model_config = {**config.model_config, **((pspec.config or {}).get("model_config") or {}),
                    **mspec.model_config_dict()}
    # the algorithm's module options (DQN's dueling...) fit its own class and the classes built on it
    kwargs = config.module_kwargs() if issubclass(cls, default_class) else {}
    return ModuleSpec(spaces[0], spaces[1], model_config, cls, kwargs)
