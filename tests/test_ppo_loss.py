"""PPO's loss as a pure function of (module, batch, config), on fake batches without an environment."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.modules import ActorCriticModule as RLModule
from pipeline.algorithms.ppo.config import PPOConfig
from pipeline.algorithms.ppo.learner import ppo_loss
from tests.fake_steps import on_policy_steps


def fake_batch(module, n=64, seed=0):
    s, g = on_policy_steps(module, n, seed)
    return {"obs": s["obs"], "actions": s["actions"], "action_logp": s["logp"], "action_dist_inputs": s["dist_inputs"],
            "advantages": torch.randn(n, generator=g), "value_targets": torch.randn(n, generator=g)}


@pytest.fixture
def module():
    torch.manual_seed(0)
    return RLModule(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2), {"fcnet_hiddens": [16]})


def test_on_policy_batch_has_zero_kl_and_surrogate_equal_to_minus_mean_advantage(module):
    cfg = PPOConfig(normalize_advantages=False)
    batch = fake_batch(module)
    loss, stats = ppo_loss(module, batch, cfg, kl_coeff=0.2, entropy_coeff=0.0)
    assert abs(float(stats["mean_kl_loss"])) < 1e-6
    assert float(stats["policy_loss"]) == pytest.approx(-float(batch["advantages"].mean()), abs=1e-5)
    vf = module.forward_train(batch["obs"])["vf_preds"]
    expected_vf = float((vf - batch["value_targets"]).pow(2).mean().detach())
    assert float(stats["vf_loss"]) == pytest.approx(expected_vf, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(float(stats["policy_loss"]) + 0.5 * expected_vf, rel=1e-5)


def test_ratio_is_clipped(module):
    """With every ratio far above 1 + clip and positive advantages, the surrogate is capped and has no gradient."""
    cfg = PPOConfig(normalize_advantages=False, use_critic=False, use_gae=False, clip_param=0.2)
    batch = fake_batch(module)
    batch["action_logp"] = batch["action_logp"] - 5.0  # the sampling policy was much less likely: ratio ~ e^5
    batch["advantages"] = batch["advantages"].abs() + 0.1
    loss, stats = ppo_loss(module, batch, cfg, kl_coeff=0.0, entropy_coeff=0.0)
    assert float(stats["policy_loss"]) == pytest.approx(-1.2 * float(batch["advantages"].mean()), rel=1e-5)
    module.zero_grad()
    loss.backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in module.pi_trunk.parameters())


def test_entropy_and_kl_terms_enter_the_total(module):
    cfg = PPOConfig(normalize_advantages=False, use_kl_loss=True)
    batch = fake_batch(module)
    batch["action_dist_inputs"] = batch["action_dist_inputs"] + torch.tensor([2.0, -2.0])  # old policy differs
    base, s0 = ppo_loss(module, batch, cfg, kl_coeff=0.0, entropy_coeff=0.0)
    with_terms, s1 = ppo_loss(module, batch, cfg, kl_coeff=0.5, entropy_coeff=0.1)
    assert float(s1["mean_kl_loss"]) > 0
    expected = float(base.detach()) + 0.5 * float(s1["mean_kl_loss"]) - 0.1 * float(s1["entropy"])
    assert float(with_terms.detach()) == pytest.approx(expected, rel=1e-5)


def test_value_error_clip(module):
    cfg = PPOConfig(normalize_advantages=False, vf_clip_param=0.5)
    batch = fake_batch(module)
    batch["value_targets"] = batch["value_targets"] + 100.0
    _, stats = ppo_loss(module, batch, cfg, kl_coeff=0.0, entropy_coeff=0.0)
    assert float(stats["vf_loss"]) == pytest.approx(0.5)
    assert float(stats["vf_loss_unclipped"]) > 1000


def test_gaussian_actions_loss_is_finite_and_differentiable():
    torch.manual_seed(0)
    module = RLModule(gym.spaces.Box(-1, 1, (4,)), gym.spaces.Box(-2, 2, (3,), np.float32))
    batch = fake_batch(module)
    loss, stats = ppo_loss(module, batch, PPOConfig(), kl_coeff=0.2, entropy_coeff=0.01)
    loss.backward()
    assert np.isfinite(float(loss.detach())) and module.pi_head.weight.grad is not None


def test_terms_the_loss_leaves_out_are_reported_with_the_gradient_of_the_terms_it_keeps(module):
    """Without an entropy bonus or the KL loss, entropy and KL are only reported: the gradient is exactly the
    surrogate's plus the value loss's, bit for bit."""
    cfg = PPOConfig(normalize_advantages=False)
    batch = fake_batch(module)
    batch["action_dist_inputs"] = batch["action_dist_inputs"] + torch.tensor([1.0, -1.0])
    loss, stats = ppo_loss(module, batch, cfg, kl_coeff=0.2, entropy_coeff=0.0)
    assert float(stats["entropy"]) > 0 and float(stats["mean_kl_loss"]) > 0
    module.zero_grad()
    loss.backward()
    got = [p.grad.clone() for p in module.parameters()]
    out = module.forward_train(batch["obs"])
    dist = module.action_dist(out["action_dist_inputs"])
    ratio = torch.exp(dist.logp(batch["actions"]) - batch["action_logp"])
    adv = batch["advantages"]
    kept = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() \
        + 0.5 * (out["vf_preds"] - batch["value_targets"]).pow(2).mean()
    module.zero_grad()
    kept.backward()
    for g, p in zip(got, module.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)
