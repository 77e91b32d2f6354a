"""MultiLearner: one algorithm learner per module, trained from per-module chunk batches.

The fast tests train PPO learners on chunks a ``MultiAgentSampler`` cut from two-agent CartPole:
only trainable modules step, weights reach a runner's ``MultiRLModule``, state round trips (whole,
through ``torch.save``, and one module into another learner's module), modules come and go, and
every misuse names the module ids; two data-parallel ranks (spawned processes) agree on the
modules they step or both refuse. The learning test trains two policies, and one shared policy,
on two-agent CartPole in this process.
"""
from __future__ import annotations

import hashlib
import io
import multiprocessing
import socket
from typing import Any

import numpy as np
import pytest
import torch

from actors.env.actions import EnvActions
from actors.env.exploration import StochasticSampling
from actors.env.multi_agent_env import make_multi_agent
from actors.env.multi_agent_sampler import MultiAgentSampler
from actors.learner import ALL_MODULES, Learner, MultiLearner
from actors.modules.multi import MultiRLModule
from pipeline.algorithms.ppo.config import PPOConfig
from pipeline.algorithms.ppo.learner import PPOLearner
from protocols.codec import encode

CARTPOLES = make_multi_agent("CartPole-v1")
_ENV = CARTPOLES({"num_agents": 2})
OBS, ACT = _ENV.get_observation_space(0), _ENV.get_action_space(0)
own = lambda agent, episode: f"p{agent}"  # noqa: E731
shared = lambda agent, episode: "shared"  # noqa: E731


def ppo(seed: int = 0, rank: int = 0, world_size: int = 1, **training: Any) -> PPOLearner:
    settings = {"model_config": {"fcnet_hiddens": [16]}, "train_batch_size_per_learner": 64, "minibatch_size": 32,
                "num_epochs": 2} | training
    return PPOLearner(PPOConfig(seed=seed, **settings), OBS, ACT, rank=rank, world_size=world_size)


def two_policies(seed: int = 0, trainable: set[str] | None = None, **training: Any) -> MultiLearner:
    return MultiLearner({"p0": ppo(seed, **training), "p1": ppo(seed + 1, **training)}, trainable)


def runner_modules(learner: MultiLearner) -> MultiRLModule:
    """Inference-only copies of the learner's modules, built from the same spaces and model config,
    as an env runner holds them."""
    return MultiRLModule({mid: type(lrn.module)(lrn.observation_space, lrn.action_space,
                                                lrn.settings.model_config, inference_only=True)
                          for mid, lrn in learner.learners.items()})


def make_sampler(modules: MultiRLModule, mapping: Any, num_envs: int, seed: int) -> MultiAgentSampler:
    mods = {mid: modules[mid] for mid in modules}
    return MultiAgentSampler([CARTPOLES({"num_agents": 2}) for _ in range(num_envs)], mods,
                             {mid: StochasticSampling(m.dist_spec) for mid, m in mods.items()},
                             {mid: EnvActions(m.action_space) for mid, m in mods.items()}, mapping, seed=seed)


@pytest.fixture(scope="module")
def chunks() -> dict[str, list]:
    """Per-module chunks of two-agent CartPole: agent 0 -> "p0", agent 1 -> "p1"."""
    sample = make_sampler(runner_modules(two_policies()), own, num_envs=2, seed=0).run(num_env_steps=64)
    assert set(sample.chunks) == {"p0", "p1"}
    return sample.chunks


def weights(learner: Learner | MultiLearner) -> dict[str, np.ndarray]:
    return learner.get_weights()


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


# --- updates ------------------------------------------------------------------------------------
def test_update_steps_only_trainable_modules_and_counts_dropped_batches(chunks):
    ml = two_policies(trainable={"p0"})
    before = {mid: weights(ml.learner(mid)) for mid in ml.module_ids}
    stats = ml.update(chunks, timestep=64)
    assert set(stats) == {"p0", ALL_MODULES}
    assert stats["p0"]["num_module_steps_trained"] == sum(len(c) for c in chunks["p0"])
    assert stats[ALL_MODULES] == {"num_modules_trained": 1.0, "num_frozen_batches_dropped": 1.0}
    assert ml.num_frozen_batches_dropped == 1
    assert not same(weights(ml.learner("p0")), before["p0"])
    assert same(weights(ml.learner("p1")), before["p1"])
    assert ml.learner("p1").num_updates == 0 and ml.learner("p0").num_updates > 0
    assert ml.learner("p0").timestep == 64 and ml.learner("p1").timestep == 0


