"""The module-to-env and learner pipelines, and PrevActionsPrevRewards: what each piece gets and gives, where
the runners and learners apply them, their state in checkpoints, and the errors users meet."""
from __future__ import annotations

import dataclasses

import gymnasium as gym
import numpy as np
import pytest

from actors.connectors import (ClipRewards, ConnectorV2, FlattenObservations, LearnerConnector, LearnerPipeline,
                               MeanStdFilter, ModuleToEnvConnector, PrevActionsPrevRewards, build_pipeline)
from actors.connectors.learner import build_learner_pipeline
from actors.connectors.module_to_env import build_module_to_env
from actors.env import EnvRunner, EnvRunnerSettings
from pipeline import APPOConfig, ConfigError, PPOConfig
from protocols.episode import EpisodeChunk
from tests.envs import ActionEcho
from tests.pieces import SeenRewards

BOX = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
ACT = gym.spaces.Discrete(3)


def _runner(**kwargs) -> EnvRunner:
    settings = EnvRunnerSettings(env_creator=lambda ctx: ActionEcho(), num_envs=3, rollout_fragment_length=8,
                                 seed=0, vectorize_mode="sync", **kwargs)
    return EnvRunner(settings)


# --- PrevActionsPrevRewards ------------------------------------------------------------------------------
def test_prev_actions_prev_rewards_space_layout_and_episode_starts():
    piece = PrevActionsPrevRewards(n_prev_actions=2, n_prev_rewards=1)
    pipe = build_pipeline(lambda env: piece, BOX, ACT)
    space = pipe.observation_space
    assert isinstance(space, gym.spaces.Dict) and set(space.spaces) == {"_obs", "prev_n_actions", "prev_n_rewards"}
    assert space["prev_n_actions"].shape == (6,) and space["prev_n_rewards"].shape == (1,)
    obs = np.ones((2, 3), np.float32)
    first = pipe.record(obs, np.ones(2, bool), True)
    assert not first["prev_n_actions"].any() and not first["prev_n_rewards"].any()
    pipe.after_step(np.array([2, 0]), np.array([0.5, -1.0], np.float32))
    out = pipe.record(obs, np.array([False, True]), True)  # env 1 started a new episode
    np.testing.assert_array_equal(out["prev_n_actions"][0], [0, 0, 0, 0, 0, 1])  # oldest first: none, then 2
    np.testing.assert_array_equal(out["prev_n_rewards"][0], [0.5])
    assert not out["prev_n_actions"][1].any() and not out["prev_n_rewards"][1].any()
    pipe.after_step(np.array([1, 1]), np.array([2.0, 3.0], np.float32))
    out = pipe.record(obs, np.zeros(2, bool), True)
    np.testing.assert_array_equal(out["prev_n_actions"][0], [0, 0, 1, 0, 1, 0])
    np.testing.assert_array_equal(out["prev_n_actions"][1], [0, 0, 0, 0, 1, 0])
    assert all(space[k].contains(v[0]) for k, v in out.items() if k != "_obs")
    # the final observation of env 0's episode sees env 0's memory, and the batch's memory is untouched
    final = pipe.record_final(obs[:1], 0)
    np.testing.assert_array_equal(final["prev_n_actions"][0], [0, 0, 1, 0, 1, 0])
    np.testing.assert_array_equal(final["prev_n_rewards"][0], [2.0])


def test_prev_actions_prev_rewards_box_actions_and_refusals():
    act = gym.spaces.Box(-1, 1, (2,), np.float32)
    pipe = build_pipeline(lambda env: [PrevActionsPrevRewards(n_prev_rewards=0), FlattenObservations()], BOX, act)
    assert pipe.observation_space.shape == (5,)
    pipe.record(np.zeros((1, 3), np.float32), np.ones(1, bool), True)
    pipe.after_step(np.array([[3.0, -4.0]], np.float32), np.zeros(1, np.float32))  # unclipped module actions
    np.testing.assert_array_equal(pipe.record(np.zeros((1, 3), np.float32), np.zeros(1, bool), True)[0, 3:], [3, -4])
    with pytest.raises(ValueError, match="adds nothing"):
        PrevActionsPrevRewards(n_prev_actions=0, n_prev_rewards=0)
    with pytest.raises(ValueError, match="n_prev_actions"):
        PrevActionsPrevRewards(n_prev_actions=-1)
    with pytest.raises(ValueError, match="Discrete or Box"):
        build_pipeline(lambda env: PrevActionsPrevRewards(), BOX, gym.spaces.MultiDiscrete([2, 2]))


