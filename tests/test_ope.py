"""Off-policy estimation (pipeline/offline/ope.py): the estimators on hand-made episodes, then wired into
an algorithm trained from a recording with no env."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

from pipeline import BCConfig
from pipeline.config.base import ConfigError
from pipeline.offline.ope import RecordedEpisode, estimate, estimator_kinds

RANDOM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cartpole_random")


def bandit(n: int, seed: int = 0) -> list[RecordedEpisode]:
    """One-step episodes: the behaviour policy picks 2 arms uniformly, arm 0 pays 1, arm 1 pays 0;
    the target policy always picks arm 0 (log-prob 0 for it, -inf for arm 1)."""
    arms = np.random.default_rng(seed).integers(0, 2, n)
    return [RecordedEpisode(np.array([1.0 - a]), np.array([math.log(0.5)]), np.array([0.0 if a == 0 else -np.inf]))
            for a in arms]


def test_same_policy_estimates_the_recorded_return():
    rng = np.random.default_rng(1)
    eps = [RecordedEpisode(rng.normal(size=t), lp := rng.normal(size=t), lp.copy()) for t in (3, 7, 5)]
    for kind in ("is", "wis"):
        out = estimate(eps, 0.9, kind)
        assert out["v_target"] == pytest.approx(out["v_behavior"]) and out["v_gain"] == pytest.approx(1.0)
    by_hand = np.mean([sum(0.9 ** t * r for t, r in enumerate(e.rewards)) for e in eps])
    assert out["v_behavior"] == pytest.approx(by_hand)


def test_bandit_estimates_the_target_policy_value():
    eps = bandit(400)
    v_is, v_wis = estimate(eps, 1.0, "is"), estimate(eps, 1.0, "wis")
    hits = sum(e.rewards[0] for e in eps)
    assert v_is["v_target"] == pytest.approx(2 * hits / len(eps))  # unbiased, noisy
    assert v_wis["v_target"] == pytest.approx(1.0)  # self-normalized: exact here
    assert v_wis["v_behavior"] == pytest.approx(hits / len(eps)) and v_wis["v_delta"] > 0.4


def test_per_decision_weights_by_hand():
    e = RecordedEpisode(np.array([1.0, 2.0]), np.log([0.5, 0.25]), np.log([1.0, 0.5]))
    # w_0 = 2, w_1 = 2 * 2 = 4: 2 * 1 + 0.5 * 4 * 2
    assert estimate([e], 0.5, "is")["v_target"] == pytest.approx(6.0)


def test_method_names_and_errors():
    kinds, problems = estimator_kinds({"a": {"type": "ImportanceSampling"}, "b": {"type": "wis"},
                                       "c": {"type": "ray.rllib.offline.estimators.WeightedImportanceSampling"}})
    assert kinds == {"a": "is", "b": "wis", "c": "wis"} and not problems
    assert "DoublyRobust" in estimator_kinds({"dr": {"type": "DoublyRobust"}})[1][0]
    with pytest.raises(ConfigError, match="offline_data"):
        BCConfig().environment("CartPole-v1").evaluation(off_policy_estimation_methods={"is": {"type": "is"}}).validate()
    with pytest.raises(ValueError, match="at least one"):
        estimate([], 0.9, "is")


def test_estimates_in_the_evaluation_results_with_no_env():
    algo = (BCConfig().offline_data(input_=RANDOM).env_runners(num_env_runners=0).debugging(seed=0)
            .training(lr=1e-3, train_batch_size_per_learner=1000, minibatch_size=250)
            .evaluation(evaluation_interval=1, off_policy_estimation_episodes=50,
                        off_policy_estimation_methods={"is": {"type": "ImportanceSampling"},
                                                       "wis": {"type": "WeightedImportanceSampling"}})).build()
    try:
        for _ in range(2):
            result = algo.train()
    finally:
        algo.stop()
    est = result["evaluation"]["off_policy_estimator"]
    assert set(est) == {"is", "wis"}
    for figures in est.values():
        assert figures["num_episodes"] == 50 and 5 < figures["v_behavior"] < 30  # the random policy's return
        assert np.isfinite(figures["v_target"]) and figures["v_target"] > 0
