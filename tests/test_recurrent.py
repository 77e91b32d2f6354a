"""Recurrent modules (``model_config={"use_lstm": True}``): the module's step and sequence passes agree, runners
carry each sub-env's state across steps and chunks and store it at each chunk's start, PPO's learner unrolls
chunks from those states, and ``compute_single_action`` takes and returns the state."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env import EnvRunner, EnvRunnerSettings
from actors.learner.sequences import chunks_to_sequences
from actors.modules import ActorCriticModule
from pipeline import ConfigError, PPOConfig
from pipeline.algorithms.ppo.learner import PPOLearner
from protocols.codec import decode, encode
from protocols.episode import EpisodeChunk
from tests.envs import StatelessCartPole
from tests.pieces import optimizer_steps

OBS = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
ACT = gym.spaces.Discrete(3)
LSTM = {"use_lstm": True, "lstm_cell_size": 16, "max_seq_len": 7, "fcnet_hiddens": [32]}


def test_a_sequence_unrolled_at_once_equals_its_steps_one_by_one():
    torch.manual_seed(0)
    module = ActorCriticModule(OBS, ACT, LSTM)
    obs = torch.randn(4, 9, 3)
    state = torch.randn(4, 2, 16) * 0.1
    seq = module.forward_sequences(obs, state)
    outs, s = [], state
    for t in range(9):
        step = module.forward_inference(obs[:, t], s)
        outs.append(step["action_dist_inputs"])
        s = step["state_out"]
    torch.testing.assert_close(torch.stack(outs, 1), seq["action_dist_inputs"], atol=1e-5, rtol=1e-5)
    assert seq["vf_preds"].shape == (4, 9)
    assert module.initial_state(5).shape == (5, 2, 16)
    with pytest.raises(RuntimeError, match="sequences"):
        module.forward_train(obs[:, 0])
    with pytest.raises(ValueError, match="recurrent state of shape"):
        module.forward_inference(obs[:, 0], torch.zeros(4, 2, 8))


def test_padding_after_a_sequence_never_reaches_its_steps():
    torch.manual_seed(1)
    module = ActorCriticModule(OBS, ACT, LSTM)
    rng = np.random.default_rng(0)
    chunks = [EpisodeChunk(f"e{i}", 0, rng.normal(size=(n + 1, 3)).astype(np.float32), np.zeros(n, np.int64),
                           np.zeros(n, np.float32), state_in=rng.normal(size=(2, 16)).astype(np.float32) * 0.1)
              for i, n in enumerate([2, 7, 4])]
    seq = chunks_to_sequences(chunks, torch.device("cpu"))
    together = module.forward_sequences(seq.obs, seq.state_in)
    for i, c in enumerate(chunks):
        alone = module.forward_sequences(torch.as_tensor(c.obs)[None], torch.as_tensor(c.state_in)[None])
        n = len(c) + 1
        torch.testing.assert_close(together["vf_preds"][i, :n], alone["vf_preds"][0], atol=1e-6, rtol=1e-6)
    flat = seq.flat_values(together["vf_preds"])
    assert flat.shape == (sum(len(c) + 1 for c in chunks),)
    padded = seq.pad_steps(torch.arange(sum(len(c) for c in chunks)))
    assert padded.shape == (3, 7) and padded[0, 2:].eq(0).all() and int(seq.mask.sum()) == 13
    with pytest.raises(ValueError, match="no state_in"):
        chunks_to_sequences([EpisodeChunk("x", 0, np.zeros((2, 3), np.float32), np.zeros(1, np.int64),
                                          np.zeros(1, np.float32))], torch.device("cpu"))


def _runner(**kw):
    settings = EnvRunnerSettings(env_creator=lambda ctx: StatelessCartPole(), num_envs=3, rollout_fragment_length=25,
                                 seed=5, model_config=LSTM, **kw)
    return EnvRunner(settings)


def test_runner_chunks_carry_the_state_they_started_from_and_a_learner_replays_their_actions():
    runner = _runner()
    torch.manual_seed(0)
    full = ActorCriticModule(runner.observation_space, runner.action_space, LSTM)
    runner.set_weights(full.get_state(inference_only=True), 1)
    chunks = []
    for _ in range(4):
        chunks += runner.sample()
    runner.stop()
    assert all(len(c) <= 7 and c.state_in is not None and c.state_in.shape == (2, 16) for c in chunks)
    assert all(not c.state_in.any() for c in chunks if c.t_started == 0)  # episodes start from zeros
    assert any(c.state_in.any() for c in chunks if c.t_started > 0)
    with torch.no_grad():
        for c in chunks:  # the learner's unroll from state_in gives the runner's distribution inputs
            out = full.forward_sequences(torch.as_tensor(c.obs[:-1])[None], torch.as_tensor(c.state_in)[None])
            np.testing.assert_allclose(out["action_dist_inputs"][0].numpy(), c.extra["action_dist_inputs"],
                                       atol=1e-5, rtol=1e-5)
        by_episode = {}
        for c in chunks:
            by_episode.setdefault(c.episode_id, []).append(c)
        checked = 0
        for pieces in by_episode.values():  # a chunk's end state is where the next one starts
            for a, b in zip(pieces, pieces[1:]):
                s = torch.as_tensor(a.state_in)[None]
                for row in a.obs[:-1]:
                    s = full.forward_inference(torch.as_tensor(row)[None], s)["state_out"]
                np.testing.assert_allclose(s[0].numpy(), b.state_in, atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked > 0
    back = decode(encode(chunks[:3]))
    for a, b in zip(chunks[:3], back):
        np.testing.assert_array_equal(a.state_in, b.state_in)


def test_ppo_learner_trains_on_sequences_without_an_environment():
    config = (PPOConfig().environment(observation_space=OBS, action_space=ACT)
              .rl_module(model_config=LSTM).training(train_batch_size_per_learner=60, minibatch_size=20, num_epochs=3)
              .debugging(seed=0))
    learner = PPOLearner(config, OBS, ACT)
    rng = np.random.default_rng(0)
    chunks = []
    for i, n in enumerate([7, 7, 3, 7, 5, 7, 7, 7, 5, 5]):
        chunks.append(EpisodeChunk(
            f"e{i}", 0, rng.uniform(-1, 1, (n + 1, 3)).astype(np.float32), rng.integers(0, 3, n),
            rng.normal(size=n).astype(np.float32), terminated=bool(i % 2),
            extra={"action_logp": np.full(n, np.log(1 / 3), np.float32),
                   "action_dist_inputs": np.zeros((n, 3), np.float32)},
            state_in=np.zeros((2, 16), np.float32)))
    before = {k: v.copy() for k, v in learner.get_weights().items()}
    stats = learner.update(chunks, timestep=0)
    assert stats["num_module_steps_trained"] == sum(len(c) for c in chunks)
    assert all(np.isfinite(stats[k]) for k in ("policy_loss", "vf_loss", "entropy", "total_loss"))
    after = learner.get_weights()
    assert any(not np.array_equal(before[k], after[k]) for k in before if k.startswith("lstm."))
    refused = learner.update([EpisodeChunk("x", 0, np.zeros((3, 3), np.float32), np.zeros(2, np.int64),
                                           np.zeros(2, np.float32), extra={
                                               "action_logp": np.zeros(2, np.float32),
                                               "action_dist_inputs": np.zeros((2, 3), np.float32)})], timestep=0)
    assert refused.get("num_batches_refused") == 1.0  # no state_in: refused, not a crash


def _fake_chunks(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [EpisodeChunk(f"e{i}", 0, rng.uniform(-1, 1, (n + 1, 3)).astype(np.float32), rng.integers(0, 3, n),
                         rng.normal(size=n).astype(np.float32), terminated=bool(i % 2),
                         extra={"action_logp": np.full(n, np.log(1 / 3), np.float32),
                                "action_dist_inputs": np.zeros((n, 3), np.float32)},
                         state_in=np.zeros((2, 16), np.float32)) for i, n in enumerate(lengths)]


@pytest.mark.parametrize("algo", ["IMPALA", "APPO"])
def test_vtrace_learners_train_on_sequences_without_an_environment(algo):
    from pipeline.algorithms.appo.config import APPOConfig
    from pipeline.algorithms.appo.learner import APPOLearner
    from pipeline.algorithms.impala.config import IMPALAConfig
    from pipeline.algorithms.impala.learner import IMPALALearner

    config_cls, learner_cls = (IMPALAConfig, IMPALALearner) if algo == "IMPALA" else (APPOConfig, APPOLearner)
    config = (config_cls().environment(observation_space=OBS, action_space=ACT).rl_module(model_config=LSTM)
              .training(train_batch_size_per_learner=60, minibatch_size=30).debugging(seed=0))
    learner = learner_cls(config, OBS, ACT)
    before = {k: v.copy() for k, v in learner.get_weights().items()}
    stats = learner.update(_fake_chunks([7, 7, 3, 7, 5, 7, 7, 7, 5, 5]), timestep=0)
    assert stats["num_module_steps_trained"] == 60
    assert all(np.isfinite(stats[k]) for k in ("policy_loss", "vf_loss", "entropy", "total_loss"))
    after = learner.get_weights()
    assert any(not np.array_equal(before[k], after[k]) for k in before if k.startswith("lstm."))


def test_vtrace_learners_take_as_many_steps_whatever_their_batch_of_whole_chunks_holds():
    """Data-parallel learners all-reduce every step: batches of 60 and of 67 steps (whole chunks) give the same
    number of optimizer steps, the settings' minibatches per epoch."""
    from pipeline.algorithms.impala.config import IMPALAConfig
    from pipeline.algorithms.impala.learner import IMPALALearner

    config = (IMPALAConfig().environment(observation_space=OBS, action_space=ACT).rl_module(model_config=LSTM)
              .training(train_batch_size_per_learner=60, minibatch_size=20, num_epochs=2).debugging(seed=0))
    counts = []
    for lengths in ([7, 7, 3, 7, 5, 7, 7, 7, 5, 5], [7, 7, 7, 7, 7, 7, 7, 7, 7, 4]):
        learner = IMPALALearner(config, OBS, ACT)
        learner.update(_fake_chunks(lengths), timestep=0)
        counts.append(optimizer_steps(learner))
    assert counts == [6, 6]  # 2 epochs x ceil(60 / 20)