def test_runner_chunks_carry_the_previous_action_and_reward_of_each_step():
    runner = _runner(env_to_module=lambda env: PrevActionsPrevRewards(n_prev_actions=1, n_prev_rewards=1))
    chunks = [c for _ in range(3) for c in runner.sample()]
    assert any(c.t_started > 0 for c in chunks) and any(c.terminated or c.truncated for c in chunks)
    for c in chunks:
        prev_a = c.obs["prev_n_actions"]  # [T + 1, 3]: one-hot of the action before each observation
        prev_r = c.obs["prev_n_rewards"][:, 0]
        # observation t+1 follows action t and its reward (the final observation too)
        np.testing.assert_array_equal(prev_a[1:].argmax(1), c.actions)
        np.testing.assert_array_equal(prev_r[1:], c.rewards)
        np.testing.assert_array_equal(c.obs["_obs"][1:, 0], c.actions)  # the env got the module's actions
        if c.t_started == 0:  # an episode's first observation has no previous step
            assert not prev_a[0].any() and prev_r[0] == 0
    runner.stop()


def test_a_restored_runner_goes_on_with_the_memory_of_its_running_episodes():
    make = dict(env_to_module=lambda env: PrevActionsPrevRewards())
    first = _runner(**make)
    first.sample()
    state = first.get_state()
    last = first.sampler.obs["prev_n_actions"].copy()  # what the next step's observations start from
    assert last.any()
    second = _runner(**make)
    second.set_state(state)
    chunks = second.sample()
    went_on = [next(c for c in chunks if c.env_index == j) for j in range(3)]
    assert all(c.t_started > 0 for c in went_on)  # 8 steps into episodes of 6: each is 2 steps into its second
    for j, c in enumerate(went_on):
        np.testing.assert_array_equal(c.obs["prev_n_actions"][0], last[j])
    first.stop()
    second.stop()


# --- module-to-env ---------------------------------------------------------------------------------------
class Shift(ModuleToEnvConnector):
    """Sends the env the next action up (mod 3), keeps what the module chose as the recorded action; counts
    its calls (its state)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = 0

    def __call__(self, batch, *, observations=None, explore=True):
        self.calls += 1
        assert len(observations) == len(batch["actions"])
        return {**batch, "actions_for_env": (batch["actions"] + 1) % 3}

    def get_state(self):
        return {"calls": self.calls}

    def set_state(self, state):
        self.calls = state["calls"]


def test_module_to_env_pieces_change_what_the_env_gets_not_what_chunks_store():
    runner = _runner(module_to_env=lambda env: Shift())
    chunks = runner.sample()
    for c in chunks:
        np.testing.assert_array_equal(c.obs[1:, 0], (c.actions + 1) % 3)  # the env got the shifted action
        np.testing.assert_array_equal(c.rewards, (c.actions + 1) % 3)
    state = runner.get_state()
    assert state["module_to_env"][0]["state"]["calls"] == 8
    again = _runner(module_to_env=lambda env: Shift())
    again.set_state(state)
    assert again.module_to_env.pieces[0].calls == 8
    runner.stop()
    again.stop()


class Greedy(ModuleToEnvConnector):
    """Rewrites the recorded action too (to 2, with its log-probability): what a piece that overrides the
    module's choice must do."""

    def __call__(self, batch, *, observations=None, explore=True):
        n = len(batch["actions"])
        logits = batch["action_dist_inputs"]
        logp = logits[:, 2] - np.log(np.exp(logits).sum(1))
        return {**batch, "actions": np.full(n, 2, batch["actions"].dtype), "action_logp": logp.astype(np.float32)}


