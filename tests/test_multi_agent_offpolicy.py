"""DQN and SAC train several modules, each from its own replay buffer (issue 27).

Fast, in-process: a turn-based two-agent env whose rewards name the agent and the env step shows
that each module's buffer holds only its own agents' transitions and that n-step returns run over
an agent's own turns (also when both agents share one module); a frozen module gets no buffer and
keeps its weights; prioritized replay's TD errors reach every module's own buffer; a checkpoint
holds every module's buffer; the replay ratio counts in ``count_steps_by`` units; what is not built
(the streaming replay) fails at ``build()`` naming the setting; SAC trains two modules with their
own temperatures. Slow (Ray): two data-parallel learners split every module's batch.
Learning (``-m learning``): DQN with two policies on two-agent CartPole reaches a summed return of 800,
and SAC with two policies on two-agent Pendulum improves clearly.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.replay import MultiAgentReplay, ReplaySettings
from pipeline import DQNConfig, MultiAgentEnv, SACConfig, make_multi_agent
from pipeline.algorithm import Algorithm
from pipeline.config.base import ConfigError
from tests.pieces import by_agent as per_agent

EPISODE_STEPS = 8
"""Env steps of a ``TurnTaking`` episode: agent "a" acts at the even ones, "b" at the odd ones."""


class TurnTaking(MultiAgentEnv):
    """Agents "a" and "b" act in turns; an observation is ``[agent index, env step]``. After env step
    ``t`` every agent that has acted gets a reward: ``t + 1`` for "a", ``100 * (t + 1)`` for "b" -- so a
    step's reward tells whose it is and which env steps it summed."""

    def __init__(self, config: dict | None = None) -> None:
        self.possible_agents = ["a", "b"]
        space = gym.spaces.Box(0.0, 100.0, (2,), np.float32)
        self.observation_spaces = {"a": space, "b": space}
        self.action_spaces = {"a": gym.spaces.Discrete(2), "b": gym.spaces.Discrete(2)}
        super().__init__()
        self.t = 0

    def obs(self, agent: str) -> np.ndarray:
        return np.array([self.possible_agents.index(agent), self.t], np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        super().reset(seed=seed)
        self.t = 0
        return {"a": self.obs("a")}, {}

    def step(self, action_dict: dict) -> tuple[dict, dict, dict, dict, dict]:
        acted = ["a"] if self.t == 0 else ["a", "b"]
        rewards = {agent: float((self.t + 1) * (1 if agent == "a" else 100)) for agent in acted}
        self.t += 1
        done = self.t == EPISODE_STEPS
        if done:  # both see the end
            return ({agent: self.obs(agent) for agent in ("a", "b")}, rewards, {"a": True, "b": True, "__all__": True},
                    {"__all__": False}, {})
        nxt = self.possible_agents[self.t % 2]
        return {nxt: self.obs(nxt)}, rewards, {"__all__": False}, {"__all__": False}, {}


def own_step_rewards(agent: str) -> list[float]:
    """What each of ``agent``'s own steps earns: the rewards of the env steps from its action up to its
    next observation (its turn's step and the other agent's)."""
    scale, first = (1, 0) if agent == "a" else (100, 1)
    turns = list(range(first, EPISODE_STEPS, 2))
    return [scale * sum(t + 1 for t in range(turn, min(turn + 2, EPISODE_STEPS))) for turn in turns]


def shared(agent_id: Any, episode: Any, **kwargs: Any) -> str:
    return "shared"


def turn_taking_dqn(mapping: Any, policies: set[str], **training: Any) -> DQNConfig:
    """Two episodes a training step (one a ``train()``), and no update: the replay is only filled."""
    training = {"num_steps_sampled_before_learning_starts": 10_000, "n_step": 2, "gamma": 0.5,
                "replay_buffer_config": {"type": "EpisodeReplayBuffer", "capacity": 20_000}} | training
    return (DQNConfig().environment(TurnTaking).multi_agent(policies=policies, policy_mapping_fn=mapping)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=1, rollout_fragment_length=2 * EPISODE_STEPS)
            .rl_module(model_config={"fcnet_hiddens": [8]}).training(**training)
            .reporting(min_sample_timesteps_per_iteration=0).debugging(seed=0))


