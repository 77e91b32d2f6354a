"""What ``Algorithm`` does differently for a multi-agent config: the plan, the groups' pieces, actions.

A config that uses ``.multi_agent(...)`` (or ``rl_module(rl_module_spec=...)``) is resolved once in the
driver against one env (``multi_agent_plan``); from the plan come the env runners' class and arguments
(``MultiAgentEnvRunner`` with every module's spec and the mapping fn), the learner group
(``MultiLearnerGroup``: one algorithm learner per module) and one driver policy per module for
``get_module(module_id)`` and ``compute_single_action(obs, policy_id=...)``. A config without them
never reaches this module: single-agent runs keep ``EnvRunner`` and the single ``Learner``.

What is not built for multi-agent runs yet is refused here, at set-up, with the setting named:
evaluation, streaming (asynchronous) algorithms, recording, external clients and offline input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from actors.env.multi_agent_runner import MultiAgentEnvRunner
from actors.env.vector_env import EnvContext
from actors.metrics import MetricsLogger
from actors.modules import RLModule
from pipeline.algorithm_actions import DriverPolicy
from pipeline.config.base import AlgorithmConfig, ConfigError
from pipeline.config.multi_agent import settings_used
from pipeline.config.multi_agent_plan import MultiAgentPlan, multi_agent_plan
from pipeline.groups.multi_agent import MultiLearnerGroup, OneModule, check_module_class, steps_counter

NOT_YET = "is not built for multi-agent runs yet (issue 27)"


@dataclass
class MultiAgentSetup:
    """The resolved plan of a multi-agent run and the driver's policy copy of each module."""

    plan: MultiAgentPlan
    driver_policies: dict[str, DriverPolicy]

    @property
    def module_ids(self) -> list[str]:
        """Sorted: ``policies`` may be a set, whose order changes from one process to the next."""
        return sorted(self.plan.module_ids)

    def first_spaces(self) -> tuple[Any, Any]:
        """The first module's (observation, action) spaces: what the driver's single-module pieces
        (frame compression, ``algo.observation_space``) are given."""
        spec = self.plan.module_specs[self.module_ids[0]]
        return spec.observation_space, spec.action_space

    def runner_group_args(self) -> dict[str, Any]:
        """``EnvRunnerGroup`` arguments: the runner class, its plan pieces and how its steps count."""
        plan = self.plan
        return {"runner_class": MultiAgentEnvRunner,
                # sorted, so the runners' modules draw their exploration in the same order in every process
                "runner_kwargs": {"module_specs": dict(sorted(plan.module_specs.items())),
                                  "policy_mapping_fn": plan.policy_mapping_fn,
                                  "count_steps_by": plan.count_steps_by},
                "count_steps": steps_counter(plan.count_steps_by)}

    def runner_timestep(self, metrics: MetricsLogger, env_steps: int) -> int:
        """The run's steps so far in the runners' ``count_steps_by`` unit (what their exploration follows)."""
        if self.plan.count_steps_by == "agent_steps":
            return int(metrics.peek("env_runners/num_agent_steps_sampled_lifetime", 0))
        return env_steps

    def learner_group(self, learner_class: type, config: AlgorithmConfig) -> MultiLearnerGroup:
        return MultiLearnerGroup(learner_class, config, self.plan)

    def policy(self, module_id: str | None, where: str) -> DriverPolicy:
        if module_id is None and len(self.driver_policies) == 1:
            module_id = self.module_ids[0]
        if module_id not in self.driver_policies:
            raise KeyError(f"{where}: module {module_id!r} is not one of this run's modules {self.module_ids}; "
                           f"name one, e.g. {where}(..., policy_id={self.module_ids[0]!r})")
        return self.driver_policies[module_id]

    def module(self, group: MultiLearnerGroup, module_id: str | None) -> RLModule:
        """Module ``module_id`` with the learners' latest weights."""
        return self.policy(module_id, "get_module").current_module(OneModule(group, module_id or self.module_ids[0]))


def multi_agent_setup(config: AlgorithmConfig, creator: Callable | None, learner_class: type
                      ) -> MultiAgentSetup | None:
    """The multi-agent plan of ``config`` (None when it uses no multi-agent setting: single-agent)."""
    if not settings_used(config):
        return None
    refuse_unbuilt(config, learner_class)
    if creator is None:
        raise ConfigError("a multi-agent config needs an env: .environment(MultiAgentEnvClass, env_config=...)")
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
    if plan.trainable is None:
        raise NotImplementedError(f"policies_to_train as a function {NOT_YET}: give the module ids that train")
    policies = {}
    for mid, spec in plan.module_specs.items():
        check_module_class(learner_class, mid, spec)
        policies[mid] = DriverPolicy.build(spec, config, spec.observation_space, spec.action_space)
    return MultiAgentSetup(plan, policies)


def refuse_unbuilt(config: AlgorithmConfig, learner_class: type) -> None:
    """What multi-agent runs do not support yet, each as an error naming the setting to change."""
    offline = config.offline_data_config or {}
    unbuilt = {"evaluation_interval": bool(config.evaluation_interval),
               "evaluation_num_env_runners": config.evaluation_num_env_runners > 0,
               "offline_data(input_=...)": offline.get("input_") not in ("sampler", None),
               "offline_data(output=...)": offline.get("output") is not None,
               "external_clients_config": bool(config.external_clients_config)}
    named = [name for name, used in unbuilt.items() if used]
    if named:
        raise NotImplementedError(f"{', '.join(named)} {NOT_YET}; leave it unset for multi-agent training")
    built = {"PPO", "DQN", "SAC"}  # the algorithms whose plans train several modules
    if getattr(config, "algo_name", "") not in built:
        raise NotImplementedError(f"{getattr(config, 'algo_name', type(config).__name__)} {NOT_YET}: only "
                                  f"{sorted(built)} train several modules so far")


def make_env(creator: Callable, env_config: dict) -> Any:
    """One env in the driver, to resolve the modules' spaces from its agents."""
    try:
        return creator(EnvContext(env_config, worker_index=0, vector_index=0))
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"creating the env failed: {type(err).__name__}: {err}") from err
