"""IMPALA and APPO: updates, the circular buffer, configs, and (with Ray)
CartPole to 450 over streaming runners, weights lag, fault tolerance, checkpoints and clean stops.

Training is seeded but asynchronous, so runs are not bit-identical; step budgets are generous and
the tests assert returns and counters, never wall-clock time. Their losses on fake batches:
``test_impala_appo_losses.py``.
"""
import math
import threading
import time

import gymnasium as gym
import numpy as np
import pytest
import ray
import torch

from actors.env import EnvRunner, EnvRunnerSettings
from actors.learner import ChunkBatch
from pipeline import APPO, APPOConfig, IMPALA, IMPALAConfig, Algorithm, ConfigError, get_algorithm
from pipeline.plans.asynchronous import max_weights_lag
from pipeline.algorithms.appo.learner import APPOLearner, CircularBuffer
from pipeline.algorithms.impala.learner import IMPALALearner
from tests.envs import FlakyEnv, GILHangEnv
from tests.helpers import train_until_seen

# --- updates on sampled chunks -------------------------------------------------------------------
def sampled_chunks(steps=1000):
    settings = EnvRunnerSettings(env_creator=lambda ctx: gym.make("CartPole-v1"), num_envs=4,
                                 rollout_fragment_length=25, seed=0)
    r = EnvRunner(settings, worker_index=1)
    out = []
    while sum(len(c) for c in out) < steps:
        out += r.sample()
    return r, out


def make_learner(cfg, learner_cls, runner):
    cfg = cfg.environment("CartPole-v1").debugging(seed=0)
    learner = learner_cls(cfg, runner.observation_space, runner.action_space)
    runner.set_weights(learner.get_weights(inference_only=True))  # the chunks' behaviour policy = the learner's
    return learner


def test_impala_update_on_policy_chunks():
    torch.manual_seed(0)
    r, _ = sampled_chunks(0)
    learner = make_learner(IMPALAConfig().training(train_batch_size_per_learner=200, minibatch_size=100), IMPALALearner, r)
    chunks = r.sample()
    before = {k: v.copy() for k, v in learner.get_weights().items()}  # get_weights aliases the live tensors
    stats = learner.update(ChunkBatch(chunks), timestep=0)
    assert stats["mean_rho"] == pytest.approx(1.0, abs=1e-4)  # same policy sampled and learns
    assert stats["rho_clipped_fraction"] < 0.5
    for key in ("policy_loss", "vf_loss", "entropy", "total_loss", "gradients_global_norm", "curr_lr"):
        assert np.isfinite(stats[key]), key
    assert learner.num_updates == learner.config.num_epochs  # 100 steps, minibatch 100: one SGD step per epoch
    after = learner.get_weights()
    assert any(not np.array_equal(before[k], after[k]) for k in before)


