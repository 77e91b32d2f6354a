"""DQN and SAC: losses on fake batches, config errors at build, exact resume, the remote replay
stage and its fault tolerance. The learning tests (CartPole, Pendulum) are in test_offpolicy_learning.py."""
import math
import tempfile

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.modules import QModule, SACModule
from pipeline import Algorithm, ConfigError, DQNConfig, SACConfig
from pipeline.algorithms.dqn.learner import categorical_projection, dqn_loss
from pipeline.algorithms.sac.learner import sac_actor_loss, sac_alpha_loss, sac_critic_loss
from tests.helpers import straight_and_resumed

OBS = gym.spaces.Box(-1, 1, (3,), np.float32)


def fake_batch(n=32, act_space=gym.spaces.Discrete(2), seed=0, terminal_every=4):
    g = np.random.default_rng(seed)
    actions = np.stack([act_space.sample() for _ in range(n)]) if not isinstance(act_space, gym.spaces.Discrete) \
        else g.integers(act_space.n, size=n)
    terminated = np.arange(n) % terminal_every == 0
    return {"obs": torch.as_tensor(g.normal(size=(n, 3)), dtype=torch.float32),
            "actions": torch.as_tensor(actions),
            "rewards": torch.as_tensor(g.normal(size=n), dtype=torch.float32),
            "next_obs": torch.as_tensor(g.normal(size=(n, 3)), dtype=torch.float32),
            "discounts": torch.as_tensor(np.where(terminated, 0.0, 0.99 ** 3), dtype=torch.float32),
            "weights": torch.ones(n)}


# --- DQN's loss -------------------------------------------------------------------------------
@pytest.mark.parametrize("double_q", [True, False])
def test_dqn_loss_matches_the_bellman_target(double_q):
    torch.manual_seed(0)
    module, target = QModule(OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [8]}), \
        QModule(OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [8]})
    b = fake_batch()
    cfg = DQNConfig(double_q=double_q, td_error_loss_fn="mse")
    loss, stats, td = dqn_loss(module, target, b, cfg)
    with torch.no_grad():
        q = module.forward_inference(b["obs"])["action_dist_inputs"].gather(1, b["actions"][:, None]).squeeze(1)
        tq = target.forward_inference(b["next_obs"])["action_dist_inputs"]
        pick = module.forward_inference(b["next_obs"])["action_dist_inputs"] if double_q else tq
        y = b["rewards"] + b["discounts"] * tq.gather(1, pick.argmax(1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(td, (y - q).abs())
    assert float(loss.detach()) == pytest.approx(float((0.5 * (y - q) ** 2).mean()), rel=1e-5)
    terminal = b["discounts"] == 0  # nothing is bootstrapped after a terminal step
    torch.testing.assert_close(td[terminal], (b["rewards"][terminal] - q[terminal]).abs())
    assert {"qf_loss", "qf_mean", "td_error_mean"} <= set(stats)


def test_dqn_loss_importance_weights_scale_each_sample():
    torch.manual_seed(0)
    module, target = QModule(OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [8]}), \
        QModule(OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [8]})
    b = fake_batch()
    base, _, _ = dqn_loss(module, target, b, DQNConfig())
    b["weights"] = torch.full_like(b["weights"], 0.5)
    half, _, _ = dqn_loss(module, target, b, DQNConfig())
    assert float(half.detach()) == pytest.approx(0.5 * float(base.detach()), rel=1e-6)


def test_dqn_multidiscrete_branches_are_trained_each_against_its_own_target():
    torch.manual_seed(0)
    space = gym.spaces.MultiDiscrete([2, 3])
    space.seed(0)
    module, target = QModule(OBS, space, {"fcnet_hiddens": [8]}), QModule(OBS, space, {"fcnet_hiddens": [8]})
    b = fake_batch(act_space=space)
    loss, _, td = dqn_loss(module, target, b, DQNConfig(double_q=False, td_error_loss_fn="mse"))
    per_branch = []
    with torch.no_grad():
        q_all = module.forward_inference(b["obs"])["action_dist_inputs"]
        tq_all = target.forward_inference(b["next_obs"])["action_dist_inputs"]
    for i, (lo, hi) in enumerate(((0, 2), (2, 5))):
        q = q_all[:, lo:hi].gather(1, b["actions"][:, i : i + 1]).squeeze(1)
        y = b["rewards"] + b["discounts"] * tq_all[:, lo:hi].max(1).values
        per_branch.append((y - q).abs())
    torch.testing.assert_close(td, torch.stack(per_branch).mean(0))
    assert float(loss.detach()) == pytest.approx(float(torch.stack([(0.5 * d ** 2).mean() for d in per_branch]).mean()), rel=1e-5)


