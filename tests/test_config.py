"""Config builders, validation messages, round trips."""
import pytest

from pipeline import PPOConfig
from pipeline.config.base import ConfigError


def test_builders_chain_and_set_fields():
    cfg = (PPOConfig().environment("CartPole-v1", env_config={"a": 1}).env_runners(num_env_runners=3)
           .training(lr=1e-3, clip_param=0.1).rl_module(model_config={"fcnet_hiddens": [8]}).debugging(seed=5))
    assert (cfg.env, cfg.env_config, cfg.num_env_runners, cfg.lr, cfg.clip_param, cfg.seed) == (
        "CartPole-v1", {"a": 1}, 3, 1e-3, 0.1, 5)
    cfg.validate()


def test_unknown_key_fails_at_validate_with_close_matches():
    cfg = PPOConfig().environment("CartPole-v1").training(lrr=0.1, clip_parm=0.2).env_runners(num_env_runner=2)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    msg = str(err.value)
    assert "'lrr'" in msg and "'lr'" in msg
    assert "'clip_parm'" in msg and "'clip_param'" in msg
    assert "'num_env_runner'" in msg and "'num_env_runners'" in msg


def test_key_of_another_group_is_unknown_there():
    cfg = PPOConfig().environment("CartPole-v1").env_runners(lr=0.1)
    with pytest.raises(ConfigError, match="unknown env_runners setting 'lr'"):
        cfg.validate()


@pytest.mark.parametrize("kwargs,needle", [
    ({"batch_mode": "whole"}, "batch_mode='whole' is not one of ['truncate_episodes', 'complete_episodes']"),
    ({"grad_clip_by": "l2"}, "grad_clip_by='l2' is not one of"),
    ({"num_env_runners": -1}, "num_env_runners must be an int >= 0"),
    ({"minibatch_size": 0}, "minibatch_size must be an int >= 1"),
    ({"lr": "fast"}, "lr must be a number or a schedule"),
    ({"gamma": 1.5}, "gamma must be in [0, 1]"),
    ({"adam_epsilon": 0}, "adam_epsilon must be a number in (0, 1), or None"),
    ({"adam_epsilon": "small"}, "adam_epsilon must be a number in (0, 1), or None"),
    ({"rollout_fragment_length": "long"}, "rollout_fragment_length must be 'auto'"),
])
def test_invalid_values_are_named(kwargs, needle):
    cfg = PPOConfig().environment("CartPole-v1")
    cfg.update_from_dict(kwargs)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert needle in str(err.value)


def test_ppo_specific_checks():
    with pytest.raises(ConfigError, match="minibatch_size"):
        PPOConfig().environment("CartPole-v1").training(minibatch_size=5000).validate()
    with pytest.raises(ConfigError, match="clip_param"):
        PPOConfig().environment("CartPole-v1").training(clip_param=2.0).validate()


def test_missing_env_is_explained():
    with pytest.raises(ConfigError, match=r"call \.environment"):
        PPOConfig().validate()


def test_unknown_env_id_suggests_close_ids():
    with pytest.raises(ConfigError, match="CartPole-v1"):
        PPOConfig().environment("CartPole-v9").env_runners(num_env_runners=0).build()


def test_unsupported_spaces_fail_at_build_naming_the_space():
    import gymnasium as gym
    import numpy as np

    class TextObsEnv(gym.Env):
        observation_space = gym.spaces.Text(5)
        action_space = gym.spaces.Discrete(2)

    with pytest.raises(ConfigError, match="cannot encode observations of Text"):
        PPOConfig().environment(TextObsEnv).env_runners(num_env_runners=0).build()

    class Box2DActionEnv(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (3,), np.float32)
        action_space = gym.spaces.Box(-1, 1, (2, 2), np.float32)

    with pytest.raises(ConfigError, match="cannot produce actions"):
        PPOConfig().environment(Box2DActionEnv).env_runners(num_env_runners=0).build()


def test_to_dict_from_dict_round_trip_and_copy():
    cfg = PPOConfig().environment("CartPole-v1").training(lr=[[0, 1e-3], [1000, 1e-4]], kl_target=0.02)
    d = cfg.to_dict()
    back = PPOConfig.from_dict(d)
    assert back.to_dict() == d
    clone = cfg.copy()
    clone.training(lr=0.5)
    assert cfg.lr == [[0, 1e-3], [1000, 1e-4]]


def test_to_dict_refuses_lambdas_with_a_fix():
    cfg = PPOConfig().environment(lambda ctx: None)
    with pytest.raises(ConfigError, match="register_env"):
        cfg.to_dict()


def test_model_config_unknown_key():
    cfg = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).rl_module(
        model_config={"fcnet_hidden": [8]})
    with pytest.raises(ConfigError, match="fcnet_hiddens"):
        cfg.build()


@pytest.mark.parametrize("cpus, threads", [(1, 1), (0.5, 1), (2, 2)])
def test_the_driver_computes_with_the_cpus_it_is_counted_for_while_the_algorithm_runs(cpus, threads):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        algo = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
                .resources(num_cpus_for_main_process=cpus).build(logdir=None))
        try:
            assert torch.get_num_threads() == threads
            algo.train()
            assert torch.get_num_threads() == threads
        finally:
            algo.stop()
        assert torch.get_num_threads() == 3  # given back
    finally:
        torch.set_num_threads(before)
