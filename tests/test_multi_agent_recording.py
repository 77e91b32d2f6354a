"""Recording multi-agent runs (``offline_data(output=DIR)``): each module's agents' chunks go to a single-agent
recording of its own, ``DIR/<module_id>`` (``actors.offline.module_recorders``), which BC trains from and
``runnel inspect`` reads; ``DIR`` itself lists the modules and single-agent readers given it say which to read.
Recorded by in-process and Ray env runners, evaluators and the multi-agent policy server."""
from __future__ import annotations

import json
import os
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from actors.env.settings import EnvRunnerSettings
from actors.external.policy_server import PolicyServer
from actors.external.settings import ExternalSettings
from actors.modules import ModuleSpec
from actors.offline import RecordingSettings, read_manifest, resolve_input
from actors.offline.module_recorders import ModuleRecorders, write_multi_agent_manifest
from pipeline import BCConfig, PPOConfig, make_multi_agent
from pipeline.config.base import ConfigError
from pipeline.offline.record import inspect_recording
from protocols.client import PolicyClient
from protocols.client_multi_agent import run_multi_agent_env
from protocols.shards import ShardReader, decode_record
from protocols.spaces import space_to_dict
from tests.pieces import by_agent, by_str_or_int_agent
from tests.test_external import free_port

CARTPOLE = gym.make("CartPole-v1")


def two_policy_ppo(output: str, **runners) -> PPOConfig:
    runners = {"num_env_runners": 0, "num_envs_per_env_runner": 2} | runners
    return (PPOConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
            .env_runners(**runners).training(train_batch_size_per_learner=256, minibatch_size=128, num_epochs=1)
            .offline_data(output=output).debugging(seed=0))


def recorded_chunks(directory: str) -> list:
    out = []
    for path in resolve_input(directory):
        reader = ShardReader(path)
        for _, frame in reader.frames():
            out += decode_record(frame, reader.limits)
    return out


def check_recording(directory: str, module_steps: dict[str, int]) -> None:
    """``directory`` holds one recording per module, each with CartPole's spaces, its own agent's whole
    episodes and as many steps as the run sampled for it."""
    with open(os.path.join(directory, "manifest.json")) as f:
        top = json.load(f)
    assert top["format"] == "runnel-multi-agent-recording" and top["modules"] == sorted(module_steps)
    for mid, steps in module_steps.items():
        manifest = read_manifest(os.path.join(directory, mid))
        assert manifest["observation_space"] == space_to_dict(CARTPOLE.observation_space)
        assert manifest["action_space"] == space_to_dict(CARTPOLE.action_space)
        summary = inspect_recording(os.path.join(directory, mid))
        assert summary["steps"] == steps > 0 and summary["damaged_records"] == 0 and summary["episodes"] > 0
        agent = str(int(mid[1:]))  # by_agent maps agent i to module p<i>
        chunks = recorded_chunks(os.path.join(directory, mid))
        assert {(c.agent_id, c.module_id) for c in chunks} == {(agent, mid)}
        assert sum(len(c) for c in chunks) == steps
        for c in chunks:  # whole episodes of one agent (or the run's last, cut off): from its first step
            assert c.t_started == 0 and np.all(c.rewards == 1.0)
        assert len({c.episode_id for c in chunks}) == len(chunks)
    with pytest.raises(ValueError, match=r"multi-agent recording of modules \['p0', 'p1'\].*read one"):
        resolve_input(directory)


