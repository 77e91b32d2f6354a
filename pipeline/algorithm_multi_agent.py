"""What ``Algorithm`` does differently for a multi-agent config: the plan, the groups' pieces, actions.

A config that uses ``.multi_agent(...)`` (or ``rl_module(rl_module_spec=...)``) is resolved once in the
driver against one env (``multi_agent_plan``); from the plan come the env runners' class and arguments
(``MultiAgentEnvRunner`` with every module's spec and the mapping fn), the learner group
(``MultiLearnerGroup``: one algorithm learner per module) and one driver policy per module for
``get_module(module_id)`` and ``compute_single_action(obs, policy_id=...)``. A config without them
never reaches this module: single-agent runs keep ``EnvRunner`` and the single ``Learner``.

Evaluators are ``MultiAgentEnvRunner``s too (``runner_group_args(evaluation=True)``). Modules added and
removed while training (``pipeline.algorithm_modules``) change the plan here and the specs and mapping
every runner group is built with, so recreated runners hold the run's modules.

What is not built for multi-agent runs yet (offline input for the on-line algorithms but DQN's and SAC's
mixing) is refused by
the config's checks (``pipeline.config.multi_agent.unbuilt_problems``), before anything is built.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from actors.connectors.multi_agent import ModuleConnectors
from actors.env.multi_agent_runner import MultiAgentEnvRunner
from actors.env.vector_env import EnvContext
from actors.metrics import MetricsLogger
from actors.modules import ModuleSpec, RLModule
from pipeline.algorithm_actions import DriverPolicy
from pipeline.config.base import AlgorithmConfig, ConfigError
from pipeline.config.connectors import refuse_view
from pipeline.config.multi_agent import NOT_YET, settings_used
from pipeline.config.multi_agent_plan import MultiAgentPlan, multi_agent_plan
from pipeline.config.offline import module_recorded_spaces, reader_settings
from pipeline.config.plain import resolve_import_path
from pipeline.groups.multi_agent import MultiLearnerGroup, OneModule, check_module_class, steps_counter


class CurrentMapping:
    """The run's mapping fn as the runners are built with it: ``add_module``/``remove_module`` may swap
    the fn inside, so a runner recreated after a crash maps agents as the live ones do."""

    def __init__(self, fn: Callable[[Any, Any], str]) -> None:
        self.fn = fn

    def __call__(self, agent_id: Any, episode: Any) -> str:
        return self.fn(agent_id, episode)


@dataclass
class MultiAgentSetup:
    """The resolved plan of a multi-agent run and the driver's policy copy of each module."""

    plan: MultiAgentPlan
    driver_policies: dict[str, DriverPolicy]
    runner_specs: dict[str, ModuleSpec] = field(default_factory=dict)
    """The module specs every runner group is built with (one dict, changed in place as modules come and
    go, so recreated runners hold the run's modules)."""
    runner_mapping: CurrentMapping | None = None
    connectors: ModuleConnectors | None = None
    """The driver's copy of each module's env-to-module pipeline (``env_to_module_connector``); None without."""
    connector_spaces: dict[str, tuple[Any, Any]] | None = None
    """Each module's spaces as the env gives them (its pipeline's input); the plan's specs hold the outputs."""

    def __post_init__(self) -> None:
        self.runner_specs.update(sorted(self.plan.module_specs.items()))
        self.runner_mapping = CurrentMapping(self.plan.policy_mapping_fn)

    def change_modules(self, added: dict[str, ModuleSpec] | None = None, removed: str | None = None,
                       mapping: Callable[[Any, Any], str] | None = None) -> None:
        """Modules added or removed, and the mapping fn from now on (None: unchanged)."""
        specs = {mid: s for mid, s in self.plan.module_specs.items() if mid != removed} | dict(added or {})
        trainable = self.plan.trainable
        if trainable is not None and removed is not None:
            trainable = trainable - {removed}
        self.plan = dataclasses.replace(self.plan, module_specs=specs, trainable=trainable,
                                        policy_mapping_fn=mapping or self.plan.policy_mapping_fn)
        self.runner_specs.clear()
        self.runner_specs.update(sorted(specs.items()))
        self.runner_mapping.fn = self.plan.policy_mapping_fn

    def set_trainable(self, which: Any) -> None:
        """The modules that train from now on: ids, or a function ``(module_id, batch) -> bool``."""
        if callable(which):
            self.plan = dataclasses.replace(self.plan, trainable=None, policies_to_train=which)
        else:
            self.plan = dataclasses.replace(self.plan, trainable=frozenset(which), policies_to_train=None)

    @property
    def module_ids(self) -> list[str]:
        """Sorted: ``policies`` may be a set, whose order changes from one process to the next."""
        return sorted(self.plan.module_ids)

    def recorded_spaces(self, module_ids: list[str] | None = None) -> dict[str, tuple[Any, Any]]:
        """Each module's (observation, action) spaces as its chunks hold them -- what its recording's manifest
        says: its recording pieces' output (a view's input: frame stacking keeps one frame a step), else the
        module's own."""
        out = {}
        for mid in self.module_ids if module_ids is None else module_ids:
            spec = self.plan.module_specs[mid]
            piped = self.connectors is not None and mid in self.connectors.pipelines
            out[mid] = (self.connectors.recorded_space(mid) if piped else spec.observation_space, spec.action_space)
        return out

    def first_spaces(self) -> tuple[Any, Any]:
        """The first module's (observation, action) spaces: what the driver's single-module pieces
        (frame compression, ``algo.observation_space``) are given."""
        spec = self.plan.module_specs[self.module_ids[0]]
        return spec.observation_space, spec.action_space

    def runner_group_args(self, evaluation: bool = False) -> dict[str, Any]:
        """``EnvRunnerGroup`` arguments: the runner class, its plan pieces and how its steps count.
        Evaluators count env steps (``evaluation_duration`` timesteps are env steps)."""
        count_steps_by = "env_steps" if evaluation else self.plan.count_steps_by
        kwargs = {"connector_spaces": self.connector_spaces} if self.connectors is not None else {}
        return {"runner_class": MultiAgentEnvRunner,
                # sorted, so the runners' modules draw their exploration in the same order in every process
                "runner_kwargs": {"module_specs": self.runner_specs, "policy_mapping_fn": self.runner_mapping,
                                  "count_steps_by": count_steps_by, **kwargs},
                "count_steps": steps_counter(count_steps_by)}

    def runner_timestep(self, metrics: MetricsLogger, env_steps: int) -> int:
        """The run's steps so far in the runners' ``count_steps_by`` unit (what their exploration follows)."""
        if self.plan.count_steps_by == "agent_steps":
            return int(metrics.peek("env_runners/num_agent_steps_sampled_lifetime", 0))
        return env_steps

    def learner_group(self, learner_class: type, config: AlgorithmConfig) -> MultiLearnerGroup:
        views = {} if self.connectors is None else {mid: self.connectors.observation_view(mid)
                                                    for mid in self.connectors.look_back}
        return MultiLearnerGroup(learner_class, config, self.plan, observation_views=views)

    def module_id(self, module_id: str | None, where: str) -> str:
        """``module_id`` checked (None: the run's one module), or a KeyError naming the run's modules."""
        if module_id is None and len(self.driver_policies) == 1:
            module_id = self.module_ids[0]
        if module_id not in self.driver_policies:
            raise KeyError(f"{where}: module {module_id!r} is not one of this run's modules {self.module_ids}; "
                           f"name one, e.g. {where}(..., policy_id={self.module_ids[0]!r})")
        return module_id

    def policy(self, module_id: str | None, where: str) -> DriverPolicy:
        return self.driver_policies[self.module_id(module_id, where)]

    def env_observation_space(self, module_id: str | None, where: str) -> Any:
        """What the env gives the agents of ``module_id``: its pipeline's input, or its module's space."""
        mid = self.module_id(module_id, where)
        if self.connectors is not None:
            return self.connectors.input_space(mid)
        return self.policy(mid, where).observation_space

    def compute_actions(self, group: MultiLearnerGroup, obs: Any, explore: bool, timestep: int,
                        module_id: str | None) -> Any:
        """``algo.compute_actions(..., policy_id=module_id)``: module ``module_id``'s env actions."""
        policy = self.policy(module_id, "compute_actions")
        return policy.compute_actions(OneModule(group, module_id or self.module_ids[0]), obs, explore, timestep)

    def module(self, group: MultiLearnerGroup, module_id: str | None) -> RLModule:
        """Module ``module_id`` with the learners' latest weights."""
        return self.policy(module_id, "get_module").current_module(OneModule(group, module_id or self.module_ids[0]))


