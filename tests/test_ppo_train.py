"""PPO learning tests with Ray actors: CartPole to 450 on defaults, checkpoints, data-parallel learners.

These are seeded and have generous step budgets; they assert returns, never wall-clock time.
"""
import numpy as np
import pytest
import torch
import yaml

from pipeline import Algorithm, PPOConfig
from pipeline.config.base import ConfigError
from tests.helpers import train_until
from tests.envs import DictObsEnv

pytestmark = pytest.mark.usefixtures("ray_cluster")


OBS = np.array([0.01, -0.02, 0.03, 0.0], np.float32)


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory):
    """PPO's defaults with 2 remote env runners, trained to a mean return of 450 (max 400k steps).

    The budget is twice the slowest seen: seeds and torch thread counts (one thread after a test that
    sampled in the driver, two alone) take 86k-228k steps; the 200k target is the benchmark's to report
    (tests/benchmarks/ppo_cartpole.py, a median over seeds), not a test's to bet on.

    The algorithm is stopped before the tests run (its actors would hold the module's CPUs);
    what they compare against is captured here."""
    algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2).debugging(seed=0).build()
    try:
        best, result = train_until(algo, 450, 400_000)
        # the smoothed training return (sampled actions, last 100 episodes) can cross 450 a little
        # before the greedy policy holds it: the checkpoint tests evaluate greedily, so train on until
        # it does (same budget)
        while (result["num_env_steps_sampled_lifetime"] < 400_000
               and algo.evaluate_episodes(5)["episode_return_mean"] < 450):
            result = algo.train()
        path = algo.save(str(tmp_path_factory.mktemp("ckpt") / "cartpole"))
        saved = {"learner": algo.learner_group.get_state(), "counters": dict(algo.counters),
                 "iteration": algo.iteration, "weights_version": algo.weights_version,
                 "action": algo.compute_single_action(OBS)}
    finally:
        algo.stop()
    return best, result, path, saved


@pytest.mark.learning
def test_cartpole_defaults_reach_450(cartpole_run):
    best, result, _, _ = cartpole_run
    assert best >= 450, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
    assert result["num_env_steps_sampled_lifetime"] <= 400_000
    # RLlib's result layout
    assert result["env_runners"]["episode_len_mean"] > 0
    assert result["env_runners"]["num_env_steps_sampled_lifetime"] == result["num_env_steps_sampled_lifetime"]
    for key in ("policy_loss", "vf_loss", "entropy", "mean_kl_loss", "curr_lr", "gradients_global_norm"):
        assert np.isfinite(result["learners"]["default_policy"][key])
    assert result["fault_tolerance"]["num_healthy_workers"] == 2
    assert {"training_iteration", "time_this_iter_s", "time_total_s"} <= set(result)
    assert "env_runner_sampling_timer" in result["timers"]


@pytest.mark.learning
def test_the_tuned_cartpole_file_reaches_450_within_120k_steps():
    """``make train``'s file: seeds 0-14 reached 450 at 55k-73k env steps (the benchmark's figure, 2026-12-04);
    the budget leaves room for torch's thread count and the host, not for a different trajectory."""
    spec = yaml.safe_load(open("tuned/cartpole-ppo.yaml"))
    config = PPOConfig().environment(spec["env"]).debugging(seed=0)
    config.update_from_dict(spec["config"])
    algo = config.build()
    try:
        best, result = train_until(algo, 450, 120_000)
    finally:
        algo.stop()
    assert best >= 450, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
    assert result["fault_tolerance"]["num_healthy_workers"] == 2


