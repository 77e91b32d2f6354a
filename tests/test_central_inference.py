"""Central inference with Ray: runners that import no torch, the same actions as local inference for the
same seeds and weights, the weights of remote learners (learner 0's) reaching every server, a server
killed mid-sample: recreated, runners reconnected, every chunk delivered once (counted by ids). Learning:
PPO to 450 on CartPole within its local test's budget; marked long (make test-long), as the suite keeps one
central-inference learning run: APPO to 450, DQN with epsilon-greedy applied by the server, and training
on to 450 after a killed server. Learning tests are seeded and assert returns and counts, never time.
The GPU case (a server and a learner on CUDA) runs where torch sees a CUDA device."""
import functools
import os
from collections import defaultdict

import numpy as np
import pytest
import torch
import yaml

from actors.metrics import MetricsLogger
from pipeline import APPOConfig, DQNConfig, PPOConfig
from pipeline.config.base import ConfigError
from pipeline.ray_cluster import actor_needs
from tests.helpers import train_until
from tests.inference_probes import kill_server_once, torch_loaded

pytestmark = pytest.mark.usefixtures("ray_cluster")


def cartpole(config_cls, runners=2, envs=None, seed=0):
    config = config_cls().environment("CartPole-v1").env_runners(num_env_runners=runners).debugging(seed=seed)
    if envs is not None:
        config.env_runners(num_envs_per_env_runner=envs)
    return config


def servers(algo):
    return algo.env_runner_group.inference.manager


# --- thin runners, the same actions -------------------------------------------------------------
@pytest.mark.slow
def test_runners_under_central_inference_import_no_torch():
    """Two runners, two servers: runner i asks server i % 2, and each server acts for its runner."""
    algo = cartpole(PPOConfig, runners=2, envs=2).inference(mode="central", num_inference_servers=2).build()
    try:
        assert algo.foreach_env_runner(torch_loaded, local_env_runner=False) == [False, False]
        m = MetricsLogger()
        chunks = algo.env_runner_group.sample(200, m)
        assert sum(len(c) for c in chunks) >= 200 and all("action_logp" in c.extra for c in chunks)
        served = [r.value["inference/num_actions"]["value"] for r in servers(algo).foreach_actor("get_metrics")]
        # CartPole's own vector env: a sub-env's reset-only step was acted on too, and is in no chunk
        reset_only = m.peek("env_runners/num_env_steps_reset_only_lifetime")
        assert reset_only >= 0
        assert len(served) == 2 and all(n > 0 for n in served) and sum(served) == sum(len(c) for c in chunks) + reset_only
        assert [r.value for r in servers(algo).foreach_actor("apply", torch_loaded)] == [True, True]  # probe works
    finally:
        algo.stop()


@pytest.mark.slow
def test_runners_on_the_servers_node_send_frames_through_shared_memory():
    """Remote runners of Atari-sized frames, double-buffered (each half of a runner's 4 sub-envs on its own
    lane): every request goes through /dev/shm (the runners share the server's node), one segment per lane,
    each segment's name is gone once answered, and the server acted for every step of every sub-env."""
    from tests.envs import FrameEnv

    algo = (PPOConfig().environment(FrameEnv).env_runners(num_env_runners=2, num_envs_per_env_runner=4)
            .inference(mode="central", double_buffer=True).build())
    try:
        m = MetricsLogger()
        chunks = algo.env_runner_group.sample(200, m)
        assert sum(len(c) for c in chunks) >= 200
        counts = servers(algo).foreach_actor("get_metrics")[0].value
        requests, shm, actions = (counts[f"inference/{k}"]["value"]
                                  for k in ("num_requests", "num_shm_requests", "num_actions"))
        assert requests > 0 and shm == requests
        assert actions == sum(len(c) for c in chunks) == 2 * requests  # two sub-envs a request: halves
        paths = algo.foreach_env_runner(lambda r: [lane.segment.path for lane in r.acting.lanes],
                                        local_env_runner=False)
        assert len(paths) == 2 and all(len(set(p)) == 2 for p in paths)
        assert all(p and not os.path.exists(p) for lanes in paths for p in lanes)
    finally:
        algo.stop()


def sample_twice(config, steps=400):
    algo = config.build()
    try:
        return [c for _ in range(2) for c in algo.env_runner_group.sample(steps, MetricsLogger())]
    finally:
        algo.stop()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("config_cls", [PPOConfig, DQNConfig])
