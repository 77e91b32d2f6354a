"""bfloat16 in runnel.

Acting (``.inference(precision="bfloat16")``): the pass runs a bfloat16 copy of the module that follows every
weights update, its outputs come back as float32, the log-probabilities recorded are the ones of the policy
that acted, and bad settings are refused with the fix.

Learning (``.learners(learner_precision="bfloat16")``): a module's forward methods run under autocast and
hand back float32 (a user's subclass too), gradients and weights stay float32, every algorithm's update runs
and moves the weights.

And PPO acting and learning in bfloat16 reaches 450 on CartPole within its float32 test's budget."""
import gymnasium as gym
import numpy as np
import pytest
import torch
import yaml

from actors.env import EnvRunner, EnvRunnerSettings
from actors.env.multi_agent_env import make_multi_agent
from actors.env.multi_agent_runner import MultiAgentEnvRunner
from actors.inference.forward import PolicyForward
from actors.modules import ActorCriticModule, ModuleSpec, RLModule
from actors.modules.multi import SEP
from actors.modules.rl_module import set_autocast
from pipeline import APPOConfig, DQNConfig, IMPALAConfig, PPOConfig, SACConfig
from pipeline.config.base import ConfigError
from pipeline.envs import env_creator, probe_spaces
from pipeline.groups.env_runners import runner_settings
from tests.helpers import train_until

FRAMES = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
CARTPOLES = make_multi_agent("CartPole-v1")


def cnn_pair(seed=0):
    """Two forwards of one CNN module's weights: float32 and bfloat16."""
    torch.manual_seed(seed)
    module = ActorCriticModule(FRAMES, gym.spaces.Discrete(6), inference_only=True)
    twin = ActorCriticModule(FRAMES, gym.spaces.Discrete(6), inference_only=True)
    twin.set_state(module.get_state())
    return PolicyForward(module), PolicyForward(twin, precision="bfloat16")


def tuned_cartpole_ppo() -> PPOConfig:
    """test_ppo_train's run: the tuned CartPole file's settings, seed 0."""
    config = PPOConfig().environment("CartPole-v1").debugging(seed=0)
    config.update_from_dict(yaml.safe_load(open("tuned/cartpole-ppo.yaml"))["config"])
    return config


def frames(n=8, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, *FRAMES.shape), dtype=np.uint8)


def test_a_bfloat16_pass_is_close_to_the_float32_one_and_follows_new_weights():
    f32, b16 = cnn_pair()
    obs = frames()
    with torch.inference_mode():
        first = f32.dist_inputs(obs, True)
        low = b16.dist_inputs(obs, True)
        assert low.dtype == torch.float32 and low.shape == first.shape
        scale = float(first.abs().max())
        assert float((low - first).abs().max()) < 0.05 * scale
        # new weights (the head's scaled up, as training moves it): the bfloat16 copy acts with them at once
        new = {k: (v * 40.0 if k.startswith("pi_head.") else v) for k, v in f32.get_state().items()}
        f32.set_state(new)
        b16.set_state(new)
        moved = f32.dist_inputs(obs, True)
        low = b16.dist_inputs(obs, True)
        assert float((moved - first).abs().max()) > 0.5 * float(moved.abs().max())  # the weights did move the outputs
        assert float((low - moved).abs().max()) < 0.05 * float(moved.abs().max())
        # the server's path: tensors copied in place
        f32.load_weights({k: torch.as_tensor(v) for k, v in f32.get_state().items()})
        b16.load_weights({k: torch.as_tensor(np.asarray(v) / 40.0 if k.startswith("pi_head.") else v)
                          for k, v in new.items()})
        assert float((b16.dist_inputs(obs, True) - first).abs().max()) < 0.05 * scale
    # the weights read back are the float32 module's, exactly what was set
    state = b16.get_state()
    assert all(np.asarray(v).dtype == np.float32 for v in state.values())
    np.testing.assert_array_equal(state["encoder.net.0.weight"], new["encoder.net.0.weight"])


