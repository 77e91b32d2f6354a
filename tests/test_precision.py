"""Acting in bfloat16 (``.inference(precision="bfloat16")``): the pass runs a bfloat16 copy of the module that
follows every weights update, its outputs come back as float32, the log-probabilities recorded are the ones
of the policy that acted, bad settings are refused with the fix, and PPO learns CartPole acting in bfloat16
within its float32 test's budget."""
import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from actors.env import EnvRunner
from actors.inference.forward import PolicyForward
from actors.modules import ActorCriticModule
from pipeline import PPOConfig
from pipeline.config.base import ConfigError
from pipeline.envs import env_creator, probe_spaces
from pipeline.groups.env_runners import runner_settings
from tests.helpers import train_until

FRAMES = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)


def cnn_pair(seed=0):
    """Two forwards of one CNN module's weights: float32 and bfloat16."""
    torch.manual_seed(seed)
    module = ActorCriticModule(FRAMES, gym.spaces.Discrete(6), inference_only=True)
    twin = ActorCriticModule(FRAMES, gym.spaces.Discrete(6), inference_only=True)
    twin.set_state(module.get_state())
    return PolicyForward(module), PolicyForward(twin, precision="bfloat16")


def frames(n=8, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, *FRAMES.shape), dtype=np.uint8)


def test_a_bfloat16_pass_is_close_to_the_float32_one_and_follows_new_weights():
    f32, b16 = cnn_pair()
    obs = frames()
    with torch.inference_mode():
        first = f32.dist_inputs(obs, True)
        low = b16.dist_inputs(obs, True)
        assert low.dtype == torch.float32 and low.shape == first.shape
        scale = float(first.abs().max())
        assert float((low - first).abs().max()) < 0.05 * scale
        # new weights (the head's scaled up, as training moves it): the bfloat16 copy acts with them at once
        new = {k: (v * 40.0 if k.startswith("pi_head.") else v) for k, v in f32.get_state().items()}
        f32.set_state(new)
        b16.set_state(new)
        moved = f32.dist_inputs(obs, True)
        low = b16.dist_inputs(obs, True)
        assert float((moved - first).abs().max()) > 0.5 * float(moved.abs().max())  # the weights did move the outputs
        assert float((low - moved).abs().max()) < 0.05 * float(moved.abs().max())
        # the server's path: tensors copied in place
        f32.load_weights({k: torch.as_tensor(v) for k, v in f32.get_state().items()})
        b16.load_weights({k: torch.as_tensor(np.asarray(v) / 40.0 if k.startswith("pi_head.") else v)
                          for k, v in new.items()})
        assert float((b16.dist_inputs(obs, True) - first).abs().max()) < 0.05 * scale
    # the weights read back are the float32 module's, exactly what was set
    state = b16.get_state()
    assert all(np.asarray(v).dtype == np.float32 for v in state.values())
    np.testing.assert_array_equal(state["encoder.net.0.weight"], new["encoder.net.0.weight"])


def test_a_recurrent_module_acts_in_bfloat16_with_float32_states():
    space = gym.spaces.Box(-1, 1, (4,), np.float32)
    torch.manual_seed(0)
    module = ActorCriticModule(space, gym.spaces.Discrete(2), {"use_lstm": True, "lstm_cell_size": 32},
                               inference_only=True)
    obs = np.random.default_rng(0).uniform(-1, 1, (5, 4)).astype(np.float32)
    with torch.inference_mode():
        want, want_state = PolicyForward(module).recurrent_dist_inputs(obs, module.initial_state(5), True)
        got, got_state = PolicyForward(module, precision="bfloat16").recurrent_dist_inputs(
            obs, module.initial_state(5), True)
    assert got.dtype == torch.float32 and got_state.dtype == np.float32 and got_state.shape == (5, 2, 32)
    np.testing.assert_allclose(got_state, want_state, atol=0.02)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=0.02)


