"""The off-policy plan: runners sample, chunks go into the replay stage, the learner trains on
replayed batches as often as the replay ratio allows, weights go out -- configured by DQN and SAC.

The replay ratio is the replay stage's rate limiter (Reverb's samples-per-insert): RLlib's
``training_intensity`` (transitions trained per transition sampled) is its ``samples_per_insert``,
``num_steps_sampled_before_learning_starts`` its ``min_size_to_sample``. Each training step
samples one round from every runner (``rollout_fragment_length`` steps per sub-env), inserts it,
then runs updates while the limiter allows a sample; prioritized replay gets the learner's TD
errors back as priorities.

A multi-agent run keeps one buffer per trainable module and updates every module on its own
replayed batch in one learner-group update, the ratio counted in ``count_steps_by`` units
(``pipeline.plans.offpolicy_multi_agent``); its replay stage is in-process only.

Settings come in RLlib's ``replay_buffer_config`` form (mixed into DQN's and SAC's configs by
``OffPolicySettings``) and are validated at ``build()``.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from actors.metrics import MetricsLogger
from actors.modules import ModelConfig
from actors.offline.reader import SAMPLER
from actors.replay import MAX_BATCHES_PER_CALL, ReplayBuffer, ReplaySettings
from pipeline.config.checks import is_int, is_number
from pipeline.groups.env_runner_group import EnvRunnerGroup
from pipeline.groups.learner_group import LearnerGroup
from pipeline.config.multi_agent import settings_used
from pipeline.config.offline import mixes_sampler
from protocols import nested

BUFFER_TYPES = {"EpisodeReplayBuffer": False, "uniform": False,
                "PrioritizedEpisodeReplayBuffer": True, "prioritized": True}
"""replay_buffer_config["type"] -> prioritized? (RLlib's class names, and runnel's short names)."""
MULTI_AGENT_UNBUILT = {"remote": "the replay actor is fed by runner streams, and multi-agent env runners do not "
                                 "stream"}
"""replay_buffer_config keys that multi-agent runs refuse, and why."""
BUFFER_KEYS = ("type", "capacity", "alpha", "beta", "epsilon", "samples_per_insert", "min_size_to_sample",
               "error_buffer", "timeout_s", "remote", "prefetch", "num_cpus", "prefill_from", "prefill_steps",
               "snapshot_interval_s", "snapshot_max_bytes")


@dataclass
class OffPolicySettings:
    """Settings of the off-policy plan, mixed into the configs of the algorithms that use it."""

    replay_buffer_config: dict = field(default_factory=lambda: {"type": "EpisodeReplayBuffer", "capacity": 50_000})
    """RLlib's keys -- ``type`` ("EpisodeReplayBuffer" or "PrioritizedEpisodeReplayBuffer"; also "uniform",
    "prioritized"), ``capacity`` (env steps), ``alpha``, ``beta``, ``epsilon`` (priority floor) -- and
    Reverb's rate limiter: ``samples_per_insert`` (default: ``training_intensity``), ``min_size_to_sample``
    (default: ``num_steps_sampled_before_learning_starts``), ``error_buffer``, ``timeout_s``. ``prefill_from``
    (a recording: directory, glob or list) fills the replay before training with up to ``prefill_steps``
    recorded steps (default: the capacity); they count toward ``min_size_to_sample`` but are not inserts,
    so the replay ratio holds from the first sampled step (a prefill unlocks no burst of updates). With
    ``remote`` (a replay actor the runners stream to): ``prefetch``, ``num_cpus``, and the snapshots a dead
    replay actor is recreated from -- ``snapshot_interval_s`` (default 60; None: none) while its arrays take
    at most ``snapshot_max_bytes`` (default 1 GiB; see ``pipeline.plans.offpolicy_streaming``)."""
    store_buffer_in_checkpoints: bool = False
    """Save the replay contents, sampler and limiter state with every checkpoint (a restored run continues exactly)."""
    num_steps_sampled_before_learning_starts: int = 1000
    """Env steps stored before the first update."""
    training_intensity: float | None = None
    """Transitions trained per transition sampled (the replay ratio); None: one update per training step."""
    n_step: int | list = 1
    """n-step returns, computed at sample time: an int, or ``[lo, hi]`` drawn per transition."""
    broadcast_interval: int = 1
    """With a remote replay stage: send new weights to the runners every this many updates."""

    def steps_per_training_step(self) -> int:
        return self.get_rollout_fragment_length() * self.num_envs_per_env_runner * max(1, self.num_env_runners)

    def replay_settings(self) -> ReplaySettings:
        c = dict(self.replay_buffer_config)
        batch, steps = self.train_batch_size_per_learner, self.steps_per_training_step()
        if self.external_clients_config is not None:  # a policy server's round may end one client chunk later
            from pipeline.config.external import external_settings

            steps += external_settings(self).fragment_length
        if mixes_sampler(self):  # recorded steps join each round: up to ratio * steps, plus one piece
            steps = int(steps * (2 + mix_ratio(self)))
        spi = c.get("samples_per_insert", self.training_intensity)
        if spi is None:  # one update of `batch` transitions per training step of `steps`
            spi = batch / steps
        # a band wide enough that one training step's inserts always fit after its updates drained
        # the samples allowed (the in-process loop inserts and samples in turns, never both at once)
        error_buffer = c.get("error_buffer", spi * steps + batch)
        n_step = tuple(self.n_step) if isinstance(self.n_step, (list, tuple)) else self.n_step
        return ReplaySettings(
            capacity=c.get("capacity", 50_000), prioritized=BUFFER_TYPES.get(c.get("type", "uniform"), False),
            alpha=c.get("alpha", 0.6), beta=c.get("beta", 0.4), epsilon=c.get("epsilon", 1e-6), n_step=n_step,
            gamma=self.gamma, samples_per_insert=spi,
            min_size_to_sample=c.get("min_size_to_sample", max(self.num_steps_sampled_before_learning_starts, batch)),
            error_buffer=error_buffer, timeout_s=c.get("timeout_s", 60.0), seed=self.seed)

    def offpolicy_problems(self) -> list[str]:
        problems = []
        c = self.replay_buffer_config
        if not isinstance(c, dict):
            return [f"replay_buffer_config must be a dict, got {type(c).__name__}"]
        for key in c:
            if key not in BUFFER_KEYS:
                close = difflib.get_close_matches(key, BUFFER_KEYS, n=2, cutoff=0.5)
                hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"valid keys: {list(BUFFER_KEYS)}"
                problems.append(f"unknown replay_buffer_config key {key!r}; {hint}")
        if c.get("remote", False) not in (True, False):
            problems.append(f"replay_buffer_config remote={c.get('remote')!r} must be True or False")
        if c.get("remote", False) and self.num_env_runners == 0 and self.external_clients_config is None:
            problems.append("replay_buffer_config remote=True needs num_env_runners >= 1: the runners stream to the "
                            "replay actor (with num_env_runners=0 use the in-process replay stage, remote=False; an "
                            "in-driver policy server for external clients may stream to it)")
        if c.get("prefill_from") is not None:
            problems += _prefill_problems(c, settings_used(self))
            if c.get("remote", False):
                problems.append("replay_buffer_config prefill_from fills the in-process replay stage: use it with "
                                "remote=False")
        if settings_used(self):
            problems += [f"replay_buffer_config {key}={c[key]!r} is not built for multi-agent runs yet (issue 27): "
                         f"{why}; leave it unset (the in-process replay keeps one buffer per trainable module)"
                         for key, why in MULTI_AGENT_UNBUILT.items() if c.get(key) not in (None, False)]
        interval, max_bytes = c.get("snapshot_interval_s", 60.0), c.get("snapshot_max_bytes", 1 << 30)
        if interval is not None and (not is_number(interval) or interval <= 0):
            problems.append(f"replay_buffer_config snapshot_interval_s={interval!r} must be a number of seconds > 0, "
                            f"or None (no snapshots of the remote replay)")
        if max_bytes is not None and (not is_int(max_bytes) or max_bytes < 0):
            problems.append(f"replay_buffer_config snapshot_max_bytes={max_bytes!r} must be an int >= 0, or None "
                            f"(no limit)")
        if not is_int(c.get("prefetch", 2)) or c.get("prefetch", 2) < 1:
            problems.append(f"replay_buffer_config prefetch={c.get('prefetch')!r} must be an int >= 1")
        if not is_int(self.broadcast_interval) or self.broadcast_interval < 1:
            problems.append(f"broadcast_interval must be an int >= 1, got {self.broadcast_interval!r}")
        if c.get("type", "uniform") not in BUFFER_TYPES:
            problems.append(f"replay_buffer_config type={c.get('type')!r} is not one of {list(BUFFER_TYPES)}")
        if not is_int(self.num_steps_sampled_before_learning_starts) or self.num_steps_sampled_before_learning_starts < 0:
            problems.append(f"num_steps_sampled_before_learning_starts must be an int >= 0, "
                            f"got {self.num_steps_sampled_before_learning_starts!r}")
        ti = self.training_intensity
        if ti is not None and (not is_number(ti) or ti <= 0):
            problems.append(f"training_intensity must be a number > 0 or None, got {ti!r}")
        if problems:
            return problems
        try:
            settings = self.replay_settings()
        except (TypeError, ValueError) as err:
            return [f"replay_buffer_config: {err}"]
        capacity = settings.capacity
        if is_int(capacity) and is_int(self.train_batch_size_per_learner) and capacity < self.train_batch_size_per_learner:
            problems.append(f"replay_buffer_config capacity={capacity} is smaller than a train batch "
                            f"({self.train_batch_size_per_learner}); raise the capacity")
        return problems + [f"replay: {p}" for p in settings.problems()]


def _prefill_problems(c: dict, multi_agent: bool) -> list[str]:
    from actors.offline import resolve_input
    from actors.offline.reader import resolve_modules_input

    problems = []
    steps = c.get("prefill_steps")
    if steps is not None and (not is_int(steps) or steps < 1):
        problems.append(f"replay_buffer_config prefill_steps={steps!r} must be an int >= 1 (or None: up to the capacity)")
    if multi_agent:  # each module's buffer from its own recording (its directory is checked when it is read)
        try:
            resolve_modules_input(c["prefill_from"], ())
        except (OSError, ValueError, TypeError) as err:
            problems.append(f"replay_buffer_config prefill_from={c['prefill_from']!r}: {err}")
        return problems
    try:
        if not resolve_input(c["prefill_from"]):
            raise ValueError("no shard files there")
    except (OSError, ValueError, TypeError) as err:
        problems.append(f"replay_buffer_config prefill_from={c['prefill_from']!r} names no recording ({err}): give "
                        f"a directory written by offline_data(output=...), a glob of its shard files, or a list")
    return problems


def prefill_replay(replay: ReplayBuffer, config: Any, runner_settings: Any, metrics: MetricsLogger,
                   module_id: str | None = None, spaces: tuple[Any, Any] | None = None) -> int:
    """One pass over the recording (in shuffled record order) into ``replay``, up to ``prefill_steps``; in a
    multi-agent run, module ``module_id``'s recording in it into that module's buffer, whose chunks hold
    ``spaces``."""
    from actors.offline import OfflineReader, ReaderSettings

    from actors.offline import manifest_for, resolve_input
    from protocols.spaces import space_to_dict

    c = config.replay_buffer_config
    source = c["prefill_from"] if module_id is None else os.path.join(os.path.expanduser(c["prefill_from"]), module_id)
    manifest = manifest_for(resolve_input(source))
    obs_space, act_space = spaces or (runner_settings.observation_space, runner_settings.action_space)
    for key, space in (("observation_space", obs_space), ("action_space", act_space)):
        recorded = (manifest or {}).get(key)
        if recorded is not None and space is not None and recorded != space_to_dict(space):
            raise ValueError(f"replay_buffer_config prefill_from={c['prefill_from']!r}: the recording's {key} "
                             f"{recorded} is not this algorithm's {space_to_dict(space)}: prefill from a recording "
                             f"of the same env")
    limit = int(c.get("prefill_steps") or replay.settings.capacity)
    modules = None if module_id is None else (module_id,)  # stamped with the module whose directory holds them
    reader = OfflineReader(runner_settings, offline=ReaderSettings(input_=c["prefill_from"], shuffle_buffer_size=0,
                                                                    seed=config.seed, modules=modules))
    stored = 0
    try:
        while stored < limit:
            chunks = reader.sample(num_timesteps=1)  # the next record's chunks
            if reader.epoch > 0:  # that was the start of a second pass: one pass is the prefill
                break
            try:
                stored += replay.prefill(chunks)
            except ValueError as err:
                raise ValueError(f"replay_buffer_config prefill_from={c['prefill_from']!r}: the recording does not "
                                 f"fit this algorithm's replay: {err}") from None
    finally:
        reader.stop()
    where = "replay" if module_id is None else f"replay/{module_id}"
    metrics.log_value(f"{where}/num_prefilled_steps", stored, reduce="max", window=1)
    return stored


def to_tensors(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A replayed batch (numpy, nested where observations are) as torch tensors on ``device``.
    Read-only arrays (decoded zero-copy from a frame) are copied: torch cannot alias them."""
    def tensor(a: Any) -> torch.Tensor:
        a = np.asarray(a)
        return torch.as_tensor(a if a.flags.writeable else a.copy(), device=device)

    return {k: nested.map_structure(tensor, v) for k, v in batch.items()}


