"""The numpy export of the default policies computes what the torch modules compute, and a
malformed description is refused with ProtocolError."""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.exploration import (EpsilonGreedy, Exploration, GaussianNoise, OrnsteinUhlenbeckNoise, SoftQ,
                                    StochasticSampling)
from actors.modules import ActorCriticModule, ModuleSpec, QModule, RLModule, SACModule, to_torch
from actors.modules.encoders import ACTIVATIONS
from actors.modules.export import describe_exploration, export_policy
from protocols.codec import decode, encode
from protocols.errors import ProtocolError
from protocols.numpy_policy import NumpyPolicy

S = gym.spaces
BOX = S.Box(-1.0, 1.0, (5,), np.float32)
DICT = S.Dict({"pos": S.Box(-1.0, 1.0, (3,), np.float32), "room": S.Discrete(4, start=1)})
NESTED = S.Tuple((S.MultiDiscrete([3, 2]), S.Dict({"b": S.MultiBinary(3), "a": S.Box(0, 1, (2, 2), np.float32)})))
IMAGE = S.Box(0, 255, (36, 36, 3), np.uint8)  # the default (Nature-DQN) filters fit 36x36
SMALL_IMAGE = S.Box(-1.0, 1.0, (16, 17, 2), np.float32)
DISCRETE, MULTI, GAUSS = S.Discrete(3), S.MultiDiscrete([2, 3]), S.Box(-2.0, 2.0, (2,), np.float32)
AC, Q = ActorCriticModule, QModule
CASES = {
    "box-discrete-tanh": (BOX, DISCRETE, AC, {"fcnet_activation": "tanh"}, {}),
    "discrete-multidiscrete-relu": (S.Discrete(6), MULTI, AC, {"fcnet_activation": "relu"}, {}),
    "dict-gaussian-elu": (DICT, GAUSS, AC, {"fcnet_hiddens": [16], "fcnet_activation": "elu"}, {}),
    "nested-multibinary": (NESTED, S.MultiBinary(3), AC, {"fcnet_hiddens": [8, 8]}, {}),
    "box-shared-layers": (BOX, GAUSS, AC, {"vf_share_layers": True, "fcnet_hiddens": []}, {}),
    "image-discrete": (IMAGE, DISCRETE, AC, {"fcnet_hiddens": [16]}, {}),
    "small-image-gaussian": (SMALL_IMAGE, GAUSS, AC, {"conv_filters": [[4, 3, 2], [6, [2, 3], 1]],
                                                      "conv_activation": "tanh", "fcnet_hiddens": [8]}, {}),
    "q-box-dueling-relu": (BOX, S.Discrete(4), Q, {"fcnet_activation": "relu"}, {"dueling": True}),
    "q-dict-multidiscrete-silu": (DICT, S.MultiDiscrete([3, 2]), Q, {"fcnet_activation": "silu"}, {"dueling": False}),
    "q-discrete-multidiscrete-dueling": (S.Discrete(5), S.MultiDiscrete([4, 2, 3]), Q, {}, {"dueling": True}),
    "q-image-dueling": (IMAGE, S.Discrete(4), Q, {"fcnet_hiddens": [8]}, {"dueling": True}),
}


def build(obs_space: gym.Space, act_space: gym.Space, cls: type[RLModule], model_config: dict,
          kwargs: dict | None = None) -> RLModule:
    """An inference-only module with random weights: the default heads' small init would make
    every logit nearly equal, which hides mistakes. Weights scale with 1/sqrt(fan-in), so values
    stay near 1 and float32 rounding stays within the tolerances."""
    torch.manual_seed(0)
    module = ModuleSpec(obs_space, act_space, model_config, cls, kwargs or {}).build(inference_only=True)
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(-1.0, 1.0).mul_(2.0 / p[0].numel() ** 0.5 if p.dim() > 1 else 0.5)
    return module


