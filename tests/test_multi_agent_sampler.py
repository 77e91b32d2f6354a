"""MultiAgentSampler: multi-agent envs stepped with one batched forward pass per module.

Small multi-agent envs written here (the duck-typed new-stack API): two agents acting together on
two CartPole copies, players moving in turns, an agent finishing early, an agent joining late, and
agents with Box actions and Dict observations. Covers the module routing, the chunks (shapes,
extras, continuity across runs), the counts and the episode metrics (seeding, the codec, weights versions,
infos and errors: ``test_multi_agent_sampler_seeds.py``).
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.actions import EnvActions
from actors.env.exploration import StochasticSampling
from actors.env.multi_agent_sampler import MultiAgentSample, MultiAgentSampler
from actors.metrics import MetricsLogger
from actors.modules import ActorCriticModule
from actors.modules.fused import FusedActors
from protocols.episode import EpisodeChunk

ALL = "__all__"
BOX2 = gym.spaces.Box(-100.0, 100.0, (2,), np.float32)
CART = gym.make("CartPole-v1")
CART_SPACES = (CART.observation_space, CART.action_space)


def ob(agent: int, t: int) -> np.ndarray:
    """An observation that says whose it is and when it was made."""
    return np.array([agent, t], np.float32)


def flags(done: bool = False, **agents: bool) -> dict:
    return {ALL: done, **agents}


class DictAPI:
    """What every test env shares: per-agent spaces and a check that exactly the right agents act."""

    observation_spaces: dict
    action_spaces: dict

    @property
    def possible_agents(self) -> list:
        return list(self.observation_spaces)

    def get_observation_space(self, agent: Any) -> gym.Space:
        return self.observation_spaces[agent]

    def get_action_space(self, agent: Any) -> gym.Space:
        return self.action_spaces[agent]

    def check(self, actions: dict, expected: list) -> None:
        assert sorted(actions) == sorted(expected), (actions, expected)
        for agent, action in actions.items():
            assert self.action_spaces[agent].contains(action), (agent, action)


class TwoCartPoles(DictAPI):
    """Two agents acting together, each balancing its own CartPole; an agent whose pole falls is done,
    the episode when both are."""

    def __init__(self) -> None:
        self.envs = {"a0": gym.make("CartPole-v1"), "a1": gym.make("CartPole-v1")}
        self.observation_spaces = {a: e.observation_space for a, e in self.envs.items()}
        self.action_spaces = {a: e.action_space for a, e in self.envs.items()}
        self.done: set = set()
        self.resets = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.done, self.resets = set(), self.resets + 1
        return {a: e.reset(seed=None if seed is None else 2 * seed + k)[0]
                for k, (a, e) in enumerate(self.envs.items())}, {}

    def step(self, actions: dict) -> tuple:
        self.check(actions, [a for a in self.envs if a not in self.done])
        obs, rewards, terms, truncs = {}, {}, {}, {}
        for a, action in actions.items():
            obs[a], rewards[a], terms[a], truncs[a], _ = self.envs[a].step(action)
            if terms[a] or truncs[a]:
                self.done.add(a)
        terms[ALL] = len(self.done) == len(self.envs)
        truncs[ALL] = False
        return obs, rewards, terms, truncs, {a: {"tick": np.float32(1.5)} for a in obs}


class TurnBased(DictAPI):
    """Players "x" and "o" move in turns; only the player to move observes. A move pays the mover
    1 + its action and the other player -0.5 (a reward while it waits); the game ends after ``moves``
    moves, with a final observation for both."""

    def __init__(self, moves: int = 5) -> None:
        self.moves = moves
        self.observation_spaces = {"x": BOX2, "o": BOX2}
        self.action_spaces = {"x": gym.spaces.Discrete(3), "o": gym.spaces.Discrete(3)}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.t = 0
        return {"x": ob(0, 0)}, {}

    def step(self, actions: dict) -> tuple:
        mover, other = ("x", "o") if self.t % 2 == 0 else ("o", "x")
        self.check(actions, [mover])
        self.t += 1
        rewards = {mover: 1.0 + actions[mover]}
        if self.t > 1:  # "o" has observed by now
            rewards[other] = -0.5
        done = self.t >= self.moves
        obs = {"x": ob(0, self.t), "o": ob(1, self.t)} if done else {other: ob("xo".index(other), self.t)}
        return obs, rewards, flags(done), flags(), {}


class AgentsAB(DictAPI):
    """Agents "a" and "b", observing a Box and picking one of 2; ``first`` observe at reset."""

    first = ("a", "b")

    def __init__(self) -> None:
        self.observation_spaces = {"a": BOX2, "b": BOX2}
        self.action_spaces = {"a": gym.spaces.Discrete(2), "b": gym.spaces.Discrete(2)}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.t = 0
        return {agent: ob("ab".index(agent), 0) for agent in self.first}, {}


class EarlyFinisher(AgentsAB):
    """Agent "a" is terminated after 2 steps (reward 1 each), "b" plays 5 (reward 2 each)."""

    def step(self, actions: dict) -> tuple:
        self.check(actions, ["a", "b"] if self.t < 2 else ["b"])
        self.t += 1
        obs, rewards = {"b": ob(1, self.t)}, {"b": 2.0}
        terms = flags(self.t >= 5)
        if self.t <= 2:
            obs["a"], rewards["a"] = ob(0, self.t), 1.0
            terms["a"] = self.t == 2
        return obs, rewards, terms, flags(), {}


class LateJoiner(AgentsAB):
    """Agent "a" plays 6 steps; "b" gets its first observation after step 3 and acts from then on."""

    first = ("a",)

    def step(self, actions: dict) -> tuple:
        self.check(actions, ["a"] if self.t < 3 else ["a", "b"])
        self.t += 1
        obs = {"a": ob(0, self.t)}
        rewards = {"a": 1.0}
        if self.t >= 3:
            obs["b"] = ob(1, self.t)
        if self.t > 3:
            rewards["b"] = 10.0
        return obs, rewards, flags(self.t >= 6), flags(), {}


class MixedSpaces(DictAPI):
    """Agent "c" observes a Dict and acts in a Box in [0, 10]; agent "d" observes a Box and picks one
    of 3. Four steps, acting together."""

    C_OBS = gym.spaces.Dict({"pos": BOX2, "flag": gym.spaces.Discrete(2)})

    def __init__(self) -> None:
        self.observation_spaces = {"c": self.C_OBS, "d": BOX2}
        self.action_spaces = {"c": gym.spaces.Box(0.0, 10.0, (2,), np.float32), "d": gym.spaces.Discrete(3)}
        self.received: list[dict] = []

    def obs(self) -> dict:
        return {"c": {"pos": ob(0, self.t), "flag": np.int64(self.t % 2)}, "d": ob(1, self.t)}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.t = 0
        return self.obs(), {}

    def step(self, actions: dict) -> tuple:
        self.check(actions, ["c", "d"])
        self.received.append(actions)
        self.t += 1
        return self.obs(), {"c": 0.5, "d": 1.0}, flags(self.t >= 4), flags(), {}


def sampler(envs: list, spaces: dict[str, tuple[gym.Space, gym.Space]], mapping, *, module_cls=ActorCriticModule,
            **kwargs: Any) -> MultiAgentSampler:
    modules = {mid: module_cls(o, a, {"fcnet_hiddens": [8]}, inference_only=module_cls is ActorCriticModule)
               for mid, (o, a) in spaces.items()}
    return MultiAgentSampler(envs, modules, {mid: StochasticSampling(m.dist_spec) for mid, m in modules.items()},
                             {mid: EnvActions(a) for mid, (_, a) in spaces.items()}, mapping, **kwargs)


def spy_passes(s: MultiAgentSampler, monkeypatch) -> dict[str, list[int]]:
    """Per module, the rows of every acting pass it made: its own forward pass, or its share of a
    fused pass (``FusedActors``: modules of one architecture act together)."""
    sizes = {mid: spy(m) for mid, m in s.acting.modules.items()}

    def recording(fused_pass: Any) -> Any:
        def recorded(fused: FusedActors, obs: Any, counts: list[int], **kwargs: Any) -> Any:
            for mid, count in zip(fused.module_ids, counts):
                if count:
                    sizes[mid].append(count)
            return fused_pass(fused, obs, counts, **kwargs)
        return recorded

    for name in ("dist_inputs", "dist_inputs_numpy"):  # the torch pass, or the numpy one of categorical policies
        monkeypatch.setattr(FusedActors, name, recording(getattr(FusedActors, name)))
    return sizes


def spy(module: torch.nn.Module, name: str = "forward_exploration") -> list[int]:
    """Record the batch size of every call of a module's forward pass."""
    sizes: list[int] = []
    forward = getattr(module, name)

    def recorded(obs: Any) -> dict:
        leaf = obs if isinstance(obs, torch.Tensor) else next(iter(obs.values()))
        sizes.append(len(leaf))
        return forward(obs)

    setattr(module, name, recorded)
    return sizes


