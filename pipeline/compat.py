"""RLlib's old and renamed setting names, and what runnel makes of each.

``ACCEPTED``: the same setting under an older name; the value goes to runnel's name.
``REFUSED``: RLlib names runnel does not take as they are (renamed with another meaning or shape,
or without a counterpart); the error names the runnel way. ``docs/MIGRATION.md`` is generated from
these two tables (``python -m pipeline.compat > docs/MIGRATION.md``; a test keeps them in step).
"""
from __future__ import annotations

ACCEPTED: dict[str, str] = {
    "evaluation_num_workers": "evaluation_num_env_runners",
    "custom_eval_function": "custom_evaluation_function",
    "evaluation_num_episodes": "evaluation_duration",
}

REFUSED: dict[str, str] = {
    # training
    "num_sgd_iter": "use num_epochs (.training(num_epochs=...))",
    "sgd_minibatch_size": "use minibatch_size (.training(minibatch_size=...))",
    "train_batch_size": "use train_batch_size_per_learner (.training(train_batch_size_per_learner=...); "
                        "with num_learners=0 it is the whole batch)",
    "lr_schedule": "give lr as a schedule: .training(lr=[[0, 3e-4], [1_000_000, 1e-5]])",
    "entropy_coeff_schedule": "give entropy_coeff as a schedule: .training(entropy_coeff=[[0, 0.01], [1e6, 0.0]])",
    "model": "use model_config: .rl_module(model_config={'fcnet_hiddens': [64, 64], ...})",
    "vf_share_layers": "use .rl_module(model_config={'vf_share_layers': True})",
    # env runners (RLlib's RolloutWorkers)
    "num_rollout_workers": "use num_env_runners (.env_runners(num_env_runners=...))",
    "num_workers": "use num_env_runners (.env_runners(num_env_runners=...))",
    "num_envs_per_worker": "use num_envs_per_env_runner (.env_runners(num_envs_per_env_runner=...))",
    "num_cpus_per_worker": "use num_cpus_per_env_runner (.env_runners(num_cpus_per_env_runner=...))",
    "num_gpus_per_worker": "env runners run on CPU in runnel; a GPU goes to the learner: "
                           ".learners(num_gpus_per_learner=1)",
    "remote_worker_envs": "use gym_env_vectorize_mode='async' (one process per sub-env): "
                          ".env_runners(gym_env_vectorize_mode='async')",
    "remote_env_batch_wait_ms": "has no counterpart: the async vector env steps all sub-envs together",
    "sample_async": "has no counterpart: IMPALA and APPO sample asynchronously by design",
    "horizon": "set the episode limit on the env (gymnasium's max_episode_steps / TimeLimit)",
    "create_env_on_driver": "has no counterpart: the driver builds one env to read the spaces; "
                            "evaluation_num_env_runners=0 evaluates in the driver",
    # resources and learners
    "num_gpus": "use num_gpus_per_learner (.learners(num_gpus_per_learner=...))",
    "num_learner_workers": "use num_learners (.learners(num_learners=...))",
    "num_gpus_per_learner_worker": "use num_gpus_per_learner (.learners(num_gpus_per_learner=...))",
    "num_cpus_per_learner_worker": "use num_cpus_per_learner (.learners(num_cpus_per_learner=...))",
    # fault tolerance
    "recreate_failed_workers": "use restart_failed_env_runners (.fault_tolerance(restart_failed_env_runners=True))",
    "recreate_failed_env_runners": "use restart_failed_env_runners (.fault_tolerance(restart_failed_env_runners=True))",
    "ignore_worker_failures": "use ignore_env_runner_failures (.fault_tolerance(ignore_env_runner_failures=...))",
    "max_num_worker_restarts": "use max_num_env_runner_restarts (.fault_tolerance(max_num_env_runner_restarts=...))",
    "delay_between_worker_restarts_s": "use delay_between_env_runner_restarts_s",
    "worker_health_probe_timeout_s": "use env_runner_health_probe_timeout_s",
    "recreate_failed_sub_environments": "use restart_failed_sub_environments",
    # callbacks
    "callbacks": "use .callbacks(YourCallbacks) (the callbacks_class setting) or .callbacks(on_episode_end=fn)",
}

IGNORED: tuple[str, ...] = ("framework", "enable_rl_module_and_learner", "enable_env_runner_and_connector_v2",
                            "_enable_new_api_stack", "eager_tracing")
"""Settings of RLlib's that mean nothing here (runnel has one framework, torch, and one API stack):
accepted and dropped (``framework`` only as "torch")."""

BUILDERS_REFUSED: dict[str, str] = {
    "rollouts": "use .env_runners(num_env_runners=..., num_envs_per_env_runner=..., rollout_fragment_length=...)",
    "exploration_config": "use .exploration(exploration_config={...})",
}


def refusal(key: str) -> str | None:
    """The message for an RLlib name runnel does not take, or None."""
    how = REFUSED.get(key)
    return f"{key!r} is RLlib's old name: {how}" if how else None


def check_framework(value: object) -> str | None:
    if value is None or str(value).lower() == "torch":
        return None
    return (f"framework={value!r} is not supported: runnel runs on PyTorch only; use .framework('torch') "
            f"or leave it out")


def migration_table() -> str:
    lines = ["# Coming from RLlib: old names and runnel's", "",
             "Generated from `pipeline/compat.py` (`python -m pipeline.compat > docs/MIGRATION.md`).", "",
             "| RLlib | runnel | |", "| --- | --- | --- |"]
    lines += [f"| `{old}` | `{new}` | accepted (same setting) |" for old, new in ACCEPTED.items()]
    lines += [f"| `{old}` | {how} | refused with this hint |" for old, how in REFUSED.items()]
    lines += [f"| `.{name}()` | {how} | refused with this hint |" for name, how in BUILDERS_REFUSED.items()]
    lines += [f"| `{key}` | (nothing: torch and one API stack) | accepted, ignored |" for key in IGNORED]
    lines += ["| `.framework('torch')`, `.api_stack(...)` | (nothing) | accepted, ignored; other frameworks refused |",
              "| `PPO(config={...})`, `PPO(config=cfg, env=...)`, `config['lr']` | the same | accepted |",
              "| `algo.save().checkpoint.path` | `algo.save()` (a path) | accepted |",
              "| `DefaultModelConfig(...)`, `get_default_learner_class()`, `get_multi_rl_module_spec(env=...)`, "
              "`Learner(config=..., module_spec=...)`, `build()`, `update_from_episodes(...)` | the same | accepted |",
              "| `SingleAgentEnvRunner(config=...)`, `episode.get_return()` | the same | accepted |",
              "| `algo.get_policy()`, `algo.workers` | `algo.get_module()`, `algo.get_weights()`, "
              "`algo.env_runner_group` | refused with this hint |",
              "| stop key `episode_reward_mean` (and the other old result names) | "
              "`env_runners/episode_return_mean` | mapped at start, with a warning |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(migration_table(), end="")