def test_every_trainable_module_learns_from_its_own_batch(chunks):
    together = two_policies()
    stats = together.update(chunks, timestep=0)
    assert set(stats) == {"p0", "p1", ALL_MODULES} and stats[ALL_MODULES]["num_modules_trained"] == 2
    # each module's update is exactly what its learner alone does with its own batch
    for mid in ("p0", "p1"):
        alone = ppo(seed=int(mid[1]))
        alone_stats = alone.update(chunks[mid], timestep=0)
        assert same(weights(alone), weights(together.learner(mid)))
        assert alone_stats == stats[mid]


def test_a_module_without_a_batch_or_with_an_empty_one_is_not_stepped(chunks):
    ml = two_policies()
    before = weights(ml.learner("p1"))
    stats = ml.update({"p0": chunks["p0"], "p1": []}, timestep=0)
    assert set(stats) == {"p0", ALL_MODULES}
    assert same(weights(ml.learner("p1")), before)
    assert set(ml.update({"p1": chunks["p1"]}, timestep=0)) == {"p1", ALL_MODULES}


def test_per_module_codec_frames_train_like_the_chunks(chunks):
    as_chunks, as_frames = two_policies(), two_policies()
    as_chunks.update(chunks, timestep=0)
    frame_stats = as_frames.update({mid: encode(cs, compress=False) for mid, cs in chunks.items()}, timestep=0)
    assert same(weights(as_chunks), weights(as_frames))
    assert set(frame_stats) == {"p0", "p1", ALL_MODULES}
    with pytest.raises(TypeError, match="each batch its own codec frame"):
        as_frames.update(encode(chunks["p0"]), timestep=0)


# --- weights --------------------------------------------------------------------------------------
def test_flat_weights_load_into_a_runners_multi_rl_module(chunks):
    ml = two_policies()
    ml.update(chunks, timestep=0)
    runner = runner_modules(ml)
    flat = ml.get_weights(inference_only=True)
    assert flat.keys() == runner.get_state().keys()  # the runner's format exactly, value head left out
    assert all(k.startswith(("p0/", "p1/")) for k in flat)
    assert len(ml.get_weights()) > len(flat)
    runner.set_state(flat)
    obs = torch.as_tensor(np.stack([c.obs[0] for c in chunks["p0"]]))
    for mid in ("p0", "p1"):
        acting = runner[mid].forward_inference(obs)["action_dist_inputs"]
        torch.testing.assert_close(acting, ml.module(mid).forward_inference(obs)["action_dist_inputs"])
    assert ml.get_weights(module_ids=["p1"]).keys() == {k for k in ml.get_weights() if k.startswith("p1/")}


def test_set_weights_sets_the_named_modules_only(chunks):
    trained, fresh = two_policies(), two_policies(seed=5)
    trained.update(chunks, timestep=0)
    p1_before = weights(fresh.learner("p1"))
    fresh.set_weights(trained.get_weights(module_ids=["p0"]))
    assert same(weights(fresh.learner("p0")), weights(trained.learner("p0")))
    assert same(weights(fresh.learner("p1")), p1_before)
    fresh.set_weights(trained.get_weights())
    assert same(weights(fresh), weights(trained))