def all_chunks(sample: MultiAgentSample) -> list[EpisodeChunk]:
    return [c for cs in sample.chunks.values() for c in cs]


def by_agent(sample: MultiAgentSample, agent: str) -> list[EpisodeChunk]:
    return [c for c in all_chunks(sample) if c.agent_id == agent]


shared = lambda agent, episode: "shared"  # noqa: E731
own = lambda agent, episode: f"p{agent[-1]}"  # noqa: E731


# --- module routing ---------------------------------------------------------------------------
def test_two_agents_one_module_one_forward_pass_per_step(monkeypatch):
    s = sampler([TwoCartPoles() for _ in range(3)], {"shared": CART_SPACES}, shared, seed=0)
    sizes = spy_passes(s, monkeypatch)["shared"]
    sample = s.run(num_env_steps=30)
    assert sample.env_steps == 30
    assert len(sizes) == 10  # ten rounds of three envs, one call each
    assert sizes[0] == 6  # both agents of all three envs in the first batch
    assert sum(sizes) == sample.agent_steps == sample.module_steps["shared"]
    assert set(sample.chunks) == {"shared"}
    assert {c.agent_id for c in sample.chunks["shared"]} == {"a0", "a1"}
    assert {c.env_index for c in sample.chunks["shared"]} == {0, 1, 2}


