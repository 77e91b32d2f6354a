"""Learners and inference servers on a device, in one process (no Ray actors): PPO, APPO, DQN and SAC
train a few iterations with the learner on ``device``; its weights change, and what acts for the runner in
the driver -- its own module, or (central inference) an inference server on the same device -- acts with
the learner's latest weights and version.

The "cpu" cases run everywhere and keep the test itself honest; the "cuda" cases run only where torch sees
a CUDA device (``tests/benchmarks/gpu_check.sh`` runs them on a GPU machine)."""
import numpy as np
import pytest
import torch

from pipeline import APPOConfig, DQNConfig, PPOConfig, SACConfig

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def small(algo: str):
    """A few hundred steps an iteration, updates from the first one on."""
    if algo == "PPO":
        return PPOConfig().environment("CartPole-v1").training(train_batch_size_per_learner=256, minibatch_size=128,
                                                               num_epochs=2)
    if algo == "APPO":
        return APPOConfig().environment("CartPole-v1").training(train_batch_size_per_learner=100, minibatch_size=100,
                                                                broadcast_interval=1)
    # DQN and SAC: an iteration per training step, as these checks count a few of them
    if algo == "DQN":
        return DQNConfig().environment("CartPole-v1").training(
            train_batch_size_per_learner=32, num_steps_sampled_before_learning_starts=64
        ).reporting(min_sample_timesteps_per_iteration=0)
    return SACConfig().environment("Pendulum-v1").training(
        train_batch_size_per_learner=32, training_intensity=8, num_steps_sampled_before_learning_starts=64
    ).reporting(min_sample_timesteps_per_iteration=0)


def build(algo: str, device: str, central: bool, precision: str = "float32"):
    """``precision``: the learner's and the acting pass's (``learner_precision``, ``inference(precision=)``)."""
    gpus = 1 if device == "cuda" else 0
    config = (small(algo).env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=50)
              .rl_module(model_config={"fcnet_hiddens": [32, 32]})
              .learners(num_gpus_per_learner=gpus, learner_precision=precision).debugging(seed=0))
    config.inference(precision=precision)
    if central:
        config.inference(mode="central", num_gpus_per_inference_server=gpus)
    return config.build(logdir=None)


def actor_weights(algo) -> tuple[dict, int]:
    """The weights and version that act for the driver's runner: its module's, or its server's."""
    group = algo.env_runner_group
    if group.inference is not None:
        server = group.inference.manager.handle(0)
        return server.get_weights(), server.weights_version
    runner = algo.foreach_env_runner(lambda r: r)[0]
    assert runner.stop_streaming()  # a streaming runner (APPO) takes new weights between fragments: now
    return runner.get_weights(), runner.weights_version


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo,central", [("PPO", False), ("PPO", True), ("APPO", False), ("APPO", True),
                                          ("DQN", False), ("DQN", True), ("SAC", False), ("SAC", True)])
def test_learner_on_device_trains_and_what_acts_gets_its_weights(algo, central, device):
    check_training_on_device(build(algo, device, central), device, central)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo,central", [("PPO", True), ("APPO", False), ("DQN", True)])
def test_bfloat16_learner_and_acting_on_device(algo, central, device):
    """learner_precision and inference precision "bfloat16": the learner's autocast passes on the device train,
    and the bfloat16 copy that acts (a runner's, or a server's on the device) follows its weights."""
    a = build(algo, device, central, precision="bfloat16")
    try:
        assert a.learner_group.local.module.autocast_dtype == torch.bfloat16
        acting = a.env_runner_group.inference.manager.handle(0) if central else a.foreach_env_runner(lambda r: r)[0].acting
        assert acting.forward.precision == "bfloat16"
    except BaseException:
        a.stop()
        raise
    check_training_on_device(a, device, central)


