"""The RLlib compatibility surface: the table of RLlib's old names (pipeline/config/compat.py) -- accepted where
they are the same setting, refused naming runnel's otherwise --, ``.framework``/``.api_stack`` no-ops,
dict-style reads, and ``foreach_env_runner`` handing an error of the user's function to the caller."""
import dataclasses
import logging
import os
import pathlib

import pytest

from actors.modules import ModelConfig
from pipeline import PPOConfig
from pipeline.algorithms.dqn.config import DQNConfig
from pipeline.config.compat import (ACCEPTED_KIND, IGNORED_KIND, MODEL_KEYS_CARRIED, NAMES, RENAMED_KIND,
                             UNSUPPORTED_KIND, is_harmless, migration_table)
from pipeline.config.base import ALGORITHM_OF, AlgorithmConfig, ConfigError
from pipeline.registry import register_builtins
from tests.pieces import boom

ROOT = pathlib.Path(__file__).resolve().parents[1]


def all_settings() -> set[str]:
    """Every setting of every algorithm config."""
    register_builtins()
    classes = {AlgorithmConfig, *ALGORITHM_OF}
    return {f.name for cls in classes for f in dataclasses.fields(cls) if f.name != "_unknown"}


def problems(config: AlgorithmConfig) -> str:
    with pytest.raises(ConfigError) as err:
        config.validate()
    return str(err.value)


# --- the table ------------------------------------------------------------------------------------------

def test_migration_doc_is_generated_from_the_table():
    doc = (ROOT / "docs" / "MIGRATION.md").read_text(encoding="utf-8")
    assert doc == migration_table(), \
        'docs/MIGRATION.md is stale: python -c "from pipeline.config.compat import regenerate; regenerate()"'
    for name, entry in NAMES.items():
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"{name} is missing from docs/MIGRATION.md"
        assert {"accepted": "accepted", "renamed": "| refused |", "unsupported": "refused unless",
                "ignored": "| ignored |"}[entry.kind] in row


def test_table_entries_point_at_real_settings():
    settings = all_settings()
    kinds = {ACCEPTED_KIND, RENAMED_KIND, UNSUPPORTED_KIND, IGNORED_KIND}
    for name, entry in NAMES.items():
        assert entry.kind in kinds, name
        assert name not in settings, f"{name} is runnel's own setting; the table would never be read for it"
        if entry.kind in (ACCEPTED_KIND, RENAMED_KIND):
            assert entry.runnel in settings, f"{name} -> {entry.runnel}, which no config has"
        if entry.kind == RENAMED_KIND:  # the fix is a call of one of runnel's builders
            builder = entry.how.split("(")[0].lstrip(".")
            assert callable(getattr(AlgorithmConfig, builder, None)), f"{name}: {entry.how}"
        if entry.kind in (UNSUPPORTED_KIND, IGNORED_KIND):
            assert entry.how and not entry.runnel, name
    assert set(MODEL_KEYS_CARRIED) <= {f.name for f in dataclasses.fields(ModelConfig)}
    # the examples the issue names
    assert NAMES["num_sgd_iter"].runnel == "num_epochs" and NAMES["sgd_minibatch_size"].runnel == "minibatch_size"
    assert NAMES["num_workers"].runnel == NAMES["num_rollout_workers"].runnel == "num_env_runners"
    assert NAMES["num_gpus"].runnel == "num_gpus_per_learner" and NAMES["model"].runnel == "model_config"
    assert NAMES["evaluation_num_workers"].kind == ACCEPTED_KIND


@pytest.mark.parametrize("old", sorted(k for k, n in NAMES.items() if n.kind == RENAMED_KIND))
def test_every_renamed_name_is_refused_naming_the_runnel_setting(old):
    runnel = NAMES[old].says or NAMES[old].runnel
    message = f"'{old}' is RLlib's old name: use {runnel}"
    assert message in problems(PPOConfig().environment("CartPole-v1").training(**{old: 7}))
    assert message in problems(PPOConfig.from_dict({"env": "CartPole-v1", old: 7}))  # dict configs too
    config = PPOConfig().environment("CartPole-v1")
    assert message in problems(config.update_from_dict({old: 7}))
    with pytest.raises(KeyError) as err:
        config[old]
    assert message in str(err.value)
    assert old not in config


