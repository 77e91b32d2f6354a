"""StreamingReplay: the off-policy plan with the replay stage as a Ray actor fed by runner streams.

Runners sample forever in their own threads and push chunk frames over ZeroMQ to the replay actor
(``ReplayBuffer.start_receiving``), whose intake thread inserts them -- blocking on the rate
limiter, so a learner that falls behind slows the runners down through the sockets. The driver
keeps ``prefetch`` batch requests in flight on the replay actor (``sample_encoded``: one codec frame
per batch), trains on each batch as it arrives, sends TD errors back as priorities without
waiting, and broadcasts weights every ``broadcast_interval`` updates. Env steps count as sampled
when the replay stage inserts them.

The replay actor is one member of an ``ActorManager`` group: if it dies it is recreated with its latest
*snapshot* -- the driver asks for one (``ReplayBuffer.snapshot``) every ``snapshot_interval_s`` seconds
(``replay_buffer_config``, default 60; None: never) unless the stored arrays exceed ``snapshot_max_bytes``
(default 1 GiB), and a checkpoint's buffer (``store_buffer_in_checkpoints``) serves as one too; with none,
it starts empty. A snapshot costs a copy of the buffer in the replay actor (intake and sampling wait while
it is made), its transfer, and that much driver memory. The runners are pointed at the new actor's address.
Lost: the env steps inserted after that snapshot (``fault_tolerance/num_replay_steps_lost``, at least:
inserts are known as the replay last reported them), the frames in the dead actor's sockets and the
runners' queues to it (never counted as sampled), and the batch requests in flight (never trained on).
``fault_tolerance/num_replay_restarts`` counts restarts; past ``max_num_replay_restarts`` the run ends.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import ray

from actors.manager import ActorGroupError, ActorManager, FaultToleranceSettings
from actors.metrics import MetricsLogger
from actors.replay import ReplayBuffer, ReplaySettings
from pipeline.groups.env_runner_group import EnvRunnerGroup
from pipeline.groups.learner_group import LearnerGroup
from protocols.codec import decode

log = logging.getLogger("runnel")


class StreamingReplay:
    def __init__(self, config: Any, settings: ReplaySettings, env_runners: EnvRunnerGroup, learners: LearnerGroup,
                 metrics: MetricsLogger, observation_space: Any, action_space: Any, compress: bool,
                 intake: Any = None, view: Any = None) -> None:
        self.config, self.env_runners, self.learners, self.metrics = config, env_runners, learners, metrics
        self.spaces = (observation_space, action_space)
        self.prioritized = settings.prioritized
        self.compress = compress
        c = config.replay_buffer_config
        self.prefetch = int(c.get("prefetch", 2))
        cls = ray.remote(num_cpus=c.get("num_cpus", 1), max_restarts=0,
                         max_concurrency=self.prefetch + 4)(ReplayBuffer)  # waiting samples must not block metrics
        # no limit of the manager's own: the run's limit is checked here, with a message naming its setting
        ft = FaultToleranceSettings(restart_failed=True, probe_timeout_s=config.env_runner_health_probe_timeout_s,
                                    max_requests_in_flight=self.prefetch + 4, restart_delay_s=0.0,
                                    max_restarts=config.max_num_replay_restarts + 1,
                                    actor_resources={"CPU": c.get("num_cpus", 1)})
        self.group = ActorManager(lambda i, recreated: cls.remote(settings, intake, view), [1], ft, on_restart=self._restore,
                                  name="replay stage")
        self.group.check_started(ft.start_timeout_s, f"{c.get('num_cpus', 1)} CPU(s)")
        self.last_state: dict | None = None  # what a recreated replay stage is given back
        self.snapshot_interval_s: float | None = c.get("snapshot_interval_s", 60.0)
        self.snapshot_max_bytes: int | None = c.get("snapshot_max_bytes", 1 << 30)
        self._last_snapshot_at = time.monotonic()
        self._snapshot_pending = False
        self._restored_inserts = 0  # the replay's own insert count in the state the current actor started from
        self._inserts_at_start = 0  # the driver's count of inserts when the current actor started
        self.address: str | None = None
        for key in ("num_replay_restarts", "num_replay_steps_lost"):  # in the results from the start
            metrics.log_value(f"fault_tolerance/{key}", 0, reduce="lifetime_sum")
        self._batches_in_flight = 0
        self._inserts_seen = 0
        self._last_metrics_at = 0.0
        self._metrics_pending = False

    # --- the replay actor ---------------------------------------------------------------------
    def _restore(self, index: int, handle: Any) -> None:
        if self.last_state:  # bounded (a whole buffer may take a while): the replacement's node may go too
            s = self.group.settings
            ray.get(handle.set_state.remote(self.last_state), timeout=max(s.start_timeout_s, s.probe_timeout_s or 0.0))

    def _point_runners(self) -> None:
        """(Re)start the replay stage's intake and have every runner stream to it."""
        obs, act = self.spaces
        cfg = self.config
        res = self.group.foreach_actor("start_receiving", obs, act, 4, 256 * 1024)
        if not res or not res[0].ok:
            return
        self.address = res[0].value
        self.env_runners.start_streaming(address=self.address, hwm=4, compress=self.compress, sndbuf=256 * 1024,
                                         stall_timeout_s=cfg.env_runner_health_probe_timeout_s)

    def training_step(self) -> None:
        m, group = self.metrics, self.group
        if self.address is None:
            self._point_runners()
        while self._batches_in_flight < self.prefetch and group.submit(
                "sample_encoded", self.config.train_batch_size_per_learner, 0.5, tag="batch"):
            self._batches_in_flight += 1
        with m.log_time("timers/learner_wait_for_batch", reduce="sum"):
            results = group.fetch_ready(timeout_s=0.1)
        for res in results:
            if res.tag == "batch":
                self._batches_in_flight -= 1
                if res.ok and res.value is not None:
                    self._learn(decode(res.value))
            elif res.tag == "metrics":
                self._metrics_pending = False
                if res.ok:
                    self._fold_replay_metrics(res.value)
            elif res.tag == "snapshot":
                self._snapshot_pending = False
                if res.ok:
                    self._keep_snapshot(res.value)
        now = time.monotonic()
        if not self._metrics_pending and now - self._last_metrics_at >= self.config.env_runner_metrics_interval_s:
            self._last_metrics_at = now
            self._metrics_pending = bool(group.submit("get_metrics", tag="metrics"))
        if (self.snapshot_interval_s is not None and not self._snapshot_pending
                and now - self._last_snapshot_at >= self.snapshot_interval_s):
            self._last_snapshot_at = now
            self._snapshot_pending = bool(group.submit("snapshot", self.snapshot_max_bytes, tag="snapshot"))
        self._recover_if_dead()
        self.env_runners.poll(m, self.config.env_runner_metrics_interval_s)
        self.env_runners.take_lost_streams()  # the replay actor's intake keeps its own (capped) episode ledger

    def _recover_if_dead(self) -> None:
        """Recreate a dead replay actor from the latest snapshot, count it and what was lost, re-point the runners."""
        m, group = self.metrics, self.group
        if group.num_healthy():
            return
        if group.num_restarts >= self.config.max_num_replay_restarts:
            raise ActorGroupError(
                f"the replay actor died ({group.members[1].last_error}) and cannot be recreated: the job has "
                f"recreated it {group.num_restarts} time(s) and max_num_replay_restarts="
                f"{self.config.max_num_replay_restarts} allows no more. Raise it with .fault_tolerance("
                f"max_num_replay_restarts=N); resume this run from its last checkpoint")
        inserts_now = self._restored_inserts + self._inserts_seen - self._inserts_at_start
        snapshot_inserts = int(self.last_state["num_inserts"]) if self.last_state else 0
        if not group.probe_unhealthy_and_restart():
            return  # not up yet: asked again at the next training step
        m.log_value("fault_tolerance/num_replay_restarts", 1, reduce="lifetime_sum")
        m.log_value("fault_tolerance/num_replay_steps_lost", max(0, inserts_now - snapshot_inserts), reduce="lifetime_sum")
        self._restored_inserts, self._inserts_at_start = snapshot_inserts, self._inserts_seen
        self._batches_in_flight, self._metrics_pending, self._snapshot_pending = 0, False, False
        self._point_runners()

    def _learn(self, batch: dict[str, Any]) -> None:
        m = self.metrics
        timestep = m.peek("env_runners/num_env_steps_sampled_lifetime", 0)
        with m.log_time("timers/learner_update_timer", reduce="sum"):
            _, outputs = self.learners.update(batch, timestep, m, with_outputs=self.prioritized)
        if self.prioritized and outputs:  # none: the learners refused the batch
            self.group.submit("update_priorities", batch["indices"], outputs["td_error"], tag="priorities")
        if self.learners.weights_version % self.config.broadcast_interval == 0:
            weights = self.learners.get_weights(inference_only=True)
            self.env_runners.sync_weights(weights, self.learners.weights_version, int(timestep), wait=False)

    def _keep_snapshot(self, state: dict[str, Any] | None) -> None:
        if state is not None:
            self.last_state = state
        elif self.snapshot_interval_s is not None:  # said once: no more snapshots are asked for
            log.warning("replay snapshots stop: the buffer's arrays grew past snapshot_max_bytes=%s; a replay "
                        "actor that dies now restarts %s", self.snapshot_max_bytes,
                        "from its last snapshot" if self.last_state else "empty")
            self.snapshot_interval_s = None

    def _fold_replay_metrics(self, export: dict[str, Any]) -> None:
        m = self.metrics
        m.merge(export, prefix="replay")
        inserts = int(m.peek("replay/inserts", 0))
        new, self._inserts_seen = inserts - self._inserts_seen, inserts
        m.log_value("env_runners/num_env_steps_sampled", new, reduce="sum")
        m.log_value("env_runners/num_env_steps_sampled_lifetime", new, reduce="lifetime_sum")

    # --- state and shutdown ----------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        res = self.group.foreach_actor("get_state")
        self.last_state = res[0].value if res and res[0].ok else self.last_state
        return self.last_state or {}

    def set_state(self, state: dict[str, Any]) -> None:
        self.last_state = state
        self.group.foreach_actor("set_state", state)

    def stop(self) -> None:
        try:
            self.env_runners.stop_streaming()
        finally:
            self.group.stop()