def check_n_step_returns(replay: MultiAgentReplay, module_id: str, agents: set[str]) -> None:
    """Every stored transition of ``module_id`` belongs to one of ``agents`` and its 2-step return
    (gamma 0.5) runs over that agent's own next step, never the other agent's nor past its end."""
    batch = replay.sample(256, [module_id])[module_id]
    for obs, ret, used, nxt, term in zip(batch["obs"], batch["rewards"], batch["n_steps"], batch["next_obs"],
                                         batch["terminateds"]):
        agent = "ab"[int(obs[0])]
        assert agent in agents, f"module {module_id} holds a step of agent {agent}"
        own = own_step_rewards(agent)
        k = (int(obs[1]) - (agent == "b")) // 2  # the agent's own step index
        want = own[k] + (0.5 * own[k + 1] if k + 1 < len(own) else 0.0)
        assert used == min(2, len(own) - k) and ret == pytest.approx(want), (agent, k, ret, want)
        assert nxt[0] == obs[0]  # bootstraps from the same agent's observation
        assert term == (k + used == len(own))


def test_each_module_buffer_holds_its_own_agents_steps_with_n_step_returns_over_their_turns():
    algo = turn_taking_dqn(per_agent, {"pa", "pb"}).build(logdir=None)
    try:
        result = algo.train()
        replay = algo.plan.multi.replay
        assert replay.module_ids == ["pa", "pb"]
        # two episodes: each agent took 4 steps in each
        assert {mid: len(replay.buffer(mid)) for mid in ("pa", "pb")} == {"pa": 8, "pb": 8}
        check_n_step_returns(replay, "pa", {"a"})
        check_n_step_returns(replay, "pb", {"b"})
        assert result["replay"]["pa"]["inserts"] == 8 and result["replay"]["pb"]["inserts"] == 8
        assert result["num_env_steps_trained_lifetime"] == 0  # before learning starts
        # the state holds every module's buffer: a copy restored from it draws the same batches
        copy = MultiAgentReplay(replay.buffer("pa").settings, ["pa", "pb"])
        copy.set_state(replay.get_state())
        for mine, theirs in zip(replay.sample(16, ["pa", "pb"]).values(), copy.sample(16, ["pa", "pb"]).values()):
            np.testing.assert_array_equal(mine["indices"], theirs["indices"])
            np.testing.assert_array_equal(mine["rewards"], theirs["rewards"])
        with pytest.raises(ValueError, match=r"holds buffers for modules \['pa', 'pb'\], this replay keeps \['pa'\]"):
            MultiAgentReplay(replay.buffer("pa").settings, ["pa"]).set_state(replay.get_state())
    finally:
        algo.stop()


def test_two_agents_of_one_module_keep_their_own_step_sequences():
    algo = turn_taking_dqn(shared, {"shared"}).build(logdir=None)
    try:
        algo.train()
        replay = algo.plan.multi.replay
        assert len(replay.buffer("shared")) == 16
        check_n_step_returns(replay, "shared", {"a", "b"})
    finally:
        algo.stop()


def cartpoles(config: Any, **multi_agent: Any) -> Any:
    multi_agent = {"policies": {"p0", "p1"}, "policy_mapping_fn": per_agent} | multi_agent
    return (config.environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
            .multi_agent(**multi_agent).env_runners(num_env_runners=0)
            .reporting(min_sample_timesteps_per_iteration=0)  # an iteration per training step
            .debugging(seed=0))


def small_dqn(**training: Any) -> DQNConfig:
    training = {"num_steps_sampled_before_learning_starts": 64, "train_batch_size_per_learner": 32,
                "training_intensity": 8} | training
    return DQNConfig().rl_module(model_config={"fcnet_hiddens": [16]}).training(**training)


def module_weights(algo: Any, module_id: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in algo.get_module(module_id).state_dict().items()}


def train_until_trained(algo: Any, iterations: int = 20) -> dict:
    result = {}
    for _ in range(iterations):
        result = algo.train()
        if result["num_env_steps_trained_lifetime"] > 0:
            return result
    return result


