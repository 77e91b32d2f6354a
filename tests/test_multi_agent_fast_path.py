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

from actors.connectors import ModuleToEnvConnector, PrevActionsPrevRewards
from actors.connectors.multi_agent import ModuleConnectors
from actors.env.multi_agent_env import make_multi_agent
from actors.env.multi_agent_runner import MultiAgentEnvRunner
from actors.env.settings import EnvRunnerSettings
from actors.modules import ModuleSpec
from tests.test_multi_agent_sampler import EarlyFinisher, LateJoiner, TurnBased

CARTPOLES = make_multi_agent("CartPole-v1")


def runner(creator: Any, mapping: Any, fast: bool, num_envs: int = 3, **settings: Any) -> MultiAgentEnvRunner:
    """``settings`` may hold ``env_to_module``: the modules are then built for its pipelines' output spaces."""
    env = creator({})
    spaces = {mapping(a, None): (env.get_observation_space(a), env.get_action_space(a)) for a in env.possible_agents}
    conns = ModuleConnectors.build(settings.get("env_to_module"), spaces)
    specs = {mid: ModuleSpec(obs if conns is None else conns.observation_space(mid), act, {"fcnet_hiddens": [8]})
             for mid, (obs, act) in spaces.items()}
    extra = {} if conns is None else {"connector_spaces": spaces}
    torch.manual_seed(0)  # the modules' weights alike
    count_steps_by = settings.pop("count_steps_by", "env_steps")
    r = MultiAgentEnvRunner(EnvRunnerSettings(env_creator=creator, num_envs=num_envs, rollout_fragment_length=7,
                                              seed=3, **settings), specs, mapping, worker_index=1, lockstep=fast,
                            count_steps_by=count_steps_by, **extra)
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


def assert_same_chunks(got: list, want: list, ids: dict[str, str], where: Any) -> None:
    assert len(got) == len(want) > 0, where
    for g, w in zip(got, want):
        assert ids.setdefault(g.episode_id, w.episode_id) == w.episode_id, where  # ids are random: paired one to one
        for name in ("chunk_index", "t_started", "terminated", "truncated", "agent_id", "module_id", "env_index",
                     "weights_version"):
            assert getattr(g, name) == getattr(w, name), (where, name)
        for name in ("obs", "actions", "rewards", "extra"):
            assert same(getattr(g, name), getattr(w, name)), (where, name)
    assert len(set(ids.values())) == len(ids)


def sampled_alike(fast: MultiAgentEnvRunner, general: MultiAgentEnvRunner, rounds: int, where: Any) -> Any:
    """Each round, both runners sample 40 steps from the same torch seed and must cut the same chunks; yields
    the fast runner's chunks of each round."""
    ids: dict[str, str] = {}
    for rnd in range(rounds):
        torch.manual_seed(rnd)
        got = fast.sample(num_timesteps=40)
        torch.manual_seed(rnd)
        want = general.sample(num_timesteps=40)
        assert_same_chunks(got, want, ids, (where, rnd))
        yield got


def episode_figures(r: MultiAgentEnvRunner) -> dict[str, Any]:
    """What the runner reports of its ended episodes: returns, lengths, per-agent and per-module returns."""
    out = {}
    for key, entry in r.get_metrics().items():
        if key.startswith("env_runners/") and "episode" in key:
            out[key] = entry.get("values", entry.get("value"))
    return out


def assert_same_figures(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value), key


@pytest.mark.parametrize("case", list(CASES))
def test_shortcuts_cut_the_chunks_of_the_general_path(case):
    creator, mapping = CASES[case]
    fast, general = runner(creator, mapping, True), runner(creator, mapping, False)
    # make_multi_agent's copies with no episode callbacks are sampled in lockstep, every other env in general
    assert type(fast.sampler).__name__ == ("LockstepSampler" if "CartPole" in case or "shared" in case
                                           else "MultiAgentSampler")
    assert type(general.sampler).__name__ == "MultiAgentSampler"
    for _ in sampled_alike(fast, general, 12, case):
        pass
    assert fast.num_agent_steps_sampled_lifetime == general.num_agent_steps_sampled_lifetime
    figures = episode_figures(general)
    assert any("agent_episode_returns_mean" in key for key in figures)
    assert_same_figures(episode_figures(fast), figures)


SAMPLING_MODES = {
    "agent steps": ({"count_steps_by": "agent_steps"}, {"num_timesteps": 50}),
    "complete episodes": ({"batch_mode": "complete_episodes"}, {"num_timesteps": 60}),
    "by episodes": ({}, {"num_episodes": 4}),
    "greedy": ({}, {"num_timesteps": 30, "explore": False}),
}