def test_a_piece_that_rewrites_the_action_is_what_chunks_store():
    runner = _runner(module_to_env=lambda env: Greedy())
    for c in runner.sample():
        assert np.all(c.actions == 2) and np.all(c.obs[1:, 0] == 2)
        assert np.all(c.extra["action_logp"] < 0)
    runner.stop()


class BadRows(ModuleToEnvConnector):
    def __call__(self, batch, *, observations=None, explore=True):
        return {**batch, "actions_for_env": batch["actions"][:1]}


def test_module_to_env_pipeline_refusals():
    with pytest.raises(TypeError, match="ModuleToEnvConnector"):
        build_module_to_env(lambda env: MeanStdFilter(), BOX, ACT)
    with pytest.raises(TypeError, match="env_to_module_connector takes|ConnectorV2 instance that acts on observations"):
        build_pipeline(lambda env: Shift(), BOX, ACT)
    assert build_module_to_env(None, BOX, ACT) is None
    runner = _runner(module_to_env=lambda env: BadRows())
    with pytest.raises(ValueError, match="1 rows of 'actions_for_env' for 3 sub-envs"):
        runner.sample()
    runner.stop()


# --- learner pipelines -----------------------------------------------------------------------------------
def _chunk(rewards) -> EpisodeChunk:
    t = len(rewards)
    return EpisodeChunk("e", 0, np.zeros((t + 1, 3), np.float32), np.zeros(t, np.int64),
                        np.asarray(rewards, np.float32), extra={"action_logp": np.zeros(t, np.float32)})


def test_clip_rewards_and_the_learner_pipeline_contract():
    pipe = build_learner_pipeline(lambda obs_space, act_space: [ClipRewards(limit=0.5)], BOX, ACT)
    given = [_chunk([2.0, -3.0, 0.25])]
    out = pipe(given)
    np.testing.assert_array_equal(out[0].rewards, [0.5, -0.5, 0.25])
    np.testing.assert_array_equal(given[0].rewards, [2.0, -3.0, 0.25])  # the batch's own arrays are not written
    np.testing.assert_array_equal(ClipRewards(sign=True)([_chunk([2.0, -3.0, 0.0])])[0].rewards, [1, -1, 0])
    with pytest.raises(ValueError, match="limit"):
        ClipRewards(limit=0)

    class Shorten(LearnerConnector):
        def __call__(self, chunks):
            return [dataclasses.replace(c, rewards=c.rewards[:-1]) for c in chunks]

    with pytest.raises(ValueError, match="each with its length"):
        LearnerPipeline([Shorten()], BOX, ACT)(given)
    with pytest.raises(TypeError, match="LearnerConnector"):
        build_learner_pipeline(lambda o, a: [MeanStdFilter()], BOX, ACT)
    with pytest.raises(TypeError, match="env_to_module_connector takes|acts on observations"):
        build_pipeline(lambda env: ClipRewards(), BOX, ACT)
    with pytest.raises(ValueError, match="saved learner pipeline"):
        pipe.set_state([{"piece": "Other", "state": {}}])


def test_ppo_learns_from_what_the_learner_pipeline_gives_while_results_keep_the_envs_returns():
    SeenRewards.seen = []
    algo = (PPOConfig().environment("CartPole-v1").callbacks(SeenRewards)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=2)
            .training(train_batch_size_per_learner=200, minibatch_size=50,
                      learner_connector=lambda obs_space, act_space: ClipRewards(limit=0.25))
            .build(logdir=None))
    result = algo.train()
    assert SeenRewards.seen and max(SeenRewards.seen) == pytest.approx(0.25)
    assert result["env_runners"]["episode_return_mean"] > 5  # CartPole's own rewards of 1
    state = algo.learner_group.local.get_state()
    assert state["learner_connector"] == [{"piece": "ClipRewards", "state": {}}]
    algo.stop()