def test_each_module_gets_a_recording_of_its_own_that_bc_trains_from(tmp_path):
    out = str(tmp_path / "rec")
    algo = two_policy_ppo(out).build(logdir=None)
    try:
        for _ in range(2):
            result = algo.train()
    finally:
        algo.stop()  # episodes still running are written as they are
    steps = {mid: int(result["env_runners"]["num_module_steps_sampled_lifetime"][mid]) for mid in ("p0", "p1")}
    assert sum(steps.values()) == result["num_agent_steps_sampled_lifetime"]
    assert 0 < result["offline_data"]["recorded_steps"] <= sum(steps.values())  # the rest written at stop()
    check_recording(out, steps)
    # a module's recording is a single-agent recording: BC trains from it
    bc = (BCConfig().environment(observation_space=CARTPOLE.observation_space, action_space=CARTPOLE.action_space)
          .offline_data(input_=os.path.join(out, "p0")).training(train_batch_size_per_learner=64, minibatch_size=64)
          .env_runners(num_env_runners=0).reporting(min_sample_timesteps_per_iteration=0).debugging(seed=0)
          .build(logdir=None))
    try:
        trained = bc.train()
        assert trained["num_env_steps_trained_lifetime"] > 0
    finally:
        bc.stop()
    # the directory itself is not one recording: readers say which to read
    with pytest.raises(ConfigError, match=r"multi-agent recording of modules \['p0', 'p1'\]"):
        BCConfig().environment("CartPole-v1").offline_data(input_=out).validate()


def test_whole_episodes_per_module_and_a_module_added_while_training_gets_its_recording(tmp_path):
    out = str(tmp_path / "rec")
    algo = two_policy_ppo(out).build(logdir=None)
    try:
        algo.train()
        algo.add_module("p2", new_agent_to_module_mapping_fn=lambda aid, ep, **kw: f"p{2 if aid == 1 else 0}")
        result = algo.train()
    finally:
        algo.stop()
    with open(os.path.join(out, "manifest.json")) as f:
        assert json.load(f)["modules"] == ["p0", "p1", "p2"]
    assert read_manifest(os.path.join(out, "p2"))["action_space"] == space_to_dict(CARTPOLE.action_space)
    sampled = result["env_runners"]["num_module_steps_sampled_lifetime"]
    lifetime = {m: int(sampled.get(m, 0)) for m in ("p0", "p1", "p2")}
    recorded = {m: inspect_recording(os.path.join(out, m))["steps"] for m in lifetime}
    assert recorded == lifetime and recorded["p2"] > 0


def test_module_ids_that_cannot_name_a_directory_and_a_single_agent_recording_there_are_refused(tmp_path):
    bad = (PPOConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
           .multi_agent(policies={"p0", "p 1"}, policy_mapping_fn=lambda aid, ep, **kw: "p0")
           .env_runners(num_env_runners=0).offline_data(output=str(tmp_path / "bad")))
    with pytest.raises(ConfigError, match=r"module id 'p 1' cannot name its recording's directory.*rename"):
        bad.build(logdir=None)
    single = str(tmp_path / "single")
    algo = PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0).offline_data(output=single).build(
        logdir=None)
    algo.stop()
    with pytest.raises(ConfigError, match="already holds a single-agent recording"):
        two_policy_ppo(single).build(logdir=None)


def test_the_multi_agent_policy_server_records_each_module_apart(tmp_path):
    settings = EnvRunnerSettings(env_creator=None, observation_space=CARTPOLE.observation_space,
                                 action_space=CARTPOLE.action_space,
                                 recording=RecordingSettings(output=str(tmp_path / "rec")))
    specs = {m: ModuleSpec(CARTPOLE.observation_space, CARTPOLE.action_space, {"fcnet_hiddens": [8]})
             for m in ("p0", "p1")}
    server = PolicyServer(settings, 0, external=ExternalSettings(
        address=f"tcp://127.0.0.1:{free_port()}", journal_dir=str(tmp_path / "journal"), fragment_length=20,
        sample_wait_s=0.5), module_specs=specs, policy_mapping_fn=by_str_or_int_agent)
    try:
        with PolicyClient(server.address, timeout_s=30) as client:
            run_multi_agent_env(client, make_multi_agent("CartPole-v1")({"num_agents": 2}), num_episodes=3, seed=0)
        chunks = server.sample(10_000)  # recorded before the server hands them on
    finally:
        server.stop()
    steps = {m: sum(len(c) for c in chunks if c.module_id == m) for m in ("p0", "p1")}
    for mid, n in steps.items():
        summary = inspect_recording(str(tmp_path / "rec" / mid))
        assert summary["steps"] == n > 0 and summary["episodes"] == 3


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_ray_runners_and_evaluators_record_each_module(tmp_path):
    out = str(tmp_path / "rec")
    config = (two_policy_ppo(out, num_env_runners=1)
              .offline_data(output=out, output_include_evaluation=True)
              .evaluation(evaluation_interval=1, evaluation_duration=2, evaluation_duration_unit="episodes"))
    algo = config.build(logdir=None)
    try:
        result = algo.train()
    finally:
        algo.stop()
    for mid in ("p0", "p1"):
        files = [os.path.basename(f) for f in resolve_input(os.path.join(out, mid))]
        assert any(f.startswith("runner001") for f in files) and any(f.startswith("eval") for f in files)
        summary = inspect_recording(os.path.join(out, mid))
        assert summary["steps"] >= result["env_runners"]["num_module_steps_sampled_lifetime"][mid]