def test_both_modules_train_each_on_its_own_prioritized_buffer():
    algo = cartpoles(small_dqn()).build(logdir=None)
    try:
        before = {mid: module_weights(algo, mid) for mid in ("p0", "p1")}
        result = train_until_trained(algo)
        for _ in range(3):
            result = algo.train()
        for mid in ("p0", "p1"):
            stats = result["learners"][mid]
            assert np.isfinite(stats["qf_loss"]) and stats["num_module_steps_trained"] == 32
            after = module_weights(algo, mid)
            assert any(not torch.equal(before[mid][k], after[k]) for k in after), f"{mid} did not change"
            assert result["replay"][mid]["samples"] > 0
            buffer = algo.plan.multi.replay.buffer(mid)  # steps enter at one priority; only TD errors set others
            steps = np.flatnonzero(buffer.storage.cols["has_action"][:buffer.storage.filled])
            assert len(np.unique(buffer.tree.get(steps))) > 1, f"no TD error reached {mid}'s buffer"
        assert result["learners"]["__all_modules__"]["num_agent_steps_trained"] == \
            2 * result["learners"]["__all_modules__"]["num_env_steps_trained"]
    finally:
        algo.stop()


def test_a_frozen_module_gets_no_buffer_is_never_sampled_for_and_keeps_its_weights():
    algo = cartpoles(small_dqn(), policies_to_train=["p0"]).build(logdir=None)
    try:
        before = module_weights(algo, "p1")
        result = train_until_trained(algo)
        result = algo.train()
        assert algo.plan.multi.replay.module_ids == ["p0"]
        assert "p1" not in result["learners"] and "p1" not in result["replay"]
        assert result["replay"]["num_frozen_steps_dropped"] > 0 and result["replay"]["p0"]["samples"] > 0
        after = module_weights(algo, "p1")
        assert all(torch.equal(before[k], after[k]) for k in after)
    finally:
        algo.stop()


def p0_and_p2(agent_id: Any, episode: Any, **kwargs: Any) -> str:
    return "p0" if agent_id == 0 else "p2"


def only_p0(module_id: str, batch: Any) -> bool:
    return module_id == "p0"


def test_modules_added_and_removed_while_training_get_and_lose_their_buffers():
    """The self-play pattern on DQN: a module added as trainable replays from its first chunk and trains;
    a removed module's buffer goes; a policies_to_train function keeps the module it refuses untrained."""
    algo = cartpoles(small_dqn()).build(logdir=None)
    try:
        train_until_trained(algo)
        algo.add_module("p2", new_agent_to_module_mapping_fn=p0_and_p2, new_should_module_be_updated=["p0", "p2"])
        before = module_weights(algo, "p2")
        result = {}
        for _ in range(20):
            result = algo.train()
            if result["learners"].get("p2", {}).get("num_module_steps_trained", 0) > 0:
                break
        assert "p2" in algo.plan.multi.replay.module_ids and result["replay"]["p2"]["samples"] > 0
        after = module_weights(algo, "p2")
        assert any(not torch.equal(before[k], after[k]) for k in after), "the added module did not train"
        algo.remove_module("p1", new_should_module_be_updated=only_p0)
        frozen, p0 = module_weights(algo, "p2"), module_weights(algo, "p0")
        for _ in range(3):
            result = algo.train()
        assert algo.plan.multi.replay.module_ids == ["p0", "p2"]  # p1's buffer went; p2 keeps its own
        assert "p0" in result["learners"]
        assert all(torch.equal(frozen[k], v) for k, v in module_weights(algo, "p2").items())
        assert any(not torch.equal(p0[k], v) for k, v in module_weights(algo, "p0").items())
    finally:
        algo.stop()


