"""Fault injection on the synchronous (PPO) path: killed, crashing and hanging env runners.

Replacements start without holding training up (``actors.replacements``): a test trains on with the
healthy rest, then waits for the group to be whole again (``wait_until_whole``) before it checks."""
import numpy as np
import pytest
import ray

from actors.manager import ActorGroupError
from pipeline import PPOConfig
from tests.envs import FlakyEnv
from tests.pieces import RECREATED, RecordRecreation

# every test here kills or hangs Ray actors and waits for their recovery: a few seconds each
pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.slow]

def config(env_config=None, **fault_tolerance):
    ft = {"delay_between_env_runner_restarts_s": 0.0, "env_runner_health_probe_timeout_s": 20.0} | fault_tolerance
    return (PPOConfig().environment(FlakyEnv, env_config=env_config or {})
            .env_runners(num_env_runners=2, num_envs_per_env_runner=2)
            .training(train_batch_size_per_learner=400, minibatch_size=200, num_epochs=1)
            .fault_tolerance(**ft).callbacks(RecordRecreation).debugging(seed=0))


def kill_runner(algo, index):
    ray.kill(algo.env_runner_group.manager.handle(index), no_restart=True)


def test_killed_runner_is_recreated_with_current_weights_and_counted():
    RECREATED.clear()
    algo = config().build()
    try:
        algo.train()
        kill_runner(algo, 1)
        results = [algo.train() for _ in range(3)]
        assert algo.env_runner_group.wait_until_whole(120)
        results.append(algo.train())
        ft = results[-1]["fault_tolerance"]
        assert ft["num_remote_worker_restarts"] == 1
        assert ft["num_remote_worker_failures"] == 1
        assert ft["num_healthy_workers"] == 2
        assert RECREATED == [([1], False)]
        # nothing lost: every iteration still trained on a full batch
        assert all(r["learners"]["__all_modules__"]["num_env_steps_trained"] >= 400 for r in results)
        # the new runner acts with the learner's current weights
        learner_w = algo.get_weights()["pi_head.weight"]
        for w in algo.foreach_env_runner(lambda r: r.get_weights()["pi_head.weight"]):
            np.testing.assert_array_equal(w, learner_w)
    finally:
        algo.stop()


def test_env_raising_in_one_runner_recreates_that_runner():
    algo = config({"fail_on_runners": [2], "fail_at_steps": [30]}).build()
    try:
        results = [algo.train() for _ in range(4)]
        assert algo.env_runner_group.wait_until_whole(120)
        results.append(algo.train())
        ft = results[-1]["fault_tolerance"]
        assert ft["num_remote_worker_failures"] == 1 and ft["num_remote_worker_restarts"] == 1
        assert ft["num_healthy_workers"] == 2
        assert results[-1]["num_env_steps_trained_lifetime"] >= 4 * 400
    finally:
        algo.stop()


def test_a_runner_failing_the_same_way_after_every_restart_ends_the_run_with_its_error():
    # the env raises at its step 30 in every incarnation of runner 2: restarting it up to
    # max_num_env_runner_restarts (1000) times would only repeat the error
    algo = config({"fail_on_runners": [2], "fail_at_steps": [30], "fail_when_recreated": True}).build()
    try:
        with pytest.raises(ActorGroupError) as err:
            for _ in range(6):
                algo.train()
                assert algo.env_runner_group.wait_until_whole(120)
        message = str(err.value)
        assert "env runner 2 failed 3 times in a row with the same error" in message
        assert "injected env failure at step 30" in message
        assert 'raise RuntimeError(f"injected env failure' in message  # the runner's stack trace
        assert algo.env_runner_group.manager.num_restarts == 2
    finally:
        algo.stop()


def test_sub_env_restart_keeps_the_runner_alive():
    algo = config({"fail_on_runners": [1, 2], "fail_at_steps": [30]}, restart_failed_sub_environments=True).build()
    try:
        results = [algo.train() for _ in range(3)]
        ft = results[-1]["fault_tolerance"]
        assert ft["num_remote_worker_failures"] == 0
        assert ft["num_sub_env_restarts"] == 4  # 2 runners x 2 sub-envs, each failing once at its step 30
    finally:
        algo.stop()