def multi_agent_setup(config: AlgorithmConfig, creator: Callable | None, learner_class: type
                      ) -> MultiAgentSetup | None:
    """The multi-agent plan of ``config`` (None when it uses no multi-agent setting: single-agent)."""
    if not settings_used(config):
        return None
    reader = reader_settings(config)
    recorded = module_recorded_spaces(config) if reader is not None and reader.modules else None
    if creator is None and recorded is None:
        raise ConfigError("a multi-agent config needs an env: .environment(MultiAgentEnvClass, env_config=...)")
    if creator is None:  # trained from a multi-agent recording: each module's spaces as recorded
        plan = multi_agent_plan(config, None, recorded)
    else:
        env = make_env(creator, config.env_config)
        try:
            plan = multi_agent_plan(config, env)
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                close()
    if not plan.is_multi_agent:  # multi_agent_plan refuses modules other than default_policy on such an env
        raise NotImplementedError(f"rl_module(rl_module_spec=...) and multi_agent(...) settings on a single-agent env "
                                  f"({config.env!r}) {NOT_YET}: leave them out (rl_module(model_config=...) sets "
                                  f"the one module's network)")
    connectors, spaces = module_connectors(config, plan)
    for mid, held in (recorded or {}).items():  # the env serves evaluation or sampling: its agents act as recorded
        spec = plan.module_specs[mid]
        piped = connectors is not None and mid in connectors.pipelines
        chunk_spaces = (connectors.recorded_space(mid) if piped else spec.observation_space, spec.action_space)
        if creator is not None and chunk_spaces != held:
            raise ConfigError(f"module {mid!r} acts in {chunk_spaces[0]} / {chunk_spaces[1]} in the env, but its "
                              f"recording holds {held[0]} / {held[1]}: use the env the recording was made in, or "
                              f"give the module its spaces")
    if connectors is not None:  # every stage builds its module for what the pipeline puts out
        plan = dataclasses.replace(plan, module_specs={
            mid: dataclasses.replace(spec, observation_space=connectors.observation_space(mid))
            for mid, spec in plan.module_specs.items()})
    policies = {}
    for mid, spec in plan.module_specs.items():
        check_module_class(learner_class, mid, spec)
        policies[mid] = DriverPolicy.build(spec, config, spec.observation_space, spec.action_space)
    return MultiAgentSetup(plan, policies, connectors=connectors, connector_spaces=spaces)


def module_connectors(config: AlgorithmConfig, plan: MultiAgentPlan
                      ) -> tuple[ModuleConnectors | None, dict[str, tuple[Any, Any]] | None]:
    """The driver's per-module env-to-module pipelines and their input spaces (None, None without
    ``env_to_module_connector``); pieces that cannot run per module are a ConfigError naming them."""
    factory = config.env_to_module_connector
    if isinstance(factory, str):
        factory = resolve_import_path(factory, "env_to_module_connector")
    if factory is None:
        return None, None
    spaces = {mid: (spec.observation_space, spec.action_space) for mid, spec in plan.module_specs.items()}
    try:
        connectors = ModuleConnectors.build(factory, spaces)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"env_to_module_connector: {err}") from err
    for mid in connectors.look_back if connectors is not None else ():
        refuse_view(config, connectors.views(mid)[0])
    return connectors, (spaces if connectors is not None else None)


def make_env(creator: Callable, env_config: dict) -> Any:
    """One env in the driver, to resolve the modules' spaces from its agents."""
    try:
        return creator(EnvContext(env_config, worker_index=0, vector_index=0))
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"creating the env failed: {type(err).__name__}: {err}") from err
