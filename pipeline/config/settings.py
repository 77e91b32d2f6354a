"""The settings every algorithm shares, grouped by the builder that sets them, each with its docstring.

``AlgorithmConfig`` (``pipeline/config/base.py``) adds RLlib's builder methods, validation and ``build()``
to these fields; algorithm configs (``PPOConfig``...) add their own, which belong to the ``training`` group.
Which builder sets which field is ``pipeline.config.keys.GROUPS``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CommonSettings:
    # environment
    env: Any = None
    """Gymnasium id, a name given to ``pipeline.register_env``, an env class, or ``"pkg.module:Class"``."""
    env_config: dict = field(default_factory=dict)
    """Passed to the env creator (as an ``EnvContext`` that also carries runner and vector indices)."""
    observation_space: Any = None
    """Observation space, if the env's own should not be used."""
    action_space: Any = None
    """Action space, if the env's own should not be used."""
    clip_rewards: bool | float | None = None
    """True: sign of the reward; a float c: clip to [-c, c]; None: leave rewards alone."""
    normalize_actions: bool = True
    """Box actions: the policy acts in [-1, 1] and runners rescale to the space's bounds."""
    clip_actions: bool = False
    """Box actions without normalize_actions: clip into the space's bounds."""
    env_task_fn: Any = None
    """Curriculum: ``fn(train_results, task_settable_env, env_context) -> task``, run on every sub-env of
    every training runner after each ``train()``; the env must have ``set_task``/``get_task``."""

    # env_runners
    num_env_runners: int = 2
    """Remote env runner actors; 0 samples in the driver process."""
    num_envs_per_env_runner: int = 8
    """Sub-environments each runner steps as one vector."""
    rollout_fragment_length: int | str = "auto"
    """Steps per sub-env per sample request; "auto" divides the train batch among all sub-envs."""
    batch_mode: str = "truncate_episodes"
    """truncate_episodes: fixed-length fragments; complete_episodes: only whole episodes."""
    num_cpus_per_env_runner: float = 1
    """CPUs Ray reserves for each env runner actor."""
    explore: bool = True
    """Explore while sampling, and the default of ``compute_actions(explore=None)`` (False: greedy)."""
    gym_env_vectorize_mode: str = "auto"
    """auto: the env's own vector implementation when its gymnasium id declares one (CartPole's steps every
    copy in a few numpy calls), else sync; sync: separate sub-envs stepped in the runner's process (each one
    reachable, running episodes carried across checkpoints); async: one process per sub-env;
    vector_entry_point: the env's own vector implementation, or an error when it has none; envpool: EnvPool's
    vector env for the id (the optional extra ``runnel-rl[envpool]``; C++ envs stepped by as many threads of its own
    as the runner has CPUs; ALE ids with runnel's Atari settings and frames; never picked by auto)."""
    env_to_module_connector: Any = None
    """``fn(env) -> piece or [pieces]`` (``pipeline.connectors``: ``MeanStdFilter``, ``FlattenObservations``,
    your ``ConnectorV2`` subclasses): what each runner does to observations before its module sees them;
    ``env`` carries the env's spaces. Single-agent runs with env runners."""
    module_to_env_connector: Any = None
    """``fn(env) -> piece or [pieces]`` (``pipeline.connectors.ModuleToEnvConnector`` subclasses): what each
    runner does to its module's actions before the env gets them (``actions_for_env``), or to what it
    records. Single-agent runs with env runners."""

    # learners
    num_learners: int = 0
    """0: one learner in the driver process; n >= 1: n Ray learner actors (data-parallel when n > 1)."""
    num_gpus_per_learner: float = 0
    """GPUs per learner; > 0 puts the learner's module on CUDA."""
    num_cpus_per_learner: float = 1
    """CPUs Ray reserves for each learner actor."""
    learner_placement_timeout_s: float = 300.0
    """Fail (naming the resources) when learner actors cannot be placed on the cluster within this."""
    learner_precision: str = "float32"
    """runnel's own: "bfloat16" runs the learners' forward passes (module and target networks) under bfloat16
    autocast, outputs cast back to float32 for the losses; weights, gradients and optimizer state stay float32
    (``actors.modules.rl_module``). Pays on GPUs and on CPUs with bfloat16 units (AMX, AVX512-BF16); costs
    more on CPUs without them."""

    # training
    gamma: float = 0.99
    """Discount factor."""
    lr: float | list = 3e-4
    """Learning rate, or a piecewise-linear schedule ``[[timestep, lr], ...]`` over sampled env steps."""
    grad_clip: float | None = None
    """Clip threshold for gradients (None: no clipping)."""
    grad_clip_by: str = "global_norm"
    """value: each element; norm: each tensor's norm; global_norm: the norm of all gradients."""
    adam_epsilon: float | None = None
    """Adam's epsilon in every optimizer of the learners: the floor under each parameter's gradient scale (RLlib
    has this name for DQN only, default 1e-8; here every algorithm reads it). None: the learner's own default,
    ``Learner.adam_eps``: 1e-2 for IMPALA (a smaller one let runs that had solved CartPole fall back to random
    play, see the README's "Asynchronous training"), 1e-8 for SAC and CQL, 1e-5 for the others."""
    train_batch_size_per_learner: int = 4000
    """Env steps each learner trains on per update."""
    minibatch_size: int = 128
    """Steps per SGD minibatch."""
    num_epochs: int = 1
    """Passes over each train batch."""
    learner_connector: Any = None
    """``fn(observation_space, action_space) -> piece or [pieces]`` (``pipeline.connectors.LearnerConnector``
    subclasses, e.g. ``ClipRewards``): what each learner does to the chunks of a train batch before its loss.
    Algorithms that train on chunks (PPO, IMPALA, APPO, BC, MARWIL), single-agent."""

    # rl_module
    model_config: dict = field(default_factory=dict)
    """Default module settings (see ``actors.modules.ModelConfig``: fcnet_hiddens, fcnet_activation, ...)."""
    rl_module_spec: Any = None
    """``RLModuleSpec(...)`` or ``MultiRLModuleSpec(rl_module_specs={module_id: RLModuleSpec(...)})``: per-module
    class, spaces and model config (None: the algorithm's module on the env's spaces)."""

    # multi_agent
    policies: Any = None
    """The module ids (a set or list), or ``{module_id: PolicySpec(...) or None}``; None: one module,
    ``default_policy``."""
    policy_mapping_fn: Any = None
    """``fn(agent_id, episode, **kwargs) -> module_id`` (or its import path); None: every agent to ``default_policy``."""
    policies_to_train: Any = None
    """The module ids learners update, or ``fn(module_id, batch) -> bool``; None: every module."""
    count_steps_by: str = "env_steps"
    """env_steps: a multi-agent env step counts once; agent_steps: each agent's step counts once."""

    # resources
    num_cpus_for_main_process: float = 1
    """CPUs the driver (local learner, local runner) is counted for; also its torch threads while the algorithm
    runs (at least 1; restored by ``stop()``). Raise it for a large model learning in the driver."""
    ray_address: str | None = None
    """Which Ray (runnel's own setting): None joins the cluster RAY_ADDRESS names when set, else starts runnel's own
    local Ray, never a cluster merely found running; "local" always its own; "auto" the running cluster; "host:port"
    or "ray://host:port" that cluster. Joins are logged and resource-checked (rule: ``pipeline.config.cluster``)."""

    # reporting
    metrics_num_episodes_for_smoothing: int = 100
    """Episode metrics are averaged over at least this many of the latest episodes."""
    min_time_s_per_iteration: float | None = None
    """Repeat training steps within one ``train()`` until this much time has passed."""
    min_sample_timesteps_per_iteration: int = 0
    """Repeat training steps within one ``train()`` until this many env steps were sampled."""
    min_train_timesteps_per_iteration: int = 0
    """Repeat training steps within one ``train()`` until this many env steps were trained on."""
    env_runner_metrics_interval_s: float = 0.5
    """How often the driver fetches episode metrics (and liveness) from streaming runners and stages."""

    # checkpointing
    export_native_model_files: bool = False
    """Also write ``model_native.pt``: the whole torch module, for use outside runnel (never loaded by runnel)."""

    # debugging
    seed: int | None = None
    """Seeds torch, numpy and every sub-environment (runner and vector index are mixed in)."""
    log_level: str = "WARN"
    """Logging level of runnel's loggers, in the driver and in every runner and evaluator."""
    log_sys_usage: bool = False
    """Report CPU utilisation and resident memory of the driver and of each runner under ``perf/``."""

    # fault_tolerance
    restart_failed_env_runners: bool = True
    """Recreate a dead env runner at the same index and restore its weights."""
    ignore_env_runner_failures: bool = False
    """Without restarts, go on with the healthy runners instead of raising."""
    max_num_env_runner_restarts: int = 1000
    """Restarts allowed per runner index before it is given up."""
    delay_between_env_runner_restarts_s: float = 1.0
    """Pause before recreating a failed runner (lets a crashing env's resources go)."""
    env_runner_health_probe_timeout_s: float = 30.0
    """A runner that does not answer a probe (or a request) within this is treated as failed."""
    restart_failed_sub_environments: bool = False
    """Recreate a sub-environment that raises inside its runner; its episode ends as truncated."""
    max_num_learner_restarts: int = 10
    """Remote learner actors (``num_learners >= 1``) the job may recreate in all when they die, each rebuilt
    from a surviving learner's state or the latest snapshot; the next death ends the run (0: the first)."""
    learner_snapshot_interval_s: float | None = 60.0
    """Seconds between in-memory copies of the learners' state (one ``get_state`` round trip, kept in the
    driver), which a learner group that lost every learner restarts from; None: only checkpoints' states."""
    max_num_replay_restarts: int = 10
    """Times the job may recreate a remote replay actor (``replay_buffer_config={"remote": True}``) that died;
    the next death ends the run (0: the first)."""

    # callbacks
    callbacks_class: Any = None
    """A ``Callbacks`` subclass, its import path, or a list of them (run in order)."""
    callbacks_functions: dict = field(default_factory=dict)
    """Per-hook functions, ``{"on_episode_end": fn or [fn, ...]}`` (``config.callbacks(on_episode_end=fn)``)."""

    # exploration
    exploration_config: dict = field(default_factory=dict)
    """``{"type": "EpsilonGreedy", ...kwargs}`` replaces the algorithm's exploration; without ``type`` the
    kwargs update the algorithm's default one. Types: StochasticSampling, EpsilonGreedy, SoftQ, GaussianNoise,
    OrnsteinUhlenbeckNoise, an ``Exploration`` subclass or its import path."""

    # evaluation
    evaluation_interval: int | None = None
    """Evaluate after every n-th ``train()``; None or 0: only when ``evaluate()`` is called."""
    evaluation_duration: int | str = 10
    """Episodes or timesteps (``evaluation_duration_unit``) per evaluation, split among the evaluators;
    "auto" (with ``evaluation_parallel_to_training``): as many timesteps as fit in the training step."""
    evaluation_duration_unit: str = "episodes"
    """"episodes" or "timesteps" (ignored with duration "auto", which counts timesteps)."""
    evaluation_num_env_runners: int = 0
    """Evaluator actors (a group of their own); 0 evaluates in the driver process."""
    evaluation_parallel_to_training: bool = False
    """Evaluate while the training step runs, with the weights from before it (results one iteration behind)."""
    evaluation_config: Any = None
    """Settings that differ for evaluators: a dict (``AlgorithmConfig.overrides(explore=False)``) or a config."""
    evaluation_sample_timeout_s: float = 120.0
    """An evaluator that has not answered within this is given up for this evaluation (and recreated
    under the fault-tolerance settings); the others finish its share. (An in-process evaluator,
    ``evaluation_num_env_runners=0``, cannot be interrupted.)"""
    evaluation_force_reset_envs_before_iteration: bool = True
    """Start fresh episodes at each evaluation, so no episode mixes older weights into the results."""
    custom_evaluation_function: Any = None
    """``fn(algorithm, eval_env_runner_group) -> metrics dict`` replacing the built-in evaluation (weights are
    synced first)."""
    always_attach_evaluation_results: bool = True
    """Every ``train()`` result carries the latest evaluation results, also in iterations without one."""
    off_policy_estimation_methods: dict = field(default_factory=dict)
    """Estimate the policy's return from the offline input's recorded episodes at each evaluation:
    ``{"wis": {"type": "WeightedImportanceSampling"}, "is": {"type": "ImportanceSampling"}}``
    (see ``pipeline.offline.ope``); results under ``evaluation/off_policy_estimator/<name>/``. Needs
    ``offline_data(input_=...)``; with no env, evaluation is these estimates alone."""
    off_policy_estimation_episodes: int = 100
    """Recorded whole episodes each off-policy estimate reads."""

    # external clients
    external_clients_config: dict | None = None
    """Serve remote env clients instead of stepping envs: ``ExternalSettings`` keys (``address``,
    ``inference_mode``, ``server_secret_key``...), set with ``.external_clients(...)``; None: off."""

    # offline data
    offline_data_config: dict | None = None
    """Record to / train from shard files: ``RecordingSettings`` keys (``output``, ``output_max_file_size``...)
    and ``ReaderSettings`` keys (``input_``, ``shuffle_buffer_size``...), set with ``.offline_data(...)``; None: off."""

    # inference (runnel's own)
    inference_config: dict | None = None
    """Local or central (SEED-style) inference: ``InferenceSettings`` keys (``mode``, ``num_inference_servers``,
    ``max_batch``...), set with ``.inference(...)``; None: each env runner acts with its own module."""
