"""Env runners acting with the numpy export of their module (``actors.env.numpy_acting``): the same
numbers as the torch module, weights refilled by name, draws resumed from a checkpointed generator,
the backend picked by ``.inference(runner_backend=...)``, and remote runners that never import torch."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.acting import LocalActing
from actors.env.numpy_acting import NumpyActing
from actors.env.settings import EnvRunnerSettings
from actors.modules.export import acting_plan
from actors.modules.q_module import QModule
from pipeline import DQNConfig, PPOConfig, SingleAgentEnvRunner
from pipeline.callbacks import DefaultCallbacks
from pipeline.config.base import ConfigError
from pipeline.groups.env_runners import numpy_plan
from tests.inference_probes import torch_loaded

BOX4 = gym.spaces.Box(-5.0, 5.0, (4,), np.float32)


def settings_for(module_class, obs_space, act_space, exploration=None, model=None):
    return EnvRunnerSettings(env_creator=None, module_class=module_class, observation_space=obs_space,
                             action_space=act_space, model_config=model or {"fcnet_hiddens": [32, 32]},
                             exploration_config=exploration or {}, seed=3)


def pair(settings):
    """A torch runner's acting piece and a numpy one exported from it, acting with the same weights."""
    torch_acting = LocalActing(settings, settings.observation_space, settings.action_space)
    plan = acting_plan(torch_acting.module, torch_acting.exploration)
    numpy_acting = NumpyActing(plan, settings.seed, 1)
    numpy_acting.set_weights(torch_acting.get_weights(), 7)
    return torch_acting, numpy_acting


