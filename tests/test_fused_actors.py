"""FusedActors: several modules of one architecture act in one pass, with each row's own module's numbers."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.actions import EnvActions
from actors.env.exploration import EpsilonGreedy, StochasticSampling
from actors.env.multi_agent_sampler import MultiAgentSampler
from actors.modules import ActorCriticModule
from actors.modules.fused import FusedActors, fusion_key, pad_rows
from actors.modules.q_module import QModule
from pipeline import make_multi_agent

BOX = gym.spaces.Box(-5.0, 5.0, (4,), np.float32)
ACTS = gym.spaces.Discrete(3)


def modules(n: int, hiddens=(16, 16), space=BOX, actions=ACTS) -> dict[str, ActorCriticModule]:
    torch.manual_seed(0)
    return {f"m{k}": ActorCriticModule(space, actions, {"fcnet_hiddens": list(hiddens)}, inference_only=True)
            for k in range(n)}


def separate(mods: dict, obs: torch.Tensor, counts: list[int]) -> torch.Tensor:
    parts, start = [], 0
    for m, c in zip(mods.values(), counts):
        if c:
            parts.append(m.forward_inference(obs[start:start + c])["action_dist_inputs"])
            start += c
    return torch.cat(parts)


@pytest.mark.parametrize("counts", [[4, 4, 4], [5, 2, 3], [0, 3, 1], [1, 0, 0]])
def test_fused_pass_equals_each_modules_own(counts):
    mods = modules(3)
    obs = torch.randn(sum(counts), 4)
    with torch.inference_mode():
        fused = FusedActors(mods).dist_inputs(obs, counts)
        torch.testing.assert_close(fused, separate(mods, obs, counts), rtol=1e-5, atol=1e-6)


def test_refresh_takes_new_weights():
    mods = modules(2)
    fused = FusedActors(mods)
    obs = torch.randn(6, 4)
    with torch.no_grad():
        for p in mods["m1"].parameters():
            p.add_(0.5)
    with torch.inference_mode():
        stale = fused.dist_inputs(obs, [3, 3])
        fused.refresh()
        fresh = fused.dist_inputs(obs, [3, 3])
        want = separate(mods, obs, [3, 3])
    torch.testing.assert_close(fresh, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(stale[3:], want[3:])  # before the refresh, m1's rows used its old weights
    torch.testing.assert_close(stale[:3], want[:3], rtol=1e-5, atol=1e-6)


class Subclass(ActorCriticModule):
    pass


def test_what_is_not_fused():
    assert fusion_key(modules(1)["m0"]) == fusion_key(modules(1)["m0"]) is not None
    masked = gym.spaces.Dict({"obs": BOX, "action_mask": gym.spaces.Box(0, 1, (3,), np.int8)})
    assert fusion_key(ActorCriticModule(masked, ACTS, {}, inference_only=True)) is None  # the mask is not fused
    assert fusion_key(ActorCriticModule(gym.spaces.Discrete(5), ACTS, {}, inference_only=True)) is None  # one-hot
    assert fusion_key(Subclass(BOX, ACTS, {}, inference_only=True)) is None  # its own forward may differ
    assert fusion_key(ActorCriticModule(gym.spaces.Dict({"x": BOX}), ACTS, {}, inference_only=True)) is None
    assert fusion_key(QModule(BOX, ACTS, {})) is None
    assert fusion_key(modules(1, hiddens=(8,))["m0"]) != fusion_key(modules(1)["m0"])
    with pytest.raises(ValueError, match="modules of one fusable architecture"):
        FusedActors({**modules(1), "other": modules(1, hiddens=(8,))["m0"]})


def test_sampler_records_each_agents_own_module_outputs():
    """Two policies fused in the sampler: every recorded row's distribution inputs and log-probability
    are what the agent's own module gives for that observation and action."""
    cartpoles = make_multi_agent("CartPole-v1")
    probe = cartpoles({"num_agents": 3})
    space, acts = probe.get_observation_space(0), probe.get_action_space(0)
    torch.manual_seed(1)
    mods = {mid: ActorCriticModule(space, acts, {"fcnet_hiddens": [8]}, inference_only=True) for mid in ("p0", "p1")}
    # a third module with another exploration acts alone beside the fused pair
    mods["eps"] = ActorCriticModule(space, acts, {"fcnet_hiddens": [8]}, inference_only=True)
    explorations = {"p0": StochasticSampling(mods["p0"].dist_spec), "p1": StochasticSampling(mods["p1"].dist_spec),
                    "eps": EpsilonGreedy(mods["eps"].dist_spec, 0.5, 0.5, 1)}
    mapping = {0: "p0", 1: "p1", 2: "eps"}
    s = MultiAgentSampler([cartpoles({"num_agents": 3}) for _ in range(4)], mods, explorations,
                          {mid: EnvActions(acts) for mid in mods}, lambda aid, ep, **kw: mapping[aid], seed=3)
    sample = s.run(num_env_steps=200)
    assert set(sample.chunks) == {"p0", "p1", "eps"}
    with torch.inference_mode():
        for mid, chunks in sample.chunks.items():
            for c in chunks:
                inputs = mods[mid].forward_inference(torch.from_numpy(c.obs[:-1]))["action_dist_inputs"]
                torch.testing.assert_close(torch.from_numpy(c.extra["action_dist_inputs"]), inputs, rtol=1e-5,
                                           atol=1e-6)
                logp = mods[mid].dist_spec.build(inputs).logp(torch.from_numpy(c.actions))
                torch.testing.assert_close(torch.from_numpy(c.extra["action_logp"]), logp, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("counts", [[4, 4, 4], [5, 2, 3], [0, 3, 1], [1, 0, 0]])
def test_padded_rows_give_the_same_inputs(counts):
    mods = modules(3)
    obs = torch.randn(sum(counts), 4)
    with torch.inference_mode():
        fused = FusedActors(mods)
        padded = torch.stack(pad_rows(list(obs), counts))
        assert len(padded) == 3 * max(counts)
        torch.testing.assert_close(fused.dist_inputs(padded, counts, padded=True), fused.dist_inputs(obs, counts),
                                   rtol=0, atol=0)
        with pytest.raises(ValueError, match="padded rows"):
            fused.dist_inputs(obs[:1], [1, 1, 1], padded=True)


@pytest.mark.parametrize("activation", ["tanh", "relu", "linear", "elu", "swish"])
def test_numpy_and_torch_passes_equal_each_modules_own(activation):
    # tanh, relu and linear trunks run in numpy (cheaper per op for small layers), the others in torch
    torch.manual_seed(0)
    mods = {f"m{k}": ActorCriticModule(BOX, ACTS, {"fcnet_hiddens": [16, 16], "fcnet_activation": activation},
                                       inference_only=True) for k in range(2)}
    fused = FusedActors(mods)
    assert (fused._numpy_pattern is not None) == (activation in ("tanh", "relu", "linear"))
    obs = torch.randn(7, 4)
    with torch.inference_mode():
        for counts in ([4, 3], [0, 7]):
            torch.testing.assert_close(fused.dist_inputs(obs, counts), separate(mods, obs, counts), rtol=1e-5,
                                       atol=1e-6)
            padded = torch.stack(pad_rows(list(obs), counts))
            assert torch.equal(fused.dist_inputs(padded, counts, padded=True), fused.dist_inputs(obs, counts))
