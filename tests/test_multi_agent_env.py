"""MultiAgentEnv (RLlib's new-stack API) and make_multi_agent: spaces per agent, a user's env with turns,
late joiners and early finishers played through the step checker, and n copies of a gymnasium env."""
import itertools
import pickle

import gymnasium as gym
import numpy as np
import pytest

from actors.env.multi_agent_checks import ALL, MultiAgentEnvError
from actors.env.multi_agent_env import MultiAgentEnv, make_multi_agent
from actors.env.vector_env import EnvContext
from tests.envs import CountingEnv
from tests.multi_agent_play import play_episode

S = gym.spaces


# --- the base class ------------------------------------------------------------------------------

class TwoSpaces(MultiAgentEnv):
    def __init__(self):
        self.observation_spaces = {"car": S.Box(-1, 1, (2,)), 3: S.Discrete(4)}
        self.action_spaces = {"car": S.Discrete(2), 3: S.Discrete(5)}
        super().__init__()


def test_spaces_per_agent_and_agents_inferred():
    env = TwoSpaces()
    assert env.get_observation_space(3) == S.Discrete(4) and env.get_action_space("car") == S.Discrete(2)
    assert env.possible_agents == ["car", 3] and env.agents == ["car", 3]
    assert env.max_num_agents == 2 and env.num_agents == 2
    env.agents.remove(3)
    assert TwoSpaces().agents == ["car", 3]  # each instance its own list
    with pytest.raises(MultiAgentEnvError, match=r"no action space for agent 'bus'.*\['car', 3\]") as info:
        env.get_action_space("bus")
    assert info.value.agent_id == "bus"


def test_old_stack_spaces():
    class OneSpace(MultiAgentEnv):
        observation_space = S.Discrete(2)
        possible_agents = ["x", "y"]

    class KeyedSpace(MultiAgentEnv):
        observation_space = S.Dict({"x": S.Discrete(2), "y": S.Discrete(3)})

    assert OneSpace().get_observation_space("y") == S.Discrete(2)
    assert OneSpace().agents == ["x", "y"]
    assert KeyedSpace().get_observation_space("y") == S.Discrete(3)
    with pytest.raises(MultiAgentEnvError, match=r"defines no action spaces: set self.action_spaces"):
        OneSpace().get_action_space("x")