def test_a_recurrent_module_acts_in_bfloat16_with_float32_states():
    space = gym.spaces.Box(-1, 1, (4,), np.float32)
    torch.manual_seed(0)
    module = ActorCriticModule(space, gym.spaces.Discrete(2), {"use_lstm": True, "lstm_cell_size": 32},
                               inference_only=True)
    obs = np.random.default_rng(0).uniform(-1, 1, (5, 4)).astype(np.float32)
    with torch.inference_mode():
        want, want_state = PolicyForward(module).recurrent_dist_inputs(obs, module.initial_state(5), True)
        got, got_state = PolicyForward(module, precision="bfloat16").recurrent_dist_inputs(
            obs, module.initial_state(5), True)
    assert got.dtype == torch.float32 and got_state.dtype == np.float32 and got_state.shape == (5, 2, 32)
    np.testing.assert_allclose(got_state, want_state, atol=0.02)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=0.02)


def test_bad_precision_settings_name_the_fix():
    with pytest.raises(ValueError, match=r"precision='fp16' is not one of \['float32', 'bfloat16'\]"):
        PolicyForward(ActorCriticModule(FRAMES, gym.spaces.Discrete(6), inference_only=True), precision="fp16")
    config = PPOConfig().environment("CartPole-v1")
    with pytest.raises(ConfigError, match=r"inference precision='fp16' is not one of \['float32', 'bfloat16'\]"):
        config.copy().inference(precision="fp16").validate()
    with pytest.raises(ConfigError, match="numpy acting computes in float32: set runner_backend='auto' or 'torch'"):
        config.copy().inference(precision="bfloat16", runner_backend="numpy").validate()


