"""What ``Algorithm.setup`` derives from a config before it builds any stage.

The config itself (in whatever form the constructor or Tune gave it), the policy's spaces, pipelines and
driver policies (``policy_setup``), the env runners' fault tolerance and frame compression, settings that
hold functions (the Ray to start or join is ``pipeline.ray_cluster``'s): each a plain function of the
config, kept apart from ``Algorithm`` so that the class reads as the order things are built in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from actors.connectors.base import ConnectorPipeline, build_pipeline
from actors.connectors.learner import LearnerPipeline, build_learner_pipeline
from actors.connectors.module_to_env import build_module_pipelines, build_module_to_env
from actors.manager import FaultToleranceSettings
from actors.modules import ModuleSpec
from pipeline.algorithm_actions import DriverPolicy
from pipeline.algorithm_multi_agent import MultiAgentSetup, multi_agent_setup
from pipeline.config.base import AlgorithmConfig, ConfigError
from pipeline.config.connectors import learner_connector_factory, refuse_view, replay_side_intake
from pipeline.config.plain import resolve_import_path
from pipeline.config.offline import recorded_spaces
from pipeline.envs import probe_spaces
from protocols.spaces import space_to_dict
from protocols.transport import compress_by_default


def algorithm_config(algo_cls: Any, config: AlgorithmConfig | dict | None, env: Any = None) -> AlgorithmConfig:
    """What ``algo_cls`` was given (its config, a dict of settings, or None) as a config of its own
    ``config_class``: a copy, never the caller's object; ``env``, if given, set on it."""
    if config is None:
        config = algo_cls.config_class()
    elif isinstance(config, dict):  # RLlib's dict configs, and Tune's trial configs
        config = algo_cls.config_class.from_dict(config)
    elif not isinstance(config, AlgorithmConfig):
        raise ConfigError(f"{algo_cls.__name__}(config=...) takes a {algo_cls.config_class.__name__} or a dict of "
                          f"its settings, got {type(config).__name__}")
    elif not isinstance(config, algo_cls.config_class):
        raise ConfigError(f"{algo_cls.__name__} was given a {type(config).__name__}; build it from a "
                          f"{algo_cls.config_class.__name__} (or call config.build())")
    else:
        config = config.copy()
    if env is not None:
        config.environment(env)
    return config


def policy_spaces(config: AlgorithmConfig, env_creator: Callable | None, readers_in_slots: bool) -> tuple[Any, Any]:
    """(observation space, action space): as configured, else as recorded (when the runner slots only
    read recordings), else probed from the env."""
    obs_space, act_space = config.observation_space, config.action_space
    if (obs_space is None or act_space is None) and readers_in_slots:
        recorded = recorded_spaces(config)
        obs_space, act_space = obs_space or recorded[0], act_space or recorded[1]
    if obs_space is None or act_space is None:
        probed = probe_spaces(env_creator, config.env_config)
        obs_space, act_space = obs_space or probed[0], act_space or probed[1]
    return obs_space, act_space


def runner_fault_tolerance(c: AlgorithmConfig) -> FaultToleranceSettings:
    """What an env runner group does about failed runners, from ``c``'s fault-tolerance settings."""
    return FaultToleranceSettings(
        restart_failed=c.restart_failed_env_runners, ignore_failures=c.ignore_env_runner_failures,
        max_restarts=c.max_num_env_runner_restarts, restart_delay_s=c.delay_between_env_runner_restarts_s,
        probe_timeout_s=c.env_runner_health_probe_timeout_s,
        max_requests_in_flight=getattr(c, "max_requests_in_flight_per_env_runner", 2))


def frame_compression(config: AlgorithmConfig, observation_space: Any) -> bool:
    """LZ4 for chunk frames: as configured (``stream_compress`` where an algorithm has it), or
    by the observations' dtype ("auto")."""
    setting = getattr(config, "stream_compress", "auto")
    if setting != "auto":
        return bool(setting)
    return compress_by_default(space_to_dict(observation_space))