def test_appo_target_network_follows_every_freq_updates_and_tunes_kl():
    r, chunks = sampled_chunks(600)
    cfg = APPOConfig().training(target_network_update_freq=2, use_kl_loss=True, kl_target=1e-9, kl_coeff=1.0,
                                train_batch_size_per_learner=100, minibatch_size=100)
    learner = make_learner(cfg, APPOLearner, r)
    batches = [ChunkBatch(chunks[i : i + 4]) for i in range(0, 12, 4)]
    initial = {k: v.clone() for k, v in learner.module.state_dict().items()}
    learner.update(batches[0], 0)
    target = learner.target
    # one update: the target is still the initial policy
    torch.testing.assert_close(target.pi_head.weight, initial["pi_head.weight"])
    assert not torch.equal(learner.module.pi_head.weight, initial["pi_head.weight"])
    stats = learner.update(batches[1], 0)
    target = learner.target
    torch.testing.assert_close(target.pi_head.weight, learner.module.pi_head.weight)
    assert stats["num_target_updates"] == 1
    assert stats["curr_kl_coeff"] == pytest.approx(1.5)  # the KL exceeded 2 x (a tiny) target
    # the target travels in the learner state and survives torch.save/torch.load(weights_only=True)
    import io

    buf = io.BytesIO()
    torch.save(learner.get_state(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    learner2 = make_learner(cfg, APPOLearner, r)
    learner2.set_state(state)
    torch.testing.assert_close(learner2.target.pi_head.weight, learner.module.pi_head.weight)


def test_circular_buffer_serves_each_batch_at_most_k_times_and_evicts_the_oldest():
    buf = CircularBuffer(num_batches=2, iterations_per_batch=3, seed=0)
    a, b, c = ChunkBatch([]), ChunkBatch([]), ChunkBatch([])
    buf.add(a)
    buf.add(b)
    served = [buf.sample() for _ in range(6)]
    assert len(buf) == 0
    assert sum(x is a for x in served) == 3 and sum(x is b for x in served) == 3
    assert buf.stats()["num_batches_reused"] == 4  # each batch's second and third draw
    buf.add(a)
    buf.add(b)
    buf.add(c)  # evicts a, never trained on
    assert len(buf) == 2 and buf.stats()["num_batches_evicted_unused"] == 1
    assert all(buf.sample() is not a for _ in range(6))
    with pytest.raises(IndexError):
        buf.sample()


# --- configs ----------------------------------------------------------------------------------
def test_configs_validate_and_register():
    assert get_algorithm("impala") == (IMPALAConfig, IMPALA) and get_algorithm("APPO") == (APPOConfig, APPO)
    cfg = (APPOConfig().environment("CartPole-v1").training(vtrace_clip_rho_threshold=2.0, broadcast_interval=2,
                                                             circular_buffer_num_batches=8, learner_queue_size=2)
           .env_runners(num_envs_per_env_runner=4))
    cfg.validate()
    assert cfg.broadcast_interval == 2 and cfg.circular_buffer_num_batches == 8
    with pytest.raises(ConfigError, match="num_env_runners >= 3"):  # a learner per runner at least
        IMPALAConfig().environment("CartPole-v1").learners(num_learners=3).validate()
    with pytest.raises(ConfigError, match="circular_buffer_num_batches"):
        APPOConfig().environment("CartPole-v1").training(circular_buffer_num_batches=0).validate()
    with pytest.raises(ConfigError, match="did you mean 'broadcast_interval'"):
        IMPALAConfig().environment("CartPole-v1").training(broadcast_intervall=3).validate()
    with pytest.raises(ConfigError, match="clip_param"):
        APPOConfig().environment("CartPole-v1").training(clip_param=1.5).validate()
    with pytest.raises(ConfigError, match=r"max_weights_lag must be 'auto', None or an int >= 0, got -1"):
        IMPALAConfig().environment("CartPole-v1").training(max_weights_lag=-1).validate()
    IMPALAConfig().environment("CartPole-v1").training(max_weights_lag=None).validate()
    assert IMPALAConfig().stream_frames_in_flight == 1  # credit-based flow control on by default
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match=rf"stream_frames_in_flight must be None or an int >= 1, got {bad!r}"):
            APPOConfig().environment("CartPole-v1").training(stream_frames_in_flight=bad).validate()
    APPOConfig().environment("CartPole-v1").training(stream_frames_in_flight=None).validate()
    # "auto": 4x a fresh fragment's lag (runners x envs x fragment steps / steps per update), at least 32
    assert IMPALAConfig().max_weights_lag is None  # off by default (see its docstring)
    small = (IMPALAConfig().environment("CartPole-v1").env_runners(num_env_runners=2)
             .training(train_batch_size_per_learner=500, max_weights_lag="auto"))
    assert max_weights_lag(small) == 32 and max_weights_lag(small.copy().training(max_weights_lag=7)) == 7
    big = small.copy().env_runners(num_env_runners=64).learners(num_learners=2).training(train_batch_size_per_learner=250)
    assert max_weights_lag(big) == math.ceil(4 * 64 * 16 * 50 / 500) == 410
    assert APPOConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()


# --- with Ray: CartPole, fault tolerance, checkpoints, stop -------------------------------------
def runnel_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("runnel-")]


