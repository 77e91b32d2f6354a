"""Recurrent DQN (R2D2): ``DQNConfig().rl_module(model_config={"use_lstm": True})``.

The recurrent Q-module's step and sequence passes agree; the sequence replay stores runners' chunks with their
start states, samples padded sequences, restores exactly from its state and follows priorities; the n-step
targets inside a sequence are the hand-computed ones; the loss fits exact returns, and burn-in (over each
sequence's previous chunk) hands the trained steps the state one unroll over both chunks reaches; bad settings are refused with the fix; and on stateless
CartPole (velocities hidden) R2D2 learns what DQN's MLP cannot."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.modules import QModule
from actors.replay import ReplaySettings
from actors.replay.sequences import SequenceReplay
from pipeline import ConfigError, DQNConfig
from pipeline.algorithms.dqn.recurrent import h_inverse, h_rescale, r2d2_loss, sequence_n_step, sequence_priorities
from protocols.episode import EpisodeChunk
from tests.envs import StatelessCartPole

OBS = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
LSTM = {"use_lstm": True, "lstm_cell_size": 8, "max_seq_len": 5, "fcnet_hiddens": [16]}


def chunk(steps: int, start: float = 0.0, terminated: bool = False, episode: str = "e", index: int = 0,
          state: float = 0.0) -> EpisodeChunk:
    obs = (start + np.arange(steps + 1, dtype=np.float32))[:, None].repeat(2, 1)
    return EpisodeChunk(episode, index, obs, np.arange(steps, dtype=np.int64) % 2, np.ones(steps, np.float32),
                        terminated=terminated, state_in=np.full((2, 8), state, np.float32))


# --- the module ---------------------------------------------------------------------------------------
def test_a_recurrent_q_module_unrolls_sequences_as_it_steps():
    torch.manual_seed(0)
    module = QModule(OBS, gym.spaces.Discrete(3), LSTM)
    obs, state = torch.randn(3, 6, 2), torch.randn(3, 2, 8) * 0.1
    seq = module.forward_sequences(obs, state)
    s, steps = state, []
    for t in range(6):
        out = module.forward_inference(obs[:, t], s)
        steps.append(out["action_dist_inputs"])
        s = out["state_out"]
    torch.testing.assert_close(torch.stack(steps, 1), seq["q_values"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, seq["state_out"], atol=1e-5, rtol=1e-5)
    assert module.initial_state(4).shape == (4, 2, 8)
    with pytest.raises(RuntimeError, match="needs its states"):
        module.forward_train(obs[:, 0])
    with pytest.raises(ValueError, match="num_atoms=51 is not supported with it: set num_atoms=1"):
        QModule(OBS, gym.spaces.Discrete(3), LSTM, num_atoms=51)


# --- the sequence replay ------------------------------------------------------------------------------
def test_the_sequence_replay_stores_chunks_with_their_states_and_samples_padded_sequences():
    replay = SequenceReplay(ReplaySettings(capacity=20, seed=0), max_seq_len=5)  # 4 slots
    replay.add([chunk(5, 0.0, state=0.5), chunk(3, 10.0, terminated=True, state=1.5, index=1)])
    assert len(replay) == 8 and replay.filled == 2
    batch = replay.sample(50, num_batches=2)  # 10 sequences a batch, 2 batches
    assert batch["obs"].shape == (20, 6, 2) and batch["actions"].shape == (20, 5) and batch["mask"].shape == (20, 5)
    for i, slot in enumerate(batch["indices"]):
        n = 5 if slot == 0 else 3
        assert batch["lengths"][i] == n and batch["mask"][i].sum() == n and batch["terminated"][i] == (slot == 1)
        np.testing.assert_array_equal(batch["obs"][i, : n + 1, 0], (0.0 if slot == 0 else 10.0) + np.arange(n + 1))
        assert not batch["obs"][i, n + 1:].any() and not batch["rewards"][i, n:].any()  # zero padding
        assert np.all(batch["state_in"][i] == (0.5 if slot == 0 else 1.5))
    replay.add([chunk(4, 20.0), chunk(2, 30.0), chunk(1, 40.0)])  # the 5th overwrites the oldest slot
    assert replay.filled == 4 and len(replay) == 3 + 4 + 2 + 1
    assert replay.cols["lengths"][0] == 1 and replay.obs[0][0, 0, 0] == 40.0


def test_the_sequence_replay_refuses_what_it_cannot_replay():
    replay = SequenceReplay(ReplaySettings(capacity=20), max_seq_len=5)
    replay.add(chunk(2))
    stateless = chunk(2)
    stateless.state_in = None
    with pytest.raises(ValueError, match="has no state_in"):
        replay.add(stateless)
    with pytest.raises(ValueError, match="6 steps, more than max_seq_len=5"):
        replay.add(chunk(6))
    other = chunk(2)
    other.obs = other.obs[:, :1]
    with pytest.raises(ValueError, match="per-step shape"):
        replay.add(other)
    with pytest.raises(ValueError, match="start state of shape"):
        replay.add(EpisodeChunk("e", 0, np.zeros((3, 2), np.float32), np.zeros(2, np.int64), np.zeros(2, np.float32),
                                state_in=np.zeros((2, 4), np.float32)))
    assert len(replay) == 2  # nothing of a refused call was stored
    with pytest.raises(ValueError, match="fewer than 2 sequences of max_seq_len=20: raise the capacity to at least 40"):
        SequenceReplay(ReplaySettings(capacity=30), max_seq_len=20)


def test_a_restored_sequence_replay_samples_what_the_original_would_and_follows_priorities():
    settings = ReplaySettings(capacity=40, prioritized=True, alpha=1.0, beta=0.4, seed=3, n_step=(1, 3))
    replay = SequenceReplay(settings, max_seq_len=5)
    replay.add([chunk(5, 10.0 * i, state=float(i)) for i in range(6)])
    twin = SequenceReplay(settings, max_seq_len=5)
    twin.set_state(replay.get_state())
    a, b = replay.sample(25), twin.sample(25)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    replay.update_priorities(np.arange(6), np.array([0, 0, 0, 0, 0, 100.0]))
    drawn = replay.sample(500)["indices"]
    assert np.mean(drawn == 5) > 0.9  # priority 100 against five of epsilon
    with pytest.raises(ValueError, match="max_seq_len=7"):
        SequenceReplay(ReplaySettings(capacity=40), max_seq_len=7).set_state(replay.get_state())


# --- targets and loss ---------------------------------------------------------------------------------
def test_n_step_targets_stay_inside_each_sequence_and_stop_at_a_terminal_step():
    g = 0.5
    rewards = torch.tensor([[1.0, 2.0, 4.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    lengths, terminated = torch.tensor([3, 4]), torch.tensor([True, False])
    returns, boot, disc, valid = sequence_n_step(rewards, lengths, terminated, torch.tensor([2, 3]), g)
    torch.testing.assert_close(returns, torch.tensor([[1 + g * 2, 2 + g * 4, 4.0, 0.0],
                                                      [1 + g + g * g, 1 + g + g * g, 1 + g, 1.0]]))
    assert boot.tolist() == [[2, 3, 3, 3], [3, 4, 4, 4]]
    # sequence 0 ends terminal: bootstraps that land on its last observation get 0; sequence 1 was cut (truncated)
    torch.testing.assert_close(disc, torch.tensor([[g * g, 0.0, 0.0, 0.0], [g ** 3, g ** 3, g ** 2, g]]))
    assert valid.tolist() == [[True, True, True, False], [True, True, True, True]]
    p = sequence_priorities(torch.tensor([[1.0, 3.0, 9.0], [2.0, 2.0, 2.0]]), torch.tensor([[1, 1, 0], [0, 0, 0]]).bool())
    torch.testing.assert_close(p, torch.tensor([0.9 * 3 + 0.1 * 2, 0.0]))


def test_the_h_function_is_inverted_by_its_inverse():
    x = torch.linspace(-1000.0, 1000.0, 2001, dtype=torch.float64)
    torch.testing.assert_close(h_inverse(h_rescale(x, 1e-3), 1e-3), x, atol=1e-6, rtol=1e-9)
    assert h_rescale(torch.tensor(99.0), 1e-3) < 10  # sqrt-like: large returns shrink


def fake_sequences(b: int = 16, width: int = 5) -> dict:
    lengths = torch.where(torch.arange(b) < b // 2, 3, width)
    return {"obs": torch.randn(b, width + 1, 2), "state_in": torch.zeros(b, 2, 8),
            "actions": torch.zeros(b, width, dtype=torch.long),
            "rewards": (torch.arange(width)[None] < lengths[:, None]).float(), "lengths": lengths,
            "terminated": torch.ones(b, dtype=torch.bool), "n_steps": torch.full((b,), 2), "weights": torch.ones(b)}


@pytest.mark.parametrize("h_epsilon", [None, 1e-3], ids=["plain", "h-rescaled"])
def test_the_loss_fits_the_returns_of_terminated_sequences(h_epsilon):
    """One action, rewards of 1: each step's Q-value must become the discounted number of steps left (with the
    h-function, h of it)."""
    torch.manual_seed(0)
    module, target = QModule(OBS, gym.spaces.Discrete(1), LSTM), QModule(OBS, gym.spaces.Discrete(1), LSTM)
    batch = fake_sequences()
    opt = torch.optim.Adam(module.parameters(), 1e-2)
    for i in range(1200):
        if i % 25 == 0:
            target.load_state_dict(module.state_dict())
        loss, stats, td, valid = r2d2_loss(module, target, batch, 0.9, h_epsilon=h_epsilon)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        q = module.forward_sequences(batch["obs"], batch["state_in"])["q_values"][..., 0]
    if h_epsilon is not None:
        q = h_inverse(q, h_epsilon)
    torch.testing.assert_close(q[0, :3], torch.tensor([1 + 0.9 + 0.81, 1.9, 1.0]), atol=0.05, rtol=0)
    torch.testing.assert_close(q[-1, :5], torch.tensor([sum(0.9 ** i for i in range(n)) for n in (5, 4, 3, 2, 1)]),
                               atol=0.05, rtol=0)
    assert td.shape == valid.shape == (16, 5) and int(valid.sum()) == 8 * 3 + 8 * 5


def test_burn_in_starts_each_sequence_from_the_state_its_previous_chunk_leads_to():
    """The replay hands each sequence the chunk before it (while stored); the loss's TD errors are then those of
    both networks unrolled over the previous chunk and the sequence in one go, from the previous chunk's state."""
    torch.manual_seed(1)
    replay = SequenceReplay(ReplaySettings(capacity=25, seed=0), max_seq_len=5, burn_in=True)  # 5 slots
    first, second = chunk(5, 0.0, episode="a", state=0.3), chunk(4, 5.0, terminated=True, episode="a", index=1)
    lone = chunk(3, 50.0, episode="b", index=4, state=0.7)  # its chunk 3 was never stored
    replay.add([first, second, lone])
    batch = replay.sample(30)
    for i, slot in enumerate(batch["indices"]):
        if slot == 1:  # "a" chunk 1: burn-in over chunk 0
            assert batch["burn_lengths"][i] == 5 and np.all(batch["burn_state"][i] == 0.3)
            np.testing.assert_array_equal(batch["burn_obs"][i][:, 0], np.arange(5.0))
        else:  # nothing before it: its own state, no steps
            assert batch["burn_lengths"][i] == 0 and np.all(batch["burn_state"][i] == batch["state_in"][i])
    assert set(batch["indices"]) == {0, 1, 2}
    replay.add([chunk(2, 70.0, episode=f"c{k}") for k in range(3)])  # overwrites "a" chunk 0 (slot 0), then more
    assert replay.sample(30)["burn_lengths"].max() == 0  # "a" chunk 1 lost its previous chunk

    module, target = QModule(OBS, gym.spaces.Discrete(2), LSTM), QModule(OBS, gym.spaces.Discrete(2), LSTM)
    b = {k: torch.as_tensor(v) for k, v in batch.items()}
    b["actions"] = torch.randint(0, 2, b["actions"].shape)
    loss, stats, td, valid = r2d2_loss(module, target, b, 0.9, burn_in=True)
    assert td.shape == valid.shape == (6, 5) and (valid == b["mask"]).all()  # every real step is trained
    with torch.no_grad():
        def unrolled(net):  # [B, 6, 2] Q-values of the sequence after the previous chunk, in one unroll
            joined = torch.cat([b["burn_obs"], b["obs"]], 1)
            rows = [net.forward_sequences(joined[r:r + 1, 5 - int(b["burn_lengths"][r]):], b["burn_state"][r:r + 1])
                    ["q_values"][0, int(b["burn_lengths"][r]):] for r in range(6)]
            return torch.stack(rows)
        q, tq = unrolled(module), unrolled(target)
    returns, boot, disc, _ = sequence_n_step(b["rewards"], b["lengths"], b["terminated"], b["n_steps"], 0.9)
    rows = torch.arange(6)[:, None]
    best = q[rows, boot].argmax(-1)
    y = returns + disc * tq[rows, boot].gather(2, best[..., None]).squeeze(2)
    taken = q[:, :5].gather(2, b["actions"][..., None]).squeeze(2)
    torch.testing.assert_close(td[valid], (y - taken).abs()[valid], atol=1e-5, rtol=1e-5)