def test_refusals_show_the_call_to_write_with_the_value_given():
    text = problems(PPOConfig().environment("CartPole-v1").training(num_sgd_iter=30, sgd_minibatch_size=256))
    assert "'num_sgd_iter' is RLlib's old name: use num_epochs: .training(num_epochs=30)" in text
    assert "'sgd_minibatch_size' is RLlib's old name: use minibatch_size: .training(minibatch_size=256)" in text
    text = problems(PPOConfig().environment("CartPole-v1").env_runners(num_rollout_workers=3)
                    .resources(num_gpus=1).training(lr_schedule=[[0, 1e-3], [10_000, 1e-4]]))
    assert ".env_runners(num_env_runners=3)" in text
    assert ".learners(num_gpus_per_learner=1)" in text and "not to the driver" in text
    assert ".training(lr=[[0, 0.001], [10000, 0.0001]])" in text
    # RLlib's old model dict: the keys runnel reads the same way carry over, the others are named
    text = problems(PPOConfig().environment("CartPole-v1").training(
        model={"fcnet_hiddens": [32, 32], "fcnet_activation": "relu", "use_lstm": True}))
    assert ".rl_module(model_config={'fcnet_hiddens': [32, 32], 'fcnet_activation': 'relu'})" in text
    assert "['use_lstm'] have no counterpart" in text
    # and the suggested fix is accepted as written
    PPOConfig().environment("CartPole-v1").training(num_epochs=30, lr=[[0, 1e-3], [10_000, 1e-4]]).env_runners(
        num_env_runners=3).rl_module(model_config={"fcnet_hiddens": [32, 32], "fcnet_activation": "relu"}).validate()


def test_train_batch_size_is_refused_saying_it_is_per_learner():
    text = problems(PPOConfig().environment("CartPole-v1").training(train_batch_size=4000))
    assert ".training(train_batch_size_per_learner=4000)" in text and "divide it by num_learners" in text


@pytest.mark.parametrize("old", sorted(k for k, n in NAMES.items() if n.kind == UNSUPPORTED_KIND))
def test_unsupported_settings_are_refused_unless_off(old):
    entry = NAMES[old]
    text = problems(PPOConfig.from_dict({"env": "CartPole-v1", old: "on please"}))
    assert f"'{old}' is an RLlib setting runnel has no counterpart for: {entry.how}" in text
    for harmless in entry.harmless:  # asking for nothing runnel does not do anyway: accepted, dropped
        assert is_harmless(entry, harmless)
        config = PPOConfig.from_dict({"env": "CartPole-v1", old: harmless})
        config.validate()
        assert old not in config.to_dict()


def test_unsupported_setting_hints():
    text = problems(PPOConfig().environment("CartPole-v1").env_runners(remote_worker_envs=True, sample_async=True))
    assert "'remote_worker_envs' is an RLlib setting" in text and "gym_env_vectorize_mode='async'" in text
    assert "'sample_async' is an RLlib setting" in text
    PPOConfig().environment("CartPole-v1").env_runners(observation_filter="NoFilter", remote_worker_envs=False).validate()
    assert "'observation_filter'" in problems(
        PPOConfig().environment("CartPole-v1").env_runners(observation_filter="MeanStdFilter"))