def test_one_module_per_agent(monkeypatch):
    s = sampler([TwoCartPoles() for _ in range(3)], {"p0": CART_SPACES, "p1": CART_SPACES}, own, seed=0)
    sizes = spy_passes(s, monkeypatch)
    sample = s.run(num_env_steps=24)
    assert len(sizes["p0"]) == len(sizes["p1"]) == 8 and sizes["p0"][0] == sizes["p1"][0] == 3
    for mid, agent in (("p0", "a0"), ("p1", "a1")):
        assert {c.agent_id for c in sample.chunks[mid]} == {agent}
        assert all(c.module_id == mid for c in sample.chunks[mid])
        assert sample.module_steps[mid] == sum(sizes[mid])
    assert sample.agent_steps == sum(sample.module_steps.values())


def test_unknown_module_from_the_mapping_names_the_agent():
    with pytest.raises(ValueError, match="'a1'.*'nobody'"):
        sampler([TwoCartPoles()], {"p0": CART_SPACES}, lambda agent, ep: "p0" if agent == "a0" else "nobody")


# --- chunks -----------------------------------------------------------------------------------
def test_chunks_carry_the_single_agent_extras_of_the_acting_module():
    s = sampler([TwoCartPoles() for _ in range(2)], {"p0": CART_SPACES, "p1": CART_SPACES}, own, seed=1)
    sample = s.run(num_env_steps=40)
    assert sum(len(c) for c in all_chunks(sample)) == sample.agent_steps  # simultaneous: nothing left pending
    for c in all_chunks(sample):
        c.validate()  # obs rows = actions + 1, every extra one row per action
        assert isinstance(c.agent_id, str) and c.obs.dtype == np.float32 and c.obs.shape[1:] == (4,)
        assert set(c.extra) == {"action_logp", "action_dist_inputs"}
        assert c.extra["action_logp"].dtype == np.float32 and c.extra["action_dist_inputs"].shape == (len(c), 2)
        module = s.acting.modules[c.module_id]
        dist_inputs = module.forward_inference(torch.from_numpy(c.obs[:-1]))["action_dist_inputs"]
        assert np.allclose(dist_inputs.detach().numpy(), c.extra["action_dist_inputs"], atol=1e-6)
        logp = module.dist_spec.build(dist_inputs).logp(torch.from_numpy(c.actions))
        assert np.allclose(logp.detach().numpy(), c.extra["action_logp"], atol=1e-6)


class ValueModule(ActorCriticModule):
    """Acts with its value head on, as a module whose acting pass gives ``vf_preds`` does."""

    def forward_exploration(self, obs: Any) -> dict:
        return self.forward_train(obs)


def test_vf_preds_recorded_when_the_module_outputs_them():
    s = sampler([EarlyFinisher()], {"m": (BOX2, gym.spaces.Discrete(2))}, lambda a, e: "m", module_cls=ValueModule)
    sample = s.run(num_env_steps=5)
    for c in sample.chunks["m"]:
        assert set(c.extra) == {"action_logp", "action_dist_inputs", "vf_preds"}
        values = s.acting.modules["m"].compute_values(torch.from_numpy(c.obs[:-1])).detach().numpy()
        assert np.allclose(values, c.extra["vf_preds"], atol=1e-6)


