"""EXTERNAL.md section 9 is complete: an evaluator written from it alone (``tests/spec_policy.py``)
computes, for policies the policy server exports, what the torch module, the server's remote
replies and ``protocols.numpy_policy`` compute -- distribution inputs, greedy actions and
log-probabilities -- and samples as the exploration rules say."""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.settings import EnvRunnerSettings
from actors.external.inference import ServerPolicy
from actors.modules import ActorCriticModule, QModule, SACModule, to_torch
from protocols import nested
from protocols.codec import decode, encode
from protocols.errors import ProtocolError
from protocols.numpy_policy import NumpyPolicy
from tests.spec_policy import SpecPolicy, Unreadable

S = gym.spaces
AC, Q = ActorCriticModule, QModule
# keys in code-point order: "Zeta" < "gear" < "speed" < "ä" < "ﬀ" (U+FB00) < "𝒳" (U+1D4B3); in UTF-16
# order "𝒳" (a surrogate pair, 0xD835...) would come before "ä" -- the trap the spec warns about
DICT = S.Dict({"speed": S.Box(-2.0, 2.0, (2,), np.float32), "gear": S.Discrete(3, start=1),
               "Zeta": S.MultiBinary(2), "ä": S.Box(-1.0, 1.0, (2, 2), np.float64),
               "𝒳": S.Box(0, 9, (3,), np.int32), "ﬀ": S.Discrete(2)})
TUPLE = S.Tuple((S.MultiDiscrete([3, 2]), S.Box(-1.0, 1.0, (2, 3), np.float32)))
IMAGE = S.Box(0, 255, (44, 44, 3), np.uint8)  # the default (Nature-DQN) filters leave 2 x 2 x 64 of it
SMALL_IMAGE = S.Box(-1.0, 1.0, (16, 17, 2), np.float32)
CARTPOLE = S.Box(-4.0, 4.0, (4,), np.float32)
GAUSS = S.Box(-2.0, 2.0, (3,), np.float32)
CASES: dict[str, tuple[gym.Space, gym.Space, type, dict, dict]] = {
    "cartpole-discrete": (CARTPOLE, S.Discrete(2), AC, {}, {}),
    "multidiscrete-actions": (S.Box(-1.0, 1.0, (6,), np.float32), S.MultiDiscrete([3, 4, 2]), AC,
                              {"fcnet_activation": "relu"}, {}),
    "box-gaussian": (S.Box(-1.0, 1.0, (5,), np.float32), GAUSS, AC, {"fcnet_activation": "elu"}, {}),
    "dict-obs": (DICT, S.Discrete(3), AC, {"fcnet_activation": "swish", "fcnet_hiddens": [16, 8]}, {}),
    "discrete-obs": (S.Discrete(7, start=-2), S.Discrete(4), AC, {"fcnet_activation": "linear"}, {}),
    "tuple-obs-multibinary-actions": (TUPLE, S.MultiBinary(3), AC, {"vf_share_layers": True}, {}),
    "no-hidden-layers": (CARTPOLE, GAUSS, AC, {"fcnet_hiddens": []}, {}),
    "cnn-uint8": (IMAGE, S.Discrete(4), AC, {"fcnet_hiddens": [16]}, {}),
    "cnn-float-nonsquare": (SMALL_IMAGE, GAUSS, AC, {"conv_filters": [[4, 3, 2], [6, [2, 3], 1]],
                                                     "conv_activation": "tanh", "fcnet_hiddens": [8]}, {}),
    "q-dueling": (CARTPOLE, S.Discrete(3), Q, {"fcnet_activation": "relu"}, {"dueling": True}),
    "q-branching-dueling": (S.Discrete(5), S.MultiDiscrete([4, 2, 3]), Q, {}, {"dueling": True}),
    "q-plain-dict": (DICT, S.MultiDiscrete([3, 2]), Q, {"fcnet_activation": "silu"}, {"dueling": False}),
    "q-cnn": (IMAGE, S.Discrete(4), Q, {"fcnet_hiddens": [8]}, {"dueling": True}),
}
TOL = {"rtol": 1e-4, "atol": 1e-4}  # float32 (torch, numpy) against float64 (the spec evaluator)