def assert_stopped_cleanly(algo, handles):
    assert algo.plan.receiver.closed and algo.plan.receiver.puller.closed
    assert runnel_threads() == []  # the loader and every sampling thread ended
    for h in handles:  # the runner actors (and their sampling threads) are gone; ray.kill lands asynchronously
        deadline = time.monotonic() + 30
        while True:
            try:
                ray.get(h.ping.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "an env runner actor is still alive after stop()"
            time.sleep(0.2)


def run_cartpole(config_cls, tmp_path_factory, max_steps=1_000_000):
    algo = config_cls().environment("CartPole-v1").env_runners(num_env_runners=2).debugging(seed=0).build()
    handles = [m.handle for m in algo.env_runner_group.manager.members.values()]
    initial = {k: v.clone() for k, v in algo.learner_group.get_state()["module"].items()}
    results = []
    try:
        while True:
            results.append(algo.train())
            ret = results[-1]["env_runners"]["episode_return_mean"]
            if ret >= 450 or results[-1]["num_env_steps_sampled_lifetime"] >= max_steps:
                break
        streaming = [r.value for r in algo.env_runner_group.manager.foreach_actor("is_streaming")]
        path = algo.save(str(tmp_path_factory.mktemp("ckpt") / config_cls.algo_name))
        saved = {"learner": algo.learner_group.get_state(), "weights_version": algo.weights_version,
                 "counters": dict(algo.counters), "initial_module": initial}
    finally:
        algo.stop()
    assert_stopped_cleanly(algo, handles)
    return results, streaming, path, saved


@pytest.fixture(scope="module")
def impala_run(ray_cluster, tmp_path_factory):
    return run_cartpole(IMPALAConfig, tmp_path_factory)


@pytest.fixture(scope="module")
def appo_run(ray_cluster, tmp_path_factory):
    return run_cartpole(APPOConfig, tmp_path_factory)


def learning_history(results) -> list:
    """(return, entropy, gradient norm, lag) per iteration, and any gradient steps skipped: what a failed
    learning run's message shows."""
    rows = []
    for r in results:
        learner = r.get("learners", {}).get("default_policy", {})
        rows.append(tuple(round(float(x), 3) for x in (
            r["env_runners"].get("episode_return_mean", float("nan")), learner.get("entropy", float("nan")),
            learner.get("gradients_global_norm", float("nan")), r["stream"].get("weights_lag_mean", float("nan")))))
    skipped = results[-1].get("learners", {}).get("default_policy", {}).get("num_gradient_steps_skipped", 0)
    return rows + [f"gradient steps skipped: {skipped}"]


def check_cartpole(results, streaming):
    last = results[-1]
    assert last["env_runners"]["episode_return_mean"] >= 450, \
        f"mean return {last['env_runners']['episode_return_mean']} after {last['num_env_steps_sampled_lifetime']} " \
        f"steps; per iteration: {learning_history(results)}"
    assert last["num_env_steps_sampled_lifetime"] <= 1_000_000
    assert streaming == [True, True]
    for r in results:
        stream = r["stream"]
        if r["num_learner_updates"]:  # weights lag: learner version minus chunk versions, over trained batches
            assert 0 <= stream["weights_lag_mean"] <= stream["weights_lag_max"] < 1000
        assert stream["num_frames_dropped_decode_error"] == stream["num_chunks_dropped_invalid"] == 0
        assert 0 <= r["learner_queue"]["size"] <= r["learner_queue"]["capacity"]
    # asynchronous: the policy lags (an iteration that ended before its first update logs no lag)
    assert any(r["stream"]["weights_lag_mean"] > 0 for r in results if r["num_learner_updates"])
    assert last["num_env_steps_trained_per_s"] > 0 and last["num_env_steps_sampled_per_s"] > 0
    assert last["learners"]["__all_modules__"]["num_env_steps_trained_lifetime"] > 0
    for key in ("policy_loss", "vf_loss", "entropy", "curr_lr", "gradients_global_norm"):
        assert np.isfinite(last["learners"]["default_policy"][key]), key
    assert last["fault_tolerance"]["num_healthy_workers"] == 2
    assert last["env_runners"]["num_episodes_lifetime"] >= last["env_runners"]["num_episodes"] > 0
    assert "learner_update" in last["timers"]


@pytest.mark.learning
def test_impala_cartpole_reaches_450(impala_run):
    results, streaming, _, _ = impala_run
    check_cartpole(results, streaming)
    assert results[-1]["num_env_steps_trained_lifetime"] <= results[-1]["num_env_steps_sampled_lifetime"]


@pytest.mark.learning
def test_appo_cartpole_reaches_450(appo_run):
    results, streaming, _, _ = appo_run
    check_cartpole(results, streaming)
    last = results[-1]
    assert last["learners"]["default_policy"]["num_target_updates"] >= 1
    assert last["circular_buffer"]["num_batches_added"] > 0
    # the circular buffer reuses batches (counted where it happens: whether more steps are trained than sampled
    # depends on whether the learner outpaces the runners, which it does not always do on a loaded machine)
    assert last["circular_buffer"]["num_batches_reused"] > 0


@pytest.mark.slow
def test_appo_checkpoint_restores_learner_target_and_streams_again(appo_run):
    _, _, path, saved = appo_run
    algo = Algorithm.from_checkpoint(path)
    try:
        assert isinstance(algo, APPO) and algo.weights_version == saved["weights_version"]
        state = algo.learner_group.get_state()
        for k, v in saved["learner"]["module"].items():
            torch.testing.assert_close(state["module"][k], v, rtol=0, atol=0)
        for k, v in saved["learner"]["targets"]["target_policy"].items():
            torch.testing.assert_close(state["targets"]["target_policy"][k], v, rtol=0, atol=0)
        # the runners act with restored weights. Not compared exactly with the learner's: a streaming runner
        # restores its own checkpointed state (weights a version or two behind the learner's, as it held
        # them at save time) and takes the learner's broadcast before its next fragment, and an APPO learner
        # keeps training on what streams in between train() calls. What must hold: no runner is back at its
        # freshly built version 0, and each runner's weights lie next to the saved learner's, far from where
        # training started.
        module, initial = saved["learner"]["module"], saved["initial_module"]
        versions = algo.foreach_env_runner(lambda r: r.weights_version, local_env_runner=False)
        assert len(versions) == 2 and min(versions) > 0, versions
        for weights in algo.foreach_env_runner(lambda r: r.get_weights(), local_env_runner=False):
            assert weights and set(weights) <= set(module)  # the policy's part (runners infer only)
            learned = sum(float(((module[k] - initial[k]) ** 2).sum()) for k in weights) ** 0.5
            drift = sum(float(((torch.tensor(weights[k]) - module[k]) ** 2).sum()) for k in weights) ** 0.5
            assert drift < 0.1 * learned, (drift, learned)
        result = algo.train()
        assert result["num_env_steps_sampled_lifetime"] > saved["counters"]["num_env_steps_sampled_lifetime"]
        assert result["learners"]["__all_modules__"]["weights_version"] > saved["weights_version"]
    finally:
        algo.stop()


@pytest.mark.parametrize("env_cls,hang", [(FlakyEnv, False), (FlakyEnv, True), (GILHangEnv, False)],
                         ids=["raises", "hangs", "hangs-holding-the-gil"])
@pytest.mark.slow
def test_failed_streaming_runner_is_recreated_and_streams_again(ray_cluster, env_cls, hang):
    env_config = {"fail_on_runners": [1], "fail_at_steps": [1500], "hang": hang}
    algo = (IMPALAConfig().environment(env_cls, env_config=env_config).env_runners(num_env_runners=2)
            .fault_tolerance(delay_between_env_runner_restarts_s=0.2, env_runner_health_probe_timeout_s=3.0)
            .debugging(seed=0).build())
    try:
        result = train_until_seen(algo, lambda r: r["fault_tolerance"]["num_remote_worker_restarts"] >= 1)
        ft = result["fault_tolerance"]
        assert ft["num_remote_worker_failures"] == 1 and ft["num_remote_worker_restarts"] == 1
        version = algo.weights_version
        sampled = result["num_env_steps_sampled_lifetime"]
        for _ in range(3):
            result = algo.train()
        assert result["fault_tolerance"]["num_healthy_workers"] == 2
        assert result["num_env_steps_sampled_lifetime"] > sampled
        # the recreated runner streams, with weights no older than those at its restart
        runner1 = algo.env_runner_group.manager.handle(1)
        assert ray.get(runner1.is_streaming.remote())
        assert ray.get(runner1.apply.remote(lambda r: r.weights_version)) >= version
    finally:
        algo.stop()
    assert runnel_threads() == []


@pytest.mark.parametrize("config_cls", [IMPALAConfig, APPOConfig], ids=["IMPALA", "APPO"])
def test_local_streaming_runner_trains_and_stops(ray_cluster, config_cls):
    """num_env_runners=0: the same plan and group code, the runner hosted in-process."""
    algo = (config_cls().environment("CartPole-v1").env_runners(num_env_runners=0, num_envs_per_env_runner=8)
            .reporting(min_time_s_per_iteration=0.5).debugging(seed=0).build())
    try:
        results = [algo.train() for _ in range(3)]
        assert results[-1]["num_learner_updates"] > 0
        assert results[-1]["env_runners"]["num_episodes_lifetime"] > 0
        assert results[-1]["fault_tolerance"]["num_healthy_workers"] == 0  # no remote runners
        assert algo.env_runner_group.local.is_streaming()
    finally:
        algo.stop()
    assert runnel_threads() == [] and algo.plan.receiver.closed


def test_stream_compression_auto_follows_the_observation_dtype():
    from pipeline.algorithms.impala.algorithm import IMPALA

    class Probe:
        def __init__(self, space, setting):
            self.observation_space = self.chunk_observation_space = space
            self.config = IMPALAConfig(stream_compress=setting)

    image = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
    vector = gym.spaces.Box(-1, 1, (4,), np.float32)
    nested = gym.spaces.Dict({"pos": vector, "cam": gym.spaces.Box(0, 255, (16, 16, 3), np.uint8)})
    assert IMPALA.compress_frames(Probe(image, "auto")) is True
    assert IMPALA.compress_frames(Probe(vector, "auto")) is False
    assert IMPALA.compress_frames(Probe(nested, "auto")) is True
    assert IMPALA.compress_frames(Probe(vector, True)) is True
    with pytest.raises(ConfigError, match="stream_compress"):
        IMPALAConfig(env="CartPole-v1", stream_compress="yes").validate()


@pytest.mark.slow
def test_killed_streaming_runner_is_recreated_and_counted(ray_cluster):
    algo = (IMPALAConfig().environment("CartPole-v1").env_runners(num_env_runners=2)
            .fault_tolerance(delay_between_env_runner_restarts_s=0.2, env_runner_health_probe_timeout_s=3.0)
            .debugging(seed=0).build())
    try:
        algo.train()
        ray.kill(algo.env_runner_group.manager.handle(2), no_restart=True)
        result = train_until_seen(algo, lambda r: r["fault_tolerance"]["num_remote_worker_restarts"] >= 1)
        sampled = result["num_env_steps_sampled_lifetime"]
        result = algo.train()
        ft = result["fault_tolerance"]
        assert ft["num_remote_worker_failures"] == 1 and ft["num_remote_worker_restarts"] == 1
        assert ft["num_healthy_workers"] == 2
        assert result["num_env_steps_sampled_lifetime"] > sampled
    finally:
        algo.stop()
    assert runnel_threads() == []


@pytest.mark.slow
def test_streaming_fatal_mode_raises_naming_the_runner_and_cause(ray_cluster):
    from actors.manager import ActorGroupError

    algo = (IMPALAConfig().environment(FlakyEnv, env_config={"fail_on_runners": [1], "fail_at_steps": [1500]})
            .env_runners(num_env_runners=2)
            .fault_tolerance(restart_failed_env_runners=False, ignore_env_runner_failures=False,
                             env_runner_health_probe_timeout_s=3.0)
            .debugging(seed=0).build())
    try:
        with pytest.raises(ActorGroupError) as err:
            for _ in range(60):
                algo.train()
        assert "env runner 1" in str(err.value) and "injected env failure" in str(err.value)
    finally:
        algo.stop()
    assert runnel_threads() == []
