"""IMPALA's and APPO's losses on fake batches, without an environment: the loss terms, the direction of the
policy gradient, APPO's clipping against the target policy, normalised advantages and the KL term."""
import gymnasium as gym
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.modules import ActorCriticModule as RLModule
from pipeline import APPOConfig, ConfigError, IMPALAConfig
from pipeline.algorithms.appo.learner import appo_loss
from pipeline.algorithms.impala.learner import impala_loss
from pipeline.algorithms.returns import vtrace
from tests.fake_steps import on_policy_steps

OBS_SPACE = gym.spaces.Box(-1, 1, (4,), np.float32)
ACT_SPACE = gym.spaces.Discrete(2)


# --- losses on fake batches -------------------------------------------------------------------
@pytest.fixture
def module():
    torch.manual_seed(0)
    return RLModule(OBS_SPACE, ACT_SPACE, {"fcnet_hiddens": [16]})


def fake_batch(module, n=64, seed=0):
    s, g = on_policy_steps(module, n, seed)
    return {"obs": s["obs"], "actions": s["actions"], "action_logp": s["logp"], "old_action_logp": s["logp"].clone(),
            "old_action_dist_inputs": s["dist_inputs"], "pg_advantages": torch.randn(n, generator=g),
            "vtrace_targets": torch.randn(n, generator=g)}


def test_impala_loss_terms(module):
    cfg = IMPALAConfig(vf_loss_coeff=0.25, entropy_coeff=0.01)
    batch = fake_batch(module)
    loss, stats = impala_loss(module, batch, cfg)
    out = module.forward_train(batch["obs"])
    dist = module.action_dist(out["action_dist_inputs"])
    logp = dist.logp(batch["actions"])
    pi = -(logp * batch["pg_advantages"]).mean()
    vf = 0.5 * (out["vf_preds"] - batch["vtrace_targets"]).pow(2).mean()
    ent = dist.entropy().mean()
    pi, vf, ent = float(pi.detach()), float(vf.detach()), float(ent.detach())
    assert float(stats["policy_loss"]) == pytest.approx(pi, rel=1e-5)
    assert float(stats["vf_loss"]) == pytest.approx(vf, rel=1e-5)
    assert float(loss.detach()) == pytest.approx(pi + 0.25 * vf - 0.01 * ent, rel=1e-5)
    # an explicit entropy coefficient (a schedule's current value) overrides the config's
    loss2, _ = impala_loss(module, batch, cfg, entropy_coeff=0.0)
    assert float(loss2.detach()) == pytest.approx(pi + 0.25 * vf, rel=1e-5)