def test_a_checkpoint_with_the_buffers_restores_every_modules_buffer(tmp_path):
    algo = cartpoles(small_dqn(store_buffer_in_checkpoints=True)).build(logdir=None)
    try:
        result = train_until_trained(algo)
        sizes = {mid: len(algo.plan.multi.replay.buffer(mid)) for mid in ("p0", "p1")}
        path = algo.save(str(tmp_path))
        path = getattr(getattr(path, "checkpoint", path), "path", path)
    finally:
        algo.stop()
    assert result["num_env_steps_trained_lifetime"] > 0 and min(sizes.values()) > 0
    restored = Algorithm.from_checkpoint(path, logdir=None)
    try:
        assert {mid: len(restored.plan.multi.replay.buffer(mid)) for mid in ("p0", "p1")} == sizes
        trained = restored.train()["num_env_steps_trained_lifetime"]
        assert trained > result["num_env_steps_trained_lifetime"]
    finally:
        restored.stop()


@pytest.mark.parametrize("count_steps_by", ["env_steps", "agent_steps"])
def test_the_replay_ratio_counts_in_count_steps_by_units(count_steps_by):
    # one module for both agents: its buffer gets two agent steps per env step, and the ratio still
    # counts in the run's unit -- update rounds = intensity / batch * (steps sampled after the start)
    algo = cartpoles(small_dqn(training_intensity=8, train_batch_size_per_learner=32),
                     policies={"shared"}, policy_mapping_fn=shared, count_steps_by=count_steps_by).build(logdir=None)
    try:
        for _ in range(8):
            result = algo.train()
        key = "num_agent_steps_sampled_lifetime" if count_steps_by == "agent_steps" else "num_env_steps_sampled_lifetime"
        sampled = result[key]
        rounds = int(8 / 32 * (sampled - 64))
        assert rounds > 0
        assert result["learners"]["__all_modules__"]["num_agent_steps_trained_lifetime"] == 32 * rounds
        assert result["num_agent_steps_sampled_lifetime"] > result["num_env_steps_sampled_lifetime"]
    finally:
        algo.stop()


def test_the_streaming_replay_is_refused_for_multi_agent_runs_naming_the_setting():
    with pytest.raises(ConfigError, match=r"replay_buffer_config remote=True is not built for multi-agent runs"):
        cartpoles(small_dqn(replay_buffer_config={"type": "uniform", "remote": True})).env_runners(
            num_env_runners=1).build(logdir=None)


def test_a_chunk_without_module_id_is_refused_naming_it():
    from protocols.episode import EpisodeBuilder

    replay = MultiAgentReplay(ReplaySettings(capacity=100), ["p0"])
    builder = EpisodeBuilder()
    builder.add_reset(np.zeros(2, np.float32))
    builder.add_step(0, 1.0, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="has no module_id"):
        replay.add([builder.cut()])


@pytest.mark.slow
def test_two_data_parallel_learners_split_every_modules_batch_and_stay_identical(ray_cluster):
    algo = cartpoles(small_dqn()).learners(num_learners=2, num_cpus_per_learner=1).build(logdir=None)
    try:
        result = train_until_trained(algo)
        for mid in ("p0", "p1"):
            assert np.isfinite(result["learners"][mid]["qf_loss"])
            buffer = algo.plan.multi.replay.buffer(mid)  # one TD error per row came back from the two shards
            steps = np.flatnonzero(buffer.storage.cols["has_action"][:buffer.storage.filled])
            assert len(np.unique(buffer.tree.get(steps))) > 1
        first, second = algo.learner_group.foreach_learner(lambda learner: learner.get_weights())
        assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)
    finally:
        algo.stop()


def test_sac_trains_two_modules_each_with_its_own_temperature():
    config = (SACConfig().rl_module(model_config={"fcnet_hiddens": [16]})
              .training(num_steps_sampled_before_learning_starts=64, train_batch_size_per_learner=32,
                        training_intensity=32, replay_buffer_config={"type": "uniform", "capacity": 2000}))
    algo = (config.environment(make_multi_agent("Pendulum-v1"), env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=per_agent)
            .reporting(min_sample_timesteps_per_iteration=0).debugging(seed=0).build(logdir=None))
    try:
        result = train_until_trained(algo, iterations=100)
        for _ in range(20):
            result = algo.train()
        for mid in ("p0", "p1"):
            stats = result["learners"][mid]
            assert np.isfinite(stats["qf_loss"]) and stats["alpha_value"] < 1  # tuned from 1.0 by its own optimizer
        assert result["learners"]["p0"]["alpha_value"] != result["learners"]["p1"]["alpha_value"]
    finally:
        algo.stop()


