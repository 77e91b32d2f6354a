"""The multi-agent step checker: the semantics it accepts (turns, early finish, late join, rewards for
agents that did not act, truncation without a final observation) and every malformed step it refuses,
each error naming the agent."""
import gymnasium as gym
import numpy as np
import pytest

from actors.env.multi_agent_checks import ALL, MultiAgentEnvError, MultiAgentStepChecker
from tests.multi_agent_play import Transitions

S = gym.spaces
SPACES = {
    "a": S.Box(-1.0, 1.0, (2,), np.float32),
    "b": S.Discrete(3),
    7: S.Dict({"obs": S.Box(0.0, 1.0, (1,), np.float32), "action_mask": S.Box(0, 1, (3,), np.int8)}),
}
A = np.zeros(2, np.float32)
SEVEN = {"obs": np.array([0.5], np.float32), "action_mask": np.array([1, 0, 1], np.int8)}


def result(obs=None, rewards=None, term=None, trunc=None, infos=None, all_term=False, all_trunc=False):
    return (obs or {}, rewards or {}, {**(term or {}), ALL: all_term}, {**(trunc or {}), ALL: all_trunc},
            infos or {})


def after_reset(obs):
    checker = MultiAgentStepChecker(SPACES)
    checker.check_reset((obs, {}))
    return checker


def refused(call, *words, agent="unset"):
    with pytest.raises(MultiAgentEnvError) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    if agent != "unset":
        assert info.value.agent_id == agent
    return info.value


# --- semantics the checker accepts ---------------------------------------------------------------

def test_agents_acting_in_turns():
    checker = after_reset({"a": A})
    assert checker.agents_to_act == ["a"]
    refused(lambda: checker.check_actions({"a": 0, "b": 1}), "'b'", "no observation yet", agent="b")
    checker.check_actions({"a": 0})
    checker.check_step(result(obs={"b": 2}, rewards={"a": 0.5}))  # a waits for its turn
    assert checker.agents_to_act == ["b"]
    refused(lambda: checker.check_actions({"a": 0}), "'a'", "latest observation at step 0", "not its turn", agent="a")
    checker.check_actions({"b": 1})
    checker.check_step(result(obs={"a": A}, rewards={"a": 1.0, "b": -1.0}))
    assert checker.agents_to_act == ["a"]


def test_rewards_for_agents_that_did_not_act_accumulate_to_their_next_step():
    checker, transitions = after_reset({"a": A, "b": 0}), Transitions()
    for actions, step in [({"a": 0, "b": 0}, result(obs={"a": A}, rewards={"a": 1.0, "b": 2.0})),
                          ({"a": 0}, result(obs={"a": A, "b": 1}, rewards={"a": 1.0, "b": 3.0})),
                          ({"a": 0, "b": 0}, result(obs={"a": A, "b": 1}, rewards={"a": 1.0, "b": 0.0},
                                                    all_term=True))]:
        checker.check_actions(actions)
        transitions.add(actions, checker.check_step(step))
    assert transitions.closed == {"a": [1.0, 1.0, 1.0], "b": [5.0, 0.0]}  # b's 3.0 came while it waited


def test_agent_finishing_early_gets_nothing_more():
    checker = after_reset({"a": A, "b": 0})
    checker.check_step(result(obs={"a": A, "b": 1}, rewards={"a": 1.0, "b": 0.0}, term={"a": True, "b": False}))
    assert checker.agents_to_act == ["b"] and checker.done == {"a": (1, "terminated")}
    refused(lambda: checker.check_actions({"a": 0, "b": 0}), "'a'", "was terminated at step 1", agent="a")
    step = checker.step_index
    refused(lambda: checker.check_step(result(obs={"a": A, "b": 1})), "'a'", "terminated at step 1",
            "a done agent", agent="a")
    refused(lambda: checker.check_step(result(obs={"b": 1}, rewards={"a": 1.0})), "reward", "'a'", agent="a")
    refused(lambda: checker.check_step(result(obs={"b": 1}, term={"a": False})), "stays done", agent="a")
    assert checker.step_index == step  # a refused step leaves the episode as it was
    checker.check_step(result(obs={"b": 1}, rewards={"b": 1.0}, term={"a": True}))  # a repeated True is fine
    checker.check_step(result(obs={"b": 2}, rewards={"b": 1.0}, term={"b": True}, all_term=True))
    assert checker.episode_over and checker.agents_to_act == []


