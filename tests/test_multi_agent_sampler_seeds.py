"""MultiAgentSampler, continued (its envs and helpers are in ``test_multi_agent_sampler.py``): a seed repeats a
run, only the first reset is seeded, chunks survive the codec, weights versions and infos reach the chunks, and
malformed env results are named."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from actors.env.actions import EnvActions
from actors.env.multi_agent_sampler import MultiAgentSampler
from actors.modules import ActorCriticModule
from protocols.codec import decode_chunks, encode
from protocols.episode import EpisodeChunk
from tests.test_multi_agent_sampler import CART, CART_SPACES, TwoCartPoles, all_chunks, own, sampler, shared


# --- seeds, codec, weights, infos, errors -----------------------------------------------------
def cartpole_run(seed: int) -> list[EpisodeChunk]:
    torch.manual_seed(0)
    s = sampler([TwoCartPoles() for _ in range(2)], {"p0": CART_SPACES, "p1": CART_SPACES}, own, seed=seed)
    return all_chunks(s.run(num_env_steps=60))


def test_a_seed_repeats_the_run():
    first, again, other = cartpole_run(3), cartpole_run(3), cartpole_run(4)
    assert [(c.agent_id, c.env_index, len(c)) for c in first] == [(c.agent_id, c.env_index, len(c)) for c in again]
    for a, b in zip(first, again):
        assert np.array_equal(a.obs, b.obs) and np.array_equal(a.actions, b.actions)
        assert np.array_equal(a.rewards, b.rewards) and np.array_equal(a.extra["action_logp"], b.extra["action_logp"])
    assert not np.array_equal(first[0].obs[0], other[0].obs[0])


def test_only_the_first_reset_is_seeded():
    s = sampler([TwoCartPoles()], {"shared": CART_SPACES}, shared, seed=7)
    sample = s.run(num_env_steps=150)
    assert len(sample.episodes) >= 3
    starts = [c.obs[0] for c in sample.chunks["shared"] if c.agent_id == "a0" and c.chunk_index == 0]
    assert len(starts) >= len(sample.episodes) and len({s.tobytes() for s in starts}) == len(starts)


def test_chunks_survive_the_codec():
    chunks = cartpole_run(5)
    decoded = decode_chunks(encode(chunks))
    assert len(decoded) == len(chunks)
    for a, b in zip(chunks, decoded):
        assert isinstance(b, EpisodeChunk)
        ids = lambda c: (c.episode_id, c.chunk_index, c.agent_id, c.module_id)  # noqa: E731
        assert ids(b) == ids(a)
        assert np.array_equal(a.obs, b.obs) and np.array_equal(a.actions, b.actions)
        assert np.array_equal(a.extra["action_dist_inputs"], b.extra["action_dist_inputs"])


def test_weights_version_and_infos_reach_the_chunks():
    envs = [TwoCartPoles()]
    s = sampler(envs, {"shared": CART_SPACES}, shared, seed=0, record_infos=True, weights_version=3)
    assert {c.weights_version for c in all_chunks(s.run(num_env_steps=2))} == {3}
    s.weights_version = 4
    sample = s.run(num_env_steps=2)
    assert {c.weights_version for c in all_chunks(sample)} == {4}
    for c in all_chunks(sample):
        assert len(c.infos) == len(c) + 1 and c.infos[-1] == {"tick": 1.5} and type(c.infos[-1]["tick"]) is float
    s.reset()
    assert envs[0].resets == 2


class Broken(TwoCartPoles):
    def step(self, actions: dict) -> tuple:
        return super().step(actions)[:4]


def test_malformed_env_results_and_pieces_are_named():
    with pytest.raises(ValueError, match=r"env 1's step\(\) returned tuple .*\(observations, rewards"):
        sampler([TwoCartPoles(), Broken()], {"shared": CART_SPACES}, shared).run(num_env_steps=2)
    with pytest.raises(ValueError, match=r"explorations are given for modules \[\], the modules are \['shared'\]"):
        MultiAgentSampler([TwoCartPoles()], {"shared": ActorCriticModule(*CART_SPACES)}, {},
                          {"shared": EnvActions(CART.action_space)}, shared)

    class BareReset(TwoCartPoles):
        def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
            return super().reset(seed=seed)[0]

    with pytest.raises(ValueError, match=r"env 0's reset\(\) returned dict"):
        sampler([BareReset()], {"shared": CART_SPACES}, shared)
