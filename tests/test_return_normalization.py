"""``model_config normalize_returns``: the value head learns value targets standardised by their running mean and
variance (learners fold in each train batch's targets before its update); the module reports values in the env's
units and the value losses are squared errors of standardised values. The statistics' arithmetic and the losses
on fixed tensors; the learners' updates on CartPole."""
from __future__ import annotations

from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from actors.modules import ActorCriticModule
from actors.modules.normalizers import ReturnNormalizer, return_normalizers
from pipeline import APPOConfig, DQNConfig, IMPALAConfig, MARWILConfig, PPOConfig, register_env
from pipeline.algorithm_results import lookup
from pipeline.algorithms.appo.learner import appo_loss
from pipeline.algorithms.impala.learner import impala_loss
from pipeline.algorithms.ppo.learner import PPOLearner, ppo_loss
from tests.helpers import small_batches_config, train_steps, train_until

ROOT = Path(__file__).resolve().parents[1]
OBS = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
ACTS = gym.spaces.Discrete(2)
NORMALIZED = {"normalize_returns": True}


def module_with_stats(mean: float, var: float) -> ActorCriticModule:
    torch.manual_seed(0)
    module = ActorCriticModule(OBS, ACTS, NORMALIZED)
    module.return_normalizer.merge(torch.tensor(mean, dtype=torch.float64), torch.tensor(var, dtype=torch.float64),
                                   10)
    return module


def test_folded_targets_give_their_moments_and_the_module_reports_values_in_the_envs_units():
    torch.manual_seed(0)
    plain = ActorCriticModule(OBS, ACTS)
    torch.manual_seed(0)
    module = ActorCriticModule(OBS, ACTS, NORMALIZED)
    obs = torch.rand(5, 4)
    with torch.no_grad():  # before any statistics: the identity
        assert torch.allclose(module.compute_values(obs), plain.compute_values(obs))
    targets = [np.random.default_rng(i).normal(40.0, 7.0, n).astype(np.float32) for i, n in enumerate((30, 1, 9))]
    [norm] = return_normalizers(module)
    for t in targets:
        norm.fold_in(torch.from_numpy(t))
    rows = np.concatenate(targets)
    assert float(norm.return_count) == 40
    assert float(norm.return_mean) == pytest.approx(rows.mean(), abs=1e-4)
    assert float(norm.return_var) == pytest.approx(rows.var(), rel=1e-4)
    std = np.sqrt(rows.var() + ReturnNormalizer.EPSILON)
    with torch.no_grad():
        expected = plain.compute_values(obs) * std + rows.mean()
        assert torch.allclose(module.compute_values(obs), expected, atol=1e-4)
        assert torch.allclose(module.forward_train(obs)["vf_preds"], expected, atol=1e-4)


def test_runner_copies_carry_no_statistics_and_full_states_do():
    module = module_with_stats(3.0, 4.0)
    full = module.get_state()
    assert {"return_normalizer.return_mean", "return_normalizer.return_var", "return_normalizer.return_count"} <= set(full)
    inference = module.get_state(inference_only=True)
    assert not [k for k in inference if k.startswith("return_normalizer.")]
    runner = ActorCriticModule(OBS, ACTS, NORMALIZED, inference_only=True)
    assert runner.return_normalizer is None and return_normalizers(runner) == []
    runner.set_state(full)  # what a runner is given from a full state: the statistics are left out
    again = ActorCriticModule(OBS, ACTS, NORMALIZED)
    again.set_state(full)
    assert float(again.return_normalizer.return_mean) == 3.0 and float(again.return_normalizer.return_var) == 4.0