def test_explore_false_acts_greedily(monkeypatch):
    s = sampler([TwoCartPoles() for _ in range(2)], {"shared": CART_SPACES}, shared, seed=2)
    passes = spy_passes(s, monkeypatch)["shared"]  # a lone fusable module acts through the fused (numpy) pass
    sample = s.run(num_env_steps=10, explore=False)
    assert len(passes) == 5
    for c in sample.chunks["shared"]:
        assert np.array_equal(c.actions, c.extra["action_dist_inputs"].argmax(-1))


def test_box_actions_and_dict_observations():
    env = MixedSpaces()
    spaces = {"c": (MixedSpaces.C_OBS, env.action_spaces["c"]), "d": (BOX2, env.action_spaces["d"])}
    s = sampler([env], spaces, lambda agent, ep: agent, seed=0)
    sample = s.run(num_env_steps=4)
    c, d = sample.chunks["c"][0].validate(), sample.chunks["d"][0].validate()
    assert c.terminated and d.terminated and len(c) == len(d) == 4
    assert sorted(c.obs) == ["flag", "pos"] and c.obs["pos"].shape == (5, 2) and c.obs["flag"].tolist() == [0, 1, 0, 1, 0]
    # the chunk keeps the module's action in [-1, 1]; the env got it rescaled to [0, 10]
    assert c.actions.shape == (4, 2) and c.extra["action_dist_inputs"].shape == (4, 4)
    sent = np.stack([step["c"] for step in env.received])
    assert np.allclose(sent, (np.clip(c.actions, -1, 1) + 1) * 5, atol=1e-5)
    assert [type(step["d"]) for step in env.received] == [int] * 4
    assert [step["d"] for step in env.received] == d.actions.tolist()


def test_chunks_continue_across_runs_and_add_up_to_each_episode():
    s = sampler([TurnBased(moves=7), TurnBased(moves=7)], {"shared": (BOX2, gym.spaces.Discrete(3))}, shared, seed=0)
    samples = [s.run(num_env_steps=6) for _ in range(5)]  # fragments end mid-episode, mid-turn
    chunks = [c for sample in samples for c in all_chunks(sample)]
    ended = [ep for sample in samples for ep in sample.episodes]
    assert len(ended) == 4  # 15 rounds of two envs: two 7-move games each
    for ep in ended:
        total = 0
        for agent, episode_id in ep.agent_episode_ids.items():
            mine = sorted((c for c in chunks if c.episode_id == episode_id), key=lambda c: c.chunk_index)
            whole = EpisodeChunk.concat(mine)  # raises unless indices, t_started and boundary rows line up
            assert whole.terminated and whole.agent_id == agent
            total += len(whole)
        assert total == ep.agent_steps() == 7


# --- awkward agents ---------------------------------------------------------------------------
def test_turn_based(monkeypatch):
    s = sampler([TurnBased(moves=5)], {"px": (BOX2, gym.spaces.Discrete(3)), "po": (BOX2, gym.spaces.Discrete(3))},
                lambda agent, ep: f"p{agent}")
    sizes = spy_passes(s, monkeypatch)
    sample = s.run(num_env_steps=5)
    assert sizes == {"px": [1, 1, 1], "po": [1, 1]}  # only the player to move is asked
    assert sample.agent_steps == sample.env_steps == 5
    x, o = sample.chunks["px"][0], sample.chunks["po"][0]
    assert x.obs[:, 1].tolist() == [0, 2, 4, 5] and o.obs[:, 1].tolist() == [1, 3, 5]
    # a mover's step: 1 + its action, and -0.5 for the other's move while it waited (none after the last)
    assert x.rewards.tolist() == [1 + a - 0.5 for a in x.actions[:2]] + [1 + x.actions[2]]
    assert o.rewards.tolist() == [1 + a - 0.5 for a in o.actions]  # "x" made the last move
    [ep] = sample.episodes
    assert ep.get_return() == pytest.approx(sum(x.rewards) + sum(o.rewards))


def test_early_finisher_and_episode_metrics():
    s = sampler([EarlyFinisher(), EarlyFinisher()], {"pa": (BOX2, gym.spaces.Discrete(2)),
                                                     "pb": (BOX2, gym.spaces.Discrete(2))},
                lambda agent, ep: f"p{agent}")
    sample = s.run(num_env_steps=10)
    assert sample.env_steps == 10 and sample.agent_steps == 2 * (2 + 5)
    assert len(sample.episodes) == 2
    assert sample.episode_returns == [12.0, 12.0] and sample.episode_lens == [5, 5]
    for c in sample.chunks["pa"]:
        assert len(c) == 2 and c.terminated and c.obs[:, 1].tolist() == [0, 1, 2]
    for c in sample.chunks["pb"]:
        assert len(c) == 5 and c.terminated and c.rewards.tolist() == [2.0] * 5
    metrics = MetricsLogger()
    sample.log_episodes(metrics)
    assert metrics.peek("episode_return_mean") == 12.0 and metrics.peek("episode_len_mean") == 5.0
    assert metrics.peek("num_episodes") == 2
    assert metrics.peek("agent_episode_returns_mean/a") == 2.0 and metrics.peek("agent_episode_returns_mean/b") == 10.0
    assert metrics.peek("module_episode_returns_mean/pa") == 2.0
    assert metrics.peek("module_episode_returns_mean/pb") == 10.0