def function_setting(value: Any, name: str) -> Callable | None:
    """A setting that holds a function, or its import path (configs read back from a checkpoint)."""
    if isinstance(value, str):
        return resolve_import_path(value, name)
    return value


def connector_pipeline(config: AlgorithmConfig, observation_space: Any, action_space: Any,
                       multi_agent: bool) -> ConnectorPipeline | None:
    """The driver's copy of the env-to-module pipeline (None without ``env_to_module_connector``, and in a
    multi-agent run, whose per-module pipelines ``pipeline.algorithm_multi_agent`` builds, once the settings
    that rule connectors out are checked here); a factory that fails, or pieces that do not fit the env's
    spaces, are a ConfigError naming the cause."""
    factory = function_setting(config.env_to_module_connector, "env_to_module_connector")
    if factory is None:
        return None
    if config.external_clients_config:
        raise ConfigError("env_to_module_connector runs in env runners, and with external_clients the observations "
                          "come from clients: preprocess in the client, or leave env_to_module_connector unset")
    from_recording = (config.offline_data_config or {}).get("input_") not in (None, "sampler")
    if from_recording and multi_agent:
        raise ConfigError("env_to_module_connector with offline_data(input_=...) in a multi-agent run: not "
                          "supported yet; leave env_to_module_connector unset")
    if multi_agent:  # one pipeline per module: pipeline.algorithm_multi_agent builds them
        return None
    try:
        pipeline = build_pipeline(factory, observation_space, action_space)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"env_to_module_connector: {err}") from err
    if from_recording and pipeline is not None and pipeline.recording_pieces:
        # a view alone (frame stacking) is rebuilt from the recording's frames and look-back rows by the learner
        raise ConfigError(f"env_to_module_connector runs in env runners, and with offline_data(input_=...) the "
                          f"observations come from a recording, which holds what {pipeline.recording_pieces} "
                          f"recorded: leave them out (a view alone, such as FrameStackingEnvToModule, is rebuilt "
                          f"from the recorded frames)")
    if pipeline is not None and pipeline.views:
        refuse_view(config, pipeline.views[0])
    return pipeline


def driver_module_to_env(config: AlgorithmConfig, observation_space: Any, action_space: Any,
                         module_spaces: dict[str, tuple[Any, Any]] | None = None) -> Any:
    """The driver's copy of the ``module_to_env_connector`` pipeline (what ``compute_actions`` passes its actions
    through; each runner builds its own), or None without one; for a multi-agent run (``module_spaces``: each
    module's (observation, action) spaces) a dict of one pipeline per module. A factory runners cannot use is a
    ConfigError at ``build()``, naming the cause."""
    factory = function_setting(config.module_to_env_connector, "module_to_env_connector")
    if factory is None:
        return None
    if module_spaces is not None:
        try:
            return build_module_pipelines(factory, module_spaces)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"module_to_env_connector: {err}") from err
    if config.external_clients_config:
        raise ConfigError("module_to_env_connector runs in env runners, and with external_clients the clients step "
                          "their own envs: convert actions in the client, or leave module_to_env_connector unset")
    try:
        return build_module_to_env(factory, observation_space, action_space)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"module_to_env_connector: {err}") from err


def learner_pipeline(config: AlgorithmConfig, chunk_observation_space: Any, action_space: Any,
                     module_specs: dict[str, Any] | None = None) -> LearnerPipeline | None:
    """The driver's single-agent learner pipeline: what each learner applies to its train batches' chunks, or a
    replay algorithm's replay stage to the chunks it stores (``pipeline.config.connectors.replay_side_intake``);
    None without ``learner_connector``, and in a multi-agent run (``module_specs``), whose modules build their
    own (``pipeline.config.connectors``) -- checked here, for each module's spaces, so a factory that cannot
    work is a ConfigError at build."""
    factory = learner_connector_factory(config)
    if factory is None:
        return None
    spaces = ([(s.observation_space, s.action_space) for _, s in sorted(module_specs.items())] if module_specs
              else [(chunk_observation_space, action_space)])
    try:
        pipelines = [build_learner_pipeline(factory, obs, act) for obs, act in spaces]
    except (TypeError, ValueError) as err:
        raise ConfigError(f"learner_connector: {err}") from err
    return None if module_specs else pipelines[0]



