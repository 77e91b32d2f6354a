"""Several replayed batches in one learner call: the replay draws them together, the learner makes
one update per batch, and the result is that of the same updates made one call at a time."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.learner import batch_slices, combined_stats
from actors.replay import ReplayBuffer, ReplaySettings
from pipeline import CQLConfig, DQNConfig, SACConfig
from pipeline.algorithms.cql.learner import CQLLearner
from pipeline.algorithms.dqn.learner import DQNLearner
from pipeline.algorithms.sac.learner import SACLearner
from pipeline.groups.learner_group import shard_rows
from protocols import EpisodeChunk

OBS = gym.spaces.Box(-1, 1, (3,), np.float32)


def replayed(n, act_space, seed=0):
    """A replayed batch of ``n`` rows, as the replay hands it over (numpy)."""
    g = np.random.default_rng(seed)
    actions = g.integers(act_space.n, size=n) if isinstance(act_space, gym.spaces.Discrete) \
        else g.uniform(-1, 1, size=(n, 1)).astype(np.float32)
    return {"obs": g.uniform(-1, 1, (n, 3)).astype(np.float32), "actions": actions,
            "rewards": g.normal(size=n).astype(np.float32),
            "next_obs": g.uniform(-1, 1, (n, 3)).astype(np.float32),
            "discounts": np.where(np.arange(n) % 5 == 0, 0.0, 0.97).astype(np.float32),
            "weights": g.uniform(0.2, 1.0, n).astype(np.float32), "indices": np.arange(n)}


LEARNERS = {
    "DQN": (DQNLearner, lambda: DQNConfig(model_config={"fcnet_hiddens": [16]}, target_network_update_freq=1),
            gym.spaces.Discrete(2)),
    "SAC": (SACLearner, lambda: SACConfig(model_config={"fcnet_hiddens": [16]}), gym.spaces.Box(-1, 1, (1,))),
    "CQL": (CQLLearner, lambda: CQLConfig(model_config={"fcnet_hiddens": [16]}, bc_iters=2),
            gym.spaces.Box(-1, 1, (1,))),
}


@pytest.mark.parametrize("algo", sorted(LEARNERS))
def test_k_updates_in_one_call_equal_k_calls(algo):
    cls, make_config, act_space = LEARNERS[algo]
    config = make_config()
    config.seed = 5
    together, apart = (cls(config, OBS, act_space) for _ in range(2))
    batch = replayed(4 * 24, act_space)
    torch.manual_seed(0)  # SAC and CQL sample actions: both runs draw the same
    stats = together.update(batch, timestep=1000, num_batches=4)
    td_together = together.last_outputs["td_error"]
    step_stats, td_apart = [], []
    torch.manual_seed(0)
    for part in batch_slices(batch, 4):
        step_stats.append(apart.update(part, timestep=1000))
        td_apart.append(apart.last_outputs["td_error"])
    for (name, a), b in zip(together.module.state_dict().items(), apart.module.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    assert np.allclose(td_together, np.concatenate(td_apart), atol=1e-5)
    assert together.num_updates == apart.num_updates
    assert stats["num_module_steps_trained"] == 24  # per update, as k calls report it
    loss_key = "qf_loss"
    assert stats[loss_key] == pytest.approx(np.mean([s[loss_key] for s in step_stats]), rel=1e-5)


def test_a_batch_that_does_not_split_evenly_is_refused_naming_the_fix():
    cls, make_config, act_space = LEARNERS["DQN"]
    learner = cls(make_config(), OBS, act_space)
    with pytest.raises(ValueError, match="does not split into num_batches=4"):
        learner.update(replayed(30, act_space), timestep=0, num_batches=4)
    with pytest.raises(ValueError, match="num_batches must be an int >= 1"):
        learner.update(replayed(32, act_space), timestep=0, num_batches=0)


def test_combined_stats_keep_the_last_counter_and_average_the_rest_over_the_updates_reporting_it():
    steps = [{"loss": torch.tensor(1.0), "norm": 2.0, "bc_logp": torch.tensor(-1.0), "num_target_updates": 3.0},
             {"loss": torch.tensor(3.0), "norm": 4.0, "num_target_updates": 4.0}]
    assert combined_stats(steps) == {"loss": 2.0, "norm": 3.0, "bc_logp": -1.0, "num_target_updates": 4.0}


def test_several_batches_drawn_at_once_are_normalised_per_batch_and_counted_by_the_limiter():
    buf = ReplayBuffer(ReplaySettings(capacity=256, prioritized=True, alpha=0.7, beta=0.5, seed=1,
                                      samples_per_insert=4.0, min_size_to_sample=8))
    t = np.arange(65)
    buf.add([EpisodeChunk("a", 0, obs=np.stack([t, t], 1).astype(np.float32), actions=np.zeros(64, np.int64),
                          rewards=np.ones(64, np.float32), terminated=True)])
    buf.update_priorities(np.arange(64), np.linspace(0.1, 10, 64))
    before = buf.num_samples
    batch = buf.sample(16, num_batches=3)
    assert len(batch["indices"]) == 48 and buf.num_samples - before == 48
    for part in batch_slices(batch, 3):
        assert part["weights"].max() == pytest.approx(1.0)  # each batch's largest weight is 1, as if drawn alone
    with pytest.raises(ValueError, match="num_batches must be an int >= 1"):
        buf.sample(16, num_batches=0)


@pytest.mark.parametrize("num_rows,learners,num_batches", [(96, 2, 4), (64, 3, 2), (10, 3, 1)])
def test_shards_of_several_batches_are_each_learners_share_of_every_batch(num_rows, learners, num_batches):
    rows = shard_rows(num_rows, learners, num_batches)
    assert sorted(np.concatenate(rows).tolist()) == list(range(num_rows))  # every row once
    size = num_rows // num_batches
    for shard in rows:
        parts = shard.reshape(num_batches, -1)  # the learner's slices: one per batch, equal sizes
        assert all((part // size == i).all() for i, part in enumerate(parts))
