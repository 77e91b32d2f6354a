"""Named pieces the tests hand to Ray actors: policy mapping functions, connector factories, callbacks.

An actor unpickles a named function or class by importing the module that defines it. A test module imports
``pipeline`` (and with it torch and ray.tune, seconds of CPU per process), so a piece defined there makes every
runner and learner actor that receives it pay for that import; defined here, it costs the actor nothing more
than ``actors`` (as ``tests.envs`` does for envs). Keep this module free of ``pipeline`` imports.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import numpy as np
import ray

from actors.callbacks import Callbacks
from actors.connectors import ClipRewards, FrameStackingEnvToModule, LearnerConnector, MeanStdFilter, ModuleToEnvConnector
from protocols.codec import encode
from protocols.multi_agent_episode import MultiAgentEpisode


def by_agent(agent_id: Any, episode: Any = None, **kwargs: Any) -> str:
    """Agent ``k`` acts with module ``"pk"``."""
    return f"p{agent_id}"


def against_snapshot(agent_id: Any, episode: Any, **kwargs: Any) -> str:
    """Self-play: agent 0 plays the learning module, agent 1 the frozen snapshot of it."""
    return "p0" if agent_id == 0 else "p0_v1"


def mean_std(env: Any) -> MeanStdFilter:
    return MeanStdFilter()


def stack4(env: Any) -> FrameStackingEnvToModule:
    return FrameStackingEnvToModule(num_frames=4)


RECREATED: list = []
"""What ``RecordRecreation`` heard in the driver: (env runner indices, is_evaluation) per recreation."""


class RecordRecreation(Callbacks):
    def on_env_runners_recreated(self, *, algorithm, env_runner_group, env_runner_indices, is_evaluation, **kw):
        RECREATED.append((list(env_runner_indices), is_evaluation))


class RecordTrainedChunks(Callbacks):
    """In each learner: the pieces of chunks it trained on, by id."""

    def __init__(self):
        super().__init__()
        self.trained = []

    def on_learn_on_batch(self, *, train_batch, **kwargs):
        self.trained += [(c.episode_id, c.chunk_index, c.t_started, len(c), c.env_runner_index, c.weights_version)
                         for c in train_batch]


def stack3(env: Any) -> FrameStackingEnvToModule:
    return FrameStackingEnvToModule(num_frames=3)


def loaded_modules(_learner: Any = None) -> list[str]:
    """The modules imported in the calling process (run on a learner actor via ``foreach_learner``: this
    module imports nothing of ``pipeline``, so shipping the function adds nothing to the answer)."""
    import sys

    return sorted(sys.modules)


# --- test_evaluation: callbacks in remote runners, evaluators and learners ---------------------------------
class Overlap(Callbacks):
    """The learner (inside the training step) marks that it started and waits for an evaluator,
    acting with the same weights, to see the mark: only evaluation running during the training step
    can answer it."""

    def on_learn_on_batch(self, *, train_batch, result, **kwargs):
        log = ray.get_actor("overlap_log")
        version = train_batch[0].weights_version
        ray.get(log.mark.remote(f"learning_on_v{version}"))
        result["overlap_seen"] = float(ray.get(log.wait_for.remote(f"evaluator_saw_v{version}", 120)))

    def on_sample_end(self, *, env_runner, samples, **kwargs):
        if env_runner.config.in_evaluation:
            log = ray.get_actor("overlap_log")
            version = env_runner.weights_version
            if ray.get(log.seen.remote(f"learning_on_v{version}")):
                ray.get(log.mark.remote(f"evaluator_saw_v{version}"))


class EpisodesPerRunner(Callbacks):
    def on_sample_end(self, *, env_runner, samples, metrics_logger, **kwargs):
        if env_runner.config.in_evaluation:
            metrics_logger.log_value(f"episodes_on_{env_runner.worker_index}", len(samples), reduce="sum")

    def on_episode_end(self, *, env_runner, metrics_logger, **kwargs):
        metrics_logger.log_value("pid", os.getpid(), reduce="max")


class BrokenInRunner(Callbacks):
    def on_sample_end(self, **kwargs):
        raise KeyError("no such thing")


# --- test_replay_learner_connector: a learner pipeline with state, run where the replay stage is -----------
class CountSteps(LearnerConnector):
    """Keeps a count of the steps it has seen (state a checkpoint must carry) and halves the observations."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen = 0

    def __call__(self, chunks):
        self.seen += sum(len(c) for c in chunks)
        return [dataclasses.replace(c, obs=c.obs * 0.5) for c in chunks]

    def get_state(self):
        return {"seen": self.seen}

    def set_state(self, state):
        self.seen = int(state["seen"])


def counting_pieces(obs_space, act_space):  # module level: a checkpoint names it
    return [ClipRewards(limit=0.25), CountSteps()]