def test_runnel_inspect_summarizes_each_module_of_a_multi_agent_recording(tmp_path, capsys):
    from pipeline.cli.main import main

    directory = str(tmp_path / "rec")
    expert_and_random(directory)
    assert main(["inspect", directory, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["multi_agent"] and sorted(out["modules"]) == ["p0", "p1"]
    assert out["modules"]["p0"]["episode_return_mean"] == 500.0 and out["modules"]["p1"]["episode_return_mean"] < 30
    assert main(["inspect", directory]) == 0
    text = capsys.readouterr().out
    assert "multi-agent recording" in text and f"recording {os.path.join(directory, 'p1')}:" in text


def test_runnel_record_plays_a_multi_agent_policy_into_a_recording_per_module(tmp_path):
    from pipeline.offline.record import record_policy

    algo = two_policy_ppo(str(tmp_path / "rec")).build(logdir=None)
    try:
        played = record_policy(algo, 3, str(tmp_path / "played"))
    finally:
        algo.stop()
    assert played["episodes"] == 3
    with open(tmp_path / "played" / "manifest.json") as f:
        assert json.load(f)["modules"] == ["p0", "p1"]
    per_module = {m: inspect_recording(str(tmp_path / "played" / m)) for m in ("p0", "p1")}
    assert all(s["episodes"] == 3 and s["open_episodes"] == 0 for s in per_module.values())
    # CartPole pays 1 a step: each agent's return is its episode's length, the episode's the longer one
    assert sum(s["steps"] for s in per_module.values()) == pytest.approx(sum(played["episode_returns"]))
    assert max(played["episode_lengths"]) == max(max(s["episode_returns"]) for s in per_module.values())


# --- training several modules from a multi-agent recording -----------------------------------------------------
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def multi_agent_recording(directory: str, sources: dict[str, str], spaces: tuple[Any, Any]) -> None:
    """A multi-agent recording whose module ``p<k>`` holds agent k's episodes, taken from the checked-in
    single-agent recording ``sources[p<k>]``, written by the recorders a multi-agent run uses."""
    write_multi_agent_manifest(directory, dict.fromkeys(sources, spaces), "PPO", {}, "test")
    recorders = ModuleRecorders(RecordingSettings(output=directory), "test")
    for mid, source in sources.items():
        chunks = recorded_chunks(os.path.join(DATA, source))
        for c in chunks:
            c.agent_id, c.module_id = mid[1:], mid
        recorders.record(chunks)
    recorders.close()


def expert_and_random(directory: str) -> None:
    """p0: the expert CartPole episodes (mean return 500); p1: the near-random ones (22)."""
    multi_agent_recording(directory, {"p0": "cartpole_expert", "p1": "cartpole_random"},
                          (CARTPOLE.observation_space, CARTPOLE.action_space))


@pytest.mark.learning
def test_bc_trains_each_module_on_its_own_recording_and_evaluates_in_the_env(tmp_path):
    """Module p0 learns the expert's play from its recording and p1 the near-random play from its own: agent 0
    balances for the whole episode in the evaluation env, agent 1 does not."""
    directory = str(tmp_path / "rec")
    expert_and_random(directory)
    config = (BCConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
              .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
              .offline_data(input_=directory).env_runners(num_env_runners=0).debugging(seed=0)
              .training(lr=1e-3, train_batch_size_per_learner=4000, minibatch_size=250)
              .evaluation(evaluation_interval=100, evaluation_duration=10, evaluation_duration_unit="episodes"))
    algo = config.build(logdir=None)
    try:
        for _ in range(100):
            result = algo.train()
    finally:
        algo.stop()
    assert result["learners"]["p0"]["num_module_steps_trained"] > 0 < result["learners"]["p1"]["num_module_steps_trained"]
    returns = result["evaluation"]["env_runners"]["agent_episode_returns_mean"]
    assert returns["0"] >= 0.95 * inspect_recording(os.path.join(directory, "p0"))["episode_return_mean"], returns
    assert returns["1"] <= 100, returns


def test_multi_agent_offline_input_is_checked_against_the_recording(tmp_path):
    directory = str(tmp_path / "rec")
    expert_and_random(directory)
    bc = BCConfig().multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent).env_runners(num_env_runners=0)
    with pytest.raises(ConfigError, match=r"holds no recording of modules \['p2'\].*it holds \['p0', 'p1'\]"):
        bc.copy().multi_agent(policies={"p0", "p2"}).offline_data(input_=directory).validate()
    with pytest.raises(ConfigError, match="is not a multi-agent recording"):
        bc.copy().offline_data(input_=os.path.join(DATA, "cartpole_expert")).validate()
    with pytest.raises(ConfigError, match=r"a multi-agent run reads a multi-agent recording.*or a dict"):
        bc.copy().offline_data(input_=[directory]).validate()
    with pytest.raises(ConfigError, match="input_reader='local'"):
        bc.copy().offline_data(input_=directory, input_reader="ray_data").validate()
    from pipeline import DQNConfig

    dqn = DQNConfig().multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent).offline_data(input_=directory)
    with pytest.raises(ConfigError, match=r"offline_data\(input_=...\) with DQN is not built.*DIR/<module_id>"):
        dqn.validate()
    # the env the evaluators step must give the modules the spaces they were recorded with
    pendulums = make_multi_agent("Pendulum-v1")
    with pytest.raises(ConfigError, match="module 'p0' acts in Box"):
        bc.copy().environment(pendulums, env_config={"num_agents": 2}).offline_data(input_=directory).build(logdir=None)
    # trained with no env: the spaces come from the recording
    algo = bc.copy().offline_data(input_=directory).training(train_batch_size_per_learner=64, minibatch_size=64).build(
        logdir=None)
    try:
        assert algo.get_module("p1").encoder_space == CARTPOLE.observation_space
        assert algo.train()["learners"]["__all_modules__"]["num_agent_steps_trained_lifetime"] >= 64
    finally:
        algo.stop()