def test_accepted_names_set_runnel_settings():
    config = PPOConfig().environment("CartPole-v1").evaluation(evaluation_num_workers=2, custom_eval_function=len,
                                                               evaluation_num_episodes=4)
    assert (config.evaluation_num_env_runners, config.custom_evaluation_function, config.evaluation_duration) \
        == (2, len, 4)
    config = PPOConfig.from_dict({"env": "CartPole-v1", "evaluation_num_workers": 3, "lambda": 0.9,
                                  "callbacks": "pipeline:DefaultCallbacks"})
    assert (config.evaluation_num_env_runners, config.lambda_, config.callbacks_class) == \
        (3, 0.9, "pipeline:DefaultCallbacks")
    assert config["lambda"] == 0.9 and config["evaluation_num_workers"] == 3 and "lambda" in config
    config.update_from_dict({"evaluation_num_workers": 1, "lambda": 0.8, "framework": "torch"})
    assert (config.evaluation_num_env_runners, config.lambda_) == (1, 0.8)
    config.validate()
    # in evaluation_config too
    config = PPOConfig().environment("CartPole-v1").evaluation(
        evaluation_config={"lambda": 0.5, "framework": "torch", "explore": False})
    config.validate()
    assert config.evaluation_settings().lambda_ == 0.5 and config.evaluation_settings().explore is False
    assert "'num_workers' is RLlib's old name" in problems(
        PPOConfig().environment("CartPole-v1").evaluation(evaluation_config={"num_workers": 1}))


def test_an_accepted_name_the_algorithm_lacks_says_so():
    text = problems(DQNConfig.from_dict({"env": "CartPole-v1", "lambda": 0.9}))
    assert "unknown config setting 'lambda' (RLlib's name of 'lambda_'): DQNConfig has no setting 'lambda_'" in text


def test_a_setting_given_to_the_wrong_builder_names_its_builder():
    text = problems(PPOConfig().environment("CartPole-v1").training(evaluation_interval=2, evaluation_num_workers=1))
    assert "unknown training setting 'evaluation_interval': it is set with .evaluation(evaluation_interval=...)" in text
    assert "unknown training setting 'evaluation_num_workers' (RLlib's name of 'evaluation_num_env_runners'): " \
           "it is set with .evaluation(evaluation_num_env_runners=...)" in text
    # a name in no table and no group still gets the closest valid ones
    assert "unknown training setting 'lrr'; did you mean 'lr'?" in problems(
        PPOConfig().environment("CartPole-v1").training(lrr=0.1))


def test_model_config_keys_are_checked_at_validate():
    text = problems(PPOConfig().environment("CartPole-v1").rl_module(model_config={"use_attention": True}))
    assert "model_config: unknown model_config key(s) ['use_attention']" in text


# --- framework and api_stack ------------------------------------------------------------------------------

def test_framework_and_api_stack_are_no_ops_with_a_debug_note(caplog):
    with caplog.at_level(logging.DEBUG, logger="runnel"):
        config = PPOConfig().environment("CartPole-v1").framework("torch", eager_tracing=True).api_stack(
            enable_rl_module_and_learner=True, enable_env_runner_and_connector_v2=True)
    config.validate()
    assert config == PPOConfig().environment("CartPole-v1")
    notes = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("framework='torch'" in n and "ignored" in n for n in notes)
    assert any("api_stack(" in n and "ignored" in n for n in notes)
    assert PPOConfig().framework().framework(framework="TORCH")["framework"] == "torch"
    PPOConfig.from_dict({"env": "CartPole-v1", "framework": "torch", "_enable_new_api_stack": True}).validate()
    PPOConfig().environment("CartPole-v1").framework("torch", torch_compile_learner=False).validate()


@pytest.mark.parametrize("bad", ["tf", "tf2", "jax"])
def test_another_framework_is_refused_naming_torch(bad):
    with pytest.raises(ConfigError, match=rf"framework='{bad}' is not supported: .*the allowed value is 'torch'"):
        PPOConfig().framework(bad)
    with pytest.raises(ConfigError, match="runnel runs on PyTorch only"):
        PPOConfig.from_dict({"framework": bad})


