"""Learning from recordings, with no env stepped for training (the env serves evaluation only).

The recordings are checked in (tests/data/make_cartpole_recordings.py made them): 20 greedy
episodes of a PPO CartPole policy (mean return 500), and about as many steps of a freshly
initialized policy acting near-uniformly at random (mean return 22).
"""
from __future__ import annotations

import os

import pytest

from actors.offline import read_manifest
from pipeline import BCConfig, MARWILConfig
from pipeline.offline.record import inspect_recording

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
EXPERT = os.path.join(DATA, "cartpole_expert")
RANDOM = os.path.join(DATA, "cartpole_random")

pytestmark = pytest.mark.learning


def train(config, iterations: int) -> float:
    config = (config.environment("CartPole-v1").env_runners(num_env_runners=0).debugging(seed=0)
              .training(lr=1e-3, train_batch_size_per_learner=2000, minibatch_size=250)
              .evaluation(evaluation_interval=iterations, evaluation_duration=20, evaluation_duration_unit="episodes"))
    algo = config.build()
    try:
        for _ in range(iterations):
            result = algo.train()
        assert result["env_runners"]["num_env_steps_sampled_lifetime"] >= iterations * 2000  # read, not stepped
        return result["evaluation"]["env_runners"]["episode_return_mean"]
    finally:
        algo.stop()


def test_bc_reaches_95_percent_of_the_recorded_policy():
    expert = inspect_recording(EXPERT)["episode_return_mean"]
    assert expert >= 450 and read_manifest(EXPERT)["algorithm"] == "PPO"
    assert train(BCConfig().offline_data(input_=EXPERT), 100) >= 0.95 * expert


def test_marwil_beats_bc_on_half_expert_half_random_data():
    mixed = inspect_recording([EXPERT, RANDOM])
    assert abs(mixed["steps"] - 20_000) < 100  # half of the steps from each policy
    bc = train(BCConfig().offline_data(input_=[EXPERT, RANDOM]), 60)
    marwil = train(MARWILConfig().offline_data(input_=[EXPERT, RANDOM]).training(beta=1.0), 60)
    assert marwil >= 1.5 * bc and marwil >= bc + 30, (marwil, bc)


def cql_pendulum(recording: str):
    """CQL's settings for the Pendulum recording (RLlib's tuned example's, a smaller critic step), evaluated every 3
    iterations over 10 episodes; the env is the caller's."""
    from pipeline import CQLConfig

    return (CQLConfig().offline_data(input_=recording)
            .env_runners(num_env_runners=0, rollout_fragment_length=200).debugging(seed=2)
            .training(num_steps_sampled_before_learning_starts=2000, bc_iters=400, num_actions=4, min_q_weight=5.0,
                      train_batch_size_per_learner=128, training_intensity=128, actor_lr=3e-4, critic_lr=1e-3,
                      alpha_lr=3e-4)
            .rl_module(model_config={"fcnet_hiddens": [128, 128], "fcnet_activation": "relu"})
            .evaluation(evaluation_interval=3, evaluation_duration=10, evaluation_duration_unit="episodes"))


def evaluate_until(config, score, target: float, iterations: int = 90) -> tuple[list[float], dict]:
    """Train ``config``'s algorithm until ``score(evaluation env_runners results)`` reaches ``target`` at an
    evaluation, or for ``iterations``: the scores of every evaluation and the last result."""
    algo = config.build(logdir=None)
    scores, result = [], {}
    try:
        for i in range(iterations):
            result = algo.train()
            if (i + 1) % config.evaluation_interval == 0:
                scores.append(score(result["evaluation"]["env_runners"]))
                if scores[-1] >= target:
                    break
    finally:
        algo.stop()
    return scores, result


def test_cql_on_sac_pendulum_recordings_reaches_minus_300():
    """CQL from the checked-in Pendulum recording (a SAC run's training steps plus its final policy's
    episodes, mean return -553), evaluated every 3 iterations over 10 episodes, stops once the
    evaluation return reaches -300 (RLlib's tuned CQL example stops at -700). Seeds 0-2 reached it at
    iterations 33, 54 and 27; the budget is 90."""
    config = cql_pendulum(os.path.join(DATA, "pendulum_sac")).environment("Pendulum-v1")
    returns, _ = evaluate_until(config, lambda ev: ev["episode_return_mean"], -300)
    assert returns[-1] >= -300, f"evaluation returns every 3 iterations: {[round(r) for r in returns]}"
