"""The exploration pieces on fake distributions (no env): what each does with explore on and off."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.exploration import (EpsilonGreedy, Exploration, GaussianNoise, OrnsteinUhlenbeckNoise, SoftQ,
                                    make_exploration)
from actors.modules.distributions import ActionDistSpec

DISCRETE = ActionDistSpec(gym.spaces.Discrete(4))
BOX = ActionDistSpec(gym.spaces.Box(-1.0, 1.0, (2,), np.float32), squashed=True)


def q_dist(n=4000):
    return DISCRETE.build(torch.tensor([[0.0, 1.0, 0.5, 0.2]]).repeat(n, 1))


def box_dist(n=4000):
    return BOX.build(torch.cat([torch.full((n, 2), 0.3), torch.full((n, 2), -1.0)], -1))


def test_soft_q_temperature_moves_between_greedy_and_uniform():
    torch.manual_seed(0)
    cold = SoftQ(DISCRETE, temperature=0.01).actions(q_dist(), True, 0)
    assert (cold == 1).float().mean() > 0.99
    hot = SoftQ(DISCRETE, temperature=1000.0).actions(q_dist(), True, 0)
    counts = torch.bincount(hot, minlength=4).float() / len(hot)
    assert torch.all((counts - 0.25).abs() < 0.04)
    assert torch.equal(SoftQ(DISCRETE).actions(q_dist(10), False, 0), torch.ones(10, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SoftQ(DISCRETE, temperature=0)
    with pytest.raises(ValueError, match="discrete"):
        SoftQ(BOX)


def test_epsilon_greedy_with_rllib_arguments():
    torch.manual_seed(0)
    piece = EpsilonGreedy(DISCRETE, initial_epsilon=1.0, final_epsilon=0.02, epsilon_timesteps=10000)
    assert piece.epsilon(0) == 1.0 and piece.epsilon(5000) == pytest.approx(0.51) and piece.epsilon(10**6) == 0.02
    acts = piece.actions(q_dist(), True, 5000)
    assert abs((acts != 1).float().mean().item() - 0.51 * 0.75) < 0.04


@pytest.mark.parametrize("cls", [GaussianNoise, OrnsteinUhlenbeckNoise])
def test_noise_pieces_random_phase_then_annealed_noise_within_bounds(cls):
    torch.manual_seed(0)
    piece = cls(BOX, random_timesteps=100, initial_scale=1.0, final_scale=0.02, scale_timesteps=1000)
    det = box_dist().deterministic()
    assert torch.equal(piece.actions(box_dist(), False, 0), det)
    warm = piece.actions(box_dist(), True, 0)
    assert warm.min() < -0.9 and warm.max() > 0.9  # uniform over the whole range
    early = [piece.actions(box_dist(), True, 150) - det for _ in range(20)][-1]
    late = [piece.actions(box_dist(), True, 5000) - det for _ in range(20)][-1]
    assert early.std() > 5 * late.std() > 0
    for acts in (warm, early + det, late + det):
        assert acts.abs().max() <= 1.0
    if cls is GaussianNoise:
        assert abs(early.mean().item()) < 0.01
    with pytest.raises(ValueError, match="continuous"):
        cls(DISCRETE)


def test_ou_state_round_trips():
    torch.manual_seed(0)
    piece = OrnsteinUhlenbeckNoise(BOX, random_timesteps=0)
    for _ in range(5):
        piece.actions(box_dist(3), True, 10)
    other = OrnsteinUhlenbeckNoise(BOX, random_timesteps=0)
    other.set_state(piece.get_state())
    torch.manual_seed(1)
    a = piece.actions(box_dist(3), True, 10)
    torch.manual_seed(1)
    assert torch.equal(other.actions(box_dist(3), True, 10), a)


class Mine(Exploration):
    def actions(self, dist, explore, timestep):
        return dist.deterministic()


def test_make_exploration_names_classes_and_paths():
    assert isinstance(make_exploration({"type": "SoftQ", "temperature": 2.0}, DISCRETE), SoftQ)
    assert isinstance(make_exploration({"type": Mine}, DISCRETE), Mine)
    assert isinstance(make_exploration({"type": "tests.test_exploration_pieces:Mine"}, DISCRETE), Mine)
    assert isinstance(make_exploration({"type": "tests.test_exploration_pieces.Mine"}, DISCRETE), Mine)
    rllib = "ray.rllib.utils.exploration.epsilon_greedy.EpsilonGreedy"
    assert isinstance(make_exploration({"type": rllib}, DISCRETE), EpsilonGreedy)
    with pytest.raises(ValueError, match="'Nope'"):
        make_exploration({"type": "Nope"}, DISCRETE)
    with pytest.raises(ValueError, match="must subclass"):
        make_exploration({"type": dict}, DISCRETE)
    with pytest.raises(ValueError, match="SoftQ"):
        make_exploration({"type": "SoftQ", "temp": 1.0}, DISCRETE)
