"""PettingZooEnv and ParallelPettingZooEnv on real PettingZoo envs (tic-tac-toe, rock-paper-scissors
as AEC and parallel) and on small PettingZoo envs written here: random legal play through the step
checker, every player's rewards equal to PettingZoo's own accounting, action masks passed through,
agents with different spaces, early finishers, wrapping and unwrapping."""
from collections import Counter, defaultdict

import gymnasium as gym
import numpy as np
import pytest
from pettingzoo import AECEnv, ParallelEnv
from pettingzoo.classic.rps import rps
from pettingzoo.classic.tictactoe import tictactoe

from actors.env.multi_agent_checks import ALL, MultiAgentEnvError, MultiAgentStepChecker
from actors.env.pettingzoo_env import ParallelPettingZooEnv, PettingZooEnv
from tests.multi_agent_play import play_episode, random_action

S = gym.spaces


def pettingzoo_totals(raw, moves, seed):
    """Every agent's total reward when ``raw`` (an AEC env) replays ``moves``, summed PettingZoo's way:
    ``last()`` gives each agent its reward since its previous turn."""
    raw.reset(seed=seed)
    totals, moves = defaultdict(float), iter(moves)
    for agent in raw.agent_iter():
        _, reward, terminated, truncated, _ = raw.last()
        totals[agent] += reward
        action = None
        if not (terminated or truncated):
            who, action = next(moves)
            assert who == agent
        raw.step(action)
    assert next(moves, None) is None
    return dict(totals)


def test_tictactoe_random_games_pay_both_players_and_keep_masks():
    env = PettingZooEnv(tictactoe.env())
    assert env.possible_agents == ["player_1", "player_2"]
    assert env.get_observation_space("player_2")["action_mask"] == S.Box(0, 1, (9,), np.int8)

    def legal_move(agent, obs, env, rng):
        np.testing.assert_array_equal(obs["action_mask"], env.env.observe(agent)["action_mask"])  # unchanged
        return random_action(agent, obs, env, rng)

    rng, outcomes = np.random.default_rng(0), Counter()
    for game in range(300):
        ep = play_episode(env, rng, legal_move, seed=game)
        returns = {a: ep.returns.get(a, 0.0) for a in env.possible_agents}
        assert returns == pettingzoo_totals(tictactoe.env(), ep.moves, game)
        outcome = (returns["player_1"], returns["player_2"])
        outcomes[outcome] += 1
        assert ep.last[2] == {"player_1": True, "player_2": True, ALL: True} and not ep.last[3][ALL]
        if outcome != (0.0, 0.0):
            # the loser's -1 comes in the step of the winning move, and closes the loser's last move
            assert {a: ep.last[1][a] for a in returns} == returns
            loser = min(returns, key=returns.get)
            assert ep.transitions.closed[loser][-1] == -1.0
    assert set(outcomes) == {(1.0, -1.0), (-1.0, 1.0), (0.0, 0.0)}


def test_rps_as_aec_rewards_reach_the_player_that_did_not_move():
    env = PettingZooEnv(rps.env(max_cycles=15))
    rng, paid_waiting = np.random.default_rng(1), 0
    for episode in range(50):
        ep = play_episode(env, rng, seed=episode)
        assert ep.steps == 30 and ep.last[3][ALL] and not ep.last[2][ALL]  # truncated after 15 rounds
        assert dict(ep.returns) == pettingzoo_totals(rps.env(max_cycles=15), ep.moves, episode)
        # a round is scored on the second player's move: the first player is paid while it waits
        paid_waiting += sum(1 for actions, (_, rewards, *_) in ep.log for agent, reward in rewards.items()
                            if agent not in actions and reward != 0)
    assert paid_waiting > 100


def test_parallel_rps_matches_the_raw_parallel_env():
    env = ParallelPettingZooEnv(rps.parallel_env(max_cycles=15))
    assert env.par_env is env.env
    rng = np.random.default_rng(2)
    for episode in range(50):
        ep = play_episode(env, rng, seed=episode)
        assert ep.steps == 15 and ep.last[3] == {"player_0": True, "player_1": True, ALL: True}
        raw, totals = rps.parallel_env(max_cycles=15), defaultdict(float)
        obs, _ = raw.reset(seed=episode)
        for actions, (wrapped_obs, *_) in ep.log:
            obs, rewards, *_ = raw.step(actions)
            assert obs == wrapped_obs
            for agent, reward in rewards.items():
                totals[agent] += reward
        assert dict(ep.returns) == totals