# --- config -------------------------------------------------------------------------------------------
def test_recurrent_dqn_settings_that_cannot_work_name_the_fix():
    base = DQNConfig().environment("CartPole-v1").rl_module(model_config={"use_lstm": True, "max_seq_len": 8}) \
        .env_runners(rollout_fragment_length=8)
    base.validate()
    with pytest.raises(ConfigError, match="rollout_fragment_length=4 with use_lstm=True cuts sequences of 4 steps"):
        base.copy().env_runners(rollout_fragment_length=4).validate()
    base.copy().training(burn_in=True).validate()
    with pytest.raises(ConfigError, match="burn_in must be True or False, got 8"):
        base.copy().training(burn_in=8).validate()
    with pytest.raises(ConfigError, match="burn_in=True is for recurrent modules"):
        DQNConfig().environment("CartPole-v1").training(burn_in=True).validate()
    base.copy().training(use_h_function=True).validate()
    with pytest.raises(ConfigError, match="use_h_function=True is for recurrent modules"):
        DQNConfig().environment("CartPole-v1").training(use_h_function=True).validate()
    with pytest.raises(ConfigError, match="h_function_epsilon must be a number > 0, got 0"):
        base.copy().training(use_h_function=True, h_function_epsilon=0).validate()
    with pytest.raises(ConfigError, match="num_atoms=51 with use_lstm=True"):
        base.copy().training(num_atoms=51).validate()
    with pytest.raises(ConfigError, match="remote=True with use_lstm=True: not built for sequence replay"):
        base.copy().training(replay_buffer_config={"remote": True}).env_runners(num_env_runners=1).validate()