def test_bad_precision_settings_name_the_fix():
    with pytest.raises(ValueError, match=r"precision='fp16' is not one of \['float32', 'bfloat16'\]"):
        PolicyForward(ActorCriticModule(FRAMES, gym.spaces.Discrete(6), inference_only=True), precision="fp16")
    config = PPOConfig().environment("CartPole-v1")
    with pytest.raises(ConfigError, match=r"inference precision='fp16' is not one of \['float32', 'bfloat16'\]"):
        config.copy().inference(precision="fp16").validate()
    with pytest.raises(ConfigError, match="numpy acting computes in float32: set runner_backend='auto' or 'torch'"):
        config.copy().inference(precision="bfloat16", runner_backend="numpy").validate()
    with pytest.raises(ConfigError, match="multi-agent runners act in float32"):
        config.copy().multi_agent(policies={"a", "b"}, policy_mapping_fn=lambda aid, *a, **k: "a") \
            .inference(precision="bfloat16").validate()


def test_a_bfloat16_runner_acts_with_torch_and_records_the_logp_of_the_policy_that_acted():
    config = PPOConfig().environment("CartPole-v1").env_runners(num_envs_per_env_runner=1,
                                                                rollout_fragment_length=60).debugging(seed=1)
    obs_space, act_space = probe_spaces(env_creator("CartPole-v1"), {})
    plain = runner_settings(config, env_creator("CartPole-v1"), ActorCriticModule, obs_space, act_space)
    assert plain.precision == "float32" and plain.numpy_policy is not None  # auto: numpy for this small MLP
    settings = runner_settings(config.copy().inference(precision="bfloat16"), env_creator("CartPole-v1"),
                               ActorCriticModule, obs_space, act_space)
    assert settings.precision == "bfloat16" and settings.numpy_policy is None  # auto picks torch then
    runner = EnvRunner(settings, worker_index=1)
    try:
        torch.manual_seed(5)
        trained = ActorCriticModule(obs_space, act_space, inference_only=True)
        # confident logits, so that bfloat16's rounding shows
        weights = {k: v * 200.0 if k.startswith("pi_head.") else v for k, v in trained.get_state().items()}
        runner.set_weights(weights, 1)
        chunks = runner.sample()
    finally:
        runner.stop()
    judge = PolicyForward(ActorCriticModule(obs_space, act_space, inference_only=True), precision="bfloat16")
    judge.set_state(weights)
    exact = PolicyForward(ActorCriticModule(obs_space, act_space, inference_only=True))
    exact.set_state(weights)
    assert sum(len(c) for c in chunks) >= 50  # 60 steps, less the reset-only ones of ended episodes
    for chunk in chunks:
        with torch.inference_mode():  # a row at a time, as the runner of one sub-env acted: the same kernels
            inputs = torch.cat([judge.dist_inputs(np.asarray(o, np.float32)[None], True) for o in chunk.obs[:len(chunk)]])
            logp = judge.dist_spec.build(inputs).logp(torch.as_tensor(np.asarray(chunk.actions))).numpy()
            exact_inputs = exact.dist_inputs(np.asarray(chunk.obs[:len(chunk)], np.float32), True).numpy()
        np.testing.assert_allclose(chunk.extra["action_dist_inputs"], inputs.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(chunk.extra["action_logp"], logp, rtol=1e-6, atol=1e-6)
        # and the float32 policy's are farther off (bfloat16 keeps 8 bits of mantissa): it did act in bfloat16
        assert np.abs(chunk.extra["action_dist_inputs"] - exact_inputs).max() > 1e-4


@pytest.mark.learning
def test_ppo_acting_in_bfloat16_reaches_450_within_the_float32_budget(ray_cluster):
    """test_ppo_train's run of the tuned CartPole file (2 runner actors, 120k steps), acting in bfloat16."""
    spec = yaml.safe_load(open("tuned/cartpole-ppo.yaml"))
    config = PPOConfig().environment("CartPole-v1").debugging(seed=0)
    config.update_from_dict(spec["config"])
    algo = config.inference(precision="bfloat16").build()
    try:
        best, result = train_until(algo, 450, 120_000)
    finally:
        algo.stop()
    assert best >= 450, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