def test_hanging_runner_is_detected_by_the_probe_timeout_and_replaced():
    algo = config({"fail_on_runners": [1], "fail_at_steps": [30], "hang": True},
                  env_runner_health_probe_timeout_s=3.0).build()
    try:
        results = [algo.train() for _ in range(3)]
        assert algo.env_runner_group.wait_until_whole(120)
        results.append(algo.train())
        ft = results[-1]["fault_tolerance"]
        assert ft["num_remote_worker_failures"] == 1 and ft["num_remote_worker_restarts"] == 1
        assert ft["num_healthy_workers"] == 2
    finally:
        algo.stop()


def test_ignore_failures_goes_on_with_the_healthy_rest():
    algo = config(restart_failed_env_runners=False, ignore_env_runner_failures=True).build()
    try:
        algo.train()
        kill_runner(algo, 2)
        result = algo.train()
        result = algo.train()
        assert result["fault_tolerance"]["num_healthy_workers"] == 1
        assert result["fault_tolerance"]["num_remote_worker_restarts"] == 0
        assert result["learners"]["__all_modules__"]["num_env_steps_trained"] >= 400
    finally:
        algo.stop()


def test_fatal_mode_raises_naming_the_runner_and_cause():
    algo = config({"fail_on_runners": [2], "fail_at_steps": [30]}, restart_failed_env_runners=False,
                  ignore_env_runner_failures=False).build()
    try:
        with pytest.raises(ActorGroupError) as err:
            for _ in range(3):
                algo.train()
        assert "env runner 2" in str(err.value) and "injected env failure" in str(err.value)
        assert "restart_failed_env_runners=True" in str(err.value)
        assert 'raise RuntimeError(f"injected env failure' in str(err.value)  # the runner's stack trace
    finally:
        algo.stop()


def test_runner_that_cannot_start_fails_the_build_clearly():
    with pytest.raises(RuntimeError, match="env runner .* failed to start"):
        (PPOConfig().environment("tests.envs:BrokenEnv").env_runners(num_env_runners=1)
         .debugging(seed=0).build())


def test_stop_returns_once_its_killed_actors_are_dead():
    """``ray.kill`` only asks; ``stop()`` waits until Ray reports each killed actor dead, so the CPUs they held are
    free for whatever the caller builds next in the same Ray (a loaded machine once kept a runner of the next
    build waiting past its start timeout)."""
    from ray.exceptions import ActorDiedError

    from actors.replacements import kill_and_wait

    algo = config().build(logdir=None)
    handles = [algo.env_runner_group.manager.handle(i) for i in (1, 2)]
    ray.get([h.ping.remote() for h in handles])
    algo.stop()
    for handle in handles:  # a call made now fails at once: the actor is known dead
        with pytest.raises(ActorDiedError):
            ray.get(handle.ping.remote())
    assert kill_and_wait([], 1.0) == []
    assert kill_and_wait(handles, 5.0) == []  # already dead: nothing to wait for


def test_an_actor_that_cannot_be_placed_fails_the_start_check_naming_rays_live_actors():
    """An actor Ray cannot place (it asks for a resource no node has) is reported at the start check with what
    Ray's live actors are, so a reader can tell an actor slow to come up from resources others hold."""
    from actors.manager import ActorManager, FaultToleranceSettings

    @ray.remote(num_cpus=0, resources={"a_resource_no_node_has": 1})
    class Unplaceable:
        def ping(self):
            return "ok"

    group = ActorManager(lambda i, recreated: Unplaceable.remote(), [1], FaultToleranceSettings(), name="stage")
    with pytest.raises(RuntimeError, match=r"stage\(s\) \[1\] did not start within 1 s; .*live actors: .*"
                                           r"PENDING_CREATION: Unplaceable x1"):
        group.check_started(1.0, "one a_resource_no_node_has")
