"""The multi-agent sampling shortcuts give exactly the chunks of the general path.

Every shortcut for the commonest step -- the step checker's one pass (``MultiAgentStepChecker.fast``),
the episode's one-pass recording, a forward pass's actions recorded across episodes in one pass
(``add_action_batch``) and the fused pass's rows padded as a list (``MultiAgentSampler.use_fast_path``)
-- has a switch that sends every step through the general path. Two
runners, seeded alike, one with the shortcuts and one without, sample the same envs (two CartPole
copies whose agents finish apart, agents moving in turns, finishing early, joining late) and must cut
the same chunks: observations, actions, rewards, extras, flags, indices, agents and modules.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from actors.env.multi_agent_env import make_multi_agent
from actors.env.multi_agent_runner import MultiAgentEnvRunner
from actors.env.settings import EnvRunnerSettings
from actors.modules import ModuleSpec
from tests.test_multi_agent_sampler import EarlyFinisher, LateJoiner, TurnBased

CARTPOLES = make_multi_agent("CartPole-v1")


def runner(creator: Any, mapping: Any, fast: bool, num_envs: int = 3) -> MultiAgentEnvRunner:
    env = creator({})
    agents = env.possible_agents
    specs = {mapping(a, None): ModuleSpec(env.get_observation_space(a), env.get_action_space(a), {"fcnet_hiddens": [8]})
             for a in agents}
    torch.manual_seed(0)  # the modules' weights alike
    r = MultiAgentEnvRunner(EnvRunnerSettings(env_creator=creator, num_envs=num_envs, rollout_fragment_length=7,
                                              seed=3), specs, mapping, worker_index=1)
    r.sampler.use_fast_path(fast)
    for checked in r.envs:
        if hasattr(checked, "checker"):  # make_multi_agent's copies check themselves
            checked.checker.fast = fast
    return r


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


CASES = {
    "two CartPoles": (lambda ctx: CARTPOLES({"num_agents": 2}), lambda agent, episode, **kw: f"p{agent}"),
    "one shared module": (lambda ctx: CARTPOLES({"num_agents": 2}), lambda agent, episode, **kw: "shared"),
    "turns": (lambda ctx: TurnBased(), lambda agent, episode, **kw: f"m{agent}"),
    "early finisher": (lambda ctx: EarlyFinisher(), lambda agent, episode, **kw: f"m{agent}"),
    "late joiner": (lambda ctx: LateJoiner(), lambda agent, episode, **kw: "m"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shortcuts_cut_the_chunks_of_the_general_path(case):
    creator, mapping = CASES[case]
    fast, general = runner(creator, mapping, True), runner(creator, mapping, False)
    ids: dict[str, str] = {}  # episode ids are random: they must pair up one to one
    for rnd in range(6):
        torch.manual_seed(rnd)
        got = fast.sample(num_timesteps=40)
        torch.manual_seed(rnd)
        want = general.sample(num_timesteps=40)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want):
            assert ids.setdefault(g.episode_id, w.episode_id) == w.episode_id
            for name in ("chunk_index", "t_started", "terminated", "truncated", "agent_id", "module_id", "env_index",
                         "weights_version"):
                assert getattr(g, name) == getattr(w, name), (case, rnd, name)
            for name in ("obs", "actions", "rewards", "extra"):
                assert same(getattr(g, name), getattr(w, name)), (case, rnd, name)
    assert len(set(ids.values())) == len(ids)
    assert fast.num_agent_steps_sampled_lifetime == general.num_agent_steps_sampled_lifetime