# --- learning -----------------------------------------------------------------------------------------
R2D2_STATELESS = dict(n_step=1, target_network_update_freq=2500, train_batch_size_per_learner=128,
                      training_intensity=16, burn_in=True)


def _stateless_dqn(model_config: dict, seed: int, target: float, budget: int, settings: dict | None = None
                   ) -> tuple[float, int]:
    from tests.helpers import train_until

    algo = (DQNConfig().environment(StatelessCartPole)
            .env_runners(num_env_runners=0, num_envs_per_env_runner=8, rollout_fragment_length=20)
            .rl_module(model_config=model_config).training(**(settings or R2D2_STATELESS)).debugging(seed=seed)
            .build(logdir=None))
    try:
        best, result = train_until(algo, target, budget)
    finally:
        algo.stop()
    return best, result["num_env_steps_sampled_lifetime"]


@pytest.mark.learning
def test_r2d2_learns_stateless_cartpole():
    """With burn-in, seed 0 passed 75 by 45k env steps (94 there) and 100 at 67k; without, 75 took 78k. Seeds 1
    and 2: see the README's "Recurrent policies". DQN's MLP with the same settings peaked at 45 within 150k (the
    next test, in make test-seeds)."""
    best, steps = _stateless_dqn({"use_lstm": True, "lstm_cell_size": 64, "max_seq_len": 20, "fcnet_hiddens": [64],
                                  "fcnet_activation": "relu"}, 0, 75, 150_000)
    assert best >= 75, f"{best} after {steps} env steps"