def test_a_bfloat16_runner_acts_with_torch_and_records_the_logp_of_the_policy_that_acted():
    config = PPOConfig().environment("CartPole-v1").env_runners(num_envs_per_env_runner=1,
                                                                rollout_fragment_length=60).debugging(seed=1)
    obs_space, act_space = probe_spaces(env_creator("CartPole-v1"), {})
    plain = runner_settings(config, env_creator("CartPole-v1"), ActorCriticModule, obs_space, act_space)
    assert plain.precision == "float32" and plain.numpy_policy is not None  # auto: numpy for this small MLP
    settings = runner_settings(config.copy().inference(precision="bfloat16"), env_creator("CartPole-v1"),
                               ActorCriticModule, obs_space, act_space)
    assert settings.precision == "bfloat16" and settings.numpy_policy is None  # auto picks torch then
    runner = EnvRunner(settings, worker_index=1)
    try:
        torch.manual_seed(5)
        trained = ActorCriticModule(obs_space, act_space, inference_only=True)
        # confident logits, so that bfloat16's rounding shows
        weights = {k: v * 200.0 if k.startswith("pi_head.") else v for k, v in trained.get_state().items()}
        runner.set_weights(weights, 1)
        chunks = runner.sample()
    finally:
        runner.stop()
    judge = PolicyForward(ActorCriticModule(obs_space, act_space, inference_only=True), precision="bfloat16")
    judge.set_state(weights)
    exact = PolicyForward(ActorCriticModule(obs_space, act_space, inference_only=True))
    exact.set_state(weights)
    assert sum(len(c) for c in chunks) >= 50  # 60 steps, less the reset-only ones of ended episodes
    for chunk in chunks:
        with torch.inference_mode():  # a row at a time, as the runner of one sub-env acted: the same kernels
            inputs = torch.cat([judge.dist_inputs(np.asarray(o, np.float32)[None], True) for o in chunk.obs[:len(chunk)]])
            logp = judge.dist_spec.build(inputs).logp(torch.as_tensor(np.asarray(chunk.actions))).numpy()
            exact_inputs = exact.dist_inputs(np.asarray(chunk.obs[:len(chunk)], np.float32), True).numpy()
        np.testing.assert_allclose(chunk.extra["action_dist_inputs"], inputs.numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(chunk.extra["action_logp"], logp, rtol=1e-6, atol=1e-6)
        # and the float32 policy's are farther off (bfloat16 keeps 8 bits of mantissa): it did act in bfloat16
        assert np.abs(chunk.extra["action_dist_inputs"] - exact_inputs).max() > 1e-4



@pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "general"])
def test_a_bfloat16_multi_agent_runner_records_the_logp_of_the_policies_that_acted(lockstep):
    """Each module acts under its own autocast (not fused into the float32 pass two alike modules share)."""
    mapping = lambda agent, episode, **kw: f"p{agent}"  # noqa: E731
    config = PPOConfig().environment(CARTPOLES, env_config={"num_agents": 2}) \
        .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=mapping).inference(precision="bfloat16")
    config.validate()  # multi-agent runs may act in bfloat16
    env = CARTPOLES({"num_agents": 2})
    obs_space, act_space = env.get_observation_space(0), env.get_action_space(0)
    specs = {m: ModuleSpec(obs_space, act_space, {"fcnet_hiddens": [32]}) for m in ("p0", "p1")}
    runner = MultiAgentEnvRunner(EnvRunnerSettings(env_creator=lambda ctx: CARTPOLES({"num_agents": 2}), num_envs=2,
                                                   rollout_fragment_length=40, seed=3, precision="bfloat16"),
                                 specs, mapping, worker_index=1, lockstep=lockstep)
    weights = {}
    for i, mid in enumerate(("p0", "p1")):
        torch.manual_seed(10 + i)
        state = ActorCriticModule(obs_space, act_space, {"fcnet_hiddens": [32]}, inference_only=True).get_state()
        weights.update({f"{mid}{SEP}{k}": v * 200.0 if k.startswith("pi_head.") else v for k, v in state.items()})
    try:
        runner.set_weights(weights, 1)
        assert all(m.autocast_dtype is torch.bfloat16 for m in runner.module.members.values())
        assert all(fused is None for _, fused in runner.sampler.acting.groups())
        chunks = runner.sample()
    finally:
        runner.stop()
    seen = set()
    for chunk in chunks:
        own = {k.split(SEP, 1)[1]: v for k, v in weights.items() if k.startswith(chunk.module_id + SEP)}
        judge, exact = (PolicyForward(ActorCriticModule(obs_space, act_space, {"fcnet_hiddens": [32]},
                                                        inference_only=True), precision=p) for p in ("bfloat16", "float32"))
        judge.set_state(own)
        exact.set_state(own)
        obs = np.asarray(chunk.obs[:len(chunk)], np.float32)
        with torch.inference_mode():
            inputs = judge.dist_inputs(obs, True)
            logp = judge.dist_spec.build(inputs).logp(torch.as_tensor(np.asarray(chunk.actions))).numpy()
            exact_inputs = exact.dist_inputs(obs, True).numpy()
        np.testing.assert_allclose(chunk.extra["action_dist_inputs"], inputs.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(chunk.extra["action_logp"], logp, rtol=1e-5, atol=1e-5)
        assert np.abs(chunk.extra["action_dist_inputs"] - exact_inputs).max() > 1e-4  # it did act in bfloat16
        seen.add(chunk.module_id)
    assert seen == {"p0", "p1"}


# --- learning in bfloat16 ------------------------------------------------------------------------------
class Doubler(RLModule):
    """A user's module: its forward method is wrapped as the built-in ones are."""

    def __init__(self, observation_space, action_space, model_config=None, inference_only=False):
        super().__init__(observation_space, action_space, model_config, inference_only)
        self.net = torch.nn.Linear(4, 2)

    def forward_inference(self, obs):
        out = self.net(obs)
        return {"action_dist_inputs": out, "seen_dtype": torch.tensor(0.0, dtype=out.dtype)}


def test_autocast_forward_methods_give_float32_outputs_and_float32_gradients():
    torch.manual_seed(0)
    module = ActorCriticModule(FRAMES, gym.spaces.Discrete(6))
    obs = torch.as_tensor(frames(16))
    full = {k: v.detach() for k, v in module.forward_train(obs).items()}
    set_autocast(module, "bfloat16", "cpu")
    low = module.forward_train(obs)
    assert {k: v.dtype for k, v in low.items()} == {"action_dist_inputs": torch.float32, "vf_preds": torch.float32}
    for k in full:
        assert float((low[k].detach() - full[k]).abs().max()) < 0.05 * float(full[k].abs().max()) + 1e-3, k
    assert float((low["vf_preds"].detach() - full["vf_preds"]).abs().max()) > 0  # it did compute in bfloat16
    low["vf_preds"].sum().backward()
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in module.parameters())
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert module.compute_values(obs).dtype == torch.float32  # it calls forward_train inside: one autocast
    set_autocast(module, "float32", "cpu")
    torch.testing.assert_close(module.forward_train(obs)["vf_preds"], full["vf_preds"])
    user = Doubler(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
    set_autocast(user, "bfloat16", "cpu")
    out = user.forward_inference(torch.ones(3, 4))
    assert out["action_dist_inputs"].dtype == torch.float32 and out["seen_dtype"].dtype == torch.float32
    assert user.forward_inference.__wrapped__  # wrapped at class creation


def test_a_bad_learner_precision_names_the_choices():
    with pytest.raises(ConfigError, match=r"learner_precision='fp16' is not one of \['float32', 'bfloat16'\]"):
        PPOConfig().environment("CartPole-v1").learners(learner_precision="fp16").validate()


@pytest.mark.parametrize("config_cls,env", [(PPOConfig, "CartPole-v1"), (APPOConfig, "CartPole-v1"),
                                            (IMPALAConfig, "CartPole-v1"), (DQNConfig, "CartPole-v1"),
                                            (SACConfig, "Pendulum-v1")])
def test_every_algorithm_updates_in_bfloat16(config_cls, env):
    config = (config_cls().environment(env).env_runners(num_env_runners=0, rollout_fragment_length=50)
              .learners(learner_precision="bfloat16").debugging(seed=0))
    if config_cls in (DQNConfig, SACConfig):
        # one update per sampled step (SAC's default intensity, 256, is meant for batches of 256)
        config.training(num_steps_sampled_before_learning_starts=100, train_batch_size_per_learner=32,
                        training_intensity=32)
    else:
        config.training(train_batch_size_per_learner=200, minibatch_size=100)
    algo = config.build(logdir=None)
    try:
        learner = algo.learner_group.local
        assert learner.module.autocast_dtype == torch.bfloat16
        assert all(t.autocast_dtype == torch.bfloat16 for t in learner.targets.values())
        before = learner.get_weights()
        for _ in range(6):  # until an iteration trained (off-policy ones start learning after 100 steps)
            stats = algo.train()["learners"].get("default_policy", {})
            if any("loss" in k for k in stats):
                break
        losses = [v for k, v in stats.items() if "loss" in k]
        assert losses and all(np.isfinite(v) for v in losses), stats
        after = learner.get_weights()
        assert any(not np.array_equal(before[k], after[k]) for k in before)
        assert all(np.asarray(v).dtype == np.float32 for v in after.values())
    finally:
        algo.stop()


@pytest.mark.learning
def test_ppo_acting_and_learning_in_bfloat16_reaches_450_within_the_float32_budget(ray_cluster):
    """test_ppo_train's run of the tuned CartPole file (2 runner actors, 120k steps), its runners acting and its
    learner training in bfloat16."""
    algo = tuned_cartpole_ppo().inference(precision="bfloat16").learners(learner_precision="bfloat16").build()
    try:
        assert algo.learner_group.local.module.autocast_dtype == torch.bfloat16
        assert algo.env_runner_group.settings.precision == "bfloat16"
        best, result = train_until(algo, 450, 120_000)
    finally:
        algo.stop()
    assert best >= 450, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