@torch.no_grad()
def polyak(target: nn.Module, source: nn.Module, tau: float, prefixes: tuple[str, ...] = ()) -> None:
    """target <- tau * source + (1 - tau) * target (tau=1: a copy), for parameters whose names start
    with ``prefixes`` (all when empty); buffers are copied."""
    src = dict(source.named_parameters())
    for name, p in target.named_parameters():
        if not prefixes or name.startswith(prefixes):
            p.lerp_(src[name], tau)
    for (name, b), sb in zip(target.named_buffers(), source.buffers()):
        b.copy_(sb)


class OffPolicyPlan:
    """Synchronous with an in-process replay stage (the default): each step samples a round from the
    runners, inserts it, trains while the limiter allows a sample. With ``replay_buffer_config
    ["remote"]``: the replay stage is a Ray actor the runners stream to, and each step takes the
    replayed batches that arrived (``prefetch`` requests stay in flight, so sampling, replay and
    learning overlap) -- see ``StreamingReplay``."""

    @classmethod
    def of(cls, algo: Any) -> "OffPolicyPlan":
        """The plan of an off-policy algorithm (DQN, SAC, CQL) from what ``algo`` built: its groups, the spaces
        its chunks hold, its replay intake and its runners' observation view."""
        return cls(algo.config, algo.env_runner_group, algo.learner_group, algo.metrics,
                   algo.chunk_observation_space, algo.action_space, algo.compress_frames(),
                   runner_settings=algo.env_runner_settings(), multi_agent=algo.multi_agent,
                   intake=algo.replay_intake, view=algo.observation_view())

    def __init__(self, config: Any, env_runners: EnvRunnerGroup, learners: LearnerGroup, metrics: MetricsLogger,
                 observation_space: Any = None, action_space: Any = None, compress: bool = False,
                 runner_settings: Any = None, multi_agent: Any = None, intake: Any = None, view: Any = None) -> None:
        """``multi_agent``: a multi-agent run's ``MultiAgentSetup`` (None: single-agent); its training
        steps are ``MultiAgentOffPolicy``'s, one buffer per trainable module. ``intake``: the learner pipeline
        the replay stage runs on what it stores (``actors.replay.intake.ReplayIntake``). ``observation_space``:
        what chunks hold; ``view``: the runners' env-to-module view (frame stacking), rebuilt by the replay
        stage at each draw (``actors.replay.ReplayBuffer``)."""
        self.config, self.env_runners, self.learners, self.metrics = config, env_runners, learners, metrics
        settings = config.replay_settings()
        self.prioritized = settings.prioritized
        self.steps_per_training_step = config.steps_per_training_step()
        self.streaming = None
        self.replay: ReplayBuffer | Any = None  # or a SequenceReplay (recurrent DQN)
        self.multi = None
        self.mix = None
        if multi_agent is not None:
            from pipeline.plans.offpolicy_multi_agent import MultiAgentOffPolicy

            self.mix = RecordedMix(config, runner_settings) if mixes_sampler(config) else None
            self.multi = MultiAgentOffPolicy(config, settings, env_runners, learners, metrics, multi_agent, self.mix)
            if config.replay_buffer_config.get("prefill_from") is not None:
                for mid in self.multi.replay.module_ids:  # each trainable module's buffer from its own recording
                    prefill_replay(self.multi.replay.buffer(mid), config, runner_settings, metrics, mid,
                                   multi_agent.recorded_spaces([mid])[mid])
            return
        if config.replay_buffer_config.get("remote", False):
            from pipeline.plans.offpolicy_streaming import StreamingReplay

            self.streaming = StreamingReplay(config, settings, env_runners, learners, metrics, observation_space,
                                             action_space, compress, intake, view)
        elif recurrent(config):  # R2D2: whole chunks replayed as sequences with their stored states
            from actors.replay.sequences import SequenceReplay

            self.replay = SequenceReplay(settings, sequence_length(config), burn_in=getattr(config, "burn_in", False))
        else:
            self.replay = ReplayBuffer(settings, intake, view)
            if config.replay_buffer_config.get("prefill_from") is not None:
                prefill_replay(self.replay, config, runner_settings, metrics)
        self.mix = RecordedMix(config, runner_settings) if mixes_sampler(config) else None

    def training_step(self) -> None:
        if self.multi is not None:
            self.multi.training_step()
            return
        if self.streaming is not None:
            self.streaming.training_step()
            return
        m, batch_size = self.metrics, self.config.train_batch_size_per_learner
        with m.log_time("timers/env_runner_sampling_timer"):
            chunks = self.env_runners.sample(self.steps_per_training_step, m)
        if self.mix is not None:
            chunks = chunks + self.mix.sample(sum(len(c) for c in chunks), m)
        with m.log_time("timers/replay_insert"):
            self.replay.add(chunks)
        timestep = m.peek("env_runners/num_env_steps_sampled_lifetime", 0)
        with m.log_time("timers/learner_update_timer", reduce="sum"):
            while (k := self.batches_ready(batch_size)) > 0:
                # all the updates the replay ratio allows now in one call: one draw, one tensor conversion,
                # one priority update (priorities within the call are those of its start, as with a
                # learner a few batches behind its replay -- Ape-X, Reverb)
                batch = self.replay.sample(batch_size, num_batches=k)
                _, outputs = self.learners.update(batch, timestep, m, with_outputs=self.prioritized, num_batches=k)
                if self.prioritized and outputs:  # none: the learners refused the batch
                    self.replay.update_priorities(batch["indices"], outputs["td_error"])
        with m.log_time("timers/synch_weights"):
            weights = self.learners.get_weights(inference_only=True)
            self.env_runners.sync_weights(weights, self.learners.weights_version, int(timestep))
        m.merge(self.replay.get_metrics(), prefix="replay")

    def batches_ready(self, batch_size: int) -> int:
        """How many batches the rate limiter lets the learner take now (at most ``MAX_BATCHES_PER_CALL``)."""
        k = 0
        while k < MAX_BATCHES_PER_CALL and self.replay.can_sample(batch_size * (k + 1)):
            k += 1
        return k

    def get_state(self) -> dict[str, Any]:
        """The replay's state, or (``store_buffer_in_checkpoints=False``) only its intake's, if it has one."""
        if not self.config.store_buffer_in_checkpoints:
            intake = self._intake_state()
            return {} if intake is None else {"intake": intake}
        if self.multi is not None:
            return self.multi.get_state()
        return self.streaming.get_state() if self.streaming is not None else self.replay.get_state()

    def _intake_state(self) -> dict[str, Any] | None:
        if self.multi is not None:  # by module
            return self.multi.replay.get_intake_states() or None
        if self.streaming is not None:
            res = self.streaming.group.foreach_actor("get_intake_state")
            return res[0].value if res and res[0].ok else None
        return self.replay.get_intake_state()

    def set_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if "storage" not in state and "replay" not in state and state.get("intake") is not None:
            # the intake's state alone: the buffer was left out of the checkpoint
            if self.multi is not None:
                self.multi.replay.set_intake_states(state["intake"])
            elif self.streaming is not None:
                self.streaming.group.foreach_actor("set_intake_state", state["intake"])
            else:
                self.replay.set_intake_state(state["intake"])
        elif self.multi is not None:
            self.multi.set_state(state)
        elif self.streaming is not None:
            self.streaming.set_state(state)
        else:
            self.replay.set_state(state)

    def stop(self) -> None:
        if self.mix is not None:
            self.mix.stop()
        if self.multi is not None:
            self.multi.stop()
        elif self.streaming is not None:
            self.streaming.stop()
        else:
            self.replay.stop()


