"""Learner mechanics without an environment: lr schedules, gradient clipping, state round trip."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.learner import Learner, piecewise
from pipeline.algorithms.ppo import PPOConfig

OBS, ACT = gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(2)


def make_learner(**training):
    cfg = PPOConfig(seed=0, **training)
    return Learner(OBS, ACT, {"fcnet_hiddens": [8]}, cfg, update_fn=lambda learner, chunks, t: {})


def big_loss(learner):
    out = learner.module.forward_train(torch.ones(4, 3))
    return 1e4 * (out["action_dist_inputs"].sum() + out["vf_preds"].sum())


def test_piecewise_schedule_interpolates_and_holds():
    sched = [[0, 1.0], [100, 0.5], [300, 0.1]]
    assert piecewise(sched, 0) == 1.0
    assert piecewise(sched, 50) == pytest.approx(0.75)
    assert piecewise(sched, 200) == pytest.approx(0.3)
    assert piecewise(sched, 10_000) == pytest.approx(0.1)
    assert piecewise(3e-4, 123) == 3e-4


def test_lr_follows_the_schedule_by_sampled_timesteps():
    learner = make_learner(lr=[[0, 1e-2], [1000, 1e-3]])
    assert learner.update([], timestep=500)["curr_lr"] == pytest.approx(5.5e-3)
    assert learner.optimizer.param_groups[0]["lr"] == pytest.approx(5.5e-3)


@pytest.mark.parametrize("by", ["value", "norm", "global_norm"])
def test_gradient_clipping_modes(by):
    learner = make_learner(grad_clip=0.5, grad_clip_by=by)
    learner.optimizer.step = lambda: None  # inspect the clipped gradients, keep the weights
    norm = learner.apply_gradients(big_loss(learner))
    grads = [p.grad for p in learner.module.parameters() if p.grad is not None]
    if by == "value":
        assert max(float(g.abs().max()) for g in grads) <= 0.5 + 1e-6
    elif by == "norm":
        assert all(float(torch.linalg.vector_norm(g)) <= 0.5 + 1e-5 for g in grads)
    else:
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        assert float(total) == pytest.approx(0.5, rel=1e-4)
        assert norm > 0.5  # the reported norm is the one before clipping


def test_state_round_trip_restores_module_optimizer_and_rng():
    a = make_learner()
    a.apply_gradients(big_loss(a))
    a.algo_state["kl_coeff"] = 0.3
    state = a.get_state()
    b = make_learner()
    b.set_state(state)
    for k, v in a.module.state_dict().items():
        torch.testing.assert_close(b.module.state_dict()[k], v, rtol=0, atol=0)
    assert b.algo_state == {"kl_coeff": 0.3}
    np.testing.assert_array_equal(a.minibatches(10, 5, 2)[0], b.minibatches(10, 5, 2)[0])


def test_minibatch_count_is_fixed_by_config_even_for_small_shards():
    learner = make_learner()
    batches = learner.minibatches(n=7, minibatch_size=4, num_minibatches=3)
    assert len(batches) == 3 and all(len(b) == 4 for b in batches)
    assert set(np.concatenate(batches)) == set(range(7))