def sample_obs(space: gym.Space, n: int, seed: int) -> Any:
    space.seed(seed)
    rows = [space.sample() for _ in range(n)]

    def stack(sp: gym.Space, items: list) -> Any:
        if isinstance(sp, S.Dict):
            return {k: stack(sp[k], [r[k] for r in items]) for k in sp.spaces}
        if isinstance(sp, S.Tuple):
            return tuple(stack(s, [r[i] for r in items]) for i, s in enumerate(sp.spaces))
        return np.stack(items)
    return stack(space, rows)


def received(desc: dict) -> NumpyPolicy:
    """The policy a client builds from the description, after the codec's round trip."""
    return NumpyPolicy(decode(encode(desc, compress=False)))


def torch_dist(module: RLModule, obs: Any) -> tuple[torch.Tensor, Any]:
    with torch.no_grad():
        inputs = module.forward_inference(to_torch(obs))["action_dist_inputs"]
    return inputs, module.dist_spec.build(inputs)


@pytest.mark.parametrize("case", CASES)
def test_numpy_matches_torch(case: str) -> None:
    module = build(*CASES[case])
    obs = sample_obs(module.observation_space, 16, seed=1)
    policy = received(export_policy(module))
    inputs, dist = torch_dist(module, obs)

    ours = policy.dist_inputs(obs)
    assert ours.dtype == np.float32 and ours.shape == (16, module.dist_spec.input_dim)
    np.testing.assert_allclose(ours, inputs.numpy(), rtol=1e-5, atol=1e-5)

    greedy, extra = policy.act(obs, explore=False)
    np.testing.assert_allclose(greedy, dist.deterministic().numpy(), rtol=1e-5, atol=1e-5)
    actions, extra = policy.act(obs, explore=True, rng=np.random.default_rng(0))
    assert actions.dtype == (np.float32 if module.dist_spec.kind == "gaussian" else np.int64)
    assert extra["action_logp"].dtype == np.float32 and extra["action_logp"].shape == (16,)
    assert extra["action_dist_inputs"].dtype == np.float32
    with torch.no_grad():
        np.testing.assert_allclose(extra["action_logp"], dist.logp(torch.as_tensor(actions)).numpy(),
                                   rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(policy.extras(obs, actions)["action_logp"], extra["action_logp"])


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_every_activation(activation: str) -> None:
    module = build(BOX, MULTI, AC, {"fcnet_activation": activation, "fcnet_hiddens": [12, 7]})
    obs = sample_obs(BOX, 8, seed=3) * 4.0  # past tanh's and elu's near-linear range
    np.testing.assert_allclose(received(export_policy(module)).dist_inputs(obs),
                               torch_dist(module, obs)[0].numpy(), rtol=1e-5, atol=1e-5)


def test_one_hot_clamps_out_of_range_values_like_the_encoder() -> None:
    space = S.Dict({"room": S.Discrete(4, start=1), "grid": S.MultiDiscrete([3, 5])})
    module = build(space, DISCRETE, AC, {})
    obs = {"room": np.array([-7, 0, 1, 4, 5, 99]), "grid": np.array([[0, 0], [2, 4], [3, 5], [-1, 9], [1, 2], [7, -3]])}
    np.testing.assert_allclose(received(export_policy(module)).dist_inputs(obs), torch_dist(module, obs)[0].numpy(),
                               rtol=1e-5, atol=1e-5)


def test_batch_of_one_and_dict_key_order() -> None:
    module = build(DICT, DISCRETE, AC, {})
    policy = received(export_policy(module))
    obs = {"room": np.array([3]), "pos": np.array([[0.1, -0.2, 0.3]], np.float32)}  # keys out of order
    actions, extra = policy.act(obs, explore=False)
    assert actions.shape == (1,) and extra["action_dist_inputs"].shape == (1, 3)
    np.testing.assert_allclose(extra["action_dist_inputs"], torch_dist(module, obs)[0].numpy(), rtol=1e-5, atol=1e-5)


def test_epsilon_greedy() -> None:
    module = build(BOX, S.MultiDiscrete([4, 3]), Q, {}, {"dueling": True})
    spec, obs = module.dist_spec, sample_obs(BOX, 300, seed=2)
    greedy = received(export_policy(module)).act(obs, explore=False)[0]
    never = received(export_policy(module, EpsilonGreedy(spec, epsilon_schedule=[[0, 0.0]])))
    np.testing.assert_array_equal(never.act(obs, rng=np.random.default_rng(1))[0], greedy)
    always = received(export_policy(module, EpsilonGreedy(spec, epsilon_schedule=[[0, 1.0]])))
    random, extra = always.act(obs, rng=np.random.default_rng(1))
    assert random.dtype == np.int64 and random.shape == (300, 2)
    assert set(random[:, 0].tolist()) == {0, 1, 2, 3} and set(random[:, 1].tolist()) == {0, 1, 2}
    assert (random != greedy).any(axis=1).mean() > 0.5
    with torch.no_grad():  # the log-probability is still that under the distribution
        np.testing.assert_allclose(extra["action_logp"], torch_dist(module, obs)[1].logp(torch.as_tensor(random)),
                                   rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(always.act(obs, explore=False)[0], greedy)
    half = received(export_policy(module, EpsilonGreedy(spec, 1.0, 0.0, 1000), timestep=500))
    assert half.epsilon == pytest.approx(0.5)
    assert 0.2 < (half.act(obs, rng=np.random.default_rng(2))[0] != greedy).any(axis=1).mean() < 0.6


def test_sampling_random_and_softmax() -> None:
    module = build(BOX, S.Discrete(4), AC, {})
    obs = np.repeat(sample_obs(BOX, 1, seed=4), 20_000, axis=0)
    probs = torch_dist(module, obs[:1])[0].softmax(-1).numpy()[0]
    policy = received(export_policy(module))
    sampled = policy.act(obs, rng=np.random.default_rng(5))[0]
    np.testing.assert_allclose(np.bincount(sampled, minlength=4) / len(obs), probs, atol=0.02)
    cold = received(export_policy(module, SoftQ(module.dist_spec, temperature=1e-4)))
    np.testing.assert_array_equal(cold.act(obs[:50], rng=np.random.default_rng(6))[0], probs.argmax())
    warm = received(export_policy(module, StochasticSampling(module.dist_spec, random_timesteps=10), timestep=3))
    uniform = warm.act(obs, rng=np.random.default_rng(7))[0]
    np.testing.assert_allclose(np.bincount(uniform, minlength=4) / len(obs), 0.25, atol=0.02)

    box = build(BOX, GAUSS, AC, {})
    mean, dist = torch_dist(box, obs[:1])
    draws = received(export_policy(box)).act(obs, rng=np.random.default_rng(8))[0]
    np.testing.assert_allclose(draws.mean(0), dist.mean[0].numpy(), atol=0.05 * dist.std.max().item())
    np.testing.assert_allclose(draws.std(0), dist.std[0].numpy(), rtol=0.05)
    warm = received(export_policy(box, StochasticSampling(box.dist_spec, random_timesteps=1)))
    random = warm.act(obs, rng=np.random.default_rng(9))[0]
    assert random.dtype == np.float32 and random.min() >= -1.0 and random.max() <= 1.0


def test_describe_exploration() -> None:
    spec = build(BOX, DISCRETE, Q, {}).dist_spec
    assert describe_exploration(None, 0) == {"type": "sample"}
    assert describe_exploration(StochasticSampling(spec, random_timesteps=10), 9) == {"type": "random"}
    assert describe_exploration(StochasticSampling(spec, random_timesteps=10), 10) == {"type": "sample"}
    assert describe_exploration(EpsilonGreedy(spec, 1.0, 0.1, 1000), 500) == {"type": "epsilon_greedy",
                                                                             "epsilon": pytest.approx(0.55)}
    assert describe_exploration(SoftQ(spec, 0.5), 0) == {"type": "softmax", "temperature": 0.5}


class Subclassed(ActorCriticModule):
    pass


class Custom(Exploration):
    pass


def test_unsupported_policies_name_the_remote_mode() -> None:
    box = build(BOX, GAUSS, AC, {})
    for exploration in (GaussianNoise(box.dist_spec), OrnsteinUhlenbeckNoise(box.dist_spec), Custom(box.dist_spec)):
        with pytest.raises(ValueError, match=f"{type(exploration).__name__}.*inference_mode='remote'"):
            export_policy(box, exploration)
    unsupported = [(build(BOX, DISCRETE, Q, {}, {"num_atoms": 11}), "num_atoms=11"),
                   (build(BOX, GAUSS, SACModule, {}), "SACModule"),
                   (build(BOX, DISCRETE, Subclassed, {}), "Subclassed")]
    for module, name in unsupported:
        with pytest.raises(ValueError, match=f"{name}.*inference_mode='remote'"):
            export_policy(module)


def linear(n_out: int, n_in: int, dtype: Any = np.float32) -> dict:
    return {"op": "linear", "weight": np.zeros((n_out, n_in), dtype), "bias": np.zeros(n_out, dtype)}


def test_malformed_descriptions_are_protocol_errors() -> None:
    good = export_policy(build(BOX, DISCRETE, AC, {"fcnet_hiddens": [4]}))
    NumpyPolicy(good)
    dueling = {"op": "dueling", "branches": [3], "advantage": [linear(3, 5)], "value": [linear(1, 5)]}
    NumpyPolicy({**good, "layers": [dueling]})
    image = {"kind": "image", "shape": [8, 8, 2], "scale": 1.0}
    conv = {"op": "conv2d", "weight": np.zeros((4, 2, 3, 3), np.float32), "bias": np.zeros(4, np.float32),
            "stride": [2, 2]}
    NumpyPolicy({**good, "encoder": [image], "layers": [conv, {"op": "flatten"}, linear(3, 36)]})
    bad = {
        "not a map": [good],
        "no format": {k: v for k, v in good.items() if k != "format"},
        "other format": {**good, "format": "pickle"},
        "other version": {**good, "version": 3},
        "unknown op": {**good, "layers": good["layers"] + [{"op": "exec", "code": "import os"}]},
        "op not a map": {**good, "layers": ["tanh"]},
        "sizes do not chain": {**good, "layers": [linear(3, 9)]},
        "float64 weights": {**good, "layers": [linear(3, 5, np.float64)]},
        "list weights": {**good, "layers": [{"op": "linear", "weight": [[0.0] * 5] * 3, "bias": [0.0] * 3}]},
        "bias of the wrong size": {**good, "layers": [{**linear(3, 5), "bias": np.zeros(4, np.float32)}]},
        "layers not a list": {**good, "layers": "rm -rf"},
        "dist dim mismatch": {**good, "dist": {"kind": "categorical", "dim": 5}},
        "unknown dist": {**good, "dist": {"kind": "beta", "dim": 3}},
        "multi nvec mismatch": {**good, "dist": {"kind": "multi_categorical", "dim": 3, "nvec": [2, 2]}},
        "odd gaussian": {**good, "dist": {"kind": "gaussian", "dim": 3}},
        "dim not an int": {**good, "dist": {"kind": "categorical", "dim": "3"}},
        "negative box": {**good, "encoder": [{"kind": "box", "size": -1}]},
        "huge one-hot": {**good, "encoder": [{"kind": "onehot", "nvec": [1 << 40]}]},
        "no leaves": {**good, "encoder": []},
        "unknown leaf": {**good, "encoder": [{"kind": "text"}]},
        "unknown exploration": {**good, "exploration": {"type": "os.system"}},
        "epsilon above 1": {**good, "exploration": {"type": "epsilon_greedy", "epsilon": 2.0}},
        "epsilon NaN": {**good, "exploration": {"type": "epsilon_greedy", "epsilon": float("nan")}},
        "softmax of a gaussian": {**export_policy(build(BOX, GAUSS, AC, {})), "exploration": {"type": "softmax"}},
        "dueling branches mismatch": {**good, "layers": [{**dueling, "branches": [2]}]},
        "dueling value too wide": {**good, "layers": [{**dueling, "value": [linear(2, 5)]}]},
        "dueling inside dueling": {**good, "layers": [{**dueling, "advantage": [dueling]}]},
        "image beside a box": {**good, "encoder": [image, {"kind": "box", "size": 1}]},
        "image without flatten": {**good, "encoder": [image], "layers": [conv]},
        "kernel larger than image": {**good, "encoder": [image], "layers": [
            {**conv, "weight": np.zeros((4, 2, 9, 3), np.float32)}, {"op": "flatten"}, linear(3, 4)]},
        "conv channels mismatch": {**good, "encoder": [image], "layers": [
            {**conv, "weight": np.zeros((4, 3, 3, 3), np.float32)}, {"op": "flatten"}, linear(3, 36)]},
        "zero stride": {**good, "encoder": [image], "layers": [{**conv, "stride": [0, 1]}]},
        "linear on an image": {**good, "encoder": [image], "layers": [linear(3, 128)]},
    }
    for name, desc in bad.items():
        with pytest.raises(ProtocolError):
            NumpyPolicy(desc)
            pytest.fail(f"accepted: {name}")


def test_wrong_observations_and_actions_are_protocol_errors() -> None:
    policy = NumpyPolicy(export_policy(build(DICT, DISCRETE, AC, {})))
    obs = sample_obs(DICT, 2, seed=0)
    policy.act(obs)
    for wrong in (obs["pos"], {**obs, "pos": obs["pos"][:, :2]}, {**obs, "room": obs["room"][:1]},
                  {**obs, "pos": np.array(["a", "b", "c"] * 2).reshape(2, 3)}, {"pos": obs["pos"][0], "room": 1}):
        with pytest.raises(ProtocolError):
            policy.act(wrong)
    for actions in (np.array([0, 3]), np.array([0]), np.array([-1, 0])):
        with pytest.raises(ProtocolError):
            policy.extras(obs, actions)


def test_small_categorical_batches_sample_the_same_distribution_in_plain_floats() -> None:
    """A remote-inference request of a few rows takes ``choose_with_logp``'s plain-float path:
    its draws follow the policy's probabilities and its log-probabilities are ``logp``'s."""
    from protocols.numpy_policy import SMALL_BATCH

    module = build(BOX, S.Discrete(4), AC, {})
    policy = received(export_policy(module))
    one = sample_obs(BOX, 1, seed=4)
    probs = torch_dist(module, one)[0].softmax(-1).numpy()[0]
    rng = np.random.default_rng(11)
    inputs = policy.dist_inputs(one)
    draws = np.array([policy.choose_with_logp(inputs, True, rng)[0][0] for _ in range(20_000)])
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / len(draws), probs, atol=0.02)

    rows = policy.dist_inputs(sample_obs(BOX, SMALL_BATCH, seed=5))
    actions, logp = policy.choose_with_logp(rows, True, np.random.default_rng(12))
    assert actions.dtype == np.int64 and actions.shape == (SMALL_BATCH,) and logp.dtype == np.float32
    np.testing.assert_allclose(logp, policy.logp(rows, actions), rtol=1e-5, atol=1e-6)
    big = np.repeat(rows, 2, axis=0)  # past SMALL_BATCH: the vectorized path, same contract
    actions, logp = policy.choose_with_logp(big, True, np.random.default_rng(13))
    np.testing.assert_allclose(logp, policy.logp(big, actions), rtol=1e-5, atol=1e-6)
    greedy, logp = policy.choose_with_logp(rows, False, np.random.default_rng(14))
    np.testing.assert_array_equal(greedy, rows.argmax(-1))
