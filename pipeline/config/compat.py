"""RLlib's old and renamed setting names, and what runnel does with each: one table, ``NAMES``.

Every entry is one of four kinds:

- ``accepted``: the same setting under another name, with the same meaning and the same kind of
  value (``evaluation_num_workers``, the dict key ``lambda``). The value goes to runnel's setting.
- ``renamed``: a name from RLlib's old API stack (the RolloutWorker / ModelV2 / Policy era) that runnel
  does not read. ``build()``/``validate()`` fail with "X is RLlib's old name: use Y", naming the builder
  call to write, with the value that was given. These are refused, not mapped quietly, when the
  meaning moved (``num_gpus`` gave GPUs to the driver, runnel's ``num_gpus_per_learner`` gives them to
  each learner; ``train_batch_size`` was the total over all learners, runnel's
  ``train_batch_size_per_learner`` is per learner -- the same number only with ``num_learners`` 0 or 1;
  ``model`` was the old ModelV2 dict, whose other keys and defaults do not carry over) and also where it
  did not (``num_sgd_iter``, ``num_workers``): RLlib's own new API stack has dropped these names, so a
  script that still uses them was written for the old stack, and the error is the place to say
  what to change.
- ``unsupported``: an RLlib setting runnel has no counterpart for. Refused, saying why and what to do
  instead -- unless the value is one that asks for nothing (``False``, ``None``, ``0``, an empty dict,
  or what the entry lists), which is what runnel does anyway: that is accepted and dropped.
- ``ignored``: a switch that means nothing in runnel, which has one framework (PyTorch) and one API
  stack (``framework``, ``enable_rl_module_and_learner``...). Accepted and dropped with a debug note;
  reading it back (``config["framework"]``) gives what runnel does.

Settings runnel spells as RLlib does (``rollout_fragment_length``, ``gamma``, ``lr``...) are not in the
table. ``docs/MIGRATION.md`` is generated from it (``regenerate()``) and a test keeps the two in step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

ACCEPTED_KIND, RENAMED_KIND, UNSUPPORTED_KIND, IGNORED_KIND = "accepted", "renamed", "unsupported", "ignored"
NO_VALUE = object()

MODEL_KEYS_CARRIED = ("fcnet_hiddens", "fcnet_activation", "vf_share_layers", "conv_filters", "conv_activation")
"""Keys of RLlib's old ``model`` dict that runnel's ``model_config`` reads with the same meaning
(``actors.modules.ModelConfig``; a test checks they are its fields)."""


@dataclass(frozen=True)
class Name:
    """One RLlib name and what runnel does with it."""

    rllib: str
    kind: str
    runnel: str = ""
    """accepted: runnel's setting that gets the value; renamed: runnel's setting to use instead."""
    how: str = ""
    """renamed: the builder call to write, ``{value}`` standing for the value given; unsupported: why
    and what to do instead; ignored: why it means nothing; accepted: a caveat (optional)."""
    harmless: tuple = (None, False, 0, {})
    """unsupported: values that ask for nothing runnel does not do anyway (accepted and dropped)."""
    reads_as: Any = None
    """ignored: what ``config[name]`` gives back."""
    says: str = ""
    """renamed: what the message says to use, where that is not ``runnel`` itself (a key inside a dict setting)."""


GPU_HOW = ("env runners run on CPU in runnel; give the GPU to the learner: .learners(num_gpus_per_learner=1), "
           "or to inference servers that act for every runner (runnel's own): "
           ".inference(mode='central', num_gpus_per_inference_server=1)")


def _entries() -> list[Name]:
    A, R, U, I = ACCEPTED_KIND, RENAMED_KIND, UNSUPPORTED_KIND, IGNORED_KIND
    one_stack = "runnel has one API stack (RLModule, Learner, EnvRunner), always on"
    return [
        # --- same setting, older name: accepted -----------------------------------------------
        Name("evaluation_num_workers", A, "evaluation_num_env_runners"),
        Name("custom_eval_function", A, "custom_evaluation_function"),
        Name("evaluation_num_episodes", A, "evaluation_duration",
             "counted in episodes, evaluation_duration_unit's default"),
        Name("lambda", A, "lambda_", "RLlib's dict key for the GAE lambda (PPO, MARWIL, BC)"),
        Name("callbacks", A, "callbacks_class", "RLlib's dict key for the callbacks class"),
        # --- training --------------------------------------------------------------------------
        Name("num_sgd_iter", R, "num_epochs", ".training(num_epochs={value})"),
        Name("sgd_minibatch_size", R, "minibatch_size", ".training(minibatch_size={value})"),
        Name("mini_batch_size_per_learner", R, "minibatch_size", ".training(minibatch_size={value})"),
        Name("train_batch_size", R, "train_batch_size_per_learner",
             ".training(train_batch_size_per_learner={value}) -- runnel's batch is per learner: the same number "
             "with num_learners 0 or 1, divide it by num_learners otherwise"),
        Name("lr_schedule", R, "lr", ".training(lr={value}) -- lr takes the schedule [[timestep, lr], ...] itself"),
        Name("entropy_coeff_schedule", R, "entropy_coeff",
             ".training(entropy_coeff={value}) -- entropy_coeff takes the schedule [[timestep, coeff], ...] itself"),
        Name("model", R, "model_config", ".rl_module(model_config={value})"),
        Name("vf_share_layers", R, "model_config", ".rl_module(model_config={{'vf_share_layers': {value}}})",
             says="model_config['vf_share_layers']"),
        Name("learning_starts", R, "num_steps_sampled_before_learning_starts",
             ".training(num_steps_sampled_before_learning_starts={value})"),
        Name("buffer_size", R, "replay_buffer_config", ".training(replay_buffer_config={{'capacity': {value}}})",
             says="replay_buffer_config['capacity']"),
        Name("prioritized_replay", R, "replay_buffer_config",
             ".training(replay_buffer_config={{'type': 'PrioritizedEpisodeReplayBuffer'}}) -- "
             "'EpisodeReplayBuffer' samples uniformly", says="replay_buffer_config['type']"),
        Name("prioritized_replay_alpha", R, "replay_buffer_config",
             ".training(replay_buffer_config={{'alpha': {value}}})", says="replay_buffer_config['alpha']"),
        Name("prioritized_replay_beta", R, "replay_buffer_config",
             ".training(replay_buffer_config={{'beta': {value}}})", says="replay_buffer_config['beta']"),
        Name("optimization", R, "actor_lr",
             ".training(actor_lr=..., critic_lr=..., alpha_lr=...) -- SAC's three learning rates are settings of "
             "their own", says="actor_lr, critic_lr and alpha_lr"),
        Name("Q_model", R, "model_config", ".rl_module(model_config={{'fcnet_hiddens': [...], ...}})"),
        Name("policy_model", R, "model_config", ".rl_module(model_config={{'fcnet_hiddens': [...], ...}})"),
        Name("optimizer", U, how="runnel's learners use Adam, set through lr, grad_clip and grad_clip_by"),
        # --- env runners (RLlib's old RolloutWorkers) -------------------------------------------
        Name("num_rollout_workers", R, "num_env_runners", ".env_runners(num_env_runners={value})"),
        Name("num_workers", R, "num_env_runners", ".env_runners(num_env_runners={value})"),
        Name("num_envs_per_worker", R, "num_envs_per_env_runner", ".env_runners(num_envs_per_env_runner={value})"),
        Name("num_cpus_per_worker", R, "num_cpus_per_env_runner", ".env_runners(num_cpus_per_env_runner={value})"),
        Name("num_gpus_per_worker", U, how=GPU_HOW),
        Name("num_gpus_per_env_runner", U, how=GPU_HOW),
        Name("remote_worker_envs", U, how="use .env_runners(gym_env_vectorize_mode='async') to step each "
                                          "sub-environment in a process of its own"),
        Name("remote_env_batch_wait_ms", U, how="the async vector env steps all sub-environments together; "
                                                "leave it out"),
        Name("sample_async", U, how="IMPALA and APPO sample asynchronously by design, the others synchronously"),
        Name("horizon", U, how="limit episodes on the env itself (gymnasium's max_episode_steps or TimeLimit)"),
        Name("soft_horizon", U, how="limit episodes on the env itself (gymnasium's TimeLimit)"),
        Name("no_done_at_end", U, how="episodes end when the env says terminated or truncated"),
        Name("create_env_on_driver", U, how="the driver builds one env to read the spaces; "
                                            "evaluation_num_env_runners=0 evaluates in the driver"),
        Name("compress_observations", U, how="episode chunks always travel LZ4-compressed"),
        Name("observation_filter", U, how="'MeanStdFilter' is a connector in runnel: "
                                          ".env_runners(env_to_module_connector=pipeline.connectors.mean_std_filter)",
             harmless=(None, "NoFilter")),
        Name("sample_timeout_s", R, "env_runner_health_probe_timeout_s",
             ".fault_tolerance(env_runner_health_probe_timeout_s={value}) -- a runner that does not answer "
             "within it is treated as failed"),
        # --- resources and learners -------------------------------------------------------------
        Name("num_gpus", R, "num_gpus_per_learner",
             ".learners(num_gpus_per_learner={value}) -- runnel gives GPUs to each learner, not to the driver"),
        Name("num_cpus_for_driver", R, "num_cpus_for_main_process", ".resources(num_cpus_for_main_process={value})"),
        Name("num_cpus_for_local_worker", R, "num_cpus_for_main_process",
             ".resources(num_cpus_for_main_process={value})"),
        Name("num_learner_workers", R, "num_learners", ".learners(num_learners={value})"),
        Name("num_gpus_per_learner_worker", R, "num_gpus_per_learner", ".learners(num_gpus_per_learner={value})"),
        Name("num_cpus_per_learner_worker", R, "num_cpus_per_learner", ".learners(num_cpus_per_learner={value})"),
        Name("_fake_gpus", U, how="without a GPU, leave num_gpus_per_learner at 0"),
        Name("custom_resources_per_worker", U, how="runners ask Ray for CPUs only (num_cpus_per_env_runner)"),
        Name("custom_resources_per_env_runner", U, how="runners ask Ray for CPUs only (num_cpus_per_env_runner)"),
        # --- reporting --------------------------------------------------------------------------
        Name("timesteps_per_iteration", R, "min_sample_timesteps_per_iteration",
             ".reporting(min_sample_timesteps_per_iteration={value})"),
        Name("min_sample_timesteps_per_reporting", R, "min_sample_timesteps_per_iteration",
             ".reporting(min_sample_timesteps_per_iteration={value})"),
        Name("min_train_timesteps_per_reporting", R, "min_train_timesteps_per_iteration",
             ".reporting(min_train_timesteps_per_iteration={value})"),
        Name("min_iter_time_s", R, "min_time_s_per_iteration", ".reporting(min_time_s_per_iteration={value})"),
        Name("min_time_s_per_reporting", R, "min_time_s_per_iteration", ".reporting(min_time_s_per_iteration={value})"),
        Name("metrics_smoothing_episodes", R, "metrics_num_episodes_for_smoothing",
             ".reporting(metrics_num_episodes_for_smoothing={value})"),
        # --- fault tolerance --------------------------------------------------------------------
        Name("recreate_failed_workers", R, "restart_failed_env_runners",
             ".fault_tolerance(restart_failed_env_runners={value})"),
        Name("recreate_failed_env_runners", R, "restart_failed_env_runners",
             ".fault_tolerance(restart_failed_env_runners={value})"),
        Name("ignore_worker_failures", R, "ignore_env_runner_failures",
             ".fault_tolerance(ignore_env_runner_failures={value})"),
        Name("max_num_worker_restarts", R, "max_num_env_runner_restarts",
             ".fault_tolerance(max_num_env_runner_restarts={value})"),
        Name("delay_between_worker_restarts_s", R, "delay_between_env_runner_restarts_s",
             ".fault_tolerance(delay_between_env_runner_restarts_s={value})"),
        Name("worker_health_probe_timeout_s", R, "env_runner_health_probe_timeout_s",
             ".fault_tolerance(env_runner_health_probe_timeout_s={value})"),
        Name("recreate_failed_sub_environments", R, "restart_failed_sub_environments",
             ".fault_tolerance(restart_failed_sub_environments={value})"),
        # --- evaluation and offline data --------------------------------------------------------
        Name("input", R, "offline_data_config", ".offline_data(input_={value})", says="input_"),
        Name("output", R, "offline_data_config", ".offline_data(output={value})", says="output"),
        Name("input_evaluation", R, "off_policy_estimation_methods",
             ".evaluation(off_policy_estimation_methods={{'is': {{'type': 'ImportanceSampling'}}, "
             "'wis': {{'type': 'WeightedImportanceSampling'}}}})"),
        # --- multi-agent ------------------------------------------------------------------------
        Name("policy_map_capacity", I, how="runnel keeps every module in memory: there is no policy cache"),
        Name("policy_states_are_swappable", I, how="runnel keeps every module in memory: there is no policy cache",
             reads_as=False),
        Name("observation_fn", U, how="put what each agent should see into the env's own observations "
                                      "(a wrapper of the MultiAgentEnv)"),
        Name("algorithm_config_overrides_per_module", U,
             how="give a module its own settings in its PolicySpec: .multi_agent(policies={'p0': "
                 "PolicySpec(config=PPOConfig.overrides(lr=...))})"),
        # --- one framework, one API stack: ignored ----------------------------------------------
        Name("framework", I, how="runnel runs on PyTorch only ('torch' is the one value accepted)", reads_as="torch"),
        Name("eager_tracing", I, how="a TensorFlow setting", reads_as=False),
        Name("eager_max_retraces", I, how="a TensorFlow setting"),
        Name("tf_session_args", I, how="a TensorFlow setting"),
        Name("local_tf_session_args", I, how="a TensorFlow setting"),
        Name("torch_compile_learner", U, how="runnel does not torch.compile its modules"),
        Name("torch_compile_worker", U, how="runnel does not torch.compile its modules"),
        *(Name(f"torch_compile_{who}_{what}", I, how="read only with torch_compile_learner/worker, which runnel lacks")
          for who, what in (("learner", "what_to_compile"), ("learner", "dynamo_backend"),
                            ("learner", "dynamo_mode"), ("worker", "dynamo_backend"), ("worker", "dynamo_mode"))),
        Name("torch_ddp_kwargs", U, how="runnel averages gradients across learners itself (torch.distributed all-reduce)"),
        Name("torch_skip_nan_gradients", U, how="runnel does not skip updates with NaN gradients; lower lr or "
                                                "set grad_clip"),
        Name("enable_rl_module_and_learner", I, how=one_stack, reads_as=True),
        Name("enable_env_runner_and_connector_v2", I, how=one_stack, reads_as=True),
        Name("_enable_new_api_stack", I, how=one_stack, reads_as=True),
        Name("_enable_learner_api", I, how=one_stack, reads_as=True),
        Name("_enable_rl_module_api", I, how=one_stack, reads_as=True),
        Name("enable_connectors", I, how=one_stack, reads_as=True),
        Name("validate_workers_after_construction", I, how="runnel always checks its env runners at build()",
             reads_as=True),
        Name("validate_env_runners_after_construction", I, how="runnel always checks its env runners at build()",
             reads_as=True),
    ]


NAMES: dict[str, Name] = {n.rllib: n for n in _entries()}
"""RLlib name -> what runnel does with it."""

BUILDERS: dict[str, str] = {
    "rollouts": ".env_runners(num_env_runners=..., num_envs_per_env_runner=..., rollout_fragment_length=...)",
}
"""RLlib's old builder methods -> runnel's (refused: ``config.rollouts(...)`` fails naming the new one)."""

# Views of the table by kind (what pipeline/config/base.py reads).
ACCEPTED: dict[str, str] = {k: n.runnel for k, n in NAMES.items() if n.kind == ACCEPTED_KIND}
IGNORED: dict[str, Name] = {k: n for k, n in NAMES.items() if n.kind == IGNORED_KIND}
REFUSED: dict[str, Name] = {k: n for k, n in NAMES.items() if n.kind in (RENAMED_KIND, UNSUPPORTED_KIND)}


def _show(value: Any) -> str:
    return "..." if value is NO_VALUE else repr(value)


def refusal(key: str, value: Any = NO_VALUE) -> str | None:
    """The message for an RLlib name runnel refuses (with ``value`` shown in the fix, when given), or None
    when ``key`` is not one (a runnel name, an accepted or ignored one, or a harmless unsupported value)."""
    entry = NAMES.get(key)
    if entry is None or entry.kind not in (RENAMED_KIND, UNSUPPORTED_KIND):
        return None
    if entry.kind == UNSUPPORTED_KIND:
        if value is not NO_VALUE and is_harmless(entry, value):
            return None
        return f"{key!r} is an RLlib setting runnel has no counterpart for: {entry.how}"
    special = _SPECIAL_HINTS.get(key)
    fix = special(value) if special is not None else entry.how.format(value=_show(value))
    call, _, note = fix.partition(" -- ")
    return f"{key!r} is RLlib's old name: use {entry.says or entry.runnel}: {call}" + (f" ({note})" if note else "")


def is_harmless(entry: Name, value: Any) -> bool:
    try:
        return any(value is h or (type(value) is type(h) and value == h) for h in entry.harmless)
    except Exception:  # noqa: BLE001 - a value that does not compare (an array): not harmless
        return False


def _model_hint(value: Any) -> str:
    """RLlib's old ``model`` dict: the keys runnel reads the same way go to ``model_config`` as they are;
    the others are named as having no counterpart."""
    if not isinstance(value, dict):
        return ".rl_module(model_config={'fcnet_hiddens': [64, 64], 'fcnet_activation': 'tanh', ...})"
    carried = {k: v for k, v in value.items() if k in MODEL_KEYS_CARRIED}
    dropped = sorted(k for k in value if k not in MODEL_KEYS_CARRIED)
    hint = f".rl_module(model_config={carried!r})"
    if dropped:
        hint += f"; {dropped} have no counterpart in runnel's model_config (its keys: {list(MODEL_KEYS_CARRIED)}, " \
                f"log_std_init)"
    return hint


_SPECIAL_HINTS: dict[str, Callable[[Any], str]] = {"model": _model_hint}


def ignored_note(key: str, value: Any) -> str | None:
    """For an ignored name, a problem with its value (a framework other than torch), or None."""
    if key == "framework":
        return check_framework(value)
    return None


def check_framework(value: object) -> str | None:
    if value is None or str(value).lower() == "torch":
        return None
    return (f"framework={value!r} is not supported: runnel runs on PyTorch only; the allowed value is 'torch' "
            f"(.framework('torch')), or leave it out")


def migration_table() -> str:
    """docs/MIGRATION.md: every entry of the table, grouped by kind."""
    out = ["# Coming from RLlib: old names and runnel's", "",
           "Generated from the table in `pipeline/config/compat.py` (see `regenerate` there);",
           "a test keeps the two in step. Settings RLlib and runnel spell alike (`gamma`, `lr`,",
           "`rollout_fragment_length`, `num_env_runners`...) are not listed.", "",
           "- **accepted**: the same setting under another name; the value goes to runnel's setting.",
           "- **refused**: `build()` fails with \"X is RLlib's old name: use Y\" and the call to write.",
           "- **refused unless off**: RLlib settings runnel has no counterpart for; a value that asks for",
           "  nothing (`False`, `None`, `0`, `{}`) is accepted and dropped.",
           "- **ignored**: one framework (PyTorch) and one API stack; accepted and dropped.", "",
           "| RLlib | runnel | what happens |", "| --- | --- | --- |"]
    for n in NAMES.values():
        if n.kind == ACCEPTED_KIND:
            out.append(f"| `{n.rllib}` | `{n.runnel}` | accepted{' (' + n.how + ')' if n.how else ''} |")
    for n in NAMES.values():
        if n.kind == RENAMED_KIND:
            fix = n.how.replace("{value}", "...").replace("{{", "{").replace("}}", "}")
            out.append(f"| `{n.rllib}` | {_md_fix(fix)} | refused |")
    default_harmless = Name("", UNSUPPORTED_KIND).harmless
    for n in NAMES.values():
        if n.kind == UNSUPPORTED_KIND:
            allowed = "off" if n.harmless == default_harmless else " or ".join(f"`{h!r}`" for h in n.harmless)
            out.append(f"| `{n.rllib}` | (none) {n.how} | refused unless {allowed} |")
    for n in NAMES.values():
        if n.kind == IGNORED_KIND:
            out.append(f"| `{n.rllib}` | (none) {n.how} | ignored |")
    for name, fix in BUILDERS.items():
        out.append(f"| `.{name}(...)` | `{fix}` | refused |")
    out += ["| `.framework('torch')`, `.api_stack(...)` | (none) | ignored; another framework is refused |",
            "| `config['lr']`, `config.get('lr', default)`, `'lr' in config` | the same; old names resolve through "
            "this table | accepted |",
            "| `PPO(config={...})`, `PPOConfig.from_dict({...})`, `config.update_from_dict({...})` | the same; keys "
            "go through this table | accepted |",
            "| `algo.workers`, `algo.get_policy()` | `algo.env_runner_group`, `algo.get_module()` | refused |",
            "| `env_runner_group.foreach_worker(fn)` | `foreach_env_runner(fn)`; an error `fn` raises reaches "
            "the caller, the runner is not restarted | accepted |",
            "| result key `episode_reward_mean` | `env_runners/episode_return_mean` | a stop criterion `runnel "
            "train` is given under the old name is mapped, with a warning |", ""]
    return "\n".join(out)


def _md_fix(fix: str) -> str:
    """A renamed entry's fix as table text: the call in code type, the comment after it plain."""
    call, _, note = fix.partition(" -- ")
    return f"`{call}`" + (f" — {note}" if note else "")



def regenerate(path: str = "docs/MIGRATION.md") -> None:
    """Rewrite the migration doc from the table:
    ``python -c "from pipeline.config.compat import regenerate; regenerate()"`` in the repository root."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(migration_table())