def test_agent_joining_late_may_get_a_reward_with_its_first_observation():
    checker, transitions = after_reset({"a": A}), Transitions()
    checker.check_actions({"a": 0})
    transitions.add({"a": 0}, checker.check_step(result(obs={"a": A, 7: SEVEN}, rewards={"a": 0.0, 7: 0.5})))
    assert checker.agents_to_act == ["a", 7]
    actions = checker.check_actions({"a": 0, 7: 2})
    transitions.add(actions, checker.check_step(result(obs={"a": A, 7: SEVEN}, rewards={"a": 1.0, 7: 1.0},
                                                       all_trunc=True)))
    assert transitions.loose == {7: 0.5} and transitions.closed == {"a": [0.0, 1.0], 7: [1.0]}


def test_agent_truncated_without_a_final_observation():
    """mobile-env PR#68: an agent dropped with no last observation. RLlib raises; the checker accepts,
    and the sampler closes the agent's transition on its last observation (rule 4)."""
    checker, transitions = after_reset({"a": A, "b": 0}), Transitions()
    actions = checker.check_actions({"a": 0, "b": 1})
    transitions.add(actions, checker.check_step(result(obs={"b": 1}, rewards={"a": 1.0, "b": 0.0},
                                                       trunc={"a": True})))
    assert checker.agents_to_act == ["b"] and checker.done["a"] == (1, "truncated")
    refused(lambda: checker.check_actions({"a": 0, "b": 1}), "was truncated at step 1", agent="a")
    actions = checker.check_actions({"b": 1})
    transitions.add(actions, checker.check_step(result(rewards={"b": 2.0}, all_trunc=True)))  # no final obs at all
    assert transitions.closed == {"a": [1.0], "b": [0.0, 2.0]}
    assert transitions.closed_without_obs == ["a", "b"]


def test_observation_dtype_need_not_match_a_box_whose_bounds_it_keeps():
    after_reset({"a": np.array([0.5, -1.0], np.float64)})
    after_reset({"a": [0.5, 1.0], "b": np.int64(2), 7: SEVEN})


def test_common_infos_and_empty_steps_while_an_agent_waits():
    checker = after_reset({"a": A})
    checker.check_step(result(infos={"__common__": {"t": 1}, "a": {}}))  # a waits, nobody observed
    assert checker.agents_to_act == []
    checker.check_actions({})


# --- malformed steps ----------------------------------------------------------------------------

def test_observation_for_an_unknown_agent():
    refused(lambda: after_reset({"c": A}), "agent 'c'", "not in possible_agents ['a', 'b', 7]", agent="c")
    checker = after_reset({"a": A})
    refused(lambda: checker.check_step(result(obs={ALL: A})), "'__all__' belongs in terminateds")


@pytest.mark.parametrize("agent, value, words", [
    ("a", np.array([0.0, 5.0], np.float32), ["[1] = 5.0 is outside [-1.0, 1.0]"]),
    ("a", np.array([np.nan, 0.0], np.float32), ["[0] = nan is outside"]),
    ("a", np.zeros(3, np.float32), ["shape (3,)", "(2,)"]),
    ("a", "left", ["'left'", "not an array of numbers"]),
    ("b", 3, ["= 3 is outside Discrete(3) (0 to 2)"]),
    ("b", 1.0, ["1.0", "holds whole numbers"]),
    (7, {"obs": np.array([0.5], np.float32)}, ["lacks the key 'action_mask'"]),
    (7, {**SEVEN, "extra": 1}, ["has the key 'extra'"]),
    (7, {**SEVEN, "action_mask": np.array([1, 2, 0], np.int8)}, ["['action_mask'] [1] = 2 is outside [0, 1]"]),
])
def test_observation_outside_the_agent_space(agent, value, words):
    other = {"a": A} if agent != "a" else {"b": 0}
    refused(lambda: after_reset({**other, agent: value}), f"agent {agent!r}", *words, agent=agent)
    checker = after_reset(other)
    refused(lambda: checker.check_step(result(obs={agent: value})), "step()", *words, agent=agent)


def test_reward_or_flag_for_an_agent_that_never_had_an_observation():
    checker = after_reset({"a": A})
    refused(lambda: checker.check_step(result(obs={"a": A}, rewards={"a": 0.0, "b": 1.0})),
            "reward (1.0) for agent 'b'", "no observation this episode", agent="b")
    refused(lambda: checker.check_step(result(obs={"a": A}, term={"b": True})), "terminateds['b']", agent="b")
    refused(lambda: checker.check_step(result(obs={"a": A}, trunc={"b": False})), "truncateds['b']", agent="b")
    refused(lambda: checker.check_step(result(rewards={"z": 1.0})), "agent 'z'", "not in possible_agents", agent="z")