@pytest.mark.parametrize("case", ["categorical", "gaussian", "q-dueling"])
def test_numpy_acting_computes_what_the_torch_module_computes(case):
    if case == "categorical":
        s = settings_for(None, BOX4, gym.spaces.Discrete(3))
    elif case == "gaussian":
        s = settings_for(None, BOX4, gym.spaces.Box(-1.0, 1.0, (2,), np.float32))
    else:
        s = settings_for(QModule, BOX4, gym.spaces.Discrete(3), exploration={"type": "EpsilonGreedy"})
        s.module_kwargs = {"dueling": True}
    t, n = pair(s)
    obs = np.random.default_rng(0).uniform(-2, 2, (32, 4)).astype(np.float32)
    with t.session():
        t_actions, t_logp, t_inputs, _ = t.act(obs, False, 10**6)
    n_actions, n_logp, n_inputs, version = n.act(obs, False, 10**6)
    assert version == 7
    np.testing.assert_allclose(n_inputs, t_inputs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(n_actions, t_actions, rtol=1e-5, atol=1e-5)  # greedy: the same actions
    np.testing.assert_allclose(n_logp, t_logp, rtol=1e-4, atol=1e-4)
    # exploring: the log-probabilities numpy reports are those torch's distribution gives its actions
    n_actions, n_logp, n_inputs, _ = n.act(obs, True, 10**6)
    dist = t.module.dist_spec.build(torch.from_numpy(n_inputs))
    np.testing.assert_allclose(n_logp, dist.logp(torch.as_tensor(n_actions)).numpy(), rtol=1e-4, atol=1e-4)
    assert s.action_space.contains(np.asarray(n_actions[0], dtype=s.action_space.dtype))


@pytest.mark.parametrize("module_class", [None, QModule])
def test_recurrent_numpy_acting_keeps_each_sub_envs_state_as_the_torch_module_does(module_class):
    """An LSTM policy acting with numpy: the same distribution inputs and states as torch step by step, states
    reset per sub-env where an episode starts, the sequence length for the chunks, and the states in the
    runner's checkpointed state."""
    model = {"use_lstm": True, "lstm_cell_size": 8, "max_seq_len": 5, "fcnet_hiddens": [16]}
    exploration = {"type": "EpsilonGreedy"} if module_class is QModule else None
    t, n = pair(settings_for(module_class, BOX4, gym.spaces.Discrete(3), exploration=exploration, model=model))
    assert n.recurrent and n.max_seq_len == 5 and n.state is None
    rng = np.random.default_rng(1)
    for step in range(12):
        obs = rng.uniform(-2, 2, (4, 4)).astype(np.float32)
        with t.session():
            t_inputs = t.act(obs, False, 10**6)[2]
        n_inputs = n.act(obs, False, 10**6)[2]
        np.testing.assert_allclose(n_inputs, t_inputs, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(n.state, t.state, rtol=1e-4, atol=1e-5)
        if step == 5:  # episodes start again in sub-envs 1 and 3
            for acting in (t, n):
                acting.reset_states(np.array([1, 3]))
            assert not n.state[[1, 3]].any() and n.state[[0, 2]].any()
    saved = n.get_state()
    _, restored = pair(settings_for(module_class, BOX4, gym.spaces.Discrete(3), exploration=exploration, model=model))
    restored.set_weights(n.get_weights(), 7)  # another module's initial weights until then
    restored.set_state(saved)
    np.testing.assert_array_equal(restored.state, n.state)
    obs = np.ones((4, 4), np.float32)
    np.testing.assert_array_equal(restored.act(obs, False, 0)[2], n.act(obs, False, 0)[2])


def test_epsilon_follows_the_schedule_and_the_generator_state_resumes_the_draws():
    s = settings_for(QModule, BOX4, gym.spaces.Discrete(4), exploration={
        "type": "EpsilonGreedy", "initial_epsilon": 1.0, "final_epsilon": 0.0, "epsilon_timesteps": 1000})
    _, n = pair(s)
    obs = np.zeros((64, 4), np.float32)
    greedy = n.act(obs, False, 0)[0]
    assert (n.act(obs, True, 5000)[0] == greedy).all()  # epsilon 0 after the schedule
    assert (n.act(obs, True, 0)[0] != greedy).any()  # epsilon 1 at the start: random actions
    assert n.exploration.epsilon(500) == pytest.approx(0.5)
    saved = n.get_state()
    first = [n.act(obs, True, 200)[0] for _ in range(5)]
    _, restored = pair(s)
    restored.set_state(saved)
    assert all((a == b).all() for a, b in zip(first, [restored.act(obs, True, 200)[0] for _ in range(5)]))


def test_weights_of_another_model_config_are_refused_and_the_runner_acts_on():
    _, n = pair(settings_for(None, BOX4, gym.spaces.Discrete(2)))
    weights = dict(n.get_weights())
    weights.pop("pi_head.weight")
    with pytest.raises(ValueError, match="pi_head.weight"):
        n.set_weights(weights, 1)
    obs = np.zeros((3, 4), np.float32)
    before = n.act(obs, False, 0)[2]
    wrong = dict(n.get_weights())
    wrong["pi_head.weight"] = np.zeros((5, 7), np.float32)  # another model config's layer
    with pytest.raises(Exception, match="shape"):
        n.set_weights(wrong, 2)
    np.testing.assert_array_equal(n.act(obs, False, 0)[2], before)  # still acting with the weights it had
    assert n.weights_version == 7


class EpisodeEnd(DefaultCallbacks):
    def on_episode_end(self, **kwargs):
        pass


def acting_of(config):
    algo = config.build(logdir=None)
    try:
        return algo.foreach_env_runner(lambda r: type(r.acting).__name__)
    finally:
        algo.stop()


def local_ppo():
    return PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0, num_envs_per_env_runner=2)


def test_auto_acts_with_numpy_where_it_can_and_with_torch_where_the_module_or_callbacks_need_it():
    assert acting_of(local_ppo()) == ["NumpyActing"]
    assert acting_of(DQNConfig().environment("CartPole-v1").env_runners(num_env_runners=0)) == ["NumpyActing"]
    assert acting_of(local_ppo().inference(runner_backend="torch")) == ["LocalActing"]
    assert acting_of(local_ppo().callbacks(EpisodeEnd)) == ["LocalActing"]  # handed the torch module
    assert acting_of(local_ppo().rl_module(model_config={"use_lstm": True, "lstm_cell_size": 8})) == ["NumpyActing"]
    distributional = DQNConfig().environment("CartPole-v1").env_runners(num_env_runners=0).training(num_atoms=11)
    assert acting_of(distributional) == ["LocalActing"]  # no numpy export of its atoms
    # RLlib's SingleAgentEnvRunner, built by hand, holds its RLModule (runner.module): torch unless told otherwise
    assert type(SingleAgentEnvRunner(config=local_ppo()).module).__name__ == "ActorCriticModule"
    assert SingleAgentEnvRunner(config=local_ppo().inference(runner_backend="numpy")).module is None


def test_auto_leaves_convolutions_to_torch_and_numpy_still_exports_them():
    """numpy's convolutions cost several times torch's: "auto" keeps a CNN module on torch; "numpy" insists."""
    frames = settings_for(None, gym.spaces.Box(0, 255, (42, 42, 4), np.uint8), gym.spaces.Discrete(3), model={})
    assert numpy_plan(frames, "auto") is None
    plan = numpy_plan(frames, "numpy")
    assert any(op["op"] == "conv2d" for op in plan["policy"]["layers"])
    assert numpy_plan(settings_for(None, BOX4, gym.spaces.Discrete(2)), "auto") is not None


def test_runner_backend_numpy_refuses_what_it_cannot_export_naming_why():
    with pytest.raises(ConfigError, match=r"runner_backend='numpy'.*on_episode_end.*'auto'"):
        local_ppo().callbacks(EpisodeEnd).inference(runner_backend="numpy").build(logdir=None)
    with pytest.raises(ConfigError, match=r"runner_backend='numpy'.*num_atoms=11"):
        (DQNConfig().environment("CartPole-v1").env_runners(num_env_runners=0).training(num_atoms=11)
         .inference(runner_backend="numpy").build(logdir=None))
    with pytest.raises(ConfigError, match=r"runner_backend='jax' is not one of \['auto', 'numpy', 'torch'\]"):
        local_ppo().inference(runner_backend="jax").build(logdir=None)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_remote_runners_acting_with_numpy_never_import_torch_and_train():
    algo = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2, num_envs_per_env_runner=4)
            .training(train_batch_size_per_learner=512, minibatch_size=128).debugging(seed=0).build(logdir=None))
    try:
        first = algo.train()
        for _ in range(3):
            result = algo.train()
        assert algo.foreach_env_runner(lambda r: type(r.acting).__name__) == ["NumpyActing"] * 2
        assert algo.foreach_env_runner(torch_loaded) == [False, False]
        # they act with the learner's weights: each runner holds exactly what the learner sent last
        learner = algo.learner_group.get_weights(inference_only=True)
        for held in algo.foreach_env_runner(lambda r: r.get_weights()):
            assert held.keys() == learner.keys() and all(np.array_equal(held[k], learner[k]) for k in held)
        assert result["num_env_steps_sampled_lifetime"] > first["num_env_steps_sampled_lifetime"]
    finally:
        algo.stop()