# --- state ----------------------------------------------------------------------------------------
def checkpointed(state: dict) -> dict:
    """A state through ``torch.save`` and a ``weights_only`` load, as a checkpoint stores it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_round_trip_continues_identically(chunks):
    original = two_policies(use_kl_loss=True, trainable={"p0"})
    original.update(chunks, timestep=0)
    assert original.learner("p0").kl_coeff != 0.2  # PPO's own state has moved: it must travel too
    state = checkpointed(original.get_state())
    restored = two_policies(seed=7, use_kl_loss=True)
    restored.set_state(state)
    assert restored.trainable == {"p0"}
    assert restored.learner("p0").kl_coeff == original.learner("p0").kl_coeff
    assert restored.num_frozen_batches_dropped == original.num_frozen_batches_dropped == 1
    assert same(weights(restored), weights(original))
    # the next update (minibatch shuffling, Adam moments, KL coefficient) is the one the original makes
    second = two_policies(seed=11, use_kl_loss=True)
    second.set_state(state)
    stats_original = original.update(chunks, timestep=64)
    for copy in (restored, second):
        assert copy.update(chunks, timestep=64) == stats_original
        assert same(weights(copy), weights(original))
        assert copy.learner("p0").kl_coeff == original.learner("p0").kl_coeff


def test_one_modules_state_restores_into_another_learners_module(chunks):
    source = two_policies()
    source.update(chunks, timestep=0)
    target = MultiLearner({"main": ppo(seed=3), "opponent": ppo(seed=4)})
    opponent_before = weights(target.learner("opponent"))
    target.set_module_state("main", checkpointed(source.get_state())["modules"]["p1"])
    assert same(weights(target.learner("main")), weights(source.learner("p1")))
    assert same(weights(target.learner("opponent")), opponent_before)
    # optimizer and RNG state came along: it trains on from there as the source's module does
    source.update({"p1": chunks["p1"]}, timestep=64)
    target.update({"main": chunks["p1"]}, timestep=64)
    assert same(weights(target.learner("main")), weights(source.learner("p1")))
    wider = MultiLearner({"main": ppo(model_config={"fcnet_hiddens": [32]})})
    with pytest.raises(ValueError, match="(?s)module .main. .*same algorithm, spaces and model config"):
        wider.set_module_state("main", source.get_module_state("p0"))


def test_set_state_needs_the_same_modules():
    state = two_policies().get_state()
    with pytest.raises(ValueError, match=r"modules \['p0', 'p1'\].*\['main'\].*set_module_state"):
        MultiLearner({"main": ppo()}).set_state(state)


# --- adding and removing modules (self-play) -------------------------------------------------------
def test_add_a_frozen_copy_then_remove_it(chunks):
    ml = MultiLearner({"main": ppo()})
    ml.add_module("main_v1", ppo(seed=9), trainable=False)
    ml.set_weights({k.replace("main/", "main_v1/", 1): v for k, v in ml.get_weights(module_ids=["main"]).items()})
    snapshot = weights(ml.learner("main_v1"))
    assert same(snapshot, weights(ml.learner("main")))
    assert ml.module_ids == ["main", "main_v1"] and ml.trainable == {"main"}
    assert set(ml.modules) == {"main", "main_v1"} and ml.modules["main"] is ml.learner("main").module
    stats = ml.update({"main": chunks["p0"], "main_v1": chunks["p1"]}, timestep=0)
    assert set(stats) == {"main", ALL_MODULES} and stats[ALL_MODULES]["num_frozen_batches_dropped"] == 1
    assert same(weights(ml.learner("main_v1")), snapshot)
    assert not same(weights(ml.learner("main")), snapshot)
    removed = ml.remove_module("main_v1")
    assert isinstance(removed, PPOLearner) and ml.module_ids == ["main"] and ml.trainable == {"main"}
    assert all(k.startswith("main/") for k in ml.get_weights())
    with pytest.raises(KeyError, match=r"unknown module id\(s\) \['main_v1'\]; this MultiLearner holds \['main'\]"):
        ml.update({"main_v1": chunks["p1"]}, timestep=0)
    ml.trainable = set()
    assert set(ml.update({"main": chunks["p0"]}, timestep=0)) == {ALL_MODULES}


# --- errors ---------------------------------------------------------------------------------------
def test_errors_name_the_module_ids(chunks):
    ml = two_policies()
    with pytest.raises(KeyError, match=r"update\(\) batches: unknown module id\(s\) \['p2'\].*\['p0', 'p1'\]"):
        ml.update({"p0": chunks["p0"], "p2": chunks["p1"]}, timestep=0)
    with pytest.raises(TypeError, match=r"takes \{module_id: batch\} \(modules: \['p0', 'p1'\]\), got list"):
        ml.update(chunks["p0"], timestep=0)
    with pytest.raises(KeyError, match=r"learner\(\): unknown module id\(s\) \['nope'\]"):
        ml.module("nope")
    with pytest.raises(KeyError, match=r"remove_module\(\).*\['nope'\]"):
        ml.remove_module("nope")
    with pytest.raises(KeyError, match=r"trainable: unknown module id\(s\) \['p9'\]"):
        ml.trainable = {"p0", "p9"}
    with pytest.raises(TypeError, match=r"got the str 'p0'; write \{'p0'\}"):
        ml.trainable = "p0"
    with pytest.raises(KeyError, match=r"set_weights\(\): unknown module id\(s\) \['p7'\]"):
        ml.set_weights({"p7/pi.0.weight": np.zeros(3)})
    with pytest.raises(ValueError, match=r"weight 'pi.0.weight' has no module id"):
        ml.set_weights({"pi.0.weight": np.zeros(3)})
    with pytest.raises(ValueError, match=r"module 'p0' exists already.*remove_module\('p0'\)"):
        ml.add_module("p0", ppo())
    for bad in ("", "a/b", "a.b", ALL_MODULES, 3):
        with pytest.raises(ValueError, match="module id .*non-empty str"):
            ml.add_module(bad, ppo())
    with pytest.raises(TypeError, match=r"module 'p2': expected a Learner.*got dict"):
        ml.add_module("p2", {})
    with pytest.raises(ValueError, match="needs at least one"):
        MultiLearner({})
    with pytest.raises(ValueError, match="cannot remove 'main', the only module"):
        MultiLearner({"main": ppo()}).remove_module("main")
    with pytest.raises(ValueError, match="module 'p1': its learner is rank 1 of 2"):
        MultiLearner({"p0": ppo(), "p1": PPOLearner(PPOConfig(seed=0), OBS, ACT, rank=1, world_size=2)})
    assert ml.module_ids == ["p0", "p1"] and ml.trainable == {"p0", "p1"}  # nothing changed by the failures


# --- data-parallel ranks --------------------------------------------------------------------------
def _rank(rank: int, port: int, results: Any) -> None:
    """One of two data-parallel ranks (a spawned process): an update with both modules' shards on both
    ranks, then one where rank 1 has no batch for "p1". Reports a digest of its weights, then the error."""
    ml = MultiLearner({mid: ppo(seed=i, rank=rank, world_size=2) for i, mid in enumerate(("p0", "p1"))})
    ml.setup_distributed("127.0.0.1", port)
    try:
        shard = make_sampler(runner_modules(ml), own, num_envs=2, seed=rank).run(num_env_steps=32).chunks
        ml.update(shard, timestep=64)
        results.put((rank, "weights", hashlib.sha256(b"".join(
            np.ascontiguousarray(v).tobytes() for _, v in sorted(ml.get_weights().items()))).hexdigest()))
        try:
            ml.update(shard if rank == 0 else {"p0": shard["p0"]}, timestep=128)
            results.put((rank, "error", "none"))
        except RuntimeError as err:
            results.put((rank, "error", str(err)))
    finally:
        ml.stop()


@pytest.mark.slow
def test_data_parallel_ranks_step_the_same_modules_or_all_refuse():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(rank, port, results), daemon=True) for rank in (0, 1)]
    for p in ranks:
        p.start()
    try:
        got = {(rank, kind): value for rank, kind, value in (results.get(timeout=120) for _ in range(4))}
    finally:
        for p in ranks:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got[0, "weights"] == got[1, "weights"]  # gradients averaged: the same weights on both ranks
    for rank, trains in ((0, "['p0', 'p1']"), (1, "['p0']")):
        assert got[rank, "error"].startswith(f"learner rank {rank}: the data-parallel learners got batches for "
                                             f"different modules (['p1'] on some ranks only; this rank trains {trains})")


# --- learning -------------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    """Small networks: torch's threads only contend on a shared machine; the count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.learning
@pytest.mark.parametrize("mapping", ["two policies", "shared policy"])
def test_ppo_learns_two_agent_cartpole(mapping, one_thread):
    """Two-agent CartPole, 8 envs sampled in this process; a summed return of 600 (of 1000) within
    300k env steps. Each update takes 2000 env steps: a module's batch is its agents' steps in them
    (~2000 per policy, ~4000 for the shared one)."""
    seed, steps_per_update = 0, 2000
    ids, mapping_fn = (["p0", "p1"], own) if mapping == "two policies" else (["shared"], shared)
    batch = steps_per_update * 2 // len(ids)
    ml = MultiLearner({mid: PPOLearner(PPOConfig(seed=seed + i, train_batch_size_per_learner=batch), OBS, ACT)
                       for i, mid in enumerate(ids)})
    runner = runner_modules(ml)
    runner.set_state(ml.get_weights(inference_only=True))
    sampler = make_sampler(runner, mapping_fn, num_envs=8, seed=seed)
    env_steps, returns, mean = 0, [], 0.0
    while env_steps < 300_000 and mean < 600:
        sample = sampler.run(num_env_steps=steps_per_update)
        env_steps += sample.env_steps
        returns.extend(sample.episode_returns)
        stats = ml.update(sample.chunks, timestep=env_steps)
        assert stats[ALL_MODULES]["num_modules_trained"] == len(ids)
        runner.set_state(ml.get_weights(inference_only=True))
        mean = float(np.mean(returns[-20:])) if len(returns) >= 20 else 0.0
    print(f"{mapping}: summed return {mean:.0f} after {env_steps} env steps")
    assert mean >= 600
