"""RLlib's old names: accepted where they mean the same setting, refused naming the runnel way otherwise."""
import pathlib

import pytest

from pipeline import PPOConfig
from pipeline.compat import ACCEPTED, BUILDERS_REFUSED, IGNORED, REFUSED, migration_table
from pipeline.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_migration_doc_is_generated_from_the_tables():
    doc = (ROOT / "docs" / "MIGRATION.md").read_text()
    assert doc == migration_table(), "regenerate it: python -m pipeline.compat > docs/MIGRATION.md"
    for name in [*ACCEPTED, *REFUSED, *IGNORED, *BUILDERS_REFUSED]:
        assert f"`{name}" in doc or f"`.{name}()" in doc


@pytest.mark.parametrize("old", sorted(REFUSED))
def test_every_refused_name_fails_naming_the_runnel_way(old):
    config = PPOConfig().environment("CartPole-v1").training(**{old: 1})
    with pytest.raises(ConfigError) as err:
        config.validate()
    assert f"'{old}' is RLlib's old name: {REFUSED[old]}" in str(err.value)
    with pytest.raises(ConfigError, match=f"'{old}' is RLlib's old name"):  # dict configs too
        PPOConfig.from_dict({"env": "CartPole-v1", old: 1}).validate()


def test_accepted_names_set_runnel_settings():
    config = PPOConfig().environment("CartPole-v1").evaluation(evaluation_num_workers=2)
    assert config.evaluation_num_env_runners == 2 and config["evaluation_num_workers"] == 2
    config = PPOConfig.from_dict({"env": "CartPole-v1", "evaluation_num_workers": 3})
    assert config.evaluation_num_env_runners == 3
    config.update_from_dict({"evaluation_num_workers": 1, "framework": "torch"})
    assert config.evaluation_num_env_runners == 1
    config.validate()


def test_framework_and_api_stack():
    config = PPOConfig().environment("CartPole-v1").framework("torch").api_stack(
        enable_rl_module_and_learner=True, enable_env_runner_and_connector_v2=True)
    config.validate()
    assert PPOConfig.from_dict({"env": "CartPole-v1", "framework": "torch", "_enable_new_api_stack": True})
    for bad in ("tf", "tf2", "jax"):
        with pytest.raises(ConfigError, match="PyTorch only"):
            PPOConfig().framework(bad)
        with pytest.raises(ConfigError, match="PyTorch only"):
            PPOConfig.from_dict({"framework": bad})


def test_rollouts_builder_is_refused_naming_env_runners():
    with pytest.raises(ConfigError, match=r"\.rollouts\(\) is RLlib's old name: use \.env_runners"):
        PPOConfig().rollouts(num_rollout_workers=2)


def test_dict_reads():
    config = PPOConfig().training(lr=1e-3)
    assert config["lr"] == 1e-3 and config.get("lr") == 1e-3 and "lr" in config
    assert "no_such_setting" not in config and config.get("no_such_setting", 7) == 7
    with pytest.raises(KeyError, match="did you mean 'lr'"):
        config["lrr"]


def _boom(runner):
    raise ValueError(f"user function failed in runner {runner.worker_index}")


@pytest.mark.parametrize("num_env_runners", [0, 1])
def test_foreach_env_runner_hands_a_user_error_to_the_caller(num_env_runners):
    """An exception raised by the user's function reaches the caller as that exception; the runners
    are healthy and are not restarted (it is not a runner failure)."""
    import ray

    started = False
    if num_env_runners and not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        started = True
    algo = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=num_env_runners,
                                                               num_envs_per_env_runner=1).build(logdir=None))
    try:
        with pytest.raises(ValueError, match="user function failed in runner"):
            algo.foreach_env_runner(_boom)
        assert algo.foreach_env_runner(lambda runner: runner.worker_index) == \
            ([0] if num_env_runners == 0 else [1])
        assert algo.env_runner_group.manager.num_restarts == 0
        assert algo.env_runner_group.num_healthy() == max(1, num_env_runners)
    finally:
        algo.stop()
        if started:
            ray.shutdown()
