"""MultiAgentEnvRunner: the env-runner stage for multi-agent envs, on two-agent CartPole.

In-process: chunks tagged with agent and module and counted in env steps and agent steps, RLlib's
metrics keys, weights from a ``MultiLearner`` (a forced greedy action shows they act; a frozen module
keeps its own), ``num_episodes`` and ``complete_episodes`` sampling, ``force_reset``, state round
trips, modules added and removed with a new mapping (self-play), episode callbacks, and a bad env
stopped by the step checker naming the agent. One slow test hosts the runner as a Ray actor and
reads its chunks back from ``sample_encoded``'s codec frame.
"""
from __future__ import annotations

import io
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import ray
import torch

from actors.callbacks import CallbacksSpec
from actors.env.multi_agent_checks import MultiAgentEnvError
from actors.env.multi_agent_env import make_multi_agent
from actors.env.multi_agent_runner import MultiAgentEnvRunner
from actors.env.multi_agent_runner_parts import CheckedMultiAgentEnv, chunks_by_module
from actors.env.settings import EnvRunnerSettings
from actors.learner import MultiLearner
from actors.metrics import MetricsLogger
from actors.modules import ModuleSpec
from pipeline.algorithms.ppo.config import PPOConfig
from pipeline.algorithms.ppo.learner import PPOLearner
from protocols.codec import decode_chunks
from tests.pieces import by_agent as own

CARTPOLES = make_multi_agent("CartPole-v1")
_ENV = CARTPOLES({"num_agents": 2})
OBS, ACT = _ENV.get_observation_space(0), _ENV.get_action_space(0)
MODEL = {"fcnet_hiddens": [16]}
SPEC = ModuleSpec(OBS, ACT, MODEL)


def shared(agent: Any, episode: Any) -> str:
    return "shared"


def make_runner(mapping: Any = own, modules: tuple[str, ...] = ("p0", "p1"), num_envs: int = 2,
                fragment: int = 10, seed: int | None = 0, **kwargs: Any) -> MultiAgentEnvRunner:
    runner_kwargs = {k: kwargs.pop(k) for k in ("count_steps_by", "check_env", "worker_index") if k in kwargs}
    settings = EnvRunnerSettings(env_creator=CARTPOLES, env_config={"num_agents": 2}, num_envs=num_envs,
                                 rollout_fragment_length=fragment, seed=seed, model_config=MODEL, **kwargs)
    return MultiAgentEnvRunner(settings, {mid: SPEC for mid in modules}, mapping, **runner_kwargs)


def peek(exported: dict, key: str) -> float:
    """``key`` of the result a stage group makes of ``get_metrics()``: keys with a '/' as they are,
    bare ones under ``env_runners/`` (``EnvRunnerGroup.fold_metrics``)."""
    logger = MetricsLogger()
    logger.merge({k: v for k, v in exported.items() if "/" in k})
    logger.merge({k: v for k, v in exported.items() if "/" not in k}, prefix="env_runners")
    return logger.peek(key)


def episodes(chunks: list) -> dict[str, list]:
    """Chunk episode id (one per agent of an episode) -> its chunks in order."""
    out: dict[str, list] = {}
    for c in chunks:
        out.setdefault(c.episode_id, []).append(c)
    return out


def whole(chunks: list) -> bool:
    """Every agent episode starts at chunk 0, runs on without a gap and ends terminated or truncated."""
    for cs in episodes(chunks).values():
        if [c.chunk_index for c in cs] != list(range(len(cs))):
            return False
        if not (cs[-1].terminated or cs[-1].truncated):
            return False
    return True


# --- chunks and counts ------------------------------------------------------------------------
def test_chunks_carry_agent_and_module_and_env_steps_are_counted():
    runner = make_runner()
    chunks = runner.sample()  # rollout_fragment_length * num_envs = 20 env steps
    assert runner.num_env_steps_sampled_lifetime == 20
    assert {c.module_id for c in chunks} == {"p0", "p1"}
    assert all(c.module_id == f"p{c.agent_id}" for c in chunks)
    assert sum(len(c) for c in chunks) == runner.num_agent_steps_sampled_lifetime
    assert 20 <= runner.num_agent_steps_sampled_lifetime <= 40  # each env step, one or two agents act
    grouped = chunks_by_module(chunks)
    assert set(grouped) == {"p0", "p1"} and sum(map(len, grouped.values())) == len(chunks)
    runner.sample(num_timesteps=7)  # one round of both envs at a time: 8
    assert runner.num_env_steps_sampled_lifetime == 28