def test_late_joiner(monkeypatch):
    s = sampler([LateJoiner()], {"shared": (BOX2, gym.spaces.Discrete(2))}, shared)
    sizes = spy_passes(s, monkeypatch)["shared"]
    sample = s.run(num_env_steps=6)
    assert sizes == [1, 1, 1, 2, 2, 2]
    assert sample.agent_steps == 9 and sample.env_steps == 6
    [a] = by_agent(sample, "a")
    [b] = by_agent(sample, "b")
    assert len(a) == 6 and a.obs[:, 1].tolist() == list(range(7))
    assert len(b) == 3 and b.t_started == 0 and b.obs[:, 1].tolist() == [3, 4, 5, 6]
    assert b.rewards.tolist() == [10.0] * 3 and sample.episode_returns == [36.0]


class Listener:
    def __init__(self) -> None:
        self.heard: list[tuple[str, int, str, int]] = []

    def note(self, what: str, env_index: int, episode: Any) -> None:
        self.heard.append((what, env_index, episode.id_, episode.env_steps()))

    def episode_created(self, env_index: int, episode: Any) -> None:
        self.note("created", env_index, episode)

    def episode_started(self, env_index: int, episode: Any) -> None:
        self.note("start", env_index, episode)

    def episode_stepped(self, env_index: int, episode: Any) -> None:
        self.note("step", env_index, episode)

    def episode_ended(self, env_index: int, episode: Any) -> None:
        self.note("end", env_index, episode)


def test_listener_hears_each_episode_created_start_step_and_end():
    listener = Listener()
    s = sampler([EarlyFinisher()], {"m": (BOX2, gym.spaces.Discrete(2))}, lambda a, e: "m", listener=listener)
    sample = s.run(num_env_steps=6)
    first, second = sample.episodes[0].id_, s.episodes[0].id_
    assert listener.heard == ([("created", 0, first, 0), ("start", 0, first, 0)]
                              + [("step", 0, first, t) for t in range(1, 5)]
                              + [("end", 0, first, 5), ("created", 0, second, 0), ("start", 0, second, 0),
                                 ("step", 0, second, 1)])


# --- counting ---------------------------------------------------------------------------------
def test_env_steps_and_agent_steps_are_counted_apart():
    s = sampler([EarlyFinisher(), EarlyFinisher()], {"m": (BOX2, gym.spaces.Discrete(2))}, lambda a, e: "m")
    by_env = s.run(num_env_steps=4)  # two rounds: both agents of both envs act twice
    assert (by_env.env_steps, by_env.agent_steps) == (4, 8)
    by_agents = s.run(num_agent_steps=5)  # "a" is done: one action per env per round from here
    assert (by_agents.env_steps, by_agents.agent_steps) == (6, 6)
    assert by_agents.module_steps == {"m": 6}
    with pytest.raises(ValueError, match="one of num_env_steps and num_agent_steps"):
        s.run(num_env_steps=4, num_agent_steps=4)
    with pytest.raises(ValueError, match="one of num_env_steps and num_agent_steps"):
        s.run()
    with pytest.raises(ValueError, match=">= 1, got 0"):
        s.run(num_env_steps=0)


def test_exploration_schedule_follows_t0_in_the_units_run():
    seen: list[int] = []

    class Recording(StochasticSampling):
        def actions(self, dist: Any, explore: bool, timestep: int) -> torch.Tensor:
            seen.append(timestep)
            return super().actions(dist, explore, timestep)

    s = sampler([EarlyFinisher(), EarlyFinisher()], {"m": (BOX2, gym.spaces.Discrete(2))}, lambda a, e: "m")
    s.acting.explorations["m"] = Recording(s.acting.modules["m"].dist_spec)
    s.run(num_agent_steps=10, t0=50)  # four actions a round, two once "a" is done
    assert seen == [50, 54, 58]
    seen.clear()
    s.run(num_env_steps=4, t0=100)
    assert seen == [100, 102]