def test_a_stream_loader_keeps_recurrent_chunks_whole():
    """Batches are cut from a stream at the batch size, slicing a chunk that straddles two; a recurrent
    policy's chunk is taken whole instead (its tail would have no start state)."""
    from actors.learner.loader import ChunkReceiver
    from protocols.transport import ChunkSender

    rec = ChunkReceiver(OBS, ACT, batch_size=10, host="127.0.0.1", prebuild=False).start()
    sender = ChunkSender(rec.address, "env-runner-1", hwm=8)
    try:
        assert sender.send(_fake_chunks([7, 7, 7]))
        batch = rec.get_batch(timeout=30)
        assert batch is not None and [len(c) for c in batch] == [7, 7]
        assert all(c.state_in is not None for c in batch)
    finally:
        sender.close()
        rec.close()


def test_compute_single_action_takes_and_returns_the_state():
    algo = (PPOConfig().environment(StatelessCartPole).env_runners(num_env_runners=0, num_envs_per_env_runner=2)
            .rl_module(model_config=LSTM).training(train_batch_size_per_learner=100, minibatch_size=50, num_epochs=1)
            .debugging(seed=0).build(logdir=None))
    try:
        algo.train()
        obs = np.array([0.01, -0.02], np.float32)
        action, state, info = algo.compute_single_action(obs, explore=False)
        assert action in (0, 1) and state.shape == (2, 16) and state.any() and info == {}
        again, state2, _ = algo.compute_single_action(obs, explore=False, state=state)
        assert not np.array_equal(state, state2)
        # the numpy export carries the cell (external clients act with it): the same next state
        from actors.modules.export import export_policy
        from protocols.numpy_policy import NumpyPolicy

        inputs, after = NumpyPolicy(export_policy(algo.get_module())).step(obs[None], state[None])
        np.testing.assert_allclose(after[0], state2, atol=1e-5)
        assert int(inputs[0].argmax()) == again
    finally:
        algo.stop()