@pytest.mark.parametrize("name", ["terminateds", "truncateds"])
def test_missing_all_key(name):
    checker = after_reset({"a": A})
    step = list(result(obs={"a": A}))
    del step[2 if name == "terminateds" else 3][ALL]
    refused(lambda: checker.check_step(tuple(step)), f"{name} without the key '__all__'", f"{name}['__all__']")


@pytest.mark.parametrize("bad, words", [
    ({"a": A}, ["reset() returned", "(observations, infos)"]),
    (([A], {}), ["observations = [array"]),
    (({"a": A}, None), ["infos = None"]),
])
def test_reset_must_return_two_dicts(bad, words):
    refused(lambda: MultiAgentStepChecker(SPACES).check_reset(bad), *words)


@pytest.mark.parametrize("bad, words", [
    (({"a": A}, {"a": 1.0}, {ALL: False}, {}), ["old gym API", "(observations, rewards, terminateds, truncateds"]),
    (None, ["step() returned None"]),
    (({"a": A}, [1.0], {ALL: False}, {ALL: False}, {}), ["rewards = [1.0]"]),
    (({"a": A}, {}, True, {ALL: False}, {}), ["terminateds = True"]),
])
def test_step_must_return_five_dicts(bad, words):
    refused(lambda: after_reset({"a": A}).check_step(bad), *words)


@pytest.mark.parametrize("rewards, flags, words", [
    ({"a": float("nan")}, {}, ["reward nan for agent 'a'", "finite"]),
    ({"a": "1"}, {}, ["reward '1' (str) for agent 'a'", "one number"]),
    ({"a": np.ones(2)}, {}, ["one number"]),
    ({}, {"a": 1}, ["terminateds['a'] = 1 (int)", "True or False"]),
])
def test_reward_and_flag_values(rewards, flags, words):
    checker = after_reset({"a": A})
    refused(lambda: checker.check_step(result(obs={"a": A}, rewards=rewards, term=flags)), *words, agent="a")


def test_rewards_of_numpy_types_pass():
    after_reset({"a": A}).check_step(result(obs={"a": A}, rewards={"a": np.float32(1.5)}, term={"a": np.bool_(False)}))


def test_action_dicts():
    checker = after_reset({"a": A, "b": 0})
    refused(lambda: checker.check_actions([0, 1]), "a dict of agent id -> action")
    refused(lambda: checker.check_actions({"a": 0}), "no action for agent 'b'", agent="b")
    refused(lambda: checker.check_actions({"a": 0, "b": 0, "q": 1}), "'q'", "not in possible_agents", agent="q")
    checker.check_step(result(obs={"a": A, "b": 0}, all_term=True))
    refused(lambda: checker.check_actions({"a": 0}), "after the episode ended", "reset()")
    refused(lambda: MultiAgentStepChecker(SPACES).check_actions({"a": 0}), "reset()")


def test_every_agent_done_without_all_would_hang():
    checker = after_reset({"a": A, "b": 0})
    refused(lambda: checker.check_step(result(term={"a": True}, trunc={"b": True})), "every agent of the episode is done",
            "set '__all__' True")


def test_step_after_the_episode_ended():
    checker = after_reset({"a": A})
    checker.check_step(result(obs={"a": A}, all_trunc=True))
    refused(lambda: checker.check_step(result(obs={"a": A})), "after the episode ended", "reset()")


def test_infos_for_unknown_agents():
    refused(lambda: MultiAgentStepChecker(SPACES).check_reset(({"a": A}, {"x": {}})), "an info for agent 'x'", agent="x")


@pytest.mark.parametrize("agent, words", [
    (("a", 1), ["('a', 1) (tuple)", "str or int"]),
    (True, ["True (bool)"]),
    (ALL, ["reserved"]),
])
def test_agent_ids_are_str_or_int(agent, words):
    refused(lambda: MultiAgentStepChecker({agent: S.Discrete(2)}), *words, agent=agent)


def test_checker_for_an_env_without_agents_or_spaces():
    class NoAgents:
        possible_agents = []

    class MissingSpace:
        possible_agents = ["x", "y"]

        def get_observation_space(self, agent):
            return {"x": S.Discrete(2)}[agent]

    refused(lambda: MultiAgentStepChecker.for_env(NoAgents()), "NoAgents.possible_agents is empty")
    refused(lambda: MultiAgentStepChecker.for_env(MissingSpace()), "no observation space for agent 'y'", agent="y")
    refused(lambda: MultiAgentStepChecker({}), "no possible agents")
