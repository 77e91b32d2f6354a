"""PrevActionsPrevRewards in multi-agent runs: each agent's own memory.

Each module's pipeline keeps the last actions and rewards of every agent mapped to it, keyed by (env index,
agent id): an agent sees its own last actions and the rewards it got between its observations (summed over
the env steps in between when it does not act every step), zeros when it enters an episode, and the memory
of an env's agents goes when the env resets. Both multi-agent samplers run it (``make_multi_agent`` copies
through the lockstep one; ``tests/test_multi_agent_fast_path.py`` checks the two cut the same chunks)."""
from __future__ import annotations

import numpy as np

from actors.connectors import FlattenObservations, PrevActionsPrevRewards
from actors.env.lockstep_sampler import LockstepSampler
from actors.env.multi_agent_sampler import MultiAgentSampler
from pipeline import PPOConfig
from tests.envs import ActionEchoes
from tests.test_multi_agent_offpolicy import EPISODE_STEPS, TurnTaking, own_step_rewards
from tests.pieces import by_agent


def ppo(env, factory, mapping=by_agent, policies=("p0", "p1"), envs=2, fragment=8):
    return (PPOConfig().environment(env)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=envs, rollout_fragment_length=fragment,
                         env_to_module_connector=factory)
            .multi_agent(policies=set(policies), policy_mapping_fn=mapping)
            .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=1).debugging(seed=0))


def check_memory(chunk, n_actions, n_rewards, width):
    """Row t of the chunk (its final observation included) holds the agent's own last actions and rewards:
    those of its steps before t, zeros before its episode's first step."""
    obs = chunk.obs
    rows = len(obs["_obs"])
    assert chunk.chunk_index == 0, "these runs' fragments hold whole episodes"
    actions = np.asarray(chunk.actions)
    rewards = np.asarray(chunk.rewards, np.float32)
    for t in range(rows):
        want_a = np.zeros((n_actions, width), np.float32)
        for k in range(1, n_actions + 1):
            if t - k >= 0:
                want_a[n_actions - k, actions[t - k]] = 1.0
        want_r = np.array([rewards[t - k] if t - k >= 0 else 0.0 for k in range(n_rewards, 0, -1)], np.float32)
        np.testing.assert_array_equal(obs["prev_n_actions"][t], want_a.reshape(-1), err_msg=f"row {t}")
        np.testing.assert_array_equal(obs["prev_n_rewards"][t], want_r, err_msg=f"row {t}")


def test_turn_taking_agents_hear_their_own_actions_and_the_rewards_summed_between_their_turns():
    """TurnTaking: "a" acts at even env steps, "b" at odd ones, and each gets a reward every env step after
    its first action, so an agent's reward per own step is two env steps' rewards summed; one module each,
    and one module shared by both (its memory still per agent)."""
    factory = lambda env: PrevActionsPrevRewards(n_prev_actions=2, n_prev_rewards=2)  # noqa: E731
    for mapping, policies in ((by_agent, ("pa", "pb")), (lambda aid, *a, **k: "shared", ("shared",))):
        algo = ppo(TurnTaking, factory, mapping, policies, envs=1, fragment=EPISODE_STEPS).build(logdir=None)
        try:
            runner = algo.env_runner_group.local
            assert isinstance(runner.sampler, MultiAgentSampler)
            chunks = [c for _ in range(3) for c in runner.sample()]  # three episodes, each whole
            by_agent_chunks = {}
            for c in chunks:
                by_agent_chunks.setdefault(c.agent_id, []).append(c)
                check_memory(c, 2, 2, 2)
            assert set(by_agent_chunks) == {"a", "b"} and len(chunks) >= 6
            for aid, cs in by_agent_chunks.items():
                for c in cs:  # the rewards themselves are the turn sums (what the memory was checked against)
                    np.testing.assert_array_equal(np.asarray(c.rewards), own_step_rewards(aid))
            pieces = [p.pieces[0] for p in runner.connectors.pipelines.values()]
            assert sum(p.num_keys for p in pieces) <= 2  # one env, two agents: ended episodes forgotten
        finally:
            algo.stop()


def test_copies_of_an_env_sample_through_the_lockstep_sampler_and_ppo_trains_on_the_dicts():
    factory = lambda env: [PrevActionsPrevRewards(n_prev_actions=1, n_prev_rewards=1), FlattenObservations()]  # noqa
    algo = ppo(ActionEchoes, factory, envs=3, fragment=6).build(logdir=None)
    try:
        runner = algo.env_runner_group.local
        assert isinstance(runner.sampler, LockstepSampler)
        for c in runner.sample():
            obs = np.asarray(c.obs)
            # flattened: [the echo of the last env action, its one-hot (3), the last reward]
            assert obs.shape[1] == 5
            np.testing.assert_array_equal(obs[0, 1:], 0.0)
            np.testing.assert_array_equal(obs[1:, 1:4].argmax(1), np.asarray(c.actions)[: len(obs) - 1])
            np.testing.assert_array_equal(obs[1:, 4], np.asarray(c.rewards)[: len(obs) - 1])
            np.testing.assert_array_equal(obs[1:, 0], obs[1:, 4])  # ActionEcho pays the action it echoes
        result = algo.train()
        assert set(result["learners"]) >= {"p0", "p1"}
        assert all(np.isfinite(result["learners"][m]["total_loss"]) for m in ("p0", "p1"))
        # and compute_single_action reads it as an episode's start: zeros beside the observation
        assert algo.compute_single_action(np.array([1.0], np.float32), policy_id="p0") in (0, 1, 2)
    finally:
        algo.stop()


class BadReward(TurnTaking):
    """TurnTaking whose fourth step pays agent "a" a string."""

    def step(self, action_dict):
        obs, rewards, terms, truncs, infos = super().step(action_dict)
        if self.t == 4:
            rewards = {**rewards, "a": "four"}
        return obs, rewards, terms, truncs, infos


def test_a_bad_reward_is_the_episodes_to_report_with_or_without_the_memory():
    errors = []
    for factory in (None, lambda env: PrevActionsPrevRewards()):
        algo = ppo(BadReward, factory, by_agent, ("pa", "pb"), envs=1, fragment=EPISODE_STEPS).build(logdir=None)
        try:
            try:
                algo.env_runner_group.local.sample()
            except Exception as err:  # noqa: BLE001 - compared below
                errors.append((type(err), str(err)))
        finally:
            algo.stop()
    assert len(errors) == 2 and errors[0] == errors[1] and "'a'" in errors[0][1], errors