@pytest.fixture
def one_torch_thread() -> Any:
    """The learner runs in the driver: one intra-op thread, as ``num_cpus_for_main_process`` is 1 (on a busy
    machine torch's thread per core spins against the sampler, 10x slower), and the same float sums on every
    machine, so a seed's run does not depend on the core count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train_to(algo: Any, target: float, budget: int) -> tuple[float, dict]:
    """Train until the smoothed summed return reaches ``target`` or ``budget`` env steps were sampled;
    returns (the best smoothed return seen, the last result)."""
    best, result = float("-inf"), {}
    while best < target and result.get("num_env_steps_sampled_lifetime", 0) < budget:
        result = algo.train()
        ret = result["env_runners"]["episode_return_mean"]
        best = max(best, ret) if ret == ret else best
    return best, result


@pytest.mark.learning
def test_dqn_trains_two_policies_to_a_summed_return_of_800_on_two_agent_cartpole(one_torch_thread):
    """Measured (one torch thread, this config): seeds 0, 1 and 2 reach 800 at 80k, 126k and 103k env
    steps (70-100 s with another run on the second core); with DQN's default lr of 5e-4 they needed 178k,
    171k and 149k. With DQN's default [64, 64] ReLU trunk seed 0 stalled at 715 by 300k once the runner's
    order of random draws changed (seeds 1 and 2 reached 800): the default was on the edge of this
    budget, so the test uses RLlib's tuned CartPole model."""
    # RLlib's tuned CartPole DQN model (one tanh layer of 256) with fewer, larger updates: 8 transitions
    # trained per env step and module, in batches of 128, at lr 1e-3; the mean over the last 20 episodes
    config = cartpoles(DQNConfig().training(training_intensity=8, train_batch_size_per_learner=128, lr=1e-3)
                       .rl_module(model_config={"fcnet_hiddens": [256], "fcnet_activation": "tanh"})
                       .reporting(metrics_num_episodes_for_smoothing=20))
    algo = config.build(logdir=None)
    try:
        best, result = train_to(algo, 800, 300_000)
        steps = result["num_env_steps_sampled_lifetime"]
        assert best >= 800, f"summed return {best:.0f} after {steps} env steps"
        for mid in ("p0", "p1"):
            assert result["learners"][mid]["num_target_updates"] > 0 and result["replay"][mid]["samples"] > 0
    finally:
        algo.stop()


SAC_TARGET, SAC_BUDGET = -1000, 8000
"""Two-agent Pendulum: the summed return SAC must reach (random play: about -2400), within these env steps.
Measured (seed 0, one torch thread): -708 at 3.8k env steps, -320 at 6k."""


@pytest.mark.learning
def test_sac_trains_two_policies_on_two_agent_pendulum(one_torch_thread):
    # random play scores about -1200 per agent (-2400 summed); each module on its own buffer,
    # one update round per env step, smoothed over the last 5 episodes
    config = (SACConfig().environment(make_multi_agent("Pendulum-v1"), env_config={"num_agents": 2})
              .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=per_agent)
              .training(actor_lr=1e-3, critic_lr=1e-3, alpha_lr=1e-3, train_batch_size_per_learner=128,
                        training_intensity=128, num_steps_sampled_before_learning_starts=500,
                        replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 20_000})
              .rl_module(model_config={"fcnet_hiddens": [64, 64]}).reporting(metrics_num_episodes_for_smoothing=5)
              .env_runners(num_env_runners=0).debugging(seed=0))
    algo = config.build(logdir=None)
    try:
        best, result = train_to(algo, SAC_TARGET, SAC_BUDGET)
        means = result["env_runners"]["module_episode_returns_mean"]
        assert best >= SAC_TARGET, f"summed return {best:.0f} after {result['num_env_steps_sampled_lifetime']} env steps"
        assert min(means.values()) > -900, f"one policy lags: {means}"
    finally:
        algo.stop()