@pytest.mark.parametrize("mode", list(SAMPLING_MODES))
@pytest.mark.parametrize("case", ["two CartPoles", "one shared module"])
def test_lockstep_sampling_modes_cut_the_chunks_of_the_general_path(case, mode):
    creator, mapping = CASES[case]
    settings, call = SAMPLING_MODES[mode]
    fast, general = runner(creator, mapping, True, 4, **settings), runner(creator, mapping, False, 4, **settings)
    assert type(fast.sampler).__name__ == "LockstepSampler"
    ids: dict[str, str] = {}
    for rnd in range(5):
        got, want = fast.sample(**call), general.sample(**call)
        assert_same_chunks(got, want, ids, (case, mode, rnd))
    assert fast.num_env_steps_sampled_lifetime == general.num_env_steps_sampled_lifetime
    assert fast.num_agent_steps_sampled_lifetime == general.num_agent_steps_sampled_lifetime
    assert_same_figures(episode_figures(fast), episode_figures(general))


def test_lockstep_cuts_the_chunks_of_the_general_path_as_modules_come_and_go():
    """A module added mid-run (self-play's snapshot) changes the fused groups; episodes that start later are
    mapped to it, and a removed module's episodes restart: both samplers still cut the same chunks."""
    creator, mapping = CASES["two CartPoles"]
    fast, general = runner(creator, mapping, True), runner(creator, mapping, False)
    assert type(fast.sampler).__name__ == "LockstepSampler"
    ids: dict[str, str] = {}
    for rnd in range(4):
        if rnd == 1:
            for r in (fast, general):
                spec = r.module_specs["p0"]
                torch.manual_seed(11)
                r.add_module("p0_v1", spec, weights=r.module["p0"].get_state())
                r.set_policy_mapping_fn(lambda agent, episode, **kw: "p0" if agent == 0 else "p0_v1")
        if rnd == 3:
            for r in (fast, general):
                r.remove_module("p1")
        for _ in range(3):
            got, want = fast.sample(num_timesteps=40), general.sample(num_timesteps=40)
            assert_same_chunks(got, want, ids, rnd)
    assert {c.module_id for c in fast.sample(num_timesteps=40)} == {"p0", "p0_v1"}


@pytest.mark.parametrize("case", ["two CartPoles", "one shared module"])
def test_lockstep_with_env_to_module_pipelines_cuts_the_chunks_of_the_general_path(case):
    """Each module's MeanStdFilter sees the same batches in the same order in both samplers: the same
    normalised observations, chunks and statistics, bit for bit."""
    from pipeline.connectors import mean_std_filter

    creator, mapping = CASES[case]
    fast = runner(creator, mapping, True, env_to_module=mean_std_filter)
    general = runner(creator, mapping, False, env_to_module=mean_std_filter)
    assert type(fast.sampler).__name__ == "LockstepSampler" and type(general.sampler).__name__ == "MultiAgentSampler"
    ids: dict[str, str] = {}
    for rnd in range(8):
        torch.manual_seed(rnd)
        got = fast.sample(num_timesteps=40)
        torch.manual_seed(rnd)
        want = general.sample(num_timesteps=40)
        assert_same_chunks(got, want, ids, (case, rnd))
        assert all(np.abs(c.obs).max() <= 10.0 for c in got)  # what the filter put out
    for mid, states in general.connectors.get_state().items():
        mine = fast.connectors.get_state()[mid][0]["state"]
        assert mine["count"] == states[0]["state"]["count"] > 0
        for key in ("mean", "m2"):
            assert mine[key].tobytes() == states[0]["state"][key].tobytes()


class Flip(ModuleToEnvConnector):
    """Sends the env the other of CartPole's two actions; the module's choice is what chunks record."""

    def __call__(self, batch, *, observations=None, explore=True):
        return {**batch, "actions_for_env": 1 - np.asarray(batch["actions"])}


@pytest.mark.parametrize("case", ["two CartPoles", "one shared module"])
def test_lockstep_with_per_agent_memory_and_module_to_env_pipelines_cuts_the_chunks_of_the_general_path(case):
    """PrevActionsPrevRewards (memory per agent) before the modules and a module-to-env piece after them: the
    lockstep sampler runs both and cuts the chunks the general sampler cuts, bit for bit."""
    creator, mapping = CASES[case]
    pieces = dict(env_to_module=lambda env: [PrevActionsPrevRewards(n_prev_actions=2, n_prev_rewards=2)],
                  module_to_env=lambda env: [Flip()])
    fast = runner(creator, mapping, True, **pieces)
    general = runner(creator, mapping, False, **pieces)
    assert type(fast.sampler).__name__ == "LockstepSampler" and type(general.sampler).__name__ == "MultiAgentSampler"
    assert fast.sampler.module_to_env is not None and fast.sampler.observations.keyed
    for got in sampled_alike(fast, general, 6, case):
        for c in got:  # each agent's own last action and reward, beside its observation
            t = len(c) - 1
            if t >= 1:
                assert c.obs["prev_n_actions"][t][-2:].argmax() == c.actions[t - 1]
                assert c.obs["prev_n_rewards"][t][-1] == c.rewards[t - 1]
    memory = [p.pieces[0].num_keys for p in fast.connectors.pipelines.values()]
    assert 0 < sum(memory) <= 6  # 3 envs x 2 agents: ended episodes' agents forgotten