def test_impala_loss_gradient_raises_the_probability_of_advantaged_actions(module):
    cfg = IMPALAConfig(vf_loss_coeff=0.0, entropy_coeff=0.0)
    batch = fake_batch(module)
    batch["pg_advantages"] = torch.where(batch["actions"] == 1, 1.0, -1.0)
    opt = torch.optim.SGD(module.parameters(), lr=0.5)

    def p1():
        with torch.no_grad():
            return float(module.action_dist(module.forward_inference(batch["obs"])["action_dist_inputs"]).logp(
                torch.ones(len(batch["obs"]), dtype=torch.long)).exp().mean())

    before = p1()
    for _ in range(5):
        loss, _ = impala_loss(module, batch, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert p1() > before + 0.05


def expected_logit_step(mu: np.ndarray, pi: np.ndarray, delta: float, pg_rho_threshold: float) -> np.ndarray:
    """The expected policy-gradient ascent direction on the logits, E_mu[pg_adv * grad log pi(a)], when every
    TD error is ``delta`` (a value function that is off by a constant), with V-trace's advantages for one-step
    chunks of each action."""
    n = len(mu)
    values = np.array([10.0, (10.0 + delta) / 0.99] * n, np.float64)  # r=0 + 0.99 * V' - V = delta
    _, adv = vtrace(np.log(mu), np.log(pi), np.zeros(n, np.float32), values, np.ones(n, np.int64),
                    np.zeros(n, bool), 0.99, clip_pg_rho_threshold=pg_rho_threshold)
    return sum(mu[a] * adv[a] * (np.eye(n)[a] - pi) for a in range(n))


def probabilities(min_size: int = 2, max_size: int = 5) -> st.SearchStrategy:
    return st.lists(st.floats(0.05, 1.0), min_size=min_size, max_size=max_size).map(lambda w: np.array(w) / np.sum(w))


@settings(max_examples=50, deadline=None)
@given(mu=probabilities(), data=st.data(), delta=st.floats(-5.0, 5.0))
def test_a_constant_td_error_pulls_by_the_clipped_mass_only(mu, data, delta):
    # E_mu[min(rho_bar, pi/mu) * delta * grad log pi] = -delta * sum_{a: pi > rho_bar mu} (pi - rho_bar mu) grad log pi:
    # with no ratio clipped a constant error pulls nowhere; clipped, it pulls along the clipped actions' excess
    pi = data.draw(probabilities(len(mu), len(mu)))
    mu, pi = mu.astype(np.float32), pi.astype(np.float32)
    unclipped = expected_logit_step(mu, pi, delta, pg_rho_threshold=float(np.max(pi / mu)) + 1.0)
    np.testing.assert_allclose(unclipped, 0.0, atol=1e-4)
    for rho_bar in (1.0, 3.0):
        excess = np.maximum(pi - rho_bar * mu, 0.0)
        formula = -delta * sum(excess[a] * (np.eye(len(mu))[a] - pi) for a in range(len(mu)))
        np.testing.assert_allclose(expected_logit_step(mu, pi, delta, rho_bar), formula, atol=1e-4)


def test_impala_default_pg_clip_gives_a_constant_advantage_error_no_pull_away_from_the_runners_policy():
    # The learner's policy has drifted from the runners' (lag): pi(0) = 0.8 against mu(0) = 0.5. A value
    # function that overestimates every state (after a dip in return) makes every TD error negative. With the
    # policy-gradient ratio clipped at 1 (the IMPALA paper's rho-bar), that constant error pushes pi further
    # towards action 0 -- away from mu, towards one action -- the feedback in which IMPALA's CartPole runs
    # collapsed (docs/HISTORY.md, 2026-12-05). At 3 (the default of 2026-12-05) a ratio of 5 still pulls; at
    # IMPALA's default (100) neither ratio is clipped and a constant error has no expected pull.
    mu, pi = np.array([0.5, 0.5], np.float32), np.array([0.8, 0.2], np.float32)
    clipped_at_one = expected_logit_step(mu, pi, delta=-1.0, pg_rho_threshold=1.0)
    assert clipped_at_one[0] - clipped_at_one[1] > 0.1  # towards action 0, away from mu
    default = expected_logit_step(mu, pi, delta=-1.0, pg_rho_threshold=IMPALAConfig().vtrace_clip_pg_rho_threshold)
    np.testing.assert_allclose(default, 0.0, atol=1e-6)
    # further drift, the trace of the runs that fell (pi(a)/mu(a) up to ~190 for a few % of the steps):
    # mu(0) = 0.1, pi(0) = 0.5 is clipped at 3, not at the default
    mu, pi = np.array([0.1, 0.9], np.float32), np.array([0.5, 0.5], np.float32)
    clipped_at_three = expected_logit_step(mu, pi, delta=-1.0, pg_rho_threshold=3.0)
    assert clipped_at_three[0] - clipped_at_three[1] > 0.1
    default = expected_logit_step(mu, pi, delta=-1.0, pg_rho_threshold=IMPALAConfig().vtrace_clip_pg_rho_threshold)
    np.testing.assert_allclose(default, 0.0, atol=1e-5)
    assert APPOConfig().vtrace_clip_pg_rho_threshold == 1.0  # APPO's clipped surrogate and target network hold it


def test_appo_loss_on_policy_is_minus_mean_advantage_with_zero_kl(module):
    cfg = APPOConfig(vf_loss_coeff=0.5, entropy_coeff=0.0, use_kl_loss=True)
    batch = fake_batch(module)
    loss, stats = appo_loss(module, batch, cfg, kl_coeff=1.0)
    assert float(stats["mean_ratio"]) == pytest.approx(1.0, abs=1e-5)
    assert abs(float(stats["mean_kl_loss"])) < 1e-6
    assert float(stats["policy_loss"]) == pytest.approx(-float(batch["pg_advantages"].mean()), abs=1e-5)
    vf = 0.5 * (module.forward_train(batch["obs"])["vf_preds"] - batch["vtrace_targets"]).pow(2).mean()
    assert float(loss.detach()) == pytest.approx(float(stats["policy_loss"]) + 0.5 * float(vf.detach()), rel=1e-5)


def test_appo_normalized_advantages_are_scale_free(module):
    """With normalize_advantages the policy loss is the same for advantages shifted and scaled (a sparse-reward
    task's tiny ones count as much as large ones), and on-policy it is minus the mean normalised advantage: 0."""
    cfg = APPOConfig(entropy_coeff=0.0, normalize_advantages=True)
    batch = fake_batch(module)
    _, stats = appo_loss(module, batch, cfg, kl_coeff=1.0)
    small = {**batch, "pg_advantages": batch["pg_advantages"] * 1e-3 + 0.5}
    _, small_stats = appo_loss(module, small, cfg, kl_coeff=1.0)
    assert float(stats["policy_loss"]) == pytest.approx(0.0, abs=1e-4)  # float32 ratios of exactly 1, nearly
    grads = []
    for b in (batch, small):
        module.zero_grad()
        loss, _ = appo_loss(module, b, APPOConfig(entropy_coeff=0.0, vf_loss_coeff=0.0, normalize_advantages=True),
                            kl_coeff=1.0)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None]).clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-6)
    assert float(small_stats["policy_loss"]) == pytest.approx(0.0, abs=1e-4)
    with pytest.raises(ConfigError, match="normalize_advantages must be True or False"):
        APPOConfig(normalize_advantages="yes").validate()