def test_recurrent_settings_that_cannot_work_are_config_errors():
    from pipeline import APPOConfig, SACConfig

    with pytest.raises(ConfigError, match="does not train recurrent modules"):
        SACConfig().environment("Pendulum-v1").rl_module(model_config={"use_lstm": True}).validate()
    APPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2).rl_module(
        model_config={"use_lstm": True}).learners(num_learners=2).validate()  # data-parallel sequences
    PPOConfig().environment("CartPole-v1").rl_module(model_config={"use_lstm": True}).inference(
        mode="central").validate()  # the runners send their states with each request
    spaces = {"observation_space": StatelessCartPole().observation_space, "action_space": gym.spaces.Discrete(2)}
    with pytest.raises(ConfigError, match="inference_mode='local'"):
        PPOConfig().environment(**spaces).rl_module(model_config={"use_lstm": True}).external_clients(
            inference_mode="remote").validate()
    with pytest.raises(ConfigError, match="lstm_use_prev_action"):
        PPOConfig().environment("CartPole-v1").rl_module(
            model_config={"use_lstm": True, "lstm_use_prev_action": True}).validate()
    with pytest.raises(ConfigError, match="max_seq_len"):
        PPOConfig().environment("CartPole-v1").rl_module(model_config={"use_lstm": True, "max_seq_len": 0}).validate()