def test_c51_projection_keeps_mass_and_shifts_the_mean():
    support = torch.linspace(-10, 10, 51)
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(16, 51, generator=g), -1)
    rewards, discounts = torch.rand(16, generator=g) - 0.5, torch.full((16,), 0.5)
    out = categorical_projection(probs, rewards, discounts, support)
    torch.testing.assert_close(out.sum(-1), torch.ones(16))
    # inside the support the projection keeps the mean of r + discount * Z exactly
    torch.testing.assert_close((out * support).sum(-1), rewards + discounts * (probs * support).sum(-1), atol=1e-4,
                               rtol=0)
    # a terminal step: all mass on the reward (between its two neighbouring atoms)
    term = categorical_projection(probs[:1], torch.tensor([1.0]), torch.tensor([0.0]), support)
    assert float((term * support).sum()) == pytest.approx(1.0, abs=1e-5) and int((term > 0).sum()) <= 2


def test_c51_loss_trains_toward_the_projected_target():
    torch.manual_seed(0)
    module = QModule(OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [16]}, num_atoms=11, v_min=-2, v_max=2)
    target = QModule(OBS, gym.spaces.Discrete(2), {"fcnet_hiddens": [16]}, num_atoms=11, v_min=-2, v_max=2)
    b = fake_batch()
    b["rewards"] = torch.ones_like(b["rewards"])
    b["discounts"] = torch.zeros_like(b["discounts"])  # target: every return is exactly 1
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    first = None
    for _ in range(200):
        loss, _, _ = dqn_loss(module, target, b, DQNConfig(num_atoms=11, v_min=-2, v_max=2))
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    q = module.forward_inference(b["obs"])["action_dist_inputs"].gather(1, b["actions"][:, None])
    assert float(loss.detach()) < first and torch.allclose(q, torch.ones_like(q), atol=0.05)


# --- SAC's losses -----------------------------------------------------------------------------
def sac_setup():
    torch.manual_seed(0)
    act = gym.spaces.Box(-2, 2, (2,), np.float32)
    module, target = SACModule(OBS, act, {"fcnet_hiddens": [16]}), SACModule(OBS, act, {"fcnet_hiddens": [16]})
    b = fake_batch(act_space=act)
    b["actions"] = b["actions"].float().clamp(-1, 1)
    return module, target, b


def test_sac_critic_loss_targets_the_soft_bellman_backup():
    module, target, b = sac_setup()
    alpha = torch.tensor(0.3)
    torch.manual_seed(1)
    loss, _, td = sac_critic_loss(module, target, b, SACConfig(), alpha)
    torch.manual_seed(1)  # the same next actions
    with torch.no_grad():
        dist = module.action_dist(module.forward_inference(b["next_obs"])["action_dist_inputs"])
        a2, logp2 = dist.rsample_with_logp()
        y = b["rewards"] + b["discounts"] * (torch.min(*target.q_values(b["next_obs"], a2)) - alpha * logp2)
        q1, q2 = module.q_values(b["obs"], b["actions"])
    assert float(loss.detach()) == pytest.approx(float(0.5 * ((q1 - y) ** 2).mean() + 0.5 * ((q2 - y) ** 2).mean()), rel=1e-5)
    torch.testing.assert_close(td, 0.5 * ((q1 - y).abs() + (q2 - y).abs()))


def test_sac_actor_and_temperature_losses_move_the_right_way():
    module, _, b = sac_setup()
    loss, stats, logp = sac_actor_loss(module, b, SACConfig(), torch.tensor(0.2))
    loss.backward()
    assert all(p.grad is not None for p in module.actor_parameters())
    # entropy below target (log-probs high) raises the temperature; above it lowers it
    log_alpha = torch.zeros((), requires_grad=True)
    sac_alpha_loss(log_alpha, torch.full((8,), 5.0), target_entropy=-2.0).backward()
    assert float(log_alpha.grad) < 0  # gradient descent increases log_alpha
    log_alpha.grad = None
    sac_alpha_loss(log_alpha, torch.full((8,), -5.0), target_entropy=-2.0).backward()
    assert float(log_alpha.grad) > 0


def test_squashed_gaussian_log_prob_matches_a_change_of_variables():
    from actors.modules.distributions import SquashedGaussian

    inputs = torch.tensor([[0.3, -0.5, -0.7, 0.2]])
    d = SquashedGaussian(inputs)
    a, logp = d.rsample_with_logp()
    normal = torch.distributions.Normal(d.mean, d.std)
    z = torch.atanh(a)
    expected = (normal.log_prob(z) - torch.log(1 - a.pow(2))).sum(-1)
    torch.testing.assert_close(logp, expected, atol=1e-4, rtol=1e-4)
    assert float(a.abs().max()) < 1.0


# --- bad input at build ------------------------------------------------------------------------
class TwoDiscreteActions(gym.Env):
    """An action space SAC has no policy for (MultiDiscrete)."""
    observation_space = OBS
    action_space = gym.spaces.MultiDiscrete([2, 3])

    def __init__(self, config=None):
        pass

    def reset(self, *, seed=None, options=None):
        return np.zeros(3, np.float32), {}

    def step(self, action):
        return np.zeros(3, np.float32), 0.0, True, False, {}


