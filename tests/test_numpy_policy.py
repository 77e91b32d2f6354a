"""The numpy export of the default policies computes what the torch modules compute."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.exploration import EpsilonGreedy, GaussianNoise, SoftQ, StochasticSampling
from actors.modules import ActorCriticModule, ModuleSpec, QModule, to_torch
from actors.modules.export import export_policy
from protocols.codec import decode, encode
from protocols.errors import ProtocolError
from protocols.numpy_policy import NumpyPolicy

BOX = gym.spaces.Box(-1.0, 1.0, (5,), np.float32)
DICT = gym.spaces.Dict({"pos": gym.spaces.Box(-1.0, 1.0, (3,), np.float32), "room": gym.spaces.Discrete(4, start=1)})
CASES = [
    (BOX, gym.spaces.Discrete(3), ActorCriticModule, {"fcnet_activation": "tanh"}, {}),
    (gym.spaces.Discrete(6), gym.spaces.MultiDiscrete([2, 3]), ActorCriticModule, {"fcnet_activation": "relu"}, {}),
    (DICT, gym.spaces.Box(-2.0, 2.0, (2,), np.float32), ActorCriticModule, {"fcnet_hiddens": [16], "fcnet_activation": "elu"}, {}),
    (BOX, gym.spaces.Discrete(4), QModule, {"fcnet_activation": "relu"}, {"dueling": True}),
    (DICT, gym.spaces.MultiDiscrete([3, 2]), QModule, {"fcnet_activation": "silu"}, {"dueling": False}),
]


def sample_obs(space: gym.Space, n: int, seed: int):
    space.seed(seed)
    rows = [space.sample() for _ in range(n)]
    if isinstance(space, gym.spaces.Dict):
        return {k: np.stack([r[k] for r in rows]) for k in space.spaces}
    return np.stack(rows)


def build(obs_space, act_space, cls, model_config, kwargs):
    torch.manual_seed(0)
    return ModuleSpec(obs_space, act_space, model_config, cls, kwargs).build(inference_only=True)


@pytest.mark.parametrize("obs_space,act_space,cls,model_config,kwargs", CASES)
def test_numpy_matches_torch(obs_space, act_space, cls, model_config, kwargs):
    module = build(obs_space, act_space, cls, model_config, kwargs)
    obs = sample_obs(obs_space, 16, seed=1)
    desc = decode(encode(export_policy(module), compress=False))  # as a client receives it
    policy = NumpyPolicy(desc)
    with torch.no_grad():
        inputs = module.forward_inference(to_torch(obs))["action_dist_inputs"]
        dist = module.dist_spec.build(inputs)
        greedy = dist.deterministic()
    np.testing.assert_allclose(policy.dist_inputs(obs), inputs.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(policy.greedy(inputs.numpy()), greedy.numpy())
    actions, extra = policy.act(obs, explore=True, rng=np.random.default_rng(0))
    with torch.no_grad():
        torch_logp = dist.logp(torch.as_tensor(actions)).numpy()
    np.testing.assert_allclose(extra["action_logp"], torch_logp, rtol=1e-4, atol=1e-4)
    assert extra["action_dist_inputs"].shape == (16, module.dist_spec.input_dim)
    assert extra["action_logp"].dtype == np.float32
    np.testing.assert_allclose(policy.extras(obs, actions)["action_logp"], extra["action_logp"])


def test_exploration_pieces():
    module = build(BOX, gym.spaces.Discrete(4), QModule, {}, {"dueling": True})
    obs = sample_obs(BOX, 200, seed=2)
    spec = module.dist_spec
    greedy = NumpyPolicy(export_policy(module)).greedy(NumpyPolicy(export_policy(module)).dist_inputs(obs))
    never = NumpyPolicy(export_policy(module, EpsilonGreedy(spec, epsilon_schedule=[[0, 0.0]])))
    np.testing.assert_array_equal(never.act(obs, rng=np.random.default_rng(1))[0], greedy)
    always = NumpyPolicy(export_policy(module, EpsilonGreedy(spec, epsilon_schedule=[[0, 1.0]])))
    random = always.act(obs, rng=np.random.default_rng(1))[0]
    assert set(random.tolist()) == {0, 1, 2, 3}
    schedule = export_policy(module, EpsilonGreedy(spec, 1.0, 0.1, 1000), timestep=500)["exploration"]
    assert schedule == {"type": "epsilon_greedy", "epsilon": pytest.approx(0.55)}
    assert export_policy(module, StochasticSampling(spec, random_timesteps=10), timestep=5)["exploration"]["type"] == "random"
    assert export_policy(module, SoftQ(spec, 0.5))["exploration"] == {"type": "softmax", "temperature": 0.5}
    np.testing.assert_array_equal(always.act(obs, explore=False)[0], greedy)


def test_unsupported_policies_name_the_remote_mode():
    box_module = build(BOX, gym.spaces.Box(-1.0, 1.0, (2,), np.float32), ActorCriticModule, {}, {})
    with pytest.raises(ValueError, match="inference_mode='remote'"):
        export_policy(box_module, GaussianNoise(box_module.dist_spec))
    c51 = build(BOX, gym.spaces.Discrete(3), QModule, {}, {"num_atoms": 11})
    with pytest.raises(ValueError, match="num_atoms"):
        export_policy(c51)
    image = build(gym.spaces.Box(0, 255, (64, 64, 3), np.uint8), gym.spaces.Discrete(3), ActorCriticModule, {}, {})
    with pytest.raises(ValueError, match="remote"):
        export_policy(image)


def test_malformed_descriptions_are_protocol_errors():
    module = build(BOX, gym.spaces.Discrete(3), ActorCriticModule, {}, {})
    good = export_policy(module)
    bad = [
        {**good, "format": "pickle"},
        {**good, "version": 7},
        {**good, "layers": [{"op": "linear", "weight": np.zeros((3, 9), np.float32), "bias": np.zeros(3, np.float32)}]},
        {**good, "layers": good["layers"] + [{"op": "exec"}]},
        {**good, "dist": {"kind": "categorical", "dim": 5}},
        {**good, "encoder": [{"kind": "box", "size": -1}]},
        {**good, "exploration": {"type": "os.system"}},
        {**good, "layers": "rm -rf"},
    ]
    for desc in bad:
        with pytest.raises(ProtocolError):
            NumpyPolicy(desc)