@pytest.mark.learning
@pytest.mark.seeds
def test_dqn_with_an_mlp_does_not_learn_stateless_cartpole():
    settings = {**R2D2_STATELESS, "burn_in": False}
    best, steps = _stateless_dqn({"fcnet_hiddens": [64, 64], "fcnet_activation": "relu"}, 0, 75, 150_000, settings)
    assert best < 75, f"the MLP reached {best} without velocities ({steps} env steps): the task is not a memory test"


def test_r2d2_resumes_exactly_from_a_checkpoint_with_its_sequences():
    """k iterations, save (sequence replay included), restore, m more == k + m uninterrupted: weights, the
    replay's slots, links and counters, and the runners' recurrent states continue bit for bit."""
    from tests.helpers import straight_and_resumed
    from tests.test_offpolicy import assert_same_tree

    config = (DQNConfig().environment(StatelessCartPole)
              .env_runners(num_env_runners=0, num_envs_per_env_runner=2, rollout_fragment_length=5,
                           gym_env_vectorize_mode="sync")
              .rl_module(model_config=LSTM)
              .training(num_steps_sampled_before_learning_starts=40, train_batch_size_per_learner=10, training_intensity=4,
                        store_buffer_in_checkpoints=True, target_network_update_freq=50, burn_in=True)
              .reporting(min_sample_timesteps_per_iteration=0).debugging(seed=0))
    with straight_and_resumed(lambda: config.build(logdir=None), k=12, m=8, logdir=None) as (straight, restored):
        wa, wb = straight.get_weights(), restored.get_weights()
        for name in wa:
            np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
        assert straight.plan.replay.filled > 0 and straight.plan.replay.cols["prev"].max() >= 0  # linked chunks
        assert_same_tree(straight.plan.replay.get_state(), restored.plan.replay.get_state())
        assert straight.counters == restored.counters and straight.counters["num_env_steps_trained_lifetime"] > 0
