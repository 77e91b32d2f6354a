"""Discrete SAC (Christodoulou, 2019): the module's shapes, the three losses on a fake batch against their
formulas written out, the temperature's target, the numpy export runners act with, and bad settings.
Its learning run on CartPole is in test_offpolicy_learning.py."""
import math

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.modules import SACModule
from actors.modules.export import export_policy
from pipeline import ConfigError, CQLConfig, SACConfig
from pipeline.algorithms.sac.learner import auto_target_entropy, sac_actor_loss, sac_alpha_loss, sac_critic_loss
from protocols.numpy_policy import NumpyPolicy

OBS = gym.spaces.Box(-1, 1, (3,), np.float32)
ACT = gym.spaces.Discrete(3)


def setup(n=32, seed=0):
    torch.manual_seed(seed)
    module, target = SACModule(OBS, ACT, {"fcnet_hiddens": [16]}), SACModule(OBS, ACT, {"fcnet_hiddens": [16]})
    g = np.random.default_rng(seed)
    terminated = np.arange(n) % 4 == 0
    batch = {"obs": torch.as_tensor(g.normal(size=(n, 3)), dtype=torch.float32),
             "actions": torch.as_tensor(g.integers(ACT.n, size=n)),
             "rewards": torch.as_tensor(g.normal(size=n), dtype=torch.float32),
             "next_obs": torch.as_tensor(g.normal(size=(n, 3)), dtype=torch.float32),
             "discounts": torch.as_tensor(np.where(terminated, 0.0, 0.99), dtype=torch.float32),
             "weights": torch.ones(n)}
    return module, target, batch


def test_the_module_gives_logits_and_every_actions_q_values():
    module, _, b = setup()
    assert module.discrete and module.dist_spec.kind == "categorical"
    assert module.forward_inference(b["obs"])["action_dist_inputs"].shape == (32, 3)
    q1, q2 = module.all_q_values(b["obs"])
    assert q1.shape == q2.shape == (32, 3) and not torch.equal(q1, q2)  # two critics, initialised apart
    t1, t2 = module.q_values(b["obs"], b["actions"])
    torch.testing.assert_close(t1, q1[torch.arange(32), b["actions"]])
    torch.testing.assert_close(t2, q2[torch.arange(32), b["actions"]])
    runner_copy = SACModule(OBS, ACT, {"fcnet_hiddens": [16]}, inference_only=True)
    assert not hasattr(runner_copy, "qf1")  # runners carry the actor alone
    with pytest.raises(ValueError, match="SAC needs a 1-d Box or a Discrete action space, got MultiDiscrete"):
        SACModule(OBS, gym.spaces.MultiDiscrete([2, 3]))
    box = SACModule(OBS, gym.spaces.Box(-1, 1, (2,), np.float32))
    with pytest.raises(ValueError, match="all_q_values is for Discrete action spaces"):
        box.all_q_values(b["obs"])


@pytest.mark.parametrize("twin_q", [True, False])
def test_critic_loss_backs_up_the_expected_soft_value_of_the_next_state(twin_q):
    module, target, b = setup()
    alpha = torch.tensor(0.3)
    config = SACConfig(twin_q=twin_q)
    loss, stats, td = sac_critic_loss(module, target, b, config, alpha)
    with torch.no_grad():
        pi = torch.softmax(module.forward_inference(b["next_obs"])["action_dist_inputs"], -1)
        tq1, tq2 = target.all_q_values(b["next_obs"])
        q_next = torch.min(tq1, tq2) if twin_q else tq1
        v_next = sum(pi[:, a] * (q_next[:, a] - alpha * torch.log(pi[:, a])) for a in range(3))
        y = b["rewards"] + b["discounts"] * v_next
        q1, q2 = module.q_values(b["obs"], b["actions"])
    expected = 0.5 * ((q1 - y) ** 2).mean() + (0.5 * ((q2 - y) ** 2).mean() if twin_q else 0.0)
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    torch.testing.assert_close(td, 0.5 * ((q1 - y).abs() + (q2 - y).abs()) if twin_q else (q1 - y).abs())
    # no sample is drawn: the same batch gives the same loss
    again, _, _ = sac_critic_loss(module, target, b, config, alpha)
    assert float(again.detach()) == float(loss.detach())
    loss.backward()
    trained = [p for n, p in module.named_parameters() if n.startswith(("q_encoder.", "qf1.", "qf2." if twin_q else "qf1."))]
    assert trained and all(p.grad is not None for p in trained)
    assert all(p.grad is None for p in module.actor_parameters())  # the backup is a constant for the critics


