"""The exploration page's config excerpts and the ``explore`` switch, on real algorithms (no Ray)."""
from __future__ import annotations

import numpy as np
import pytest

from actors.env.exploration import EpsilonGreedy, SoftQ, StochasticSampling
from pipeline import DQN, ConfigError, DQNConfig, PPOConfig


def ppo(**env_runners):
    return (PPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=0, num_envs_per_env_runner=1, rollout_fragment_length=50, **env_runners)
            .training(train_batch_size_per_learner=50, minibatch_size=50, num_epochs=1).debugging(seed=0))


def action_spread(algo, explore):
    """Distinct actions over many calls on one observation (1: deterministic)."""
    obs = np.array([0.0, 0.0, 0.01, 0.0], np.float32)
    return len({algo.compute_single_action(obs, **({} if explore == "default" else {"explore": explore}))
                for _ in range(200)})


def test_explore_switch_default_and_per_call_override():
    # 1) explore=False by default: no exploration unless a call asks for it
    algo = ppo(explore=False).build()
    try:
        assert action_spread(algo, "default") == 1
        assert action_spread(algo, True) == 2  # per-call override
        assert algo.foreach_env_runner(lambda w: w.config.explore) == [False]
    finally:
        algo.stop()
    # 2) explore=True by default: exploration unless a call switches it off
    algo = ppo(explore=True).build()
    try:
        assert action_spread(algo, "default") == 2
        assert action_spread(algo, False) == 1
        assert action_spread(algo, None) == 2  # None -> the config's value
    finally:
        algo.stop()


def dqn(backend="auto"):
    return (DQNConfig().environment("CartPole-v1").inference(runner_backend=backend)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=1, rollout_fragment_length=50).debugging(seed=0))


def runner_exploration(algo):
    return algo.foreach_env_runner(lambda w: w.exploration)[0]


def is_rule(piece, cls, rule_type):
    """The runner's exploration is ``cls`` (a torch runner's piece) or, acting with numpy, that piece's rule."""
    return isinstance(piece, cls) or getattr(piece, "rule", {}).get("type") == rule_type


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_page_excerpts_epsilon_greedy_soft_q_and_stochastic_sampling(backend):
    # a) DQN with EpsilonGreedy over 10000 timesteps
    algo = dqn(backend).exploration(explore=True, exploration_config={
        "type": "EpsilonGreedy", "initial_epsilon": 1.0, "final_epsilon": 0.02, "epsilon_timesteps": 10000}).build()
    try:
        piece = runner_exploration(algo)
        assert is_rule(piece, EpsilonGreedy, "epsilon_greedy") and isinstance(piece, EpsilonGreedy) == (backend == "torch")
        assert piece.epsilon(0) == 1.0 and piece.epsilon(5000) == pytest.approx(0.51) and piece.epsilon(20000) == 0.02
    finally:
        algo.stop()
    # b) Soft-Q
    algo = dqn(backend).exploration(explore=True, exploration_config={"type": "SoftQ", "temperature": 1.0}).build()
    try:
        assert is_rule(runner_exploration(algo), SoftQ, "softmax")
        algo.train()  # samples with it
    finally:
        algo.stop()
    # c) policy gradients: StochasticSampling with random warm-up steps; kwargs without a type update the default
    algo = (ppo().inference(runner_backend=backend)
            .exploration(explore=True, exploration_config={"type": "StochasticSampling", "random_timesteps": 0}).build())
    try:
        assert is_rule(runner_exploration(algo), StochasticSampling, "sample")
    finally:
        algo.stop()
    algo = dqn(backend).exploration(exploration_config={"final_epsilon": 0.1}).build()
    try:
        piece = runner_exploration(algo)
        assert piece.epsilon(10**9) == 0.1 and piece.epsilon(0) == 1.0
    finally:
        algo.stop()


def test_user_exploration_by_import_path_and_bad_types():
    algo = ppo().exploration(exploration_config={"type": "tests.test_explore_config:AlwaysLeft"}).build()
    try:
        result = algo.train()
        assert result["env_runners"]["episode_len_mean"] < 15  # always pushing left drops the pole fast
    finally:
        algo.stop()
    with pytest.raises(ConfigError, match="NoSuchExploration"):
        ppo().exploration(exploration_config={"type": "NoSuchExploration"}).build()
    with pytest.raises(ConfigError, match="exploration_config must be a dict"):
        ppo().exploration(exploration_config="EpsilonGreedy").build()


class AlwaysLeft(StochasticSampling):
    def actions(self, dist, explore, timestep):
        return dist.deterministic() * 0


def test_exploration_state_survives_a_checkpoint(tmp_path):
    algo = dqn().training(num_steps_sampled_before_learning_starts=100).reporting(
        min_sample_timesteps_per_iteration=300).build()
    try:
        algo.train()
        before = algo.foreach_env_runner(lambda w: (w.timestep, w.exploration.epsilon(w.timestep)))[0]
        path = algo.save(str(tmp_path / "ckpt"))
    finally:
        algo.stop()
    restored = DQN.from_checkpoint(path)
    try:
        after = restored.foreach_env_runner(lambda w: (w.timestep, w.exploration.epsilon(w.timestep)))[0]
    finally:
        restored.stop()
    assert before[0] >= 300 and after == before
