"""The asynchronous plan: runners stream, a loader queues train batches, the learner updates, weights
go out every ``broadcast_interval`` updates -- one loop that IMPALA and APPO configure.

Env runners never wait for the learner: each samples ``rollout_fragment_length`` steps per sub-env
at a time in a background thread and pushes the fragment's chunks over ZeroMQ to the driver,
stamped with the ``weights_version`` that acted. A loader thread (``ChunkReceiver``) decodes and
checks them and cuts train batches of ``train_batch_size_per_learner`` steps into a queue of
``learner_queue_size``; a full queue stops the loader reading, and the sockets' high-water marks
then block the runners -- memory stays bounded.

Each training step takes a batch from a *batch source* (``FreshBatches``: each queued batch once;
APPO's circular buffer: reuse), makes one learner update, and reports the weights lag (learner
version minus the versions that sampled the batch). Every ``broadcast_interval`` updates the
weights are ``ray.put`` once and sent to every runner without waiting; runners apply them between
fragments. The env runner group polls the runners (metrics, health) and recreates failed ones.

While streaming, env steps count as sampled when the loader receives them, so nothing is counted
as sampled before it can be trained on. The loader drops a chunk it has already received and counts it
(``stream/num_chunks_dropped_duplicate``); every step received is batched once or still pending
(``stream/num_env_steps_batched``, ``stream/num_env_steps_pending``); a runner lost while streaming (its
actor or node died) is reported to the loader, which counts the episodes it left unfinished
(``stream/num_episodes_cut``) and the fragment it was sampling (``stream/num_fragments_lost``).

With ``num_learners=n > 0`` there is no loader in the driver: each learner actor receives its own share
of the streams (runner i pushes to learner ``i mod n``), cuts its own batches and keeps its own batch
source and target networks (``actors.learner.feed``); a training step updates every learner once, each
on its own batch, gradients averaged, once all have one (``pipeline.plans.learner_feeds``), and weights
go out from learner 0. Counters and queue depths are summed over the learners. A remote learner that dies
is rebuilt in the job (``pipeline.plans.learner_feeds``); the runners that streamed to it are re-pointed
to its replacement, and the env steps they had sent it that it never trained on are counted in
``fault_tolerance/num_env_steps_lost_with_learners``. With external clients the env runner slots host policy
servers (``actors.external.policy_server``), which stream what their clients send the same way: server i
pushes to learner ``i mod n``, and is re-pointed like a runner when its learner is rebuilt (the chunks the dead
learner held had been acknowledged to their clients; they are lost and counted as a runner's would be).

Multi-agent runs (``multi_agent``: the run's ``MultiAgentSetup``) stream the same way from
``MultiAgentEnvRunner``s. The loader checks each chunk against its module's spaces and cuts
``ModuleBatches`` (the next ``train_batch_size_per_learner`` agent steps, laid out per module; see
``actors.learner.loader``); one update of the ``MultiLearnerGroup`` trains every trainable module on its
part (APPO: each module's learner keeps its own target network; the circular buffer reuses whole
multi-module batches); the flat ``{"<module_id>/<param>": array}`` weights go out. Chunks hold agent
steps, so here env and agent steps count as sampled where the runners report them, and a batch's env
steps trained are its agent steps times the runners' env-to-agent step ratio so far. With
``num_learners=n > 0`` each learner actor is a ``MultiLearner`` whose ``ModuleFeed`` cuts every module's
steps into batches of their own (``train_batch_size_per_learner`` agent steps of that module); an update
steps the modules every learner holds a batch of, on all learners at once (the gradient all-reduces must
pair up), and a module's batches wait until every learner has one (``pipeline.plans.learner_feeds``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from actors.env.streaming import stream_sender_id
from actors.learner import ChunkBatch
from actors.learner.feed import BatchSource, FeedSettings, FreshBatches
from actors.learner.loader import ChunkReceiver, ModuleBatches
from actors.metrics import MetricsLogger
from pipeline.algorithm_multi_agent import MultiAgentSetup
from pipeline.config.checks import is_int, is_number
from pipeline.config.multi_agent import settings_used
from pipeline.groups.env_runner_group import EnvRunnerGroup
from pipeline.groups.learner_group import LearnerGroup
from pipeline.plans.learner_feeds import LearnerFeeds
from protocols.transport import SENDER_COUNTERS


@dataclass
class AsyncPlanSettings:
    """Settings of the asynchronous plan, mixed into the configs of the algorithms that use it."""

    synchronous_sampling: ClassVar[bool] = False

    num_envs_per_env_runner: int = 16
    """Sub-environments each runner steps as one vector."""
    rollout_fragment_length: int | str = 50
    """Steps per sub-env in each streamed fragment (one ZeroMQ frame per fragment)."""
    min_time_s_per_iteration: float | None = 1.0
    """Each ``train()`` runs training steps for at least this long."""
    broadcast_interval: int = 1
    """Send new weights to the runners every this many updates."""
    learner_queue_size: int = 4
    """Train batches the loader thread may hold ready for the learner; when full it stops reading
    (back-pressure reaches the runners as credits they do not get, ``stream_frames_in_flight``)."""
    learner_queue_timeout: float = 300.0
    """Raise (naming runners and drop counters) if no train batch arrives for this many seconds."""
    stream_frames_in_flight: int | None = 1
    """Fragments each runner may have sent that its receiver has not read yet (credit-based flow control,
    see ``protocols.transport``): a learner slower than its runners stops them after this many each, so
    the data it trains on lags by a known number of updates whatever the frame size. 1 is enough to
    keep a learner that keeps up fed (the runner samples its next fragment while one is in flight);
    raise it for links with a long round trip. None: no credit, only ``stream_hwm`` and
    ``stream_socket_buffer_bytes`` bound what waits (measured: ~25 of a learner's batches per runner with
    two learners on 2 cores, and no learning)."""
    stream_hwm: int = 4
    """ZeroMQ high-water mark, in frames (fragments), of each runner's send queue and the receiver's
    per-runner receive queue (what bounds the queues without ``stream_frames_in_flight``)."""
    stream_socket_buffer_bytes: int = 256 * 1024
    """Kernel send/receive buffer of each stream socket: bounds the data in flight beyond the high-water
    marks (0 = the OS default, which on loopback holds many MB, i.e. hundreds of stale fragments)."""
    max_weights_lag: int | str | None = None
    """Drop streamed fragments acted by weights more than this many updates older than the learner's,
    counted in ``stream/num_env_steps_dropped_stale`` (Sample Factory's ``max_policy_lag``): a learner
    slower than its runners otherwise trains on fragments that waited in the socket buffers for dozens of
    updates (measured: a lag of ~90 updates with two learners on a loaded machine, and no learning).
    "auto": 4x the lag a fragment has when nothing waits -- the updates the other runners' fragments pay
    for while it is sampled, ``runners * envs * fragment / (learners * batch)`` -- and at least 32 (healthy
    CartPole runs lag ~5 updates, up to ~30 now and then); it grows with the number of runners, so a large
    cluster keeps its healthy data. None (the default for now) keeps every fragment: dropped fragments
    still count as sampled, and with "auto" a two-agent APPO run on a loaded machine missed its test's
    env-step budget (the drops' part in that not measured apart from the load) -- whether "auto" should
    be the default awaits measurements on a quiet machine."""
    stream_compress: bool | str = "auto"
    """LZ4-compress streamed frames: True, False, or "auto" = compress when observations hold integer
    (pixel-like) arrays, which shrink 20x and more, and not for float vectors, which shrink ~1.3x
    for ~17% of sampling throughput on CartPole."""
    def async_plan_problems(self) -> list[str]:
        problems = []
        if self.stream_compress not in (True, False, "auto"):
            problems.append(f"stream_compress must be True, False or 'auto', got {self.stream_compress!r}")
        problems += self.remote_learner_problems()
        if not is_int(self.stream_socket_buffer_bytes) or self.stream_socket_buffer_bytes < 0:
            problems.append(f"stream_socket_buffer_bytes must be an int >= 0, got {self.stream_socket_buffer_bytes!r}")
        for key in ("broadcast_interval", "learner_queue_size", "stream_hwm"):
            if not is_int(getattr(self, key)) or getattr(self, key) < 1:
                problems.append(f"{key} must be an int >= 1, got {getattr(self, key)!r}")
        window = self.stream_frames_in_flight
        if window is not None and (not is_int(window) or window < 1):
            problems.append(f"stream_frames_in_flight must be None or an int >= 1, got {window!r}")
        lag = self.max_weights_lag
        if lag is not None and lag != "auto" and (not is_int(lag) or lag < 0):
            problems.append(f"max_weights_lag must be 'auto', None or an int >= 0, got {lag!r}")
        for key in ("learner_queue_timeout",):
            if not is_number(getattr(self, key)) or getattr(self, key) <= 0:
                problems.append(f"{key} must be a number > 0, got {getattr(self, key)!r}")
        return problems

    def remote_learner_problems(self) -> list[str]:
        """What ``num_learners > 0`` needs: a single-agent run fed by env runners (or policy servers for external
        clients), at least one per learner."""
        n = self.num_learners
        if not is_int(n) or n == 0:
            return []
        if settings_used(self) and callable(self.policies_to_train):
            return [f"{self.algo_name} with num_learners={n} takes policies_to_train as module ids, not a function: "
                    f"the function is asked per batch in the driver, and with num_learners > 0 the learners receive "
                    f"the streams themselves; give .multi_agent(policies_to_train=[...]) or set "
                    f".learners(num_learners=0)"]
        runners = self.num_env_runners
        if n > 1 and is_int(runners) and runners < n:
            # with external clients each env runner slot hosts a policy server, and servers feed learners alike
            what = "policy server slots" if self.external_clients_config is not None else "env runners"
            return [f"num_learners={n} needs num_env_runners >= {n}: each learner trains on the streams of its own "
                    f"{what} (runner i feeds learner i mod {n}), got num_env_runners={runners}; raise "
                    f"num_env_runners or lower num_learners"]
        return []


def max_weights_lag(config: Any) -> int | None:
    """``config.max_weights_lag`` with "auto" worked out (see its docstring)."""
    if config.max_weights_lag != "auto":
        return config.max_weights_lag
    runners = max(1, config.num_env_runners)  # 0: the local runner streams
    fragment = config.num_envs_per_env_runner * config.get_rollout_fragment_length()
    update = max(1, config.num_learners) * config.train_batch_size_per_learner
    return max(32, math.ceil(4 * runners * fragment / update))


class AsyncPlan:
    def __init__(self, config: Any, env_runners: EnvRunnerGroup, learners: LearnerGroup, metrics: MetricsLogger,
                 observation_space: Any, action_space: Any, *, compress: bool, batches: BatchSource | None = None,
                 multi_agent: MultiAgentSetup | None = None) -> None:
        """``batches``: the learner's batch source (default ``FreshBatches``); with remote learners each
        learner gets its own copy."""
        self.config, self.env_runners, self.learners, self.metrics = config, env_runners, learners, metrics
        self.multi_agent = multi_agent
        module_spaces = None
        if multi_agent is not None:
            module_spaces = {mid: (spec.observation_space, spec.action_space)
                             for mid, spec in multi_agent.plan.module_specs.items()}
            env_runners.receiver_counts_env_steps = False
        self.batches = FreshBatches() if batches is None else batches
        self.receiver: ChunkReceiver | None = None
        """The driver's loader (``num_learners=0``); None when the learners receive the streams (``feeds``)."""
        self.feeds: LearnerFeeds | None = None
        """The remote learners' own receivers (``num_learners > 0``)."""
        if learners.local is not None:
            self.receiver = ChunkReceiver(
                observation_space, action_space, config.train_batch_size_per_learner,
                queue_size=config.learner_queue_size, hwm=config.stream_hwm, rcvbuf=config.stream_socket_buffer_bytes,
                device=learners.local.device, module_spaces=module_spaces,
                max_weights_lag=max_weights_lag(config),
                observation_view=getattr(learners.local, "observation_view", None),
                learner_connector=getattr(learners.local, "learner_connector", None),
                module_connector=getattr(learners.local, "module_connector", None),
                module_view=getattr(learners.local, "module_view", None)).start()
            address: str | list[str] = self.receiver.address
        else:
            settings = FeedSettings(config.train_batch_size_per_learner, config.learner_queue_size, config.stream_hwm,
                                    config.stream_socket_buffer_bytes, max_weights_lag(config), module_spaces)
            self.feeds = LearnerFeeds(learners, settings, self.batches, config.learner_queue_timeout,
                                      env_steps_of=self._env_steps_of if multi_agent is not None else None)
            address = self.feeds.addresses  # runner i streams to learner i mod n
            metrics.log_value("fault_tolerance/num_env_steps_lost_with_learners", 0, reduce="lifetime_sum")
        self.stream_args = {"address": address, "hwm": config.stream_hwm, "window": config.stream_frames_in_flight,
                            "compress": compress, "sndbuf": config.stream_socket_buffer_bytes,
                            "stall_timeout_s": config.env_runner_health_probe_timeout_s}
        self._last_batch_at = time.monotonic()
        self._received_counted = 0  # env steps of the receiver already logged as sampled
        self._streaming = False

    def training_step(self) -> None:
        if not self._streaming:
            self.env_runners.start_streaming(**self.stream_args)
            self._streaming = True
        if self.feeds is None:
            with self.metrics.log_time("timers/learner_wait_for_batch", reduce="sum"):
                batch = self.batches.next(self._take)
            if batch is not None:
                self._update(batch)
        else:
            with self.metrics.log_time("timers/learner_wait_for_batch", reduce="sum"):
                ready = self.feeds.wait_ready(0.1)  # briefly: the plan comes back soon to poll the runners
            if ready:
                self._update_remote()
            self._follow_moved_learners()
        self.env_runners.poll(self.metrics, self.config.env_runner_metrics_interval_s)
        lost = self.env_runners.take_lost_streams()
        if self.receiver is not None:  # remote learners' feeds keep their own counts of what arrived
            for i in lost:
                self.receiver.sender_lost(stream_sender_id(i))
        self._log_stream()

    def add_module(self, module_id: str, observation_space: Any, action_space: Any) -> None:
        """A module added to the multi-agent run (``Algorithm.add_module``): the receivers take its chunks from
        now on -- call before any runner maps an agent to it."""
        if self.receiver is not None:
            self.receiver.add_module(module_id, observation_space, action_space)
        else:
            self.feeds.add_module(module_id, observation_space, action_space)

    def pause_streams(self) -> None:
        """Stop the runners' sampling threads (a runner removes a module only while it does not stream); the
        next training step starts them again."""
        self.env_runners.stop_streaming()
        self._streaming = False

    def remove_module(self, module_id: str) -> None:
        """A module removed from the run: its chunks are dropped from now on (counted as invalid)."""
        if self.receiver is not None:
            self.receiver.remove_module(module_id)
        else:
            self.feeds.remove_module(module_id)

    def _take(self, timeout: float) -> ChunkBatch | ModuleBatches | None:
        batch = self.receiver.get_batch(timeout=timeout)
        now = time.monotonic()
        if batch is not None:
            self._last_batch_at = now
            self.metrics.log_value("learner_queue/size_mean", self.receiver.qsize())
        elif now - self._last_batch_at > self.config.learner_queue_timeout:
            s = self.receiver.stats()
            raise RuntimeError(
                f"no train batch arrived for {now - self._last_batch_at:.0f} s (learner_queue_timeout="
                f"{self.config.learner_queue_timeout}); healthy env runners: {self.env_runners.num_healthy()}, "
                f"frames received: {s['num_frames_received']}, dropped: "
                f"{s['num_frames_dropped_decode_error'] + s['num_frames_dropped_bad_envelope']} frames and "
                f"{s['num_chunks_dropped_invalid']} chunks (see the log for why)")
        return batch

    def _update(self, batch: ChunkBatch | ModuleBatches) -> None:
        """One learner update on ``batch``: weights lag, the update, and a broadcast when due."""
        m = self.metrics
        versions, steps = batch.weights_versions()
        lag = self.learners.weights_version - versions
        m.log_value("stream/weights_lag_mean", float((lag * steps).sum() / steps.sum()))
        m.log_value("stream/weights_lag_max", int(lag.max()), reduce="max")
        timestep = m.peek("env_runners/num_env_steps_sampled_lifetime", 0)
        env_steps = {} if self.multi_agent is None else {"num_env_steps": self._env_steps_of(batch.num_steps)}
        with m.log_time("timers/learner_update", reduce="sum"):
            self.learners.update(batch, timestep, m, **env_steps)
        self.receiver.set_weights_version(self.learners.weights_version)
        self._broadcast_if_due(timestep)

    def _update_remote(self) -> None:
        """One update of every remote learner, each on a batch of its own stream, then a broadcast when due."""
        m = self.metrics
        timestep = m.peek("env_runners/num_env_steps_sampled_lifetime", 0)
        with m.log_time("timers/learner_update", reduce="sum"):
            self.feeds.update(timestep, self.learners.weights_version, m)
        self.learners.snapshot_if_due()
        self._broadcast_if_due(timestep)

    def _follow_moved_learners(self) -> None:
        """After a learner was recreated: its runners stream to the new learner's receiver, and what they had
        sent the dead one that it never trained on is counted as lost (those frames are never sent again)."""
        moved = self.feeds.take_moved()
        if not moved:
            return
        self.stream_args = {**self.stream_args, "address": list(self.feeds.addresses)}
        self.env_runners.start_streaming(**self.stream_args)  # only the runners whose address changed restart
        totals = [r.value for r in self.env_runners.manager.foreach_actor("stream_totals") if r.ok]
        lost = sum(max(0, sum(t.get(address, 0) for t in totals) - trained) for address, trained in moved.items())
        self.metrics.log_value("fault_tolerance/num_env_steps_lost_with_learners", lost, reduce="lifetime_sum")

    def _broadcast_if_due(self, timestep: int) -> None:
        if self.learners.weights_version % self.config.broadcast_interval == 0:
            weights = self.learners.get_weights(inference_only=True)  # with remote learners: learner 0's
            if self.multi_agent is not None:  # multi-agent runners follow their schedules in count_steps_by units
                timestep = self.multi_agent.runner_timestep(self.metrics, timestep)
            self.env_runners.sync_weights(weights, self.learners.weights_version, int(timestep), wait=False)

    def _env_steps_of(self, agent_steps: int) -> int:
        """The env steps behind ``agent_steps`` of a multi-agent stream, at the runners' ratio so far
        (the chunks count agent steps; only the runners know the env steps they took)."""
        m = self.metrics
        env = m.peek("env_runners/num_env_steps_sampled_lifetime", 0)
        agents = m.peek("env_runners/num_agent_steps_sampled_lifetime", 0)
        return round(agent_steps * env / agents) if agents else agent_steps

    def _stream_stats(self) -> tuple[dict[str, Any], dict[str, int], dict[str, int], int]:
        """The receivers' counters, drops by sender, the batch sources' stats and the learner queues'
        capacity: the driver's loader's, or summed over the remote learners' feeds."""
        if self.feeds is None:
            s = self.receiver.stats()
            return s, dict(self.receiver.dropped_by_sender), self.batches.stats(), self.config.learner_queue_size
        s = self.feeds.stats()
        return s, s["dropped_by_sender"], s["source"], self.config.learner_queue_size * self.feeds.num_learners

    def _log_stream(self) -> None:
        m = self.metrics
        s, dropped_by_sender, source, capacity = self._stream_stats()
        received = s.get("num_env_steps_received", 0)
        new, self._received_counted = received - self._received_counted, received
        if self.multi_agent is None:
            m.log_value("env_runners/num_env_steps_sampled", new, reduce="sum")
            m.log_value("env_runners/num_env_steps_sampled_lifetime", new, reduce="lifetime_sum")
        else:  # the runners' reports count the env and agent steps (fold_metrics); these are the rows received
            m.log_value("stream/num_agent_steps_received", received, reduce="max", window=1)
        for key in SENDER_COUNTERS:  # runners add theirs: in results from the start
            m.log_value(f"stream/runner_{key}", 0, reduce="lifetime_sum")
        for key in ("num_frames_received", "num_chunks_received", "num_frames_dropped_decode_error",
                    "num_frames_dropped_bad_envelope", "num_frames_dropped_not_chunks", "num_chunks_dropped_invalid",
                    "num_env_steps_dropped", "num_chunks_dropped_duplicate", "num_chunks_missing", "num_episodes_cut",
                    "num_fragments_lost", "num_env_steps_batched", "num_env_steps_pending", "num_env_steps_dropped_stale"):
            m.log_value(f"stream/{key}", s.get(key, 0), reduce="max", window=1)  # window=1: the latest value
        for sender, n in dropped_by_sender.items():
            m.log_value(f"stream/num_dropped_by_sender/{sender.replace('/', '_')}", n, reduce="max", window=1)
        m.log_value("learner_queue/size", s.get("learner_queue_size", 0), reduce="max", window=1)
        m.log_value("learner_queue/capacity", capacity, reduce="max", window=1)
        if source and self.batches.metrics_prefix:
            m.log_dict(source, prefix=self.batches.metrics_prefix, reduce="max", window=1)  # the latest values

    def get_state(self) -> dict[str, Any]:
        return {}  # what is in flight is re-sampled after a restore

    def set_state(self, state: dict[str, Any]) -> None:
        if self.receiver is not None:  # restored runners sample again chunks the loader has had
            self.receiver.forget_episodes()

    def stop(self) -> None:
        """Stop the runners' sampling threads, then the loader thread(s) and socket(s)."""
        try:
            self.env_runners.stop_streaming()
        finally:
            if self.receiver is not None:
                self.receiver.close()
            if self.feeds is not None:
                self.feeds.close()