@pytest.mark.slow
def test_appo_stream_batches_go_through_the_learner_pipeline_in_their_loader(ray_cluster):
    SeenRewards.seen = []
    algo = (APPOConfig().environment("CartPole-v1").callbacks(SeenRewards)
            .env_runners(num_env_runners=1, num_envs_per_env_runner=2)
            .training(train_batch_size_per_learner=100, minibatch_size=100,
                      learner_connector=lambda obs_space, act_space: ClipRewards(limit=0.25))
            .build(logdir=None))
    while not SeenRewards.seen:  # an iteration ends on time, whether or not a batch arrived
        algo.train()
    assert max(SeenRewards.seen) == pytest.approx(0.25)
    assert algo.plan.receiver.learner_connector is algo.learner_connector
    algo.stop()


class Broken(LearnerConnector):
    def __call__(self, chunks):
        raise RuntimeError("a bug in the user's piece")


def test_a_failing_learner_piece_costs_its_batch_not_the_job():
    algo = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
            .training(train_batch_size_per_learner=100, minibatch_size=50, learner_connector=lambda o, a: Broken())
            .build(logdir=None))
    result = algo.train()
    assert result["learners"]["default_policy"]["num_batches_refused"] == 1
    assert algo.learner_group.local.num_batches_refused == 1
    algo.stop()


def test_connector_settings_that_cannot_work_are_config_errors():
    from pipeline import make_multi_agent

    with pytest.raises(ConfigError, match="learner_connector: .*LearnerConnector"):
        PPOConfig().environment("CartPole-v1").training(learner_connector=lambda o, a: MeanStdFilter()).build(logdir=None)
    with pytest.raises(ConfigError, match="module_to_env_connector: .*ModuleToEnvConnector"):
        (PPOConfig().environment("CartPole-v1")
         .env_runners(num_env_runners=0, module_to_env_connector=lambda env: MeanStdFilter()).build(logdir=None))
    with pytest.raises(ConfigError, match="clients"):
        (PPOConfig().environment(observation_space=BOX, action_space=ACT)
         .external_clients(address="tcp://127.0.0.1:0")
         .env_runners(num_env_runners=0, module_to_env_connector=lambda env: Shift()).build(logdir=None))
    ma = make_multi_agent("CartPole-v1")
    with pytest.raises(ConfigError, match="learner_connector: .*LearnerConnector"):  # checked for every module
        (PPOConfig().environment(ma, env_config={"num_agents": 2})
         .training(learner_connector=lambda o, a: MeanStdFilter())
         .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=lambda aid, ep, **kw: f"p{aid}").build(logdir=None))


def test_a_users_observation_piece_is_still_refused_in_the_other_pipelines():
    class Plain(ConnectorV2):
        pass

    with pytest.raises(TypeError, match="LearnerConnector"):
        LearnerPipeline([Plain()], BOX, ACT)


def test_compute_actions_in_the_driver_go_through_the_module_to_env_pipeline():
    """algo.compute_single_action / compute_actions give what a runner would send the env: the driver's copy of
    the pipeline's ``actions_for_env`` (Shift), or the recorded action a piece chose (Greedy), converted."""
    base = (PPOConfig().environment(ActionEcho).env_runners(num_env_runners=0, num_envs_per_env_runner=2)
            .debugging(seed=0))
    plain = base.copy().build(logdir=None)
    shifted = base.copy().env_runners(module_to_env_connector=lambda env: Shift()).build(logdir=None)
    greedy = base.copy().env_runners(module_to_env_connector=lambda env: Greedy()).build(logdir=None)
    try:
        shifted.learner_group.set_weights(plain.learner_group.get_weights())
        obs = np.array([[0.0], [1.0], [2.0], [-1.0]], np.float32)
        chosen = plain.compute_actions(obs, explore=False)
        np.testing.assert_array_equal(shifted.compute_actions(obs, explore=False), (chosen + 1) % 3)
        assert shifted.compute_single_action(obs[1], explore=False) == (int(chosen[1]) + 1) % 3
        assert shifted.driver_policy.module_to_env.pieces[0].calls == 2  # the driver's own copy, its own state
        assert all(a == 2 for a in greedy.compute_actions(obs, explore=True))
        assert greedy.compute_single_action(obs[0]) == 2
    finally:
        for algo in (plain, shifted, greedy):
            algo.stop()