def fake_batch(module: ActorCriticModule, n: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    obs = torch.rand(n, 4, generator=g)
    with torch.no_grad():
        dist_inputs = module.forward_train(obs)["action_dist_inputs"]
    actions = torch.randint(0, 2, (n,), generator=g)
    logp = module.action_dist(dist_inputs).logp(actions)
    targets = 50.0 + 20.0 * torch.randn(n, generator=g)
    return {"obs": obs, "actions": actions, "action_logp": logp, "action_dist_inputs": dist_inputs,
            "old_action_logp": logp, "old_action_dist_inputs": dist_inputs, "advantages": torch.randn(n, generator=g),
            "pg_advantages": torch.randn(n, generator=g), "value_targets": targets, "vtrace_targets": targets}


@pytest.mark.parametrize("algo", ["PPO", "IMPALA", "APPO"])
def test_value_losses_are_squared_errors_of_standardised_values(algo):
    """The same module and batch: the value loss is that of the plain formula on values and targets both
    standardised by the statistics, and its gradient reaches the value head as the standardised error's."""
    module = module_with_stats(45.0, 400.0)
    batch = fake_batch(module)
    std = float(np.sqrt(400.0 + ReturnNormalizer.EPSILON))
    if algo == "PPO":
        config, half = PPOConfig().training(vf_clip_param=1e9, vf_loss_coeff=1.0), 1.0
        loss_fn = lambda: ppo_loss(module, batch, config, kl_coeff=0.0, entropy_coeff=0.0)  # noqa: E731
    elif algo == "IMPALA":
        config, half = IMPALAConfig().training(vf_loss_coeff=1.0), 0.5
        loss_fn = lambda: impala_loss(module, batch, config, 0.0)  # noqa: E731
    else:
        config, half = APPOConfig().training(vf_loss_coeff=1.0), 0.5
        loss_fn = lambda: appo_loss(module, batch, config, 0.0, 0.0)  # noqa: E731
    total, stats = loss_fn()
    with torch.no_grad():
        values = module.compute_values(batch["obs"])
    expected = half * (((values - 45.0) / std - (batch["value_targets"] - 45.0) / std) ** 2).mean()
    assert float(stats["vf_loss"]) == pytest.approx(float(expected), rel=1e-5)
    # the head's outputs are the standardised values: the value head's gradient (the policy's part of the loss
    # does not reach it: separate trunks) is that of the standardised error, not std times it
    module.zero_grad()
    total.backward()
    got = module.vf_head.bias.grad.clone()
    module.zero_grad()
    head_out = module.vf_head(module.vf_trunk(module.encoder(batch["obs"]))).squeeze(-1)
    (half * (head_out - (batch["value_targets"] - 45.0) / std).pow(2).mean()).backward()
    assert torch.allclose(got, module.vf_head.bias.grad, rtol=1e-4, atol=1e-6)


def test_data_parallel_learners_pool_their_targets():
    learner = PPOLearner(PPOConfig().environment("CartPole-v1").rl_module(model_config=NORMALIZED), OBS, ACTS)
    mine, theirs = np.arange(6, dtype=np.float32), np.arange(100, 110, dtype=np.float32)
    other = np.array([10.0, theirs.mean() * 10, (theirs.var() + theirs.mean() ** 2) * 10])
    learner.world_size = 2
    learner.allreduce_mean = lambda values: (values + other) / 2
    learner.update_return_stats(mine)
    [norm] = return_normalizers(learner.module)
    both = np.concatenate([mine, theirs]).astype(np.float64)
    assert float(norm.return_count) == 16
    assert float(norm.return_mean) == pytest.approx(both.mean())
    assert float(norm.return_var) == pytest.approx(both.var(), rel=1e-6)


def test_algorithms_whose_learners_keep_no_return_statistics_refuse_the_setting():
    with pytest.raises(ValueError, match="normalize_returns.*(PPO|IMPALA|APPO)"):
        DQNConfig().environment("CartPole-v1").rl_module(model_config=NORMALIZED).validate()
    with pytest.raises(ValueError, match="normalize_returns.*(PPO|IMPALA|APPO)"):
        MARWILConfig().environment("CartPole-v1").rl_module(model_config=NORMALIZED).validate()


def record_return_targets(learner) -> tuple[list, ReturnNormalizer]:
    """Wrap the (in-process) learner's ``update_return_stats`` to keep a copy of every batch of targets it is given;
    returns that list and the learner's own normalizer."""
    seen: list = []
    update = learner.update_return_stats

    def recording(targets):
        seen.append(torch.as_tensor(targets).detach().cpu().double().reshape(-1).clone())
        update(targets)

    learner.update_return_stats = recording
    [norm] = return_normalizers(learner.module)
    return seen, norm


@pytest.mark.parametrize("config_class", [PPOConfig, IMPALAConfig, APPOConfig])
def test_learners_fold_in_the_value_targets_of_every_trained_batch_once(config_class):
    """The statistics after training are the moments of exactly the value targets the learner computed, each
    trained batch's once (the targets themselves depend on the run: V-trace's bootstrap on the values of the day).
    Read after ``stop()``, when nothing trains any more."""
    algo = small_batches_config(config_class, "CartPole-v1", NORMALIZED).build()
    try:
        [(seen, norm)] = algo.learner_group.foreach_learner(record_return_targets)  # the learner is in this process
        results = train_steps(algo, 128)
        trained = lookup(results[-1], "num_env_steps_trained_lifetime")
    finally:
        algo.stop()
    targets = torch.cat(seen)
    count, mean, var = float(norm.return_count), float(norm.return_mean), float(norm.return_var)
    assert count == len(targets) >= trained > 0
    assert mean == pytest.approx(float(targets.mean()), rel=1e-5, abs=1e-5)
    assert var == pytest.approx(float(targets.var(unbiased=False)), rel=1e-4) and var > 0


class HundredfoldRewards(gym.RewardWrapper):
    def reward(self, reward):
        return 100.0 * reward


register_env("cartpole_x100", lambda cfg: HundredfoldRewards(gym.make("CartPole-v1")))


@pytest.mark.learning
def test_ppo_learns_a_hundredfold_reward_cartpole_as_the_plain_one_and_without_the_setting_its_critic_does_not():
    """CartPole paying 100 a step, PPO with the tuned CartPole file's settings (runners in the driver). The value
    errors are then ~10^4 times CartPole's, beyond PPO's ``vf_clip_param`` (10), so without normalize_returns every
    value error is clipped and the critic learns nothing (explained variance 0 throughout, measured); with it the
    critic explains most of the variance within 12 iterations and the run reaches CartPole's 450 (45,000 here)
    in about the plain task's env steps (57k-59k for seeds 0-2 against 54k-64k unscaled; without the setting 1
    of those 3 seeds reached it within 150k)."""
    spec = yaml.safe_load(open(ROOT / "tuned" / "cartpole-ppo.yaml"))

    def build(normalize: bool):
        config = PPOConfig().environment("cartpole_x100").debugging(seed=0)
        config.update_from_dict(spec["config"])
        return config.env_runners(num_env_runners=0).rl_module(model_config={"normalize_returns": normalize}).build()

    history = {}
    for normalize in (False, True):
        algo = build(normalize)
        try:
            results = [algo.train() for _ in range(12)]
            history[normalize] = [lookup(r, "learners/default_policy/vf_explained_var") for r in results]
            if normalize:
                while results[-1]["env_runners"].get("episode_return_mean", 0) < 45_000:
                    assert results[-1]["num_env_steps_sampled_lifetime"] < 150_000, \
                        f"not at 45,000 within 150k env steps: {results[-1]['env_runners']}"
                    results.append(algo.train())
        finally:
            algo.stop()
    assert max(abs(v) for v in history[False]) < 0.05, history[False]
    assert max(history[True]) > 0.5, history[True]


@pytest.mark.learning
def test_the_tuned_pendulum_ppo_file_reaches_minus_400_within_its_budget():
    """``tuned/pendulum-ppo.yaml`` (normalize_returns on), seed 0, runners in the driver: measured at 52k env
    steps (seeds 0-4: 52k-56k); the file's budget is 300k, which 4 of those 5 seeds did not meet without the setting."""
    spec = yaml.safe_load(open(ROOT / "tuned" / "pendulum-ppo.yaml"))
    assert spec["config"]["model_config"] == NORMALIZED
    config = PPOConfig().environment(spec["env"]).debugging(seed=0)
    config.update_from_dict(spec["config"])
    algo = config.env_runners(num_env_runners=0).build()
    target, budget = spec["stop"]["env_runners/episode_return_mean"], spec["stop"]["num_env_steps_sampled_lifetime"]
    try:
        best, result = train_until(algo, target, budget)
    finally:
        algo.stop()
    assert best >= target, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} env steps"