def recurrent(config: Any) -> bool:
    """The module is recurrent (``model_config`` ``use_lstm``): its replay holds sequences."""
    return isinstance(config.model_config, dict) and bool(config.model_config.get("use_lstm"))


def sequence_length(config: Any) -> Any:
    """A recurrent module's ``max_seq_len`` (its steps per stored sequence), the module default when unset."""
    model = config.model_config if isinstance(config.model_config, dict) else {}
    return model.get("max_seq_len", ModelConfig.max_seq_len)


def mix_ratio(config: Any) -> float:
    """Recorded steps per sampled step of an ``input_`` that mixes in the sampler."""
    shares = config.offline_data_config["input_"]
    return sum(float(p) for k, p in shares.items() if k != SAMPLER) / float(shares[SAMPLER])


class RecordedMix:
    """``input_={"sampler": p, "DIR": q, ...}``: next to each round the env runners sample, recorded steps
    in the proportion ``sum(q) / p`` go into the replay (inserts like any other: the replay ratio holds).
    Records are handed out in pieces of at most one round, so a long recorded episode never needs
    more room in the rate limiter's band than a round does."""

    def __init__(self, config: Any, runner_settings: Any) -> None:
        from actors.offline import OfflineReader
        from pipeline.config.offline import reader_settings

        self.ratio = mix_ratio(config)
        self.piece = max(1, config.steps_per_training_step())
        self.reader = OfflineReader(runner_settings, offline=reader_settings(config))
        self._pending: list = []
        self._owed = 0.0

    def sample(self, sampled_steps: int, metrics: MetricsLogger) -> list:
        self._owed += sampled_steps * self.ratio
        out, n = [], 0
        while self._owed - n >= 1:
            if not self._pending:
                self._pending = [p for c in self.reader.sample(num_timesteps=1) for p in c.split(self.piece)]
            piece = self._pending.pop(0)
            out.append(piece)
            n += len(piece)
        self._owed -= n  # the last piece may run past what was owed: the next round takes less
        if n:
            metrics.log_value("offline_data/num_env_steps_read_lifetime", n, reduce="lifetime_sum")
        return out

    def stop(self) -> None:
        self.reader.stop()