def test_actor_loss_is_the_policys_expectation_and_feeds_the_temperature():
    module, _, b = setup()
    alpha = torch.tensor(0.2)
    loss, stats, logp = sac_actor_loss(module, b, SACConfig(), alpha)
    with torch.no_grad():
        pi = torch.softmax(module.forward_inference(b["obs"])["action_dist_inputs"], -1)
        q = torch.min(*module.all_q_values(b["obs"]))
        expected = (pi * (alpha * torch.log(pi) - q)).sum(-1).mean()
        neg_entropy = (pi * torch.log(pi)).sum(-1)
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-5)
    torch.testing.assert_close(logp, neg_entropy)
    assert float(stats["entropy"]) == pytest.approx(float(-neg_entropy.mean()), rel=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in module.actor_parameters())
    # the temperature rises while the entropy is below the target and falls above it
    target_entropy = auto_target_entropy(ACT, 0.3)
    log_alpha = torch.zeros((), requires_grad=True)
    sac_alpha_loss(log_alpha, torch.full((8,), -0.1), target_entropy).backward()  # entropy 0.1 < 0.33
    assert float(log_alpha.grad) < 0
    log_alpha.grad = None
    sac_alpha_loss(log_alpha, torch.full((8,), -1.0), target_entropy).backward()  # entropy 1.0 > 0.33
    assert float(log_alpha.grad) > 0


def test_the_temperatures_automatic_target():
    assert auto_target_entropy(ACT, 0.3) == pytest.approx(0.3 * math.log(3))
    assert auto_target_entropy(gym.spaces.Box(-1, 1, (2,), np.float32), 0.3) == -2.0
    learner_config = SACConfig().environment("CartPole-v1").training(discrete_target_entropy_scale=0.5)
    learner_config.validate()
    for bad in (0, 1.0, "high"):
        with pytest.raises(ConfigError, match=rf"discrete_target_entropy_scale must be a number in \(0, 1\), got {bad!r}"):
            SACConfig().environment("CartPole-v1").training(discrete_target_entropy_scale=bad).validate()


def test_runners_act_with_the_numpy_export_of_the_actor():
    module, _, b = setup()
    policy = NumpyPolicy(export_policy(module))
    logits = module.forward_inference(b["obs"])["action_dist_inputs"].detach().numpy()
    np.testing.assert_allclose(policy.dist_inputs(b["obs"].numpy()), logits, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="SACModule with Discrete actions"):
        export_policy(SACModule(OBS, gym.spaces.Box(-1, 1, (2,), np.float32)))


def test_cql_refuses_discrete_actions_at_build_naming_the_alternatives():
    config = (CQLConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
              .offline_data(input_="tests/data/cartpole_expert"))
    with pytest.raises(ConfigError, match="CQL needs a 1-d Box action space, got Discrete.*BC or MARWIL"):
        config.build()


def test_two_discrete_sac_policies_train_on_two_agent_cartpole():
    """A multi-agent run: each module its own categorical actor, critics and temperature, updated from its own
    buffer (a smoke check of the plumbing; the learning run is the single-agent one)."""
    from pipeline import make_multi_agent
    from tests.pieces import by_agent

    config = (SACConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
              .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
              .training(train_batch_size_per_learner=32, training_intensity=32, num_steps_sampled_before_learning_starts=64,
                        replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 5_000})
              .rl_module(model_config={"fcnet_hiddens": [16]}).env_runners(num_env_runners=0).debugging(seed=0))
    algo = config.build(logdir=None)
    try:
        result = {}
        while result.get("num_env_steps_sampled_lifetime", 0) < 400:
            result = algo.train()
        for mid in ("p0", "p1"):
            stats = result["learners"][mid]
            assert stats["target_entropy"] == pytest.approx(0.3 * math.log(2)) and np.isfinite(stats["qf_loss"])
            assert algo.get_module(mid).discrete
        assert algo.compute_single_action(np.zeros(4, np.float32), policy_id="p1") in (0, 1)
    finally:
        algo.stop()