@pytest.mark.long
def test_cql_trains_two_modules_from_a_multi_agent_pendulum_recording(tmp_path):
    """CQL (SAC's off-policy plan, one replay buffer per module filled by the readers) from a recording whose
    modules each hold the checked-in SAC Pendulum recording (mean return -553): both agents reach -300 in the
    two-agent evaluation env. Seed 2 (the single-agent test's settings) reached it at iteration 36 of 90."""
    from tests.test_offline_learning import cql_pendulum, evaluate_until

    pendulum = gym.make("Pendulum-v1")
    directory = str(tmp_path / "rec")
    multi_agent_recording(directory, {"p0": "pendulum_sac", "p1": "pendulum_sac"},
                          (pendulum.observation_space, pendulum.action_space))
    config = (cql_pendulum(directory).environment(make_multi_agent("Pendulum-v1"), env_config={"num_agents": 2})
              .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent))
    worst, result = evaluate_until(config, lambda ev: min(ev["agent_episode_returns_mean"].values()), -300)
    assert worst[-1] >= -300, f"the worse agent's evaluation return every 3 iterations: {[round(r) for r in worst]}"
    assert result["learners"]["p0"]["num_module_steps_trained"] > 0 < result["learners"]["p1"]["num_module_steps_trained"]


def test_a_module_trains_on_what_its_own_directory_holds_whatever_the_chunks_say(tmp_path):
    """Chunks are stamped with the module whose recording the reader found them in: a file that names another
    module (moved, or written by someone else) cannot feed that module's learner."""
    from actors.offline.reader import OfflineReader, ReaderSettings

    directory = str(tmp_path / "rec")
    expert_and_random(directory)
    files = {m: resolve_input(os.path.join(directory, m)) for m in ("p0", "p1")}
    for mid, other in (("p0", "p1"), ("p1", "p0")):  # swapped: each module's files now hold the other's chunks
        for path in files[mid]:
            os.rename(path, os.path.join(directory, other, "moved-" + os.path.basename(path)))
    settings = EnvRunnerSettings(env_creator=None, num_envs=1, rollout_fragment_length=500)
    reader = OfflineReader(settings, offline=ReaderSettings(input_=directory, modules=("p0", "p1"), seed=0))
    try:
        chunks = [c for _ in range(20) for c in reader.sample(num_timesteps=500)]
    finally:
        reader.stop()
    returns = {m: [float(c.rewards.sum()) for c in chunks if c.module_id == m and c.chunk_index == 0 and c.is_done]
               for m in ("p0", "p1")}
    assert returns["p0"] and returns["p1"] and max(returns["p0"]) < 100 < min(returns["p1"])  # swapped