class Relay(MultiAgentEnv):
    """A user's env: "red" and "blue" take turns; the judge (agent 2) joins at step 3 and acts every
    step; red finishes at step 6 with a final observation; blue is truncated at step 9 without one.
    The mover gets 1, from step 2 to 6 the waiting player -0.25 (a reward for an agent that did not
    act), the judge 0.5 for each action."""

    def __init__(self, config=None):
        super().__init__()
        self.possible_agents = ["red", "blue", 2]
        self.observation_spaces = {a: S.Box(0.0, 20.0, (1,), np.float32) for a in self.possible_agents}
        self.action_spaces = {a: S.Discrete(2) for a in self.possible_agents}

    def obs(self):
        return np.array([self.t], np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.agents = 0, ["red", "blue"]
        return {"red": self.obs()}, {}

    def step(self, action_dict):
        self.t += 1
        mover = "red" if self.t % 2 == 1 and self.t < 6 else "blue"
        rewards = {mover: 1.0}
        if 2 <= self.t <= 6:
            rewards["blue" if mover == "red" else "red"] = -0.25
        if 2 in action_dict:
            rewards[2] = 0.5
        nxt = "blue" if mover == "red" or self.t >= 6 else "red"
        obs = {nxt: self.obs()}
        terminateds, truncateds = {ALL: False}, {ALL: False}
        if self.t >= 3:
            obs[2] = self.obs()  # joins at step 3
        if self.t == 6:
            obs["red"], terminateds["red"] = self.obs(), True
            self.agents.remove("red")
        if self.t == 9:
            obs = {2: self.obs()}
            truncateds.update({"blue": True, ALL: True})
        return obs, rewards, terminateds, truncateds, {}


def test_user_env_with_turns_late_join_and_early_finish_passes_the_checker():
    rng = np.random.default_rng(0)
    for seed in range(20):
        ep = play_episode(Relay(), rng, seed=seed)
        assert ep.steps == 9
        acted = [agent for agent, _ in ep.moves]
        assert acted[:3] == ["red", "blue", "red"] and acted.count("red") == 3 and acted.count(2) == 6
        # every reward, the waiting player's included, ends in the transition of the agent's last action
        assert ep.returns["red"] == 3.0 - 0.25 * 3 and ep.returns["blue"] == 6.0 - 0.25 * 2
        assert ep.transitions.closed["red"] == [1.0 - 0.25] * 3
        assert ep.transitions.closed["blue"] == [1.0 - 0.25] * 2 + [1.0] * 4
        assert ep.transitions.closed_without_obs == ["blue"]  # truncated with no final observation
        assert ep.transitions.loose == {} and ep.transitions.closed[2] == [0.5] * 6


# --- make_multi_agent ----------------------------------------------------------------------------

def test_make_multi_agent_cartpole_agents_are_independent_copies():
    cls = make_multi_agent("CartPole-v1")
    env = cls({"num_agents": 2})
    assert env.possible_agents == [0, 1] and env.get_observation_space(1) == gym.make("CartPole-v1").observation_space
    rng = np.random.default_rng(1)
    for seed in (10, 11, 12):
        ep = play_episode(env, rng, seed=seed)
        assert not np.array_equal(ep.first_obs[0], ep.first_obs[1])  # copy i is seeded seed + i
        for agent in (0, 1):
            single = gym.make("CartPole-v1")
            obs, _ = single.reset(seed=seed + agent)
            np.testing.assert_array_equal(obs, ep.first_obs[agent])
            total, done = 0.0, False
            for action in (a for who, a in ep.moves if who == agent):
                assert not done  # a done agent is not asked to act again
                obs, reward, terminated, truncated, _ = single.step(action)
                total, done = total + reward, terminated or truncated
            assert done and total == ep.returns[agent]
        assert ep.last[2][ALL] and not ep.last[3][ALL]


def test_make_multi_agent_defaults_to_one_agent():
    env = make_multi_agent("CartPole-v1")()
    assert env.possible_agents == [0] and list(env.reset(seed=0)[0]) == [0]


def test_all_truncated_or_mixed_endings():
    env = make_multi_agent(CountingEnv)({"num_agents": 2, "length": 3, "truncate": True})
    ep = play_episode(env, np.random.default_rng(0))
    assert ep.steps == 3 and ep.last[3] == {0: True, 1: True, ALL: True} and ep.last[2][ALL] is False

    endings = itertools.cycle([{"length": 2}, {"length": 4, "truncate": True}])
    env = make_multi_agent(lambda config: CountingEnv(next(endings)))({"num_agents": 2})
    ep = play_episode(env, np.random.default_rng(0))
    assert [a for a, _ in ep.moves] == [0, 1, 0, 1, 1, 1]  # agent 0 stops appearing after step 2
    assert ep.last[2][ALL] is True and ep.last[3][ALL] is False and env.agents == []
    assert dict(ep.returns) == {0: 2.0, 1: 4.0}


def test_config_reaches_every_copy_without_num_agents():
    seen = []
    ctx = EnvContext({"num_agents": 3, "length": 2}, worker_index=4)
    make_multi_agent(lambda config: seen.append(config) or CountingEnv(config))(ctx)
    assert ctx["num_agents"] == 3  # the caller's dict is left as it was
    assert len(seen) == 3 and all(dict(c) == {"length": 2} and c.worker_index == 4 for c in seen)
    env = make_multi_agent("CartPole-v1")({"num_agents": 1, "max_episode_steps": 4})
    assert play_episode(env, np.random.default_rng(0)).steps <= 4


def test_actions_for_done_or_unknown_agents_are_refused():
    env = make_multi_agent(CountingEnv)({"num_agents": 2, "length": 1})
    env.reset()
    with pytest.raises(MultiAgentEnvError, match=r"agent '0'.*agents are \[0, 1\]"):
        env.step({"0": 1})
    assert env.step({0: 1, 1: 1})[2] == {0: True, 1: True, ALL: True}
    with pytest.raises(MultiAgentEnvError, match=r"agent 1, which is terminated") as info:
        env.step({1: 0})
    assert info.value.agent_id == 1
    with pytest.raises(MultiAgentEnvError, match="got no actions"):
        env.step({})


@pytest.mark.parametrize("num", [0, -1, "2", 1.5, True])
def test_bad_num_agents(num):
    with pytest.raises(MultiAgentEnvError, match=r"num_agents = .*whole number of 1 or more"):
        make_multi_agent("CartPole-v1")({"num_agents": num})


def test_made_class_pickles_and_resolves_by_name():
    from pipeline.config.plain import import_path, resolve_import_path

    cls = make_multi_agent("CartPole-v1")
    assert make_multi_agent("CartPole-v1") is cls and pickle.loads(pickle.dumps(cls)) is cls
    assert import_path(cls) == "actors.env.multi_agent_env:MultiAgent[CartPole-v1]"
    assert resolve_import_path(import_path(cls), "env") is cls
    env = pickle.loads(pickle.dumps(cls({"num_agents": 2})))
    assert type(env) is cls and play_episode(env, np.random.default_rng(0)).steps > 0
    assert "<locals>" in make_multi_agent(CountingEnv).__qualname__  # a creator's class has no import path
    with pytest.raises(TypeError, match="gymnasium env id"):
        make_multi_agent(3)


def test_render_puts_the_copies_side_by_side():
    env = make_multi_agent("CartPole-v1")({"num_agents": 2, "render_mode": "rgb_array"})
    env.reset(seed=0)
    frame = gym.make("CartPole-v1", render_mode="rgb_array")
    frame.reset(seed=0)
    height, width, _ = frame.render().shape
    assert env.render().shape == ((2 * height, width, 3) if width > height else (height, 2 * width, 3))
    env.close()


def test_exported_from_pipeline():
    import pipeline
    from actors.env import multi_agent_env, pettingzoo_env

    assert pipeline.MultiAgentEnv is multi_agent_env.MultiAgentEnv
    assert pipeline.make_multi_agent is multi_agent_env.make_multi_agent
    assert pipeline.PettingZooEnv is pettingzoo_env.PettingZooEnv
    assert pipeline.ParallelPettingZooEnv is pettingzoo_env.ParallelPettingZooEnv


# --- make_multi_agent's copies check what their copies return -----------------------------------------------
class Scripted(gym.Env):
    """Returns the step values it is given (reward, terminated, truncated, observation), one per step."""

    observation_space = S.Box(-1.0, 1.0, (2,), np.float32)
    action_space = S.Discrete(2)

    def __init__(self, script):
        self.script = list(script)

    def reset(self, *, seed=None, options=None):
        return np.zeros(2, np.float32), {}

    def step(self, action):
        reward, term, trunc, obs = self.script.pop(0)
        return np.asarray(obs, np.float32), reward, term, trunc, {}


def copies_of(*script):
    env = make_multi_agent(lambda config: Scripted(script))({"num_agents": 2})
    env.reset(seed=0)
    return env


def test_copies_give_rewards_as_floats_and_refuse_what_is_not_a_finite_number():
    ok = copies_of((np.float64(0.5), False, np.bool_(False), [0.0, 0.0]))
    _, rewards, terminateds, _, _ = ok.step({0: 0, 1: 1})
    assert rewards == {0: 0.5, 1: 0.5} and all(type(r) is float for r in rewards.values())
    assert terminateds == {0: False, 1: False, ALL: False}
    for bad, match in ((float("nan"), "finite"), (float("inf"), "finite"), ("1", "one number")):
        with pytest.raises(MultiAgentEnvError, match=match) as err:
            copies_of((bad, False, False, [0.0, 0.0])).step({0: 0, 1: 0})
        assert err.value.agent_id == 0


def test_copies_refuse_flags_that_are_not_bools_and_final_observations_outside_the_space():
    with pytest.raises(MultiAgentEnvError, match="terminated=1 .*True or False") as err:
        copies_of((1.0, 1, False, [0.0, 0.0])).step({0: 0, 1: 0})
    assert err.value.agent_id == 0
    with pytest.raises(MultiAgentEnvError, match="final observation of agent 1") as err:
        copies_of((1.0, False, True, [5.0, 0.0])).step({1: 0})
    assert err.value.agent_id == 1
    env = copies_of((1.0, True, False, [0.5, -0.5]))  # in its space: agent 0 finishes, agent 1 plays on
    _, _, terminateds, _, _ = env.step({0: 0})
    assert terminateds == {0: True, ALL: False}


def test_a_runner_still_checks_the_observations_copies_act_on():
    from actors.env.multi_agent_runner import MultiAgentEnvRunner
    from actors.env.settings import EnvRunnerSettings
    from actors.modules import ModuleSpec

    script = [(1.0, False, False, [0.0, 0.0]), (1.0, False, False, [0.0, 3.0])] + [(1.0, False, False, [0.0, 0.0])] * 50
    copies = make_multi_agent(lambda config: Scripted(script))
    spec = ModuleSpec(Scripted.observation_space, Scripted.action_space, {"fcnet_hiddens": [8]})
    runner = MultiAgentEnvRunner(EnvRunnerSettings(env_creator=copies, env_config={"num_agents": 2}, num_envs=1,
                                                   rollout_fragment_length=10, seed=0), {"p": spec},
                                 lambda agent, episode, **kw: "p")
    with pytest.raises(MultiAgentEnvError, match="observation of agent 0 .*observation space of module 'p'"):
        runner.sample()
    runner.stop()


def test_the_lockstep_stepper_checks_what_step_checks():
    from actors.env.multi_agent_env import CopiesStepper

    ok = copies_of((np.float64(0.5), False, np.bool_(False), [0.0, 0.0]))
    stepper = CopiesStepper([ok])
    obs, rewards, ended = stepper.step([0, 1])
    assert rewards == [0.5, 0.5] and all(type(r) is float for r in rewards) and ended == []
    assert len(obs) == 2 and stepper.playing == [(0, 0), (0, 1)]
    for bad, match in ((float("nan"), "finite"), (float("inf"), "finite"), ("1", "one number")):
        with pytest.raises(MultiAgentEnvError, match=match) as err:
            CopiesStepper([copies_of((bad, False, False, [0.0, 0.0]))]).step([0, 0])
        assert err.value.agent_id == 0
    with pytest.raises(MultiAgentEnvError, match="terminated=1 .*True or False") as err:
        CopiesStepper([copies_of((1.0, 1, False, [0.0, 0.0]))]).step([0, 0])
    assert err.value.agent_id == 0
    second = copies_of((1.0, False, True, [5.0, 0.0]))
    second.envs[0].script = [(1.0, False, False, [0.0, 0.0])]  # copy 0 plays on; copy 1 ends outside its space
    with pytest.raises(MultiAgentEnvError, match="final observation of agent 1") as err:
        CopiesStepper([copies_of((1.0, False, False, [0.0, 0.0])), second]).step([0, 0, 0, 0])
    assert err.value.agent_id == 1
    # agent 0 of the second env finishes in its space: it leaves the playing list, its env plays on
    first, second = copies_of((1.0, False, False, [0.0, 0.0])), copies_of((1.0, True, False, [0.5, -0.5]))
    second.envs[1].script = [(1.0, False, False, [0.0, 0.0])] * 3
    stepper = CopiesStepper([first, second])
    _, _, ended = stepper.step([0, 0, 0, 0])
    assert ended == [2] and second.agents == [1] and second.ended == {0: "terminated"}
    assert stepper.playing == [(0, 0), (0, 1), (1, 1)]