# --- test_atari: what a learner actor trains on -----------------------------------------------------------
class FrameCheck(Callbacks):
    """Reports whether every chunk a learner trains on holds 84x84x1 uint8 frames."""

    def on_learn_on_batch(self, *, train_batch, result, **kwargs):
        result["uint8_frames"] = float(all(c.obs.dtype == np.uint8 and c.obs.shape[1:] == (84, 84, 1)
                                           for c in train_batch))


# --- test_compat: a user function that fails in a runner -------------------------------------------------------
def boom(runner):
    raise ValueError(f"user function failed on runner {runner.worker_index}")


# --- test_external_multi_agent: agent ids of both kinds ------------------------------------------------------
def by_str_or_int_agent(agent_id: Any, episode: Any, **kwargs: Any) -> str:
    """Agents 0 and "a" (and any str but "b") act with p0, 1 and "b" with p1; other ints map to no module."""
    return {0: "p0", 1: "p1", "b": "p1"}.get(agent_id, "p0" if isinstance(agent_id, str) else f"p{agent_id}")


# --- test_offline_crash: what the driver's learner trained on, by id and content --------------------------------
COLLECTED: list = []
"""(episode id, chunk index, digest) of every chunk ``Collect`` saw, in the process whose learner ran it."""


def digest(chunk: Any) -> str:
    return hashlib.sha1(encode(chunk, compress=False)).hexdigest()


class Collect(Callbacks):
    def on_learn_on_batch(self, *, policy, train_batch, result, **kw):
        COLLECTED.extend((c.episode_id, c.chunk_index, digest(c)) for c in train_batch)


# --- test_multi_agent_eval: per-agent metrics from runners and evaluators ------------------------------------
class AgentReturns(Callbacks):
    """Logs each agent's return as a custom metric, counts the hooks, and checks what they are given."""

    def on_episode_start(self, *, episode, env_runner, metrics_logger, env_index, rl_module, **kwargs):
        assert isinstance(episode, MultiAgentEpisode) and episode.env_steps() == 0
        assert set(rl_module.members) == set(env_runner.module_ids)
        metrics_logger.log_value("episodes_started", 1, reduce="sum")

    def on_episode_step(self, *, episode, metrics_logger, **kwargs):
        assert isinstance(episode, MultiAgentEpisode)
        metrics_logger.log_value("episode_steps_seen", 1, reduce="sum")

    def on_episode_end(self, *, episode, env_runner, metrics_logger, env, **kwargs):
        assert isinstance(episode, MultiAgentEpisode) and episode.is_done
        for agent_id, ret in episode.agent_returns.items():
            metrics_logger.log_value(f"agent_return/{agent_id}", ret)
        metrics_logger.log_value("in_evaluation", float(env_runner.config.in_evaluation), reduce="max")

    def on_sample_end(self, *, env_runner, samples, metrics_logger, **kwargs):
        assert {c.module_id for c in samples} <= set(env_runner.module_ids)
        assert {c.agent_id for c in samples} <= {"0", "1", 0, 1}
        metrics_logger.log_value("sampled_chunks", len(samples), reduce="sum")

    def on_train_result(self, *, algorithm, result, **kwargs):
        result["modules_seen"] = sorted(result["env_runners"]["module_episode_returns_mean"])


# --- test_multi_agent_module_to_env: a module-to-env piece with state ----------------------------------------
class ShiftFor(ModuleToEnvConnector):
    """Sends the env ``(action + shift) % 3``, records what the module chose; counts its calls and rows (its
    state)."""

    def __init__(self, shift: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.shift, self.calls, self.rows = shift, 0, 0

    def __call__(self, batch, *, observations=None, explore=True):
        self.calls += 1
        self.rows += len(batch["actions"])
        assert len(observations) == len(batch["actions"]) and observations.shape[1:] == (1,)
        return {**batch, "actions_for_env": (batch["actions"] + self.shift) % 3}

    def get_state(self):
        return {"calls": self.calls, "rows": self.rows}

    def set_state(self, state):
        self.calls, self.rows = state["calls"], state["rows"]


# --- test_connector_pipelines: what a learner trained on after its pipeline ----------------------------------
class SeenRewards(Callbacks):
    """Keeps the largest reward of every batch a learner trains on (after its pipeline)."""

    seen: list[float] = []

    def on_learn_on_batch(self, *, policy, train_batch, result, **kwargs):
        SeenRewards.seen.append(max(float(np.max(c.rewards)) for c in train_batch))


def optimizer_steps(learner) -> int:
    """Steps the learner's default optimizer has taken (its Adam's step count; 0 before the first)."""
    state = learner.optimizers["default"].optimizer.state
    return max((int(s["step"]) for s in state.values() if "step" in s), default=0)