def check_training_on_device(a, device: str, central: bool) -> None:
    """Three iterations: the learner's weights on ``device`` change and stay finite, and what acts holds them."""
    try:
        learner = a.learner_group.local
        assert {p.device.type for p in learner.module.parameters()} == {device}
        if central:
            assert a.env_runner_group.inference.manager.handle(0).forward.device.type == device
        before = a.learner_group.get_weights(inference_only=True)
        for _ in range(3):
            result = a.train()
        after = a.learner_group.get_weights(inference_only=True)
        assert result["num_env_steps_sampled_lifetime"] >= 3 * 100 and a.weights_version >= 2
        assert all(np.isfinite(w).all() for w in after.values())
        changed = [k for k in after if not np.allclose(before[k], after[k])]
        assert changed, "no weight changed in 3 iterations of training"
        acting, version = actor_weights(a)
        assert version == a.weights_version
        assert sorted(acting) == sorted(after)
        for k in after:
            np.testing.assert_allclose(acting[k], after[k], rtol=1e-6, atol=1e-7, err_msg=k)
    finally:
        a.stop()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["PPO lstm", "APPO frame stacking", "PPO mean-std filter"])
def test_recurrent_and_connector_learners_on_device(case, device):
    """The learner sides of issue 30 on the device: PPO unrolling LSTM sequences, APPO's loader rebuilding
    frame stacks, PPO on filtered observations -- weights change and stay finite, nothing is refused."""
    from pipeline.connectors import FrameStackingEnvToModule, MeanStdFilter

    algo_name = case.split()[0]
    config = (small(algo_name).env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=50)
              .learners(num_gpus_per_learner=1 if device == "cuda" else 0).debugging(seed=0))
    if case == "PPO lstm":
        config.rl_module(model_config={"use_lstm": True, "lstm_cell_size": 32, "max_seq_len": 10})
    elif case == "APPO frame stacking":
        config.env_runners(env_to_module_connector=lambda env: FrameStackingEnvToModule(num_frames=3))
    else:
        config.env_runners(env_to_module_connector=lambda env: MeanStdFilter())
    a = config.build(logdir=None)
    try:
        assert {p.device.type for p in a.learner_group.local.module.parameters()} == {device}
        before = a.learner_group.get_weights()
        for _ in range(3):
            result = a.train()
        after = a.learner_group.get_weights()
        assert result["learners"]["default_policy"].get("num_batches_refused", 0) == 0
        assert all(np.isfinite(w).all() for w in after.values())
        assert [k for k in after if not np.allclose(before[k], after[k])]
    finally:
        a.stop()


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_on_device_skips_a_non_finite_step_and_trains_the_rest(device):
    """On a GPU every learner's Adam is fused, and ``sgd`` leaves each step's skip to it (no read of the norm
    per step): a minibatch whose loss is infinite changes nothing, the others train, the means leave it out.
    On a CPU APPO's Adam is the unfused one, decided per step: the same outcome."""
    import gymnasium as gym

    from pipeline.algorithms.appo.config import APPOConfig as Config
    from pipeline.algorithms.appo.learner import APPOLearner

    obs, act = gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(2)
    learner = APPOLearner(Config(seed=0, model_config={"fcnet_hiddens": [8]}), obs, act, device=device)
    assert bool(learner.optimizers["default"].optimizer.defaults.get("fused")) == (device == "cuda")
    x = torch.ones(4, 3, device=device)

    def loss(scale):
        out = learner.module.forward_train(x)
        return scale * (out["action_dist_inputs"].sum() + out["vf_preds"].sum())

    before = {k: v.clone() for k, v in learner.module.state_dict().items()}
    scales = iter([float("inf"), 1.0, float("nan"), 1.0])
    stats = learner.sgd({"x": torch.zeros(8, 1, device=device)},
                        lambda mb: (loss(next(scales)), {"policy_loss": torch.tensor(2.0, device=device)}), 8, 2, 4, 1)
    assert stats["num_gradient_steps_skipped"] == 2.0 and stats["policy_loss"] == 2.0
    assert np.isfinite(stats["gradients_global_norm"])
    assert learner.num_gradient_steps_skipped == 2 and learner.num_updates == 2
    assert all(torch.isfinite(p).all() for p in learner.module.parameters())
    assert any(not torch.equal(v, before[k]) for k, v in learner.module.state_dict().items())
    assert all(int(s["step"]) == 2 for s in learner.optimizers["default"].optimizer.state_dict()["state"].values())