# --- learning: memory where the observation leaves out the velocities ------------------------------
def _stateless_run(model_config: dict, seed: int, budget: int, base=None) -> tuple[float, int]:
    """Stateless CartPole with MeanStdFilter until a mean return of 350 or ``budget`` env steps; ``base``: the
    algorithm's config with its training settings (default: PPO with RLlib's tuned example's)."""
    from pipeline.connectors import mean_std_filter
    from tests.helpers import train_until

    base = base if base is not None else PPOConfig().training(lr=3e-4, num_epochs=6, vf_loss_coeff=0.05)
    algo = (base.environment(StatelessCartPole)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=8, env_to_module_connector=mean_std_filter)
            .rl_module(model_config=model_config).debugging(seed=seed).build(logdir=None))
    try:
        best, result = train_until(algo, 350, budget)
    finally:
        algo.stop()
    return best, result["num_env_steps_sampled_lifetime"]


STATELESS_LSTM = {"use_lstm": True, "lstm_cell_size": 64, "max_seq_len": 20, "fcnet_hiddens": [64]}


@pytest.mark.learning
def test_ppo_with_an_lstm_reaches_350_on_stateless_cartpole():
    """RLlib's tuned example's settings (MeanStdFilter, lr 3e-4, 6 epochs, value weight 0.05) with a 64-unit
    LSTM: seeds 0, 1, 2 reached 350 at 240k, 180k and 190k env steps (tests/benchmarks/recurrent.py); the
    issue's bar is 500k (RLlib's example: 2M)."""
    best, steps = _stateless_run(STATELESS_LSTM, 0, 500_000)
    assert best >= 350, f"{best} after {steps} env steps"


@pytest.mark.seeds
@pytest.mark.parametrize("seed", [1, 2])
def test_ppo_with_an_lstm_reaches_350_on_stateless_cartpole_other_seeds(seed):
    best, steps = _stateless_run(STATELESS_LSTM, seed, 500_000)
    assert best >= 350, f"seed {seed}: {best} after {steps} env steps"


@pytest.mark.seeds
def test_the_mlp_does_not_reach_350_on_stateless_cartpole():
    best, steps = _stateless_run({}, 0, 500_000)
    assert best < 350, f"the MLP reached {best} without velocities ({steps} env steps): the task is not a memory test"


@pytest.mark.long
def test_appo_with_an_lstm_reaches_350_on_stateless_cartpole():
    """RLlib's APPO example's settings (MeanStdFilter, lr 5e-4, value weight 0.05, entropy 0.005), the same
    LSTM: seeds 0 and 1 reached 350 at 366k and 359k env steps; seed 2 peaked at 344 within 1M."""
    from pipeline import APPOConfig

    appo = APPOConfig().training(lr=5e-4, vf_loss_coeff=0.05, entropy_coeff=0.005)
    best, steps = _stateless_run(STATELESS_LSTM, 0, 1_000_000, base=appo)
    assert best >= 350, f"{best} after {steps} env steps"