def server_policy(obs_space: gym.Space, act_space: gym.Space, cls: type, model_config: dict, kwargs: dict,
                  exploration: dict | None = None) -> ServerPolicy:
    """The policy server's copy of a policy, given random weights the way the server gets weights.
    Random, not the default init: the heads' small init makes every logit nearly equal. Weights
    scale with 1/sqrt(fan-in) so values stay near 1; Gaussian log-stds are pushed past both clamps."""
    settings = EnvRunnerSettings(env_creator=lambda ctx: None, observation_space=obs_space, action_space=act_space,
                                 module_class=cls, model_config=model_config, module_kwargs=kwargs,
                                 exploration_config=exploration or {}, seed=0)
    policy = ServerPolicy(settings, 0, "torch")
    rng = np.random.default_rng(0)
    state = {}
    for name, value in policy.get_weights().items():
        scale = 2.0 / np.sqrt(np.prod(value.shape[1:])) if value.ndim > 1 else 0.5
        state[name] = rng.uniform(-scale, scale, value.shape).astype(np.float32)
    if policy.module.dist_spec.kind == "gaussian":
        half = policy.module.dist_spec.input_dim // 2
        state["pi_head.bias"][half:] = np.linspace(5.0, -25.0, half)
    policy.set_weights(state, 1, 0)
    return policy


def received(policy: ServerPolicy) -> dict:
    """The description as a client decodes it from the ``policy`` body."""
    desc = policy.exported()
    assert desc is not None, policy.export_error
    return decode(encode(desc, compress=True))


def plain(obs: Any, reverse_keys: bool = False) -> Any:
    """One observation as a client holds it from an ``act`` header: dicts (built in another key order),
    tuples for Tuple spaces, numbers and nested lists for leaves."""
    if isinstance(obs, dict):
        return {k: plain(obs[k], reverse_keys) for k in sorted(obs, reverse=reverse_keys)}
    if isinstance(obs, tuple):
        return tuple(plain(x, reverse_keys) for x in obs)
    return np.asarray(obs).tolist()


def observations(space: gym.Space, n: int, seed: int) -> list[Any]:
    space.seed(seed)
    return [space.sample() for _ in range(n)]


def torch_dist(policy: ServerPolicy, batch: Any) -> tuple[np.ndarray, Any]:
    with torch.no_grad():
        inputs = policy.module.forward_inference(to_torch(batch))["action_dist_inputs"]
    return inputs.numpy(), policy.module.dist_spec.build(inputs)