def _inverse_cdf_draw(logits: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The textbook inverse-CDF draw: the number of cumulative weights at or below ``u * total``, capped."""
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    targets = u * weights.sum(axis=1)
    return np.minimum((np.cumsum(weights, axis=1) <= targets[:, None]).sum(axis=1), logits.shape[1] - 1)


@pytest.mark.parametrize("k", [2, 3, 5])
def test_categorical_draw_is_the_inverse_cdf_draw_with_its_log_probability(k):
    from actors.env.numpy_acting import categorical_draw

    logits = np.random.default_rng(k).normal(size=(4000, k)).astype(np.float32) * 3
    actions, logp = categorical_draw(logits, explore=True, uniform=False, rng=np.random.default_rng(7))
    u = np.random.default_rng(7).random(len(logits))  # the same generator: the same uniforms, one a row
    assert actions.dtype == np.int64 and logp.dtype == np.float32
    np.testing.assert_array_equal(actions, _inverse_cdf_draw(logits, u))
    log_softmax = logits - logits.max(axis=1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(logp, log_softmax[np.arange(len(logits)), actions], rtol=1e-5, atol=1e-5)
    # the draws follow the policy: each action's frequency is near its mean probability
    probs = np.exp(log_softmax).mean(axis=0)
    freq = np.bincount(actions, minlength=k) / len(actions)
    np.testing.assert_allclose(freq, probs, atol=0.03)