def test_agent_steps_count_actions_and_one_shared_module_serves_both_agents():
    runner = make_runner(shared, modules=("shared",), count_steps_by="agent_steps")
    chunks = runner.sample(num_timesteps=30)
    agent_steps = runner.num_agent_steps_sampled_lifetime
    assert 30 <= agent_steps < 30 + 2 * 2  # overshoot: less than one round (2 envs x 2 agents)
    assert sum(len(c) for c in chunks) == agent_steps
    assert {c.module_id for c in chunks} == {"shared"} and {c.agent_id for c in chunks} == {"0", "1"}
    assert runner.num_env_steps_sampled_lifetime < agent_steps


def test_metrics_use_rllibs_keys_and_sum_returns_over_agents():
    runner = make_runner(num_envs=1, fragment=400)
    runner.sample()
    m = runner.get_metrics()
    logger = MetricsLogger()
    logger.merge({k: v for k, v in m.items() if "/" in k})
    logger.merge({k: v for k, v in m.items() if "/" not in k}, prefix="env_runners")
    for key in ("episode_return_mean", "episode_len_mean", "agent_episode_returns_mean/0",
                "agent_episode_returns_mean/1", "module_episode_returns_mean/p0", "module_episode_returns_mean/p1",
                "num_env_steps_sampled", "num_agent_steps_sampled", "num_module_steps_sampled/p0",
                "num_module_steps_sampled/p1", "num_env_steps_sampled_lifetime", "num_agent_steps_sampled_lifetime",
                "num_episodes"):
        assert f"env_runners/{key}" in logger, key
    r = lambda key: peek(m, f"env_runners/{key}")  # noqa: E731
    assert r("num_episodes") > 1
    assert r("episode_return_mean") == pytest.approx(r("agent_episode_returns_mean/0")
                                                     + r("agent_episode_returns_mean/1"))
    assert r("module_episode_returns_mean/p0") == pytest.approx(r("agent_episode_returns_mean/0"))
    assert r("num_env_steps_sampled") == 400
    assert r("num_agent_steps_sampled") == runner.num_agent_steps_sampled_lifetime
    assert (r("num_module_steps_sampled/p0") + r("num_module_steps_sampled/p1")
            == runner.num_agent_steps_sampled_lifetime)
    assert "num_env_steps_sampled" not in runner.get_metrics()  # what was logged since the last call


def test_sample_metrics_gives_what_evaluation_reads():
    runner = make_runner(num_envs=2)
    out = runner.sample_metrics(num_episodes=3)
    assert len(out["episode_returns"]) == len(out["episode_lengths"]) == 3
    assert peek(out["metrics"], "env_runners/episode_return_mean") == pytest.approx(np.mean(out["episode_returns"]))
    assert out["num_env_steps"] >= max(out["episode_lengths"]) and all(n > 0 for n in out["episode_lengths"])
    assert runner.sample_metrics(num_timesteps=4)["num_env_steps"] == 4


# --- weights ----------------------------------------------------------------------------------
def ppo(seed: int) -> PPOLearner:
    return PPOLearner(PPOConfig(seed=seed, model_config=MODEL, train_batch_size_per_learner=64, minibatch_size=32),
                      OBS, ACT)