class Convoy(ParallelEnv):
    """A truck (Box observations and actions) and a drone (Discrete ones); the drone lands (terminated)
    after 3 steps, the truck is truncated after 5."""

    metadata = {"name": "convoy_v0"}

    def __init__(self):
        self.possible_agents = ["truck", "drone"]
        self.spaces = {"truck": (S.Box(-10, 10, (3,), np.float32), S.Box(-1, 1, (1,), np.float32)),
                       "drone": (S.Discrete(6), S.Discrete(2))}

    def observation_space(self, agent):
        return self.spaces[agent][0]

    def action_space(self, agent):
        return self.spaces[agent][1]

    def observe(self, agent):
        return np.full(3, self.t, np.float32) if agent == "truck" else self.t

    def reset(self, seed=None, options=None):
        self.t, self.agents = 0, list(self.possible_agents)
        return {a: self.observe(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        assert set(actions) == set(self.agents)
        self.t += 1
        obs = {a: self.observe(a) for a in self.agents}
        rewards = {a: 1.0 for a in self.agents}
        terminations = {a: a == "drone" and self.t == 3 for a in self.agents}
        truncations = {a: a == "truck" and self.t == 5 for a in self.agents}
        self.agents = [a for a in self.agents if not (terminations[a] or truncations[a])]
        return obs, rewards, terminations, truncations, {a: {} for a in obs}


def test_parallel_env_with_different_spaces_and_an_early_finisher():
    env = ParallelPettingZooEnv(Convoy())
    assert env.get_observation_space("drone") == S.Discrete(6)  # per-agent spaces: ray#39453's failure
    assert env.get_action_space("truck") == S.Box(-1, 1, (1,), np.float32)
    ep = play_episode(env, np.random.default_rng(3))
    assert [sorted(actions) for actions, _ in ep.log] == [["drone", "truck"]] * 3 + [["truck"]] * 2
    assert dict(ep.returns) == {"truck": 5.0, "drone": 3.0}
    # one agent terminated, one truncated: the episode counts as terminated, each agent keeps its own flag
    assert ep.last[2][ALL] is True and ep.last[3] == {"truck": True, ALL: False}


class Gift(AECEnv):
    """"a" and "b" alternate for 4 moves; each move gives the other player 0.5 -- b's first gift comes
    before b's first turn."""

    metadata = {"name": "gift_v0"}

    def __init__(self):
        super().__init__()
        self.possible_agents = ["a", "b"]

    def observation_space(self, agent):
        return S.Discrete(5)

    def action_space(self, agent):
        return S.Discrete(2)

    def observe(self, agent):
        return self.moves

    def reset(self, seed=None, options=None):
        self.agents, self.moves, self.agent_selection = list(self.possible_agents), 0, "a"
        self.rewards, self._cumulative_rewards = {"a": 0.0, "b": 0.0}, {"a": 0.0, "b": 0.0}
        self.terminations, self.truncations = {"a": False, "b": False}, {"a": False, "b": False}
        self.infos = {"a": {}, "b": {}}

    def step(self, action):
        me = self.agent_selection
        if self.terminations[me]:
            self._was_dead_step(action)
            return
        other = "b" if me == "a" else "a"
        self._cumulative_rewards[me] = 0.0
        self._clear_rewards()
        self.rewards[other] = 0.5
        self.moves += 1
        if self.moves == 4:
            self.terminations = {"a": True, "b": True}
        self.agent_selection = other
        self._accumulate_rewards()


def test_reward_before_an_agents_first_turn_comes_with_its_first_observation():
    env = PettingZooEnv(Gift())
    ep = play_episode(env, np.random.default_rng(4))
    first_actions, (first_obs, first_rewards, *_) = ep.log[0]
    assert list(first_actions) == ["a"] and list(first_obs) == ["b"] and first_rewards == {"a": 0.0, "b": 0.5}
    assert dict(ep.returns) == pettingzoo_totals(Gift(), ep.moves, None) == {"a": 1.0, "b": 1.0}
    assert ep.transitions.loose == {"b": 0.5}  # before b's first action: in its return, in no transition


def test_illegal_move_ends_the_game_with_both_flags():
    env = PettingZooEnv(tictactoe.env())
    checker = MultiAgentStepChecker.for_env(env)
    checker.check_reset(env.reset(seed=0))
    checker.check_step(env.step(checker.check_actions({"player_1": 4})))
    obs, rewards, terminateds, truncateds, _ = checker.check_step(env.step(checker.check_actions({"player_2": 4})))
    assert rewards == {"player_1": 0.0, "player_2": -1.0} and set(obs) == {"player_1", "player_2"}
    assert terminateds == {"player_1": True, "player_2": True, ALL: True}
    assert truncateds == {"player_1": True, "player_2": True, ALL: False}  # terminated wins


def test_aec_step_takes_the_action_of_the_agent_whose_turn_it_is():
    env = PettingZooEnv(tictactoe.env())
    env.reset(seed=0)
    with pytest.raises(MultiAgentEnvError, match=r"agent 'player_1''s turn, but the actions are for \['player_2'\]"):
        env.step({"player_2": 0})
    with pytest.raises(MultiAgentEnvError, match=r"an action for agent 'player_2'") as info:
        env.step({"player_1": 0, "player_2": 1})
    assert info.value.agent_id == "player_2"


def test_wrap_unwrap_and_play():
    raw = tictactoe.env(render_mode="rgb_array", screen_height=90)
    env = PettingZooEnv(raw)
    assert env.env is raw
    play_episode(env, np.random.default_rng(5), seed=1)
    assert env.render().shape == (90, 90, 3)
    raw.reset(seed=2)  # the unwrapped env plays on by PettingZoo's own loop
    for agent in raw.agent_iter():
        obs, _, terminated, truncated, _ = raw.last()
        raw.step(None if terminated or truncated else int(np.flatnonzero(obs["action_mask"])[0]))
    assert raw.agents == []
    env.close()

    par = rps.parallel_env()
    wrapped = ParallelPettingZooEnv(par)
    assert wrapped.env is par and wrapped.par_env is par
    obs, _ = wrapped.reset(seed=0)
    assert set(obs) == set(par.agents)


def test_the_wrong_kind_of_env_is_refused():
    with pytest.raises(TypeError, match="for a parallel env use ParallelPettingZooEnv"):
        PettingZooEnv(rps.parallel_env())
    with pytest.raises(TypeError, match="for an AEC env use PettingZooEnv"):
        ParallelPettingZooEnv(tictactoe.env())