@pytest.mark.parametrize("make, needle", [
    (lambda: DQNConfig().environment("Pendulum-v1"), "DQN needs Discrete or MultiDiscrete actions"),
    (lambda: SACConfig().environment(TwoDiscreteActions), "SAC needs a 1-d Box or a Discrete action space"),
    (lambda: DQNConfig().environment("CartPole-v1").training(
        replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 16}), "smaller than a train batch"),
    (lambda: DQNConfig().environment("CartPole-v1").training(n_step=[5, 2]), "n_step"),
    (lambda: DQNConfig().environment("CartPole-v1").training(
        replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capcity": 100}), "did you mean 'capacity'"),
    (lambda: DQNConfig().environment("CartPole-v1").training(
        replay_buffer_config={"type": "FancyBuffer"}), "is not one of"),
    (lambda: DQNConfig().environment("CartPole-v1").training(
        replay_buffer_config={"type": "EpisodeReplayBuffer", "samples_per_insert": 4, "min_size_to_sample": 100,
                              "error_buffer": [500, 900]}), "deadlock"),
    (lambda: DQNConfig().environment("CartPole-v1").training(replay_buffer_config={"remote": True}),
     "remote=True needs num_env_runners"),
    (lambda: DQNConfig().environment("tests.envs:DictObsEnv").training(num_atoms=51, v_min=0, v_max=1).env_runners(
        num_env_runners=0).rl_module(model_config={"fcnet_hiddens": [8]}), None),
])
def test_bad_off_policy_settings_fail_at_build_naming_the_fix(make, needle):
    config = make().env_runners(num_env_runners=0)
    if needle is None:  # the counter-example: a valid distributional config builds
        config.build().stop()
        return
    with pytest.raises(ConfigError, match=needle):
        config.build()


# --- exact resume --------------------------------------------------------------------------------
def small_dqn(seed=3):
    return (DQNConfig().environment("CartPole-v1")
            # separate sub-envs: their running episodes go into the checkpoint (CartPole's own vector env's do not)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=8,
                         gym_env_vectorize_mode="sync")
            .training(num_steps_sampled_before_learning_starts=64, train_batch_size_per_learner=16,
                      training_intensity=4, store_buffer_in_checkpoints=True, target_network_update_freq=50)
            .rl_module(model_config={"fcnet_hiddens": [16]})
            .reporting(min_sample_timesteps_per_iteration=0)  # an iteration per training step (16 env steps)
            .debugging(seed=seed))


def assert_same_tree(a, b, path="state"):
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, path


def test_dqn_resumes_exactly_from_a_checkpoint_with_its_buffer():
    """k iterations, save (buffer included), restore, m more == k + m uninterrupted: weights, every
    replay array and counter, and the runner's episodes continue bit for bit."""
    with straight_and_resumed(lambda: small_dqn().build(), k=12, m=10) as (straight, restored):
        wa, wb = straight.get_weights(), restored.get_weights()
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
        assert_same_tree(straight.plan.replay.get_state(), restored.plan.replay.get_state())
        assert straight.counters == restored.counters and straight.iteration == restored.iteration
        ta, tb = straight.learner_group.local.targets["target"], restored.learner_group.local.targets["target"]
        for name, v in ta.state_dict().items():
            torch.testing.assert_close(tb.state_dict()[name], v, rtol=0, atol=0)


def test_checkpoint_without_the_buffer_restores_weights_and_starts_an_empty_replay():
    algo = small_dqn().training(store_buffer_in_checkpoints=False).build()
    try:
        for _ in range(12):
            algo.train()
        path = algo.save(tempfile.mkdtemp() + "/checkpoint")
        weights = algo.get_weights()
    finally:
        algo.stop()
    restored = Algorithm.from_checkpoint(path)
    try:
        assert len(restored.plan.replay) == 0
        for name, v in weights.items():
            np.testing.assert_array_equal(restored.get_weights()[name], v)
        restored.train()  # refills before it learns again
    finally:
        restored.stop()


def test_runner_state_arrays_sharing_one_buffer_are_saved_and_read_back(tmp_path):
    # Remote runners' states arrive as read-only views into one Ray buffer; arrays of different
    # dtypes over the same memory must not make torch.save refuse the checkpoint.
    from pipeline.checkpoints.directory import read_extras, write_checkpoint

    raw = np.arange(64, dtype=np.uint8)
    raw.flags.writeable = False
    runners = {"0": {"actions": raw[:32].view(np.int64), "bytes": raw[:32], "seeds": raw[32:].view(np.uint32)}}
    path = write_checkpoint(tmp_path / "ckpt", "DQN", {}, {"weights": {}}, {}, runner_states=runners)
    restored, _ = read_extras(path)
    for key, value in runners["0"].items():
        np.testing.assert_array_equal(restored["0"][key], value)
        assert restored["0"][key].dtype == value.dtype