def test_weights_from_a_multi_learner_act_and_a_module_left_out_keeps_its_own():
    learner = MultiLearner({"p0": ppo(0), "p1": ppo(1)})
    weights = learner.get_weights(inference_only=True)
    runner = make_runner()
    runner.set_weights(weights, weights_version=3)
    got = runner.get_weights()
    assert got.keys() == weights.keys() and all(np.array_equal(got[k], weights[k]) for k in got)

    p1_before = runner.get_weights(["p1"])
    forced = {k: np.zeros_like(v) for k, v in weights.items() if k.startswith("p0/")}
    forced["p0/pi_head.bias"] = np.array([0.0, 50.0], np.float32)  # p0 always pushes right
    runner.set_weights(forced, weights_version=4)
    chunks = runner.sample(num_timesteps=20, explore=False, force_reset=True)
    p0_actions = np.concatenate([c.actions for c in chunks if c.module_id == "p0"])
    assert len(p0_actions) and (p0_actions == 1).all()
    assert {c.weights_version for c in chunks} == {4}
    p1_after = runner.get_weights(["p1"])
    assert all(np.array_equal(p1_after[k], p1_before[k]) for k in p1_before)
    assert runner.get_weights(["p0"])["p0/pi_head.bias"].tolist() == [0.0, 50.0]