def test_framework_and_api_stack_extras_go_through_the_table():
    text = problems(PPOConfig().environment("CartPole-v1").framework("torch", torch_compile_learner=True)
                    .api_stack(enable_everything=True))
    assert "'torch_compile_learner' is an RLlib setting runnel has no counterpart for" in text
    assert "unknown api_stack setting 'enable_everything'" in text


def test_rollouts_builder_is_refused_naming_env_runners():
    with pytest.raises(ConfigError, match=r"\.rollouts\(\) is RLlib's old name: use \.env_runners\(num_env_runners="):
        PPOConfig().rollouts(num_rollout_workers=2)


# --- dict-style reads -------------------------------------------------------------------------------------

def test_dict_reads():
    config = PPOConfig().training(lr=1e-3).evaluation(evaluation_num_env_runners=2)
    assert config["lr"] == 1e-3 and config.get("lr") == 1e-3 and "lr" in config
    assert config["evaluation_num_workers"] == 2 and config.get("evaluation_num_workers") == 2
    assert config["framework"] == "torch" and config["enable_rl_module_and_learner"] is True
    assert "no_such_setting" not in config and config.get("no_such_setting", 7) == 7
    assert config.get("num_sgd_iter", "absent") == "absent" and "num_sgd_iter" not in config
    with pytest.raises(KeyError, match="did you mean 'lr'"):
        config["lrr"]
    with pytest.raises(KeyError, match=r"'num_sgd_iter' is RLlib's old name: use num_epochs: \.training"):
        config["num_sgd_iter"]


# --- foreach_env_runner: the user's error is the caller's -------------------------------------------------

@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(params=[0, 1], ids=["in-process", "one-ray-runner"])
def algo(request, ray_local):
    algo = (PPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=request.param, num_envs_per_env_runner=1)
            .training(train_batch_size_per_learner=64, minibatch_size=32).build(logdir=None))
    yield algo
    algo.stop()


@pytest.mark.slow
def test_foreach_env_runner_hands_a_user_error_to_the_caller(algo):
    """An exception raised by the user's function reaches the caller as that exception, naming the
    runner; the runner is healthy, is not restarted, and answers the next call."""
    remote = not algo.env_runner_group.manager.in_process
    index = 1 if remote else 0
    with pytest.raises(ValueError, match=f"user function failed on runner {index}") as err:
        algo.foreach_env_runner(boom)
    assert any(f"env runner {index}" in note and "not restarted" in note for note in err.value.__notes__)
    with pytest.raises(ValueError):  # RLlib's older spelling, on the group
        algo.env_runner_group.foreach_worker(boom)
    manager = algo.env_runner_group.manager
    assert (manager.num_restarts, manager.num_failures) == (0, 0)
    assert algo.foreach_env_runner(lambda runner: runner.worker_index) == [index]
    with pytest.raises(TypeError, match=r"takes a function of one runner, e\.g\. lambda runner"):
        algo.env_runner_group.foreach_env_runner(None)
    assert algo.train()["training_iteration"] == 1  # the runners were left as they were


def test_a_runner_that_dies_in_foreach_is_still_a_runner_failure(ray_local):
    """The function killing its runner's process is the actor dying, not an error in the function: fault
    tolerance as before (the result is left out, the runner is recreated)."""
    algo = (PPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=1)
            .fault_tolerance(delay_between_env_runner_restarts_s=0.0)
            .training(train_batch_size_per_learner=64, minibatch_size=32).build(logdir=None))
    try:
        assert algo.foreach_env_runner(lambda runner: os._exit(1)) == []
        manager = algo.env_runner_group.manager
        assert manager.num_failures == 1 and manager.num_healthy() == 0
        algo.env_runner_group.restart_failed(force=True)  # started, not waited for
        assert algo.env_runner_group.wait_for_restarts(120) == [1]
        assert algo.foreach_env_runner(lambda runner: runner.worker_index) == [1]
    finally:
        algo.stop()