@dataclass
class PolicySetup:
    """What the driver's side of the policy is, derived from the config before any stage is built."""

    multi_agent: MultiAgentSetup | None
    """The plan and driver policies of a multi-agent run; None for a single-agent one."""
    env_observation_space: Any
    """The env's observations (what an env-to-module pipeline starts from)."""
    connector: Any
    """The driver's copy of the env-to-module pipeline: its state is what runners sync to and checkpoints hold;
    ``compute_single_action`` applies it. None without ``env_to_module_connector``; in a multi-agent run a
    ``ModuleConnectors``, one pipeline per module."""
    chunk_observation_space: Any
    """What chunks carry (recordings, streams): the module's observations, or a view's input (frame stacks are
    rebuilt where they are used)."""
    observation_space: Any
    """What the module gets (the pipeline's output space)."""
    action_space: Any
    learner_connector: LearnerPipeline | None
    """The single-agent learner pipeline each learner gets a copy of (None without ``learner_connector``)."""
    replay_intake: Any
    """A replay algorithm's learner pipeline, run by its replay stage on the chunks it stores (then the learners,
    which train on transitions, get none)."""
    module_spec: ModuleSpec
    driver_policy: DriverPolicy
    """What ``compute_actions`` acts with (the first module's in a multi-agent run)."""


def policy_setup(config: AlgorithmConfig, env_creator: Callable | None, learner_class: Any,
                 readers_in_slots: bool) -> PolicySetup:
    """Spaces, connector pipelines and driver policies for ``config``; ConfigError for settings that do not fit."""
    multi_agent = multi_agent_setup(config, env_creator, learner_class)
    if multi_agent is None:
        obs_space, act_space = policy_spaces(config, env_creator, readers_in_slots)
    else:
        obs_space, act_space = multi_agent.first_spaces()
    env_obs_space = obs_space
    connector: Any = connector_pipeline(config, obs_space, act_space, multi_agent is not None)
    if multi_agent is not None and multi_agent.connectors is not None:
        connector = multi_agent.connectors  # the plan's specs hold the pipelines' output spaces
        env_obs_space = connector.input_space(multi_agent.module_ids[0])
    single = connector is not None and multi_agent is None
    chunk_obs_space = connector.recorded_space if single else obs_space
    if single:
        obs_space = connector.observation_space
    module_specs = None if multi_agent is None else multi_agent.plan.module_specs
    module_to_env = driver_module_to_env(config, obs_space, act_space, None if module_specs is None else {
        mid: (spec.observation_space, spec.action_space) for mid, spec in module_specs.items()})
    learners_pipeline = learner_pipeline(config, chunk_obs_space, act_space, module_specs)
    intake = None if multi_agent is not None else replay_side_intake(config, chunk_obs_space, act_space,
                                                                     learners_pipeline)
    module_spec = ModuleSpec(obs_space, act_space, config.model_config, learner_class.module_class,
                             config.module_kwargs())
    if multi_agent is None:
        driver_policy = DriverPolicy.build(module_spec, config, obs_space, act_space)
        policies = {"default_policy": driver_policy}
    else:
        driver_policy = multi_agent.driver_policies[multi_agent.module_ids[0]]
        policies = multi_agent.driver_policies
    if module_to_env is not None:  # compute_actions' actions go through the driver's copy, as a runner's do
        for mid, policy in policies.items():
            policy.module_to_env = module_to_env if multi_agent is None else module_to_env[mid]
    return PolicySetup(multi_agent, env_obs_space, connector, chunk_obs_space, obs_space, act_space,
                       learners_pipeline, intake, module_spec, driver_policy)
