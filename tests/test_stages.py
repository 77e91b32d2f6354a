"""Roles, stage groups hosted in-process (the same code path as Ray actors), the module catalogue,
exploration and the result layout -- without Ray."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.core import EnvRunnerRole, LearnerRole
from actors.env import EnvRunner, EnvRunnerSettings
from actors.env.exploration import StochasticSampling, make_exploration
from actors.manager import ActorManager, FaultToleranceSettings
from actors.modules import ActorCriticModule, ModuleSpec, MultiRLModule
from actors.modules.distributions import ActionDistSpec
from pipeline import PPOConfig
from pipeline.algorithms.ppo.learner import PPOLearner
from tests.envs import CountingEnv

OBS, ACT = gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(2)


class Counter:
    """A minimal stage."""

    def __init__(self, index, recreated):
        self.index, self.calls, self.stopped = index, 0, False

    def ping(self):
        return "ok"

    def bump(self, by=1):
        self.calls += by
        return self.index * 100 + self.calls

    def fail(self):
        raise ValueError(f"stage {self.index} refuses")

    def stop(self):
        self.stopped = True


def in_process_group():
    return ActorManager(Counter, [0], FaultToleranceSettings(), name="counter", in_process=True)


def test_in_process_group_calls_like_a_remote_one():
    group = in_process_group()
    assert [(r.actor_id, r.ok, r.value) for r in group.foreach_actor("bump", 2)] == [(0, True, 2)]
    assert group.foreach_actor("bump", per_actor_args={0: (5,)})[0].value == 7
    assert group.submit("bump", tag="t") == 1 and group.submit("bump", tag="u") == 1  # no in-flight limit in-process
    done = group.fetch_ready()
    assert [(r.tag, r.value) for r in done] == [("t", 8), ("u", 9)] and group.fetch_ready() == []
    assert group.probe_health() == [] and group.num_healthy() == 1
    assert group.share(obj := {"w": 1}) is obj  # no object store in-process
    stage = group.handle(0)
    group.stop()
    assert stage.stopped


def test_in_process_failure_raises_the_stage_error_itself():
    """Serial mode is for debugging: the original exception and its traceback, not a failed result."""
    group = in_process_group()
    with pytest.raises(ValueError, match="stage 0 refuses"):
        group.foreach_actor("fail")


def test_stages_implement_their_roles():
    runner = EnvRunner(EnvRunnerSettings(env_creator=lambda ctx: CountingEnv(ctx), num_envs=1), worker_index=1)
    learner = PPOLearner(PPOConfig(seed=0), OBS, ACT)
    assert isinstance(runner, EnvRunnerRole) and isinstance(learner, LearnerRole)
    runner.stop()


def test_module_spec_builds_full_and_inference_only_copies():
    spec = ModuleSpec(OBS, ACT, {"fcnet_hiddens": [8]})
    full, light = spec.build(), spec.build(inference_only=True)
    assert isinstance(full, ActorCriticModule) and light.inference_only
    assert set(light.get_state()) == set(full.get_state(inference_only=True))
    light.set_state(full.get_state())  # full weights load into the light copy
    obs = torch.randn(4, 3)
    torch.testing.assert_close(light.forward_inference(obs)["action_dist_inputs"],
                               full.forward_inference(obs)["action_dist_inputs"])


def test_multi_module_keys_weights_by_module_id_and_exports_inference_only():
    torch.manual_seed(0)
    multi = MultiRLModule({"left": ActorCriticModule(OBS, ACT), "right": ActorCriticModule(OBS, gym.spaces.Discrete(3))})
    state = multi.get_state()
    assert {k.split("/")[0] for k in state} == {"left", "right"}
    light = multi.get_state(inference_only=True)
    assert light and not any("vf_" in k for k in light)
    other = MultiRLModule({"left": ActorCriticModule(OBS, ACT), "right": ActorCriticModule(OBS, gym.spaces.Discrete(3))})
    other.set_state(state)
    for k, v in other.get_state().items():
        np.testing.assert_array_equal(v, state[k])
    assert multi["right"].dist_spec.input_dim == 3
    with pytest.raises(KeyError, match="holds \\['left', 'right'\\]"):
        multi["middle"]
    with pytest.raises(ValueError, match="module ids"):
        MultiRLModule({"a/b": ActorCriticModule(OBS, ACT)})


@pytest.mark.parametrize("space", [gym.spaces.Discrete(3), gym.spaces.MultiDiscrete([2, 4]),
                                   gym.spaces.Box(-2, 2, (2,), np.float32)], ids=["discrete", "multidiscrete", "box"])
def test_stochastic_sampling_warm_up_acts_at_random_then_samples(space):
    spec = ActionDistSpec(space)
    explore = StochasticSampling(spec, random_timesteps=100)
    # a distribution that would always pick the same action: random warm-up must not
    inputs = torch.zeros(500, spec.input_dim)
    if spec.kind == "gaussian":
        inputs[:, : spec.input_dim // 2], inputs[:, spec.input_dim // 2 :] = 0.3, -20.0
    else:  # the first choice of every component is certain
        offsets = np.cumsum([0] + list(getattr(spec, "nvec", [spec.input_dim]))[:-1])
        inputs[:, offsets] = 50.0
    dist = spec.build(inputs)
    warm = explore.actions(dist, explore=True, timestep=0)
    later = explore.actions(dist, explore=True, timestep=100)
    greedy = explore.actions(dist, explore=False, timestep=0)
    assert warm.shape == later.shape == greedy.shape
    assert len(torch.unique(warm, dim=0)) > 1 and torch.equal(later, greedy)
    if spec.kind == "gaussian":
        assert float(warm.abs().max()) <= 1.0  # the normalized range the policy acts in
    with pytest.raises(ValueError, match="unknown exploration type 'Boltzmann'"):
        make_exploration({"type": "Boltzmann"}, spec)


def test_runner_counts_exploration_steps_into_its_state():
    settings = EnvRunnerSettings(env_creator=lambda ctx: CountingEnv(ctx), num_envs=2, rollout_fragment_length=5,
                                 exploration_config={"random_timesteps": 6})
    runner = EnvRunner(settings, worker_index=1)
    runner.sample()
    state = runner.get_state()
    assert state["num_env_steps_sampled_lifetime"] == 10
    again = EnvRunner(settings, worker_index=1)
    again.set_state(state)  # a recreated runner resumes the schedule where the old one was
    assert again.num_env_steps_sampled_lifetime == 10


def private_keys(d, prefix=""):
    out = []
    for k, v in d.items():
        k = str(k)
        if k.startswith("_") and not (k.startswith("__") and k.endswith("__")):  # RLlib's __all_modules__ is a name
            out.append(prefix + k)
        if isinstance(v, dict):
            out += private_keys(v, f"{prefix}{k}/")
    return out


@pytest.mark.parametrize("config_cls", ["PPO", "IMPALA", "APPO"])
def test_results_are_reduced_from_the_metrics_logger_with_no_private_keys(config_cls):
    from pipeline import get_algorithm

    config = get_algorithm(config_cls)[0]().environment("CartPole-v1").env_runners(
        num_env_runners=0, num_envs_per_env_runner=4).debugging(seed=0)
    if config_cls == "PPO":
        config.training(train_batch_size_per_learner=256, minibatch_size=128, num_epochs=1)
    else:  # an iteration ends on time, and a loaded machine may deliver no batch in 0.2 s: ask for steps too
        config.reporting(min_time_s_per_iteration=0.2, min_train_timesteps_per_iteration=1)
    algo = config.build()
    try:
        results = [algo.train() for _ in range(2)]
    finally:
        algo.stop()
    for r in results:
        assert private_keys(r) == []
        assert r["env_runners"]["num_env_steps_sampled_lifetime"] == r["num_env_steps_sampled_lifetime"] > 0
        assert r["learners"]["__all_modules__"]["num_env_steps_trained_lifetime"] == r["num_env_steps_trained_lifetime"]
        assert algo.counters["num_env_steps_sampled_lifetime"] >= r["num_env_steps_sampled_lifetime"]
    assert results[1]["training_iteration"] == 2
    assert results[1]["num_env_steps_sampled_lifetime"] > results[0]["num_env_steps_sampled_lifetime"]
