"""``model_config normalize_input``: image observations standardised per pixel inside the CNN by running
statistics that learners update after each train batch and that travel with the weights (runners,
checkpoints). The statistics' arithmetic on fixed arrays; the learners' updates on a cheap frame env."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.modules import ActorCriticModule
from actors.modules.normalizers import InputNormalizer, input_normalizers
from actors.modules.export import export_policy
from pipeline import APPOConfig, Algorithm, DQNConfig, PolicySpec, PPOConfig, register_env
from pipeline.algorithm_results import lookup
from pipeline.algorithms.ppo.learner import PPOLearner
from tests.envs import FrameEnv
from tests.helpers import small_batches_config, train_steps

SPACE = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
NORMALIZED = {"normalize_input": True}

register_env("norm_frames", lambda cfg: FrameEnv(cfg))


def frames(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n,) + SPACE.shape, dtype=np.uint8))


def test_merged_batches_give_the_moments_of_all_their_rows():
    norm = InputNormalizer((3, 2))
    rng = np.random.default_rng(0)
    parts = [rng.normal(5.0, 3.0, (n, 3, 2)).astype(np.float32) for n in (7, 1, 12)]
    for part in parts:
        norm.merge(*InputNormalizer.moments(torch.from_numpy(part)), len(part))
    rows = np.concatenate(parts)
    assert float(norm.input_count) == 20
    assert np.allclose(norm.input_mean.numpy(), rows.mean(0), atol=1e-5)
    assert np.allclose(norm.input_var.numpy(), rows.var(0), atol=1e-4)
    norm.merge(torch.zeros(3, 2, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64), 0)  # nothing to fold in
    assert float(norm.input_count) == 20


def test_an_untrained_normalized_cnn_acts_as_the_plain_one_then_standardises_and_clips():
    torch.manual_seed(0)
    plain = ActorCriticModule(SPACE, gym.spaces.Discrete(6))
    torch.manual_seed(0)
    module = ActorCriticModule(SPACE, gym.spaces.Discrete(6), NORMALIZED)
    [norm] = input_normalizers(module)
    obs = frames(3, 1)
    with torch.no_grad():  # before any statistics: the 1/255 scaling of the plain module
        for p in (plain.pi_head.weight, module.pi_head.weight):
            p.copy_(torch.linspace(-1, 1, p.numel()).reshape(p.shape))
        assert torch.allclose(module.forward_train(obs)["action_dist_inputs"],
                              plain.forward_train(obs)["action_dist_inputs"], atol=1e-5)
    norm.merge(*InputNormalizer.moments(frames(50, 2)), 50)
    x = obs.float()
    expected = ((x - norm.input_mean) / torch.sqrt(norm.input_var + 1e-5)).clamp(-5, 5)
    assert torch.allclose(norm(obs), expected, atol=1e-6)
    flat_bright = torch.full((1,) + SPACE.shape, 255, dtype=torch.uint8)
    norm.input_mean.fill_(0.0), norm.input_var.fill_(1.0)
    assert float(norm(flat_bright).max()) == 5.0  # clipped


def test_the_statistics_are_module_state_for_runners_and_checkpoints():
    module = ActorCriticModule(SPACE, gym.spaces.Discrete(6), NORMALIZED)
    [norm] = input_normalizers(module)
    norm.merge(*InputNormalizer.moments(frames(20, 3)), 20)
    for inference_only in (False, True):
        state = module.get_state(inference_only=inference_only)
        assert {"encoder.normalizer.input_mean", "encoder.normalizer.input_var", "encoder.normalizer.input_count"} <= set(state)
    runner = ActorCriticModule(SPACE, gym.spaces.Discrete(6), NORMALIZED, inference_only=True)
    runner.set_state(module.get_state(inference_only=True))
    [copied] = input_normalizers(runner)
    for name in ("input_mean", "input_var", "input_count"):
        assert torch.equal(getattr(copied, name), getattr(norm, name))


def test_errors_name_the_setting_and_what_to_do():
    with pytest.raises(ValueError, match="MeanStdFilter"):
        ActorCriticModule(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2), NORMALIZED)
    with pytest.raises(ValueError, match="normalize_input.*(PPO|IMPALA|APPO)"):
        DQNConfig().environment("norm_frames").rl_module(model_config=NORMALIZED).validate()
    with pytest.raises(ValueError, match=r"policies\['p0'\].*normalize_input.*DQN"):
        (DQNConfig().environment("norm_frames")
         .multi_agent(policies={"p0": PolicySpec(config={"model_config": NORMALIZED})},
                      policy_mapping_fn=lambda agent_id, episode, **kw: "p0").validate())
    with pytest.raises(ValueError, match="normalize_input.*no numpy export.*remote"):
        export_policy(ActorCriticModule(SPACE, gym.spaces.Discrete(6), NORMALIZED, inference_only=True))


def test_data_parallel_learners_pool_their_moments():
    """Two learners' shards: each folds in the moments of both, as one learner would of the whole batch."""
    config = PPOConfig().environment("norm_frames").rl_module(model_config=NORMALIZED)
    learner = PPOLearner(config, SPACE, gym.spaces.Discrete(6))
    mine, theirs = frames(6, 4), frames(10, 5)
    n_theirs = 10.0
    mean_t, var_t = InputNormalizer.moments(theirs)
    other = np.concatenate([[n_theirs], (n_theirs * mean_t).numpy().ravel(),
                            (n_theirs * (var_t + mean_t.square())).numpy().ravel()])
    learner.world_size = 2
    learner.allreduce_mean = lambda values: (values + other) / 2
    learner.update_input_stats(mine)
    [norm] = input_normalizers(learner.module)
    both = torch.cat([mine, theirs]).double()
    assert float(norm.input_count) == 16
    assert torch.allclose(norm.input_mean.double(), both.mean(0), atol=1e-4)
    assert torch.allclose(norm.input_var.double(), both.var(0, unbiased=False), atol=1e-2)


@pytest.mark.parametrize("config_class", [PPOConfig, APPOConfig])
def test_learners_fold_in_every_trained_batch_and_checkpoints_keep_the_statistics(config_class, tmp_path):
    """FrameEnv cycles through 8 frames, and each runner's 32-step fragment holds each of them 4 times: the
    statistics after training are those of the 8 frames exactly, counted once per trained step."""
    algo = small_batches_config(config_class, "norm_frames", NORMALIZED).build()
    try:
        results = train_steps(algo, 128)
        [norm] = input_normalizers(algo.get_module())
        stack = torch.from_numpy(FrameEnv().frames).double()
        trained = lookup(results[-1], "num_env_steps_trained_lifetime")
        assert float(norm.input_count) == trained > 0
        assert torch.allclose(norm.input_mean.double(), stack.mean(0), atol=1e-3)
        assert torch.allclose(norm.input_var.double(), stack.var(0, unbiased=False), atol=1e-1)
        path = algo.save(str(tmp_path / "ckpt"))
        saved = {k: v.clone() for k, v in norm.state_dict().items()}
    finally:
        algo.stop()
    restored = Algorithm.from_checkpoint(path)
    try:
        [again] = input_normalizers(restored.get_module())
        for name, value in saved.items():
            assert torch.equal(again.state_dict()[name], value), name
    finally:
        restored.stop()