def test_dqn_mixes_a_multi_agent_recording_into_each_modules_replay(tmp_path):
    """``input_={"sampler": 0.5, DIR: 0.5}`` in a multi-agent DQN run: a recorded (agent) step per step sampled
    (``count_steps_by`` units: env steps here) joins the replay each round, each into the buffer of the module
    whose recording holds it."""
    from pipeline import DQNConfig

    directory = str(tmp_path / "rec")  # short episodes for both: records are drawn a chunk (episode) at a time
    multi_agent_recording(directory, {"p0": "cartpole_random", "p1": "cartpole_random"},
                          (CARTPOLE.observation_space, CARTPOLE.action_space))
    algo = (DQNConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
            .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
            .offline_data(input_={"sampler": 0.5, directory: 0.5})
            .rl_module(model_config={"fcnet_hiddens": [16]}).env_runners(num_env_runners=0)
            .training(num_steps_sampled_before_learning_starts=64, train_batch_size_per_learner=32)
            .reporting(min_sample_timesteps_per_iteration=0).debugging(seed=0).build(logdir=None))
    try:
        for _ in range(30):
            result = algo.train()
    finally:
        algo.stop()
    read = result["offline_data"]["num_env_steps_read_lifetime"]
    sampled = result["num_env_steps_sampled_lifetime"]
    assert sampled <= read <= sampled + 500  # one recorded step per sampled one (a piece may run over)
    modules = result["env_runners"]["num_module_steps_sampled_lifetime"]
    added = {m: result["replay"][m]["inserts"] for m in ("p0", "p1")}
    assert all(added[m] > modules[m] for m in added) and sum(added.values()) == sum(modules.values()) + read, \
        (added, modules, read)
    assert result["learners"]["p0"]["num_module_steps_trained"] > 0


def test_each_modules_buffer_is_prefilled_from_its_own_recording(tmp_path):
    from pipeline import DQNConfig

    directory = str(tmp_path / "rec")
    expert_and_random(directory)
    config = (DQNConfig().environment(make_multi_agent("CartPole-v1"), env_config={"num_agents": 2})
              .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=by_agent)
              .rl_module(model_config={"fcnet_hiddens": [16]}).env_runners(num_env_runners=0)
              .training(num_steps_sampled_before_learning_starts=64, train_batch_size_per_learner=32,
                        replay_buffer_config={"prefill_from": directory, "prefill_steps": 3000})
              .reporting(min_sample_timesteps_per_iteration=0).debugging(seed=0))
    algo = config.build(logdir=None)
    try:
        result = algo.train()
        assert all(len(algo.plan.multi.replay.buffer(m)) >= 3000 for m in ("p0", "p1"))
    finally:
        algo.stop()
    prefilled = {m: result["replay"][m]["num_prefilled_steps"] for m in ("p0", "p1")}
    assert all(3000 <= n < 3000 + 500 for n in prefilled.values()), prefilled  # whole chunks, up to prefill_steps
    assert prefilled["p0"] % 500 == 0  # p0's recording: the expert's 500-step episodes
    with pytest.raises(ConfigError, match="is not a multi-agent recording"):
        config.copy().training(replay_buffer_config={"prefill_from": os.path.join(DATA, "cartpole_expert")}).validate()
