"""Nodes that come and go, on a simulated cluster: several Ray nodes on this one machine
(``ray.cluster_utils.Cluster``), RLlib's ``test_node_failures.py`` bar.

* PPO with 6 env runners on 3 nodes of 2 CPUs, a worker node removed every 5 iterations and added back
  the next: the iteration after a removal returns with the 2 lost runners' replacements still starting
  (they cannot even be placed until the node is back: a restart that held training up would never
  return), the group grows back to 6 when the node returns, and PPO reaches 450 within 30 iterations.
* APPO streaming from 6 runners, a node removed and added back: the loader receives no chunk twice, the
  lost runners' unfinished episodes and fragments are counted, every step received is batched once or
  pending, and APPO reaches 450 within its step budget.
* DQN with its replay stage and evaluators as actors on the node that is removed: they are recreated on
  the node that remains, evaluation and training go on.

All three are marked ``long`` (5 to 13 minutes together on 2 cores, by the machine's load): ``make
test-long`` runs them, the suite (``make test``) leaves them out.

Hygiene: the cluster lives in a temporary directory of its own (``RAY_TMPDIR``: other Ray users of the
machine never see it) and is shut down at the module's end; the environment is restored, and no process
this module started is left.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline import APPOConfig, DQNConfig, PPOConfig
from tests.procs import command, with_environment

pytestmark = pytest.mark.long

NODE_CPUS = 2
ENV_KEYS = ("RAY_ADDRESS", "RAY_TMPDIR")


class SimCluster:
    """A head node (the driver's) and worker nodes that a test removes and adds back."""

    def __init__(self, num_workers: int) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": NODE_CPUS, "include_dashboard": False})
        self.workers = [self.cluster.add_node(num_cpus=NODE_CPUS) for _ in range(num_workers)]
        self.cluster.wait_for_nodes()

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def remove(self, node: Any) -> None:
        self.workers.remove(node)
        self.cluster.remove_node(node)

    def add(self) -> Any:
        node = self.cluster.add_node(num_cpus=NODE_CPUS)
        self.cluster.wait_for_nodes()
        self.workers.append(node)
        return node

    def shutdown(self) -> None:
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def sim():
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    tmp = tempfile.mkdtemp(prefix="rn", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    os.environ["RAY_TMPDIR"] = tmp
    os.environ.pop("RAY_ADDRESS", None)
    cluster = SimCluster(num_workers=2)
    try:
        ray.init(address=cluster.cluster.address, logging_level="ERROR", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)
    # every process of the cluster had RAY_TMPDIR=tmp (orphaned workers too); they end soon after their raylet
    deadline = time.monotonic() + 60
    while with_environment("RAY_TMPDIR", tmp) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = with_environment("RAY_TMPDIR", tmp)
    for pid in left:  # ours, by pid: end them before failing, so that the machine is left clean
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left by the simulated cluster: {[(pid, command(pid)[:1]) for pid in left]}"


def node_of(_runner: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def runner_nodes(group: Any) -> dict[int, str]:
    """Runner index -> the node it runs on, for the healthy runners of ``group``."""
    return {r.actor_id: r.value for r in group.manager.foreach_actor("apply", node_of) if r.ok}


def ft(result: dict) -> dict:
    return result["fault_tolerance"]


# --- PPO: a node removed every 5 iterations, added back the next ----------------------------------------
@pytest.mark.learning
def test_ppo_reaches_450_while_a_node_is_removed_and_added_back(sim):
    algo = (PPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=6, num_cpus_per_env_runner=1)
            .training(train_batch_size_per_learner=6000, minibatch_size=500)
            .fault_tolerance(delay_between_env_runner_restarts_s=0.0)
            .debugging(seed=0).build(logdir=None))
    results, removed_at, best = [], [], -np.inf
    try:
        assert sorted(runner_nodes(algo.env_runner_group).values()).count(sim.head_id) == NODE_CPUS
        for it in range(1, 31):
            results.append(algo.train())
            best = max(best, results[-1]["env_runners"]["episode_return_mean"])
            if it % 5 == 0:
                sim.remove(sim.workers[0])
                removed_at.append(it)
            elif removed_at and removed_at[-1] == it - 1:
                sim.add()
            if best >= 450 and len(sim.workers) == 2:
                break
        if len(sim.workers) < 2:
            sim.add()
        assert algo.env_runner_group.wait_until_whole(300)
        last = algo.train()
    finally:
        algo.stop()
    assert best >= 450, f"best mean return {best:.1f} in {len(results)} iterations"
    assert removed_at, "no node was removed before PPO reached 450: the run proves nothing about node loss"
    for at in [a for a in removed_at if a < len(results)]:
        after = results[at]  # the iteration that ran with the node gone
        # train() returned while the lost runners' replacements could not even be placed
        assert ft(after)["num_healthy_workers"] == 4 and ft(after)["num_workers_starting"] == 2, ft(after)
        assert after["learners"]["__all_modules__"]["num_env_steps_trained"] >= 6000  # the rest took their share
    assert ft(last)["num_healthy_workers"] == 6 and ft(last)["num_workers_starting"] == 0
    assert ft(last)["num_remote_worker_restarts"] == 2 * len(removed_at)
    assert ft(last)["num_remote_worker_failures"] == 2 * len(removed_at)
    print(f"PPO: {len(results)} iterations, best return {best:.1f}, nodes removed after iterations {removed_at}; "
          f"restart_wait_s per iteration: {[round(ft(r)['restart_wait_s'], 3) for r in results]}")


# --- APPO: streaming runners through a node loss ----------------------------------------------------------
@pytest.mark.learning
def test_appo_streams_through_a_node_loss_with_no_chunk_trained_twice(sim):
    algo = (APPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=6, num_cpus_per_env_runner=1, num_envs_per_env_runner=8)
            .fault_tolerance(delay_between_env_runner_restarts_s=0.0)
            .debugging(seed=0).build(logdir=None))
    results, removed_at = [], None
    try:
        while True:
            results.append(algo.train())
            it = len(results)
            if it == 5:
                sim.remove(sim.workers[0])
                removed_at = it
            elif it == 6:
                sim.add()
            if it > 6 and (results[-1]["env_runners"]["episode_return_mean"] >= 450
                           or results[-1]["num_env_steps_sampled_lifetime"] >= 1_500_000):
                break
        assert algo.env_runner_group.wait_until_whole(300)
        last = algo.train()
    finally:
        algo.stop()
    stream = algo.plan.receiver.stats()  # the loader has stopped: these counts are final
    assert results[-1]["env_runners"]["episode_return_mean"] >= 450, \
        f"mean return {results[-1]['env_runners']['episode_return_mean']} after {len(results)} iterations"
    assert stream["num_chunks_dropped_duplicate"] == 0 and stream["num_chunks_missing"] == 0
    assert stream["num_env_steps_received"] == (stream["num_env_steps_batched"] + stream["num_env_steps_pending"]
                                                + stream["num_env_steps_dropped_stale"])
    # every runner lost while streaming is reported once, with the episodes it left unfinished
    assert stream["num_fragments_lost"] == ft(last)["num_remote_worker_failures"] >= 2
    assert stream["num_episodes_cut"] > 0
    assert last["stream"]["num_episodes_cut"] == stream["num_episodes_cut"]
    after = results[removed_at]  # the iteration that ran with the node gone
    assert ft(after)["num_workers_starting"] >= 1 and ft(after)["num_healthy_workers"] <= 5
    assert after["env_runners"]["num_env_steps_sampled"] > 0  # the other runners streamed on
    assert ft(last)["num_healthy_workers"] == 6 and ft(last)["num_workers_starting"] == 0
    print(f"APPO: {len(results)} iterations, {results[-1]['num_env_steps_sampled_lifetime']} env steps; loader: "
          + ", ".join(f"{k}={stream[k]}" for k in ("num_chunks_received", "num_chunks_dropped_duplicate",
                                                   "num_episodes_cut", "num_fragments_lost", "num_env_steps_received",
                                                   "num_env_steps_batched", "num_env_steps_pending",
                                                   "num_env_steps_dropped_stale")))


# --- DQN: its replay stage and evaluators on the node that goes ---------------------------------------------
class Holder:
    """Takes a node's CPUs, so that the algorithm's actors land where the test wants them."""

    def ping(self) -> bool:
        return True


@pytest.mark.slow
def test_replay_and_evaluators_of_a_removed_node_are_recreated_on_the_remaining_one(sim):
    doomed, remaining = sim.workers[0], sim.workers[1]
    pinned = [ray.remote(num_cpus=NODE_CPUS)(Holder).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        for node in (sim.head_id, remaining.node_id)]
    ray.get([h.ping.remote() for h in pinned], timeout=120)
    algo = (DQNConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5, num_envs_per_env_runner=2)
            .training(replay_buffer_config={"type": "EpisodeReplayBuffer", "capacity": 20_000, "remote": True,
                                            "num_cpus": 0.5}, num_steps_sampled_before_learning_starts=200)
            .evaluation(evaluation_interval=1, evaluation_num_env_runners=2, evaluation_duration=2,
                        evaluation_duration_unit="episodes")
            .fault_tolerance(delay_between_env_runner_restarts_s=0.0)
            .debugging(seed=0).build(logdir=None))
    try:
        result = algo.train()
        # everything is on the node about to go: the runner, both evaluators and (the only room left) the replay
        assert set(runner_nodes(algo.env_runner_group).values()) == {doomed.node_id}
        assert set(runner_nodes(algo.eval_env_runner_group).values()) == {doomed.node_id}
        ray.kill(pinned.pop())  # room on the remaining node
        sim.remove(doomed)
        trained_before = result["num_env_steps_trained_lifetime"]
        deadline = time.monotonic() + 300
        while True:
            result = algo.train()
            whole = (ft(result).get("num_replay_restarts") == 1 and ft(result)["num_healthy_workers"] == 1
                     and result["evaluation"]["num_healthy_env_runners"] == 2
                     and result["num_env_steps_trained_lifetime"] > trained_before)
            if whole or time.monotonic() > deadline:
                break
        assert ft(result).get("num_replay_restarts") == 1, ft(result)
        assert ft(result)["num_healthy_workers"] == 1 and result["evaluation"]["num_healthy_env_runners"] == 2
        assert result["num_env_steps_trained_lifetime"] > trained_before  # the new replay stage fills, training goes on
        assert result["evaluation"]["env_runners"]["num_episodes"] >= 2
        assert set(runner_nodes(algo.env_runner_group).values()) == {remaining.node_id}
        assert set(runner_nodes(algo.eval_env_runner_group).values()) == {remaining.node_id}
    finally:
        algo.stop()
        for h in pinned:
            ray.kill(h)
        sim.add()