def test_weights_for_an_unknown_module_or_without_a_module_prefix_are_refused():
    runner = make_runner()
    with pytest.raises(ValueError, match=r"\['p9'\].*add_module"):
        runner.set_weights({"p9/pi_head.bias": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="names no module"):
        runner.set_weights({"pi_head.bias": np.zeros(2, np.float32)})
    with pytest.raises(ValueError, match="module 'p0'"):
        runner.set_weights({"p0/pi_head.bias": np.zeros(2, np.float32)})  # the rest of p0's weights missing


# --- what is sampled ---------------------------------------------------------------------------
def test_num_episodes_returns_exactly_that_many_whole_episodes_then_fresh_ones():
    runner = make_runner()
    runner.sample(num_timesteps=6)  # episodes running, dropped by the episode sampling
    chunks = runner.sample(num_episodes=3)
    assert whole(chunks)
    assert len({c.episode_id.rsplit(".", 1)[0] for c in chunks}) == 3
    assert peek(runner.get_metrics(), "env_runners/num_episodes") == 3
    after = runner.sample(num_timesteps=6)
    assert {c.chunk_index for c in after} == {0}  # the episodes left running were dropped


def test_num_episodes_keeps_the_first_episodes_to_start_not_the_first_to_end():
    started: list[str] = []
    spec = CallbacksSpec(functions={"on_episode_start": [lambda episode, **kw: started.append(episode.id_)]})
    for seed in range(3):
        started.clear()
        runner = make_runner(num_envs=4, seed=seed, callbacks=spec)
        started.clear()  # the episodes the constructor started are dropped by the episode sampling
        chunks = runner.sample(num_episodes=2)
        assert whole(chunks)
        assert {c.episode_id.rsplit(".", 1)[0] for c in chunks} == set(started[:2])


def test_complete_episodes_returns_whole_episodes_only():
    runner = make_runner(batch_mode="complete_episodes")
    chunks = runner.sample(num_timesteps=60)
    assert chunks and whole(chunks)
    ends = [c for c in chunks if c.terminated or c.truncated]
    assert len(ends) == 2 * len({c.episode_id.rsplit(".", 1)[0] for c in chunks})  # both agents of each
    more = runner.sample(num_timesteps=60)  # episodes that spanned the calls come out whole
    assert whole(more) and not set(episodes(more)) & set(episodes(chunks))


def test_force_reset_starts_fresh_episodes_and_without_it_episodes_go_on():
    runner = make_runner()
    first = runner.sample(num_timesteps=6)
    going_on = runner.sample(num_timesteps=6)
    assert {c.chunk_index for c in going_on} == {1}
    assert set(episodes(going_on)) == set(episodes(first))
    fresh = runner.sample(num_timesteps=6, force_reset=True)
    assert {c.chunk_index for c in fresh} == {0} and not set(episodes(fresh)) & set(episodes(first))


def test_seeded_runners_repeat_and_worker_indices_differ():
    a, b, c = make_runner(seed=5), make_runner(seed=5), make_runner(seed=5, worker_index=1)
    obs = lambda runner: np.concatenate([ch.obs[0] for ch in runner.sample(num_timesteps=4)])  # noqa: E731
    assert np.array_equal(obs(a), obs(b)) and not np.array_equal(obs(a), obs(c))
    # no two CartPole copies of one runner start alike (seed + env index + agent index would pair them up)
    firsts = [ch.obs[0].tobytes() for ch in make_runner(seed=5, num_envs=3).sample(num_timesteps=3)]
    assert len(firsts) == 6 and len(set(firsts)) == 6


# --- state ------------------------------------------------------------------------------------
def as_tensors(tree: Any) -> Any:
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.array(tree, copy=True, order="C"))
    if isinstance(tree, dict):
        return {k: as_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [as_tensors(v) for v in tree]
    return tree


def test_state_round_trips_through_a_weights_only_torch_load():
    runner = make_runner()
    runner.set_weights(MultiLearner({"p0": ppo(3), "p1": ppo(4)}).get_weights(inference_only=True), 7, timestep=500)
    runner.sample()
    buffer = io.BytesIO()
    torch.save(as_tensors(runner.get_state()), buffer)  # as a checkpoint's runners.pt keeps arrays
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    other = make_runner(seed=1)
    other.set_state(state)
    mine, theirs = runner.get_weights(), other.get_weights()
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    assert (other.weights_version, other.num_env_steps_sampled_lifetime, other.num_agent_steps_sampled_lifetime,
            other.timestep) == (7, runner.num_env_steps_sampled_lifetime, runner.num_agent_steps_sampled_lifetime,
                                runner.timestep)
    lone = make_runner(shared, modules=("shared",))
    with pytest.raises(ValueError, match=r"\['p0', 'p1'\].*add_module"):
        lone.set_state(state)


# --- self-play: modules come and go, the mapping changes ---------------------------------------
def test_added_module_and_new_mapping_serve_new_episodes_and_removal_resets_its_episodes():
    runner = make_runner()
    snapshot = {k.split("/", 1)[1]: v for k, v in runner.get_weights(["p0"]).items()}
    runner.add_module("snap", SPEC, weights=snapshot)
    assert runner.get_weights(["snap"])["snap/pi_head.bias"].tolist() == snapshot["pi_head.bias"].tolist()
    runner.sample(num_timesteps=6)
    runner.set_policy_mapping_fn(lambda agent, episode: "p0" if agent == 0 else "snap")
    running = runner.sample(num_timesteps=6)  # the running episodes keep the mapping they started with
    assert {c.module_id for c in running} == {"p0", "p1"} and {c.chunk_index for c in running} == {1}
    runner.remove_module("p1")  # its episodes cannot go on: fresh ones, with the new mapping
    after = runner.sample(num_timesteps=6)
    assert {(c.agent_id, c.module_id) for c in after} == {("0", "p0"), ("1", "snap")}
    assert {c.chunk_index for c in after} == {0}
    assert not any(k.startswith("p1/") for k in runner.get_weights())
    with pytest.raises(ValueError, match="exists already"):
        runner.add_module("snap", SPEC)
    with pytest.raises(KeyError, match="no module 'p1'"):
        runner.remove_module("p1")


def test_removing_the_last_module_or_mapping_to_a_missing_one_is_refused():
    runner = make_runner(shared, modules=("shared",))
    with pytest.raises(ValueError, match="last module"):
        runner.remove_module("shared")
    runner.set_policy_mapping_fn(own)
    with pytest.raises(ValueError, match="'p0', which does not exist"):
        runner.sample(force_reset=True)


# --- callbacks and checks ----------------------------------------------------------------------
def test_episode_callbacks_get_the_multi_agent_episode():
    seen: list[tuple[str, Any]] = []
    hooks = {name: [lambda episode, name=name, **kw: seen.append((name, episode))]
             for name in ("on_episode_created", "on_episode_start", "on_episode_step", "on_episode_end")}
    created_agents: list[int] = []
    hooks["on_episode_created"].append(lambda episode, **kw: created_agents.append(len(episode.agent_ids)))
    envs: list[tuple[Any, int]] = []
    hooks["on_environment_created"] = [lambda env, env_context, **kw: envs.append((env, env_context.vector_index))]
    runner = make_runner(num_envs=2, fragment=100, callbacks=CallbacksSpec(functions=hooks))
    assert envs == [(runner.user_envs[0], 0), (runner.user_envs[1], 1)]  # once per env the runner steps
    runner.sample()
    ended = [ep for name, ep in seen if name == "on_episode_end"]
    assert ended and all(ep.is_done for ep in ended)
    first = ended[0]
    assert [n for n, ep in seen if ep is first] == (["on_episode_created", "on_episode_start"]
                                                    + ["on_episode_step"] * len(first) + ["on_episode_end"])
    assert set(created_agents) == {0}  # created before the reset: no agent has joined yet


class StrayAgentEnv:
    """Declares agent 0 only, then observes an agent 7 as well."""

    possible_agents = [0]

    def __init__(self, config: dict) -> None:
        self.space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def get_observation_space(self, agent: Any) -> gym.Space:
        return self.space

    def get_action_space(self, agent: Any) -> gym.Space:
        return gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        return {0: np.zeros(2, np.float32), 7: np.zeros(2, np.float32)}, {}


def test_an_env_observing_an_unknown_agent_fails_naming_it():
    spec = ModuleSpec(gym.spaces.Box(-1.0, 1.0, (2,), np.float32), gym.spaces.Discrete(2), MODEL)
    settings = EnvRunnerSettings(env_creator=StrayAgentEnv, model_config=MODEL)
    with pytest.raises(MultiAgentEnvError, match=r"agent 7, which is not in possible_agents \[0\]") as err:
        MultiAgentEnvRunner(settings, {"p": spec}, lambda agent, episode: "p")
    assert err.value.agent_id == 7


def test_without_the_checker_the_users_envs_are_stepped_directly():
    runner = make_runner(check_env=False)
    assert all(type(env) is CARTPOLES for env in runner.envs)
    assert all(type(env) is CARTPOLES for env in runner.foreach_env(lambda env: env))
    assert sum(len(c) for c in runner.sample()) == runner.num_agent_steps_sampled_lifetime
    copies = make_runner()
    assert all(type(env) is CARTPOLES for env in copies.envs)  # make_multi_agent's copies check their own steps


class OwnStep(CARTPOLES):
    """A subclass with a step of its own: it is checked like any user env."""

    def step(self, action_dict):
        return super().step(action_dict)


def test_a_users_env_and_a_copies_subclass_with_its_own_step_go_behind_the_checker():
    settings = EnvRunnerSettings(env_creator=lambda ctx: OwnStep({"num_agents": 2}), num_envs=2,
                                 rollout_fragment_length=5, seed=0)
    checked = MultiAgentEnvRunner(settings, {"p0": SPEC, "p1": SPEC}, own)
    assert all(type(env) is CheckedMultiAgentEnv for env in checked.envs)
    assert all(type(env) is OwnStep for env in checked.foreach_env(lambda env: env))
    assert sum(len(c) for c in checked.sample()) > 0


def test_a_single_agent_env_or_bad_arguments_are_refused():
    single = EnvRunnerSettings(env_creator=lambda ctx: gym.make("CartPole-v1"))
    with pytest.raises(TypeError, match="not a multi-agent env"):
        MultiAgentEnvRunner(single, {"p": SPEC}, shared)
    with pytest.raises(ValueError, match="module id 'a/b'"):
        make_runner(modules=("p0", "a/b"))
    with pytest.raises(ValueError, match="module id 'x.y'"):
        make_runner().add_module("x.y", SPEC)
    with pytest.raises(TypeError, match="module 'q': got dict"):
        make_runner().add_module("q", {"observation_space": OBS})
    with pytest.raises(ValueError, match="count_steps_by='steps'"):
        make_runner(count_steps_by="steps")
    with pytest.raises(ValueError, match="num_timesteps=0"):
        make_runner().sample(num_timesteps=0)


# --- as a Ray actor ---------------------------------------------------------------------------
@pytest.mark.slow
def test_as_a_ray_actor_chunks_come_back_as_codec_frames(ray_cluster):  # conftest: Ray once for this module
    settings = EnvRunnerSettings(env_creator=CARTPOLES, env_config={"num_agents": 2}, num_envs=2,
                                 rollout_fragment_length=10, seed=0, model_config=MODEL)
    actor = ray.remote(MultiAgentEnvRunner).remote(settings, {"p0": SPEC, "p1": SPEC}, own, worker_index=1)
    try:
        weights = MultiLearner({"p0": ppo(0), "p1": ppo(1)}).get_weights(inference_only=True)
        ray.get(actor.set_weights.remote(weights, 2))
        frame, metrics = ray.get(actor.sample_encoded.remote(compress=True))
        assert isinstance(frame, bytes)
        chunks = decode_chunks(frame)
        assert {(c.agent_id, c.module_id) for c in chunks} == {("0", "p0"), ("1", "p1")}
        assert {c.weights_version for c in chunks} == {2}
        assert peek(metrics, "env_runners/num_env_steps_sampled") == 20
        assert peek(metrics, "env_runners/num_agent_steps_sampled") == sum(len(c) for c in chunks)
        got = ray.get(actor.get_weights.remote())
        assert all(np.array_equal(got[k], weights[k]) for k in weights)
        assert ray.get(actor.ping.remote()) == "ok"
    finally:
        ray.get(actor.stop.remote())
        ray.kill(actor)


class DriftingEnv:
    """Two agents in a Box(-1, 1) that act together; at step ``bad_at`` agent ``who``'s observation leaves the
    box (``value``), in a step that ends nobody (``final=False``) or in the step that ends the episode."""

    possible_agents = ["a", "b"]

    def __init__(self, config: dict) -> None:
        self.space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.bad_at, self.who, self.value, self.final = config["bad_at"], config["who"], config["value"], config["final"]
        self.t = 0

    def get_observation_space(self, agent: Any) -> gym.Space:
        return self.space

    def get_action_space(self, agent: Any) -> gym.Space:
        return gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.t = 0
        return {a: np.zeros(2, np.float32) for a in self.possible_agents}, {}

    def step(self, actions: dict) -> tuple:
        self.t += 1
        obs = {a: np.full(2, 0.5, np.float32) for a in actions}
        if self.t == self.bad_at:
            obs[self.who] = np.array([0.0, self.value], np.float32)
        over = self.final and self.t == self.bad_at
        flags = {a: over for a in actions}
        return obs, {a: 1.0 for a in actions}, {**flags, "__all__": over}, {a: False for a in actions} | {
            "__all__": False}, {}


@pytest.mark.parametrize("final", [False, True])
@pytest.mark.parametrize("value", [3.0, float("nan")])
def test_an_observation_outside_its_space_is_named_with_its_agent(final, value):
    """On a plain step the sampler checks the batch the agents act on; on a step that ends agents the step
    checker checks each final observation. Either way the error names the agent."""
    spec = ModuleSpec(gym.spaces.Box(-1.0, 1.0, (2,), np.float32), gym.spaces.Discrete(2), MODEL)
    settings = EnvRunnerSettings(env_creator=DriftingEnv, model_config=MODEL, num_envs=2, rollout_fragment_length=8,
                                 env_config={"bad_at": 3, "who": "b", "value": value, "final": final})
    runner = MultiAgentEnvRunner(settings, {"p": spec}, lambda agent, episode, **kw: "p")
    with pytest.raises(MultiAgentEnvError, match=r"observation of agent 'b' \[1\] = (3\.0|nan) is outside") as err:
        runner.sample()
    assert err.value.agent_id == "b"
    unchecked = MultiAgentEnvRunner(settings, {"p": spec}, lambda agent, episode, **kw: "p", check_env=False)
    assert unchecked.sample()  # without the checks the run goes on (the learner's loader checks chunks)


@pytest.mark.parametrize("bad", [{"num_episodes": 0}, {"num_timesteps": 2.5}])
def test_sample_counts_that_are_not_whole_numbers_are_named(bad):
    (name, value), = bad.items()
    with pytest.raises(ValueError, match=f"{name}={value!r}: give a whole number >= 1"):
        make_runner().sample(**bad)
