"""The order ``Algorithm.setup`` builds its stages in: env runners, learners, evaluators, the plan.

Kept apart from ``Algorithm`` because the order is where the start-up time goes: remote runners (and
evaluators) are asked for first and the driver's learner is built while their processes start, but only
where nothing the learner's seeded initialization draws from is touched by building them.
"""
from __future__ import annotations

from typing import Any

from pipeline.config.inference import inference_settings
from pipeline.groups.env_runner_group import EnvRunnerGroup
from pipeline.groups.learner_group import LearnerGroup


def build_stages(algo: Any, readers_in_slots: bool) -> None:
    """Set ``algo.env_runner_group``, ``algo.learner_group``, the evaluators (with ``evaluation_interval``)
    and ``algo.plan``; the caller cleans up what was built if this raises."""
    config = algo.config
    algo.check_spaces()
    # Remote runners start in processes of their own: ask for them first and build the driver's learner while
    # they start (both take seconds), then wait for them. An in-process runner keeps coming after the learner:
    # building it draws from this process's generators, which the learner's seeded initialization must not see
    # moved. Remote learners and inference servers keep the old order.
    early = (config.num_env_runners > 0 and config.num_learners == 0 and algo.multi_agent is None
             and inference_settings(config) is None)
    evaluate = bool(config.evaluation_interval) and algo.env_creator is not None
    if early:
        algo.env_runner_group = env_runner_group(algo, readers_in_slots, check_started=False)
        if evaluate and config.evaluation_num_env_runners > 0:  # their processes start beside the runners'
            algo.evaluation.build_evaluators(check_started=False)
    algo.learner_group = learner_group(algo)
    if early:
        algo.env_runner_group.check_started()
    else:
        algo.env_runner_group = env_runner_group(algo, readers_in_slots)
    if evaluate and algo.evaluators is None:
        algo.build_evaluators()  # waits for its actors
    elif evaluate:  # asked for beside the runners: wait for them now
        algo.evaluators.check_started()
    algo.plan = algo.build_plan()


def learner_group(algo: Any) -> LearnerGroup:
    """The learners: one module's (with the env-to-module view and learner connectors it trains through), or
    a multi-agent run's (``MultiAgentSetup.learner_group``)."""
    if algo.multi_agent is not None:
        return algo.multi_agent.learner_group(algo.learner_class, algo.config)
    view = algo.observation_view()
    kwargs = {"observation_view": view} if view else {}
    if algo.learner_connector is not None and algo.replay_intake is None:
        kwargs["learner_connector"] = algo.learner_connector
    return LearnerGroup(algo.learner_class, algo.config, algo.observation_space, algo.action_space,
                        learner_kwargs=kwargs or None)


def env_runner_group(algo: Any, readers_in_slots: bool, check_started: bool = True) -> EnvRunnerGroup:
    """The training env runners (offline readers in their slots, external-client servers or central
    inference where configured), which call the ``on_env_runners_recreated`` hook after a restart."""
    config = algo.config
    multi_agent_runners = algo.multi_agent.runner_group_args() if algo.multi_agent is not None else {}

    def recreated(ids: list[int]) -> None:
        algo.run_hook("on_env_runners_recreated", algorithm=algo, env_runner_group=algo.env_runner_group,
                       env_runner_indices=ids, is_evaluation=False)

    return EnvRunnerGroup(
        algo.env_runner_settings(), config.num_env_runners, config.num_cpus_per_env_runner,
        algo.fault_tolerance_settings(), compress_frames=algo.compress_frames(), external=algo.external,
        offline=algo.offline_input if readers_in_slots else None, inference=inference_settings(config),
        on_recreated=recreated, check_started=check_started, **multi_agent_runners)