def assert_same_actions(kind: str, ours: np.ndarray, theirs: np.ndarray, inputs: np.ndarray, nvec: list[int]) -> None:
    """Equal greedy actions; a component whose two best logits are closer than float32 rounding may differ."""
    if kind == "gaussian":
        np.testing.assert_allclose(ours, theirs, **TOL)
        return
    ours, theirs = ours.reshape(len(ours), -1), theirs.reshape(len(theirs), -1)
    bounds = np.cumsum([0] + nvec)
    for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        top2 = np.sort(inputs[:, lo:hi], axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-3
        assert clear.mean() > 0.9
        np.testing.assert_array_equal(ours[clear, i], theirs[clear, i])


@pytest.mark.parametrize("case", CASES)
def test_spec_evaluator_matches_torch_remote_and_numpy(case: str) -> None:
    policy = server_policy(*CASES[case])
    desc = received(policy)
    spec, numpy_policy = SpecPolicy(desc), NumpyPolicy(desc)
    rows = observations(policy.observation_space, 64, seed=1)
    batch = nested.stack(rows)
    torch_inputs, dist = torch_dist(policy, batch)

    dist_inputs = spec.dist_inputs([plain(r, reverse_keys=True) for r in rows])
    assert dist_inputs.shape == (64, policy.module.dist_spec.input_dim)
    np.testing.assert_allclose(dist_inputs, torch_inputs, **TOL)
    np.testing.assert_allclose(dist_inputs, numpy_policy.dist_inputs(batch), **TOL)

    greedy = spec.greedy(dist_inputs)
    remote_actions, remote_logp, remote_dist = policy.compute(batch, [False] * 64, {})  # what `act` replies
    np.testing.assert_allclose(dist_inputs, remote_dist, **TOL)
    for theirs in (dist.deterministic().numpy(), numpy_policy.greedy(torch_inputs), remote_actions):
        assert_same_actions(spec.kind, greedy, theirs, dist_inputs, spec.nvec)

    # log-probabilities of the greedy actions and of arbitrary valid ones (log_action), from the same inputs
    for actions in (remote_actions, spec.random(64, np.random.default_rng(2))):
        typed = actions.astype(np.float32 if spec.kind == "gaussian" else np.int64)
        ours = spec.logp(torch_inputs.astype(np.float64), typed)
        with torch.no_grad():
            np.testing.assert_allclose(ours, dist.logp(torch.as_tensor(typed)).numpy(), **TOL)
        np.testing.assert_allclose(ours, numpy_policy.logp(torch_inputs, typed), **TOL)
    # logp from the numbers the reply sends as dist: with a log-std clamped at -20 (sigma ~ 2e-9), float32
    # rounding of the mean alone would move the logp of the greedy action by thousands
    np.testing.assert_allclose(spec.logp(remote_dist.astype(np.float64), remote_actions), remote_logp, **TOL)


def test_dict_leaf_order_is_code_point_order() -> None:
    """Each Dict leaf moves the inputs on its own: the spec's order is the module's."""
    policy = server_policy(DICT, S.Discrete(3), AC, {"fcnet_hiddens": []}, {})
    spec = SpecPolicy(received(policy))
    assert [leaf.kind for leaf in spec.leaves] == ["box", "onehot", "box", "box", "onehot", "box"]
    assert [leaf.width for leaf in spec.leaves] == [2, 3, 2, 4, 2, 3]  # Zeta gear speed ä ﬀ 𝒳
    base = observations(DICT, 1, seed=4)[0]
    for key in DICT.spaces:
        changed = dict(base, **{key: DICT[key].sample()})
        while np.array_equal(changed[key], base[key]):
            changed[key] = DICT[key].sample()
        torch_inputs = torch_dist(policy, nested.stack([changed]))[0]
        np.testing.assert_allclose(spec.dist_inputs([plain(changed)]), torch_inputs, **TOL)


def test_out_of_range_discrete_values_clamp_like_the_module() -> None:
    space = S.Dict({"room": S.Discrete(4, start=1), "grid": S.MultiDiscrete([3, 5])})
    policy = server_policy(space, S.Discrete(3), AC, {}, {})
    rows = [{"room": r, "grid": g} for r, g in zip([-7, 0, 1, 4, 5, 99], [[0, 0], [2, 4], [3, 5], [-1, 9], [1, 2], [7, -3]])]
    np.testing.assert_allclose(SpecPolicy(received(policy)).dist_inputs(rows),
                               torch_dist(policy, nested.stack([{k: np.asarray(v) for k, v in r.items()}
                                                                for r in rows]))[0], **TOL)


# --- sampling by the exploration rules (9.5): frequencies against the distribution ----------------
def one_row_many_times(policy: ServerPolicy, n: int) -> tuple[SpecPolicy, list[Any], np.ndarray]:
    spec = SpecPolicy(received(policy))
    row = plain(observations(policy.observation_space, 1, seed=5)[0])
    return spec, [row] * n, spec.dist_inputs([row])[0]


def softmax(logits: np.ndarray) -> np.ndarray:
    p = np.exp(logits - logits.max())
    return p / p.sum()


@pytest.mark.parametrize("temperature", [None, 2.5])
def test_sampling_and_softmax_follow_the_logits(temperature: float | None) -> None:
    exploration = {"type": "SoftQ", "temperature": temperature} if temperature else {}
    cls, kwargs = (Q, {"dueling": True}) if temperature else (AC, {})
    policy = server_policy(CARTPOLE, S.MultiDiscrete([3, 4]), cls, {}, kwargs, exploration)
    spec, rows, inputs = one_row_many_times(policy, 20_000)
    assert spec.rule == ("softmax" if temperature else "sample")
    actions, logp, _ = spec.act(rows, explore=True, rng=np.random.default_rng(6))
    for i, logits in enumerate(np.split(inputs, [3])):
        expected = softmax(logits / (temperature or 1.0))
        assert expected.max() - expected.min() > 0.1  # logits far enough apart to tell rules apart
        np.testing.assert_allclose(np.bincount(actions[:, i], minlength=len(logits)) / len(rows), expected, atol=0.015)
    np.testing.assert_allclose(logp, spec.logp(np.tile(inputs, (len(rows), 1)), actions))  # untempered


def test_gaussian_sampling_uses_the_clamped_log_std() -> None:
    policy = server_policy(CARTPOLE, GAUSS, AC, {}, {})
    spec, rows, inputs = one_row_many_times(policy, 20_000)
    actions, _, _ = spec.act(rows, explore=True, rng=np.random.default_rng(7))
    mean, std = inputs[:3], np.exp(np.clip(inputs[3:], -20.0, 2.0))
    assert inputs[3] > 2.0 and inputs[5] < -20.0  # both clamps are exercised
    np.testing.assert_allclose(actions.mean(axis=0), mean, atol=4 * std.max() / np.sqrt(len(rows)))
    np.testing.assert_allclose(actions.std(axis=0), std, rtol=0.03)


def test_epsilon_greedy_draws_once_per_observation() -> None:
    exploration = {"type": "EpsilonGreedy", "epsilon_schedule": [[0, 0.4], [100, 0.4]]}
    policy = server_policy(CARTPOLE, S.MultiDiscrete([4, 3]), Q, {}, {"dueling": True}, exploration)
    spec, rows, inputs = one_row_many_times(policy, 20_000)
    assert (spec.rule, spec.epsilon) == ("epsilon_greedy", pytest.approx(0.4))
    actions, _, _ = spec.act(rows, explore=True, rng=np.random.default_rng(8))
    differs = (actions != spec.greedy(inputs[None])[0]).any(axis=1).mean()
    # one draw per row: 0.4 * 11/12 of rows differ; a draw per component would give about 0.49
    assert abs(differs - 0.4 * 11 / 12) < 0.015
    greedy, _, _ = spec.act(rows[:50], explore=False, rng=np.random.default_rng(9))
    assert (greedy == spec.greedy(inputs[None])[0]).all()


@pytest.mark.parametrize("action_space", [S.Discrete(5), GAUSS])
def test_random_warm_up_is_uniform(action_space: gym.Space) -> None:
    exploration = {"type": "StochasticSampling", "random_timesteps": 1000}
    spec, rows, _ = one_row_many_times(server_policy(CARTPOLE, action_space, AC, {}, {}, exploration), 20_000)
    assert spec.rule == "random"
    actions, _, _ = spec.act(rows, explore=True, rng=np.random.default_rng(10))
    if spec.kind == "gaussian":
        assert actions.min() >= -1.0 and actions.max() <= 1.0 and abs(actions.mean()) < 0.02
    else:
        np.testing.assert_allclose(np.bincount(actions, minlength=5) / len(rows), 0.2, atol=0.015)


# --- what is not exported, and what a reader refuses (9.1, 9.6) ------------------------------------
@pytest.mark.parametrize("module, exploration", [
    ((GAUSS, SACModule, {}), None), ((S.Discrete(3), Q, {"num_atoms": 11}), None),
    ((GAUSS, AC, {}), {"type": "GaussianNoise"}), ((GAUSS, AC, {}), {"type": "OrnsteinUhlenbeckNoise"})])
def test_unexportable_policies_have_no_description(module: tuple, exploration: dict | None) -> None:
    action_space, cls, kwargs = module
    settings = EnvRunnerSettings(env_creator=lambda ctx: None, observation_space=CARTPOLE, action_space=action_space,
                                 module_class=cls, module_kwargs=kwargs, exploration_config=exploration or {})
    policy = ServerPolicy(settings, 0, "torch")
    policy.refresh_export()
    assert policy.exported() is None and "inference_mode='remote'" in policy.export_error


def test_readers_refuse_unknown_math_and_ignore_unknown_keys() -> None:
    desc = received(server_policy(*CASES["dict-obs"]))
    rows = [plain(r) for r in observations(DICT, 4, seed=11)]
    batch = nested.stack(observations(DICT, 4, seed=11))
    extended = dict(desc, comment="informative", dist=dict(desc["dist"], note=1))
    np.testing.assert_allclose(SpecPolicy(extended).dist_inputs(rows), NumpyPolicy(extended).dist_inputs(batch), **TOL)
    layer_norm = {"op": "layer_norm", "weight": np.ones(16, np.float32), "bias": np.zeros(16, np.float32)}
    refused = [dict(desc, version=3), dict(desc, format="other"), {k: v for k, v in desc.items() if k != "version"},
               dict(desc, layers=desc["layers"][:2] + [layer_norm] + desc["layers"][2:]),
               dict(desc, encoder=[dict(desc["encoder"][0], kind="text")] + desc["encoder"][1:]),
               dict(desc, dist=dict(desc["dist"], kind="squashed_gaussian")),
               dict(desc, exploration={"type": "gaussian_noise"}),
               dict(desc, layers=[dict(desc["layers"][0], weight=desc["layers"][0]["weight"].astype(np.float64))]
                    + desc["layers"][1:])]
    for bad in refused:
        with pytest.raises(Unreadable):
            SpecPolicy(bad)
        with pytest.raises(ProtocolError):
            NumpyPolicy(bad)


def test_the_worked_example_of_section_9() -> None:
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    desc = {"format": "runnel-numpy-policy", "version": 1,
            "encoder": [{"kind": "onehot", "nvec": [3], "start": 1}, {"kind": "box", "size": 2}],
            "layers": [{"op": "linear", "weight": f32([[1, 0, 0, 2, 0], [0, 1, -1, 0, 1]]), "bias": f32([0, 0.5])},
                       {"op": "relu"}, {"op": "linear", "weight": f32([[1, 0], [0, 1], [-1, 2]]), "bias": f32([0, 0, 1])}],
            "dist": {"kind": "categorical", "dim": 3, "nvec": [3]}, "exploration": {"type": "sample"}}
    desc = decode(encode(desc))
    spec, numpy_policy = SpecPolicy(desc), NumpyPolicy(desc)
    inputs = spec.dist_inputs([{"speed": [0.5, -1.0], "gear": 3}])
    np.testing.assert_allclose(inputs, [[1.0, 0.0, 0.0]])
    np.testing.assert_allclose(numpy_policy.dist_inputs({"speed": f32([[0.5, -1.0]]), "gear": np.array([3])}), inputs)
    assert spec.greedy(inputs).tolist() == [0]
    for action, logp in ((0, -0.55144), (2, -1.55144)):
        np.testing.assert_allclose(spec.logp(inputs, np.array([action])), [logp], atol=1e-5)
        np.testing.assert_allclose(numpy_policy.logp(f32(inputs), np.array([action])), [logp], atol=1e-5)

    gaussian = decode(encode({"format": "runnel-numpy-policy", "version": 1, "encoder": [{"kind": "box", "size": 1}],
                              "layers": [{"op": "linear", "weight": np.zeros((4, 1), np.float32),
                                          "bias": f32([0.2, -0.5, 0.1, 5.0])}],
                              "dist": {"kind": "gaussian", "dim": 4}}))
    spec, numpy_policy = SpecPolicy(gaussian), NumpyPolicy(gaussian)
    inputs = spec.dist_inputs([[0.0]])
    np.testing.assert_allclose(spec.greedy(inputs), [[0.2, -0.5]])
    for action, logp in (([0.2, -0.5], -3.93788), ([1.0, 0.0], -4.20216)):
        np.testing.assert_allclose(spec.logp(inputs, np.array([action])), [logp], atol=1e-5)
        np.testing.assert_allclose(numpy_policy.logp(f32(inputs), f32([action])), [logp], atol=1e-5)