@pytest.mark.learning
def test_checkpoint_restores_weights_counters_optimizer_and_continues(cartpole_run):
    _, _, path, saved = cartpole_run
    restored = Algorithm.from_checkpoint(path)
    try:
        a_state, b_state = saved["learner"], restored.learner_group.get_state()
        for k in a_state["module"]:
            torch.testing.assert_close(a_state["module"][k], b_state["module"][k], rtol=0, atol=0)
        a_opt, b_opt = a_state["optimizers"]["default"]["state"], b_state["optimizers"]["default"]["state"]
        for k in a_opt:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(a_opt[k][name], b_opt[k][name], rtol=0, atol=0)
        assert restored.counters == saved["counters"] and restored.iteration == saved["iteration"]
        assert restored.weights_version == saved["weights_version"]
        # the env runners act with the restored weights
        runner_w = restored.foreach_env_runner(lambda r: r.get_weights())[0]
        np.testing.assert_array_equal(runner_w["pi_head.weight"], a_state["module"]["pi_head.weight"].numpy())
        assert restored.compute_single_action(OBS) == saved["action"]
        result = restored.train()
        assert result["training_iteration"] == saved["iteration"] + 1
        assert result["num_env_steps_sampled_lifetime"] > saved["counters"]["num_env_steps_sampled_lifetime"]
        assert result["env_runners"]["episode_return_mean"] >= 400  # keeps the learned policy
    finally:
        restored.stop()


@pytest.mark.learning
def test_restored_policy_evaluates_at_450_or_more(cartpole_run):
    _, _, path, _ = cartpole_run
    algo = Algorithm.from_checkpoint(path, num_env_runners=0)
    try:
        out = algo.evaluate_episodes(5)
        assert out["episode_return_mean"] >= 450
    finally:
        algo.stop()


@pytest.mark.learning
def test_runnel_evaluate_on_the_checkpoint_reports_450_or_more(cartpole_run, capsys):
    import json

    from pipeline.cli.main import main

    _, _, path, _ = cartpole_run
    assert main(["evaluate", path, "--episodes", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["episode_return_mean"] >= 450


@pytest.mark.slow
def test_local_env_runner_trains():
    algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).debugging(seed=1).build()
    try:
        best, result = train_until(algo, 200, 100_000)
        assert best >= 200
        assert result["fault_tolerance"]["num_healthy_workers"] == 0
    finally:
        algo.stop()


@pytest.mark.slow
def test_two_learners_hold_identical_weights_after_every_update():
    algo = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1, num_envs_per_env_runner=8)
            .learners(num_learners=2).training(train_batch_size_per_learner=500, minibatch_size=250)
            .debugging(seed=3).build())
    try:
        returns = []
        for _ in range(12):
            result = algo.train()
            returns.append(result["env_runners"]["episode_return_mean"])
            w0, w1 = algo.learner_group.foreach_learner(lambda l: l.get_weights())
            for k in w0:
                np.testing.assert_array_equal(w0[k], w1[k])
        assert result["num_env_steps_trained_lifetime"] >= 12 * 1000
        assert max(returns[-3:]) > returns[0] + 20  # it learns, too
    finally:
        algo.stop()


def test_dict_observation_env_improves():
    algo = (PPOConfig().environment(DictObsEnv).env_runners(num_env_runners=0, num_envs_per_env_runner=8)
            .training(train_batch_size_per_learner=1000, minibatch_size=250).debugging(seed=0).build())
    try:
        first = algo.train()["env_runners"]["episode_return_mean"]
        best, _ = train_until(algo, 17, 40_000)
        assert first < 10 and best >= 17  # random play scores ~6.7 of 20
    finally:
        algo.stop()


def test_gpu_learner_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path is for CPU-only machines")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).learners(num_gpus_per_learner=1).build()


def test_bad_env_in_remote_runner_config_fails_at_build():
    with pytest.raises(ConfigError, match="unknown env"):
        PPOConfig().environment("NoSuchEnv-v0").build()


@pytest.mark.learning
def test_pendulum_box_actions_improve():
    """Measured (numpy acting, seeds 0-4): +200 over the first iteration's return at 44k, 36k, 32k, 28k and 32k env
    steps. With gamma 0.95 and lr 1e-3 the same seeds gained 58 to 340 within the budget: on the edge, whichever
    backend acted (torch missed it for seeds 2 and 4)."""
    algo = (PPOConfig().environment("Pendulum-v1").env_runners(num_env_runners=0, num_envs_per_env_runner=8)
            .training(gamma=0.9, lr=3e-3, train_batch_size_per_learner=4000, num_epochs=10)
            .reporting(metrics_num_episodes_for_smoothing=20).debugging(seed=0).build())
    try:
        first = algo.train()["env_runners"]["episode_return_mean"]
        best, result = train_until(algo, first + 200, 80_000)
        assert best >= first + 200, f"return went from {first} to at best {best}"
    finally:
        algo.stop()