def test_appo_ratio_is_clipped_against_the_target_policy(module):
    cfg = APPOConfig(vf_loss_coeff=0.0, entropy_coeff=0.0, clip_param=0.4)
    batch = fake_batch(module)
    batch["pg_advantages"] = batch["pg_advantages"].abs() + 0.1
    # behaviour = target, both far less likely than the current policy: ratio ~ e^5, capped at 1 + clip
    batch["action_logp"] = batch["action_logp"] - 5.0
    batch["old_action_logp"] = batch["action_logp"].clone()
    loss, stats = appo_loss(module, batch, cfg, kl_coeff=0.0)
    assert float(stats["policy_loss"]) == pytest.approx(-1.4 * float(batch["pg_advantages"].mean()), rel=1e-5)
    module.zero_grad()
    loss.backward()
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for n, p in module.named_parameters()
               if n.startswith(("pi_", "encoder")))
    # behaviour far likelier than the target: the behaviour/target factor is capped at target_worker_clipping
    batch = fake_batch(module)
    batch["pg_advantages"] = batch["pg_advantages"].abs() + 0.1
    batch["old_action_logp"] = batch["action_logp"] - 5.0
    _, stats = appo_loss(module, batch, cfg, kl_coeff=0.0)
    assert float(stats["mean_ratio"]) == pytest.approx(cfg.target_worker_clipping, rel=1e-4)


def test_appo_kl_term_is_added_only_with_use_kl_loss(module):
    batch = fake_batch(module)
    batch["old_action_dist_inputs"] = batch["old_action_dist_inputs"] + torch.tensor([1.0, -1.0])
    with_kl, s1 = appo_loss(module, batch, APPOConfig(use_kl_loss=True), kl_coeff=2.0)
    without, s2 = appo_loss(module, batch, APPOConfig(use_kl_loss=False), kl_coeff=2.0)
    assert float(s1["mean_kl_loss"]) > 0.01
    assert float(with_kl.detach()) == pytest.approx(float(without.detach()) + 2.0 * float(s1["mean_kl_loss"]), rel=1e-5)