def test_same_seed_and_weights_give_the_same_actions_with_central_and_local_inference(config_cls, backend):
    """Two runners share one server (their requests batched together); each runner's actions,
    log-probabilities and distribution inputs equal those it takes acting with its own module, whether
    it would act with the numpy export or the torch module (the server draws as it would).
    PPO samples from the policy; DQN's epsilon-greedy runs in the server."""
    config = (cartpole(config_cls, runners=2, envs=4, seed=3).env_runners(rollout_fragment_length=25)
              .inference(runner_backend=backend))
    local = sample_twice(config.copy())
    central = sample_twice(config.copy().inference(mode="central"))
    assert len(local) == len(central) > 8
    for a, b in zip(local, central):
        assert (a.env_runner_index, a.env_index, a.chunk_index, len(a)) == (b.env_runner_index, b.env_index,
                                                                            b.chunk_index, len(b))
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.obs, b.obs)
        np.testing.assert_allclose(a.extra["action_logp"], b.extra["action_logp"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a.extra["action_dist_inputs"], b.extra["action_dist_inputs"], rtol=1e-5, atol=1e-6)
    assert len({int(a) for c in central for a in c.actions}) == 2  # both actions taken: the draws matter


@pytest.mark.slow
@pytest.mark.parametrize("config_cls", [PPOConfig, DQNConfig])
def test_frame_stacks_act_the_same_with_central_and_local_inference(config_cls):
    """With frame stacking runners send the servers the stacks (what the module gets) and chunks keep one frame
    per step plus the look-back rows, as when runners act themselves."""
    from tests.pieces import stack4

    config = cartpole(config_cls, runners=2, envs=4, seed=3).env_runners(rollout_fragment_length=25,
                                                                        env_to_module_connector=stack4)
    local = sample_twice(config.copy())
    central = sample_twice(config.copy().inference(mode="central"))
    assert len(local) == len(central) > 8
    for a, b in zip(local, central):
        assert a.obs.shape[1:] == (4,) and a.look_back.shape == (3, 4)  # recorded frames, not stacks
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_array_equal(a.obs, b.obs)
        np.testing.assert_array_equal(a.look_back, b.look_back)
        np.testing.assert_allclose(a.extra["action_dist_inputs"], b.extra["action_dist_inputs"], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_server_acting_in_bfloat16_draws_what_a_runner_acting_in_bfloat16_draws():
    """precision="bfloat16" on both sides, one runner (so the server's batches are the runner's own, computed
    by the same bfloat16 kernels): the same actions, log-probabilities and distribution inputs."""
    config = (cartpole(PPOConfig, runners=1, envs=4, seed=3).env_runners(rollout_fragment_length=25)
              .inference(precision="bfloat16"))
    local = sample_twice(config.copy(), steps=200)
    central = sample_twice(config.copy().inference(mode="central"), steps=200)
    assert len(local) == len(central) > 8
    for a, b in zip(local, central):
        assert (a.env_index, a.chunk_index, len(a)) == (b.env_index, b.chunk_index, len(b))
        np.testing.assert_array_equal(a.actions, b.actions)
        np.testing.assert_allclose(a.extra["action_logp"], b.extra["action_logp"], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(a.extra["action_dist_inputs"], b.extra["action_dist_inputs"], rtol=1e-6, atol=1e-6)


def test_central_inference_config_is_checked_at_build():
    with pytest.raises(ConfigError, match=r"inference mode='remote' is not one of \['local', 'central'\]"):
        cartpole(PPOConfig).inference(mode="remote").build()
    with pytest.raises(ConfigError, match="unknown inference setting 'max_batch_size'; did you mean 'max_batch'"):
        cartpole(PPOConfig).inference(mode="central", max_batch_size=8).build()
    with pytest.raises(ConfigError, match="num_inference_servers=3 is more than num_env_runners=2"):
        cartpole(PPOConfig).inference(mode="central", num_inference_servers=3).build()
    with pytest.raises(ConfigError, match="inference max_wait_s must be a number >= 0, got -1"):
        cartpole(PPOConfig).inference(mode="central", max_wait_s=-1).build()
    with pytest.raises(ConfigError, match=r"inference mode='central' serves single-agent runs.*"
                                          r"\.inference\(mode='local'\)"):
        cartpole(PPOConfig).multi_agent(policies={"a", "b"}, policy_mapping_fn=lambda aid, *a, **k: "a") \
            .inference(mode="central").validate()


def test_servers_count_in_what_a_joined_cluster_must_hold():
    """The ``ray_address`` check of a joined cluster and the local Ray's size count the servers' CPUs and
    GPUs; with the runner in the driver, its server is there too, outside Ray's accounting."""
    config = cartpole(PPOConfig).inference(mode="central", num_inference_servers=2, num_gpus_per_inference_server=0.5)
    needs = actor_needs(config)
    assert (needs.cpus, needs.gpus) == (2 * 1 + 2 * 1, 1.0)
    assert needs.describe() == "2 env runners x 1 CPU, 2 inference servers x 1 CPU + 0.5 GPU"
    in_driver = cartpole(PPOConfig, runners=0).inference(mode="central", num_gpus_per_inference_server=1)
    assert (actor_needs(in_driver).cpus, actor_needs(in_driver).gpus) == (0, 0)


# --- remote learners ----------------------------------------------------------------------------
@pytest.mark.parametrize("num_learners,device", [(2, "cpu"), pytest.param(1, "cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
@pytest.mark.slow
def test_remote_learners_weights_reach_every_server(num_learners, device):
    """APPO with learners in Ray actors (num_learners > 0): the weights go out from learner 0, and every
    server acts with them, stamped with their version, once an iteration ends. On CUDA: the learner and the
    server share the GPU."""
    cuda = device == "cuda"  # one GPU: half for the learner, a quarter for each server
    config = (cartpole(APPOConfig).learners(num_learners=num_learners, num_gpus_per_learner=0.5 if cuda else 0)
              .training(train_batch_size_per_learner=200, minibatch_size=200, broadcast_interval=1)
              .inference(mode="central", num_inference_servers=2, num_cpus_per_inference_server=0,
                         num_gpus_per_inference_server=0.25 if cuda else 0))
    algo = config.build()
    try:
        for _ in range(3):
            result = algo.train()
        learner = algo.learner_group.get_weights(inference_only=True)
        served = [r.value for r in servers(algo).foreach_actor("get_state")]
        devices = [r.value for r in servers(algo).foreach_actor("apply", lambda s: s.forward.device.type)]
    finally:
        algo.stop()
    assert devices == [device, device]
    assert algo.weights_version >= 2 and result["inference"]["weights_version"] == algo.weights_version
    for state in served:
        assert state["weights_version"] == algo.weights_version and sorted(state["weights"]) == sorted(learner)
        for k, w in learner.items():
            np.testing.assert_array_equal(state["weights"][k], w, err_msg=k)


# --- learning ------------------------------------------------------------------------------------
def learn_centrally(config_cls, budget, settings=None):
    """``config_cls``'s local learning test run (2 remote runners, seed 0, the same budget and ``settings``),
    acting centrally."""
    config = cartpole(config_cls)
    if settings:
        config.update_from_dict(settings)
    algo = config.inference(mode="central").build()
    try:
        best, result = train_until(algo, 450, budget)
    finally:
        algo.stop()
    assert best >= 450, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
    inference = result["inference"]
    assert inference["batch_size_mean"] > 0 and inference["num_bad_requests"] == inference["num_failed_batches"] == 0
    assert inference["weights_version"] >= 1
    return result


@pytest.mark.learning
def test_ppo_with_central_inference_reaches_450_within_the_local_budget():
    """test_ppo_train's run of the tuned CartPole file: its settings, 120k steps."""
    spec = yaml.safe_load(open("tuned/cartpole-ppo.yaml"))
    assert spec["config"]["num_env_runners"] == 2
    result = learn_centrally(PPOConfig, 120_000, spec["config"])
    # every step acted on once, and each reset-only step of CartPole's own vector env too
    reset_only = result["env_runners"]["num_env_steps_reset_only_lifetime"]
    assert result["inference"]["num_actions"] == result["num_env_steps_sampled_lifetime"] + reset_only


@pytest.mark.learning
@pytest.mark.long
def test_appo_with_central_inference_reaches_450_within_the_local_budget():
    """test_impala_appo's APPO run: streaming runners, 1M steps."""
    result = learn_centrally(APPOConfig, 1_000_000)
    assert result["stream"]["num_chunks_dropped_invalid"] == 0


@pytest.mark.learning
@pytest.mark.long
def test_dqn_with_central_inference_learns():
    """DQN's tuned CartPole settings, the runner in the driver and its server in a thread: epsilon-greedy
    in the server follows the runner's timestep; the return climbs well above a random policy's ~22."""
    config = (DQNConfig().environment("CartPole-v1").debugging(seed=0)
              .env_runners(num_env_runners=0, num_envs_per_env_runner=8, rollout_fragment_length=4)
              .training(lr=0.0005, train_batch_size_per_learner=64, training_intensity=16,
                        num_steps_sampled_before_learning_starts=1000, target_network_update_freq=500, n_step=[2, 5],
                        epsilon=[[0, 1.0], [10000, 0.02]],
                        replay_buffer_config={"type": "PrioritizedEpisodeReplayBuffer", "capacity": 50000,
                                              "alpha": 0.6, "beta": 0.4})
              .rl_module(model_config={"fcnet_hiddens": [64, 64], "fcnet_activation": "relu"})
              .inference(mode="central"))
    algo = config.build()
    try:
        best, result = train_until(algo, 150, 60_000)
    finally:
        algo.stop()
    assert best >= 150, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
    reset_only = result["env_runners"]["num_env_steps_reset_only_lifetime"]  # acted on, ignored by the env
    assert result["inference"]["num_actions"] == result["num_env_steps_sampled_lifetime"] + reset_only


# --- a server killed mid-run ----------------------------------------------------------------------
def run_with_a_killed_server(tmp_path, target=None, double_buffer=False):
    """PPO (2 runners, one server) whose server runner 1 kills at its first episode end after the first
    iteration, mid-sample; then 3 iterations, or training on to ``target``. Returns what the group's sample
    calls returned (episode id, chunk index, length, done), the first and the last result, the best return.
    ``double_buffer``: the runners step separate CartPole envs (not its vector implementation) in two halves,
    each with a request out when the server dies."""
    pid_file = str(tmp_path / "server.pid")
    config = (cartpole(PPOConfig).inference(mode="central", resend_after_s=1.0, health_check_interval_s=0.5,
                                            double_buffer=double_buffer)
              .callbacks(on_episode_end=functools.partial(kill_server_once, pid_file)))
    if double_buffer:  # separate envs: a vector env that steps them by halves
        config.env_runners(gym_env_vectorize_mode="sync", num_envs_per_env_runner=4)
    algo = config.build()
    seen = []
    sample = algo.env_runner_group.sample

    def recording(*args, **kwargs):
        chunks = sample(*args, **kwargs)
        seen.extend((c.episode_id, c.chunk_index, len(c), c.terminated or c.truncated) for c in chunks)
        return chunks

    algo.env_runner_group.sample = recording
    best = -np.inf
    try:
        first = algo.train()
        pid = servers(algo).foreach_actor("apply", lambda server: os.getpid())[0].value
        with open(pid_file, "w") as f:  # runner 1 kills the server at its next episode's end, mid-sample
            f.write(str(pid))
        if target is None:
            for _ in range(3):
                result = algo.train()
        else:
            best, result = train_until(algo, target, 400_000)
        buffered = algo.foreach_env_runner(lambda r: r.sampler.double_buffered(), local_env_runner=False)
        assert buffered == [double_buffer] * 2
    finally:
        algo.stop()
    assert os.path.exists(pid_file + ".taken"), "the server was never killed"
    return seen, first, result, best


def check_recovered_and_every_chunk_once(seen, first, result):
    assert first["fault_tolerance"]["num_inference_server_restarts"] == 0
    ft = result["fault_tolerance"]
    assert ft["num_inference_server_restarts"] >= 1
    assert ft["num_remote_worker_failures"] == 0 and ft["num_healthy_workers"] == 2  # no runner was lost
    assert result["inference"]["runner_num_reconnects"] >= 1  # runner 1 resent its pending request elsewhere
    # every chunk once, every episode's chunks 0, 1, 2... without a gap, ended ones closed by their last chunk
    keys = [(e, i) for e, i, _, _ in seen]
    assert len(keys) == len(set(keys)), "a chunk was delivered twice"
    by_episode = defaultdict(dict)
    for e, i, _, done in seen:
        by_episode[e][i] = done
    for e, chunks in by_episode.items():
        assert sorted(chunks) == list(range(len(chunks))), f"episode {e} lost chunks: has {sorted(chunks)}"
        assert not any(chunks[i] for i in range(len(chunks) - 1)), f"episode {e} goes on after its end"
    assert sum(n for _, _, n, _ in seen) == result["num_env_steps_sampled_lifetime"]


@pytest.mark.slow
@pytest.mark.parametrize("double_buffer", [False, True], ids=["one_request", "double_buffered"])
def test_killed_server_is_recreated_runners_reconnect_and_no_chunk_is_lost_or_doubled(tmp_path, double_buffer):
    seen, first, result, _ = run_with_a_killed_server(tmp_path, double_buffer=double_buffer)
    check_recovered_and_every_chunk_once(seen, first, result)
    assert result["training_iteration"] == 4 and result["inference"]["weights_version"] == 4


@pytest.mark.learning
@pytest.mark.long
def test_training_reaches_450_after_a_killed_server(tmp_path):
    seen, first, result, best = run_with_a_killed_server(tmp_path, target=450)
    check_recovered_and_every_chunk_once(seen, first, result)
    assert best >= 450, f"mean return {best} after {result['num_env_steps_sampled_lifetime']} steps"
