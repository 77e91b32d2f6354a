"""EnvRunnerGroup: the driver's handle on its env runners, in-process or remote, one code path.

With ``num_env_runners=0`` one EnvRunner samples in the driver process; otherwise the runners are
Ray actors. Either way an ``ActorManager`` hosts them, and the group only says what to ask:

* synchronous sampling (``sample``): each healthy runner samples its share and returns one codec
  frame with its metrics; a runner that fails mid-request is counted and replaced, and its share
  is re-requested from the rest, so no batch comes up short;
* weights (``sync_weights``): one ``ray.put``, read by every runner; a recreated runner gets the
  latest weights before it is used again;
* restarts never hold the driver up: a replacement joins when it has come up (``actors.replacements``),
  and until then the healthy runners take its share -- a runner of a lost node waits for room and the
  group grows back when nodes return; only with no runner healthy does ``sample`` wait for one;
* streaming (``start_streaming``/``poll``/``stop_streaming``): runners sample in their own
  threads and push frames to a receiver; ``poll`` folds their metrics, probes runners that stopped
  answering, recreates failed ones and sets them streaming again -- without ever waiting on a
  healthy runner. Runners lost while streaming are kept for the plan to ask (``take_lost_streams``):
  the episodes they were sampling end there, and the receiver counts them as cut.

Central inference (``inference``): the group also owns the inference servers
(``pipeline.groups.inference_group``); its runners act through them, the weights go to the servers
(the runners get only the version and timestep), and the servers' figures join the results.

Runner metrics (``EnvRunner.get_metrics()``) are merged into the driver's ``MetricsLogger``: bare
keys under ``env_runners/``, ``section/key`` keys under their own section (``fault_tolerance/``,
``stream/``).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import ray

from actors.env import EnvRunner, EnvRunnerSettings
from actors.manager import ActorManager, FaultToleranceSettings
from actors.metrics import MetricsLogger
from actors.offline import reader_class
from pipeline.groups.env_runners import thin
from protocols.codec import decode
from protocols.episode import EpisodeChunk

log = logging.getLogger("runnel")


class EnvRunnerGroup:
    def __init__(self, settings: EnvRunnerSettings, num_env_runners: int, num_cpus_per_env_runner: float,
                 fault_tolerance: FaultToleranceSettings, *, compress_frames: bool = False,
                 on_recreated: Callable[[list[int]], None] | None = None, external: Any = None,
                 offline: Any = None, runner_class: type | None = None, runner_kwargs: dict[str, Any] | None = None,
                 count_steps: Callable[[list[EpisodeChunk], dict[str, Any]], int] | None = None,
                 inference: Any = None, check_started: bool = True) -> None:
        """``external`` (``actors.external.settings.ExternalSettings``): the slots host policy servers for
        remote clients instead of env runners. ``runner_class`` / ``runner_kwargs``: another runner and
        its arguments (multi-agent); ``count_steps(chunks, runner_metrics)``: the steps one answer brought
        towards ``sample``'s count (default: the chunks' lengths). ``inference``
        (``actors.inference.settings.InferenceSettings``): central inference servers act for the runners.
        ``check_started=False``: return once the runner actors are asked for, without waiting for them to be up;
        the caller builds something else meanwhile and calls ``check_started()`` before using the group."""
        self.inference: Any = None
        if inference is not None:
            from pipeline.groups.inference_group import InferenceGroup

            self.inference = InferenceGroup(settings, inference, in_process=num_env_runners == 0,
                                            probe_timeout_s=fault_tolerance.probe_timeout_s)
            settings = self.inference.runner_settings(settings)
        self.settings = settings
        self.compress_frames = compress_frames
        self.on_recreated = on_recreated
        self.count_steps = count_steps or _chunk_steps
        runner_cls: type = runner_class or EnvRunner
        extra: dict[str, Any] = dict(runner_kwargs or {})
        if external is not None:
            from actors.external.policy_server import PolicyServer

            runner_cls, extra = PolicyServer, {**extra, "external": external}  # multi-agent: its plan's pieces
        elif offline is not None:  # readers of a recording in the runners' place (actors.offline)
            runner_cls, extra = reader_class(offline), {"offline": offline, "num_readers": max(1, num_env_runners)}
        elif runner_cls is EnvRunner and settings.numpy_policy is not None and self.inference is None:
            settings = thin(settings)
        self.servers = external is not None
        if num_env_runners == 0:
            make: Callable[[int, bool], Any] = lambda i, recreated: runner_cls(  # noqa: E731
                settings, worker_index=i, recreated=recreated, **extra)
        else:
            remote_cls = ray.remote(num_cpus=num_cpus_per_env_runner, max_restarts=0)(runner_cls)
            # a replacement waiting for this much free is waiting for room (a node), not failing to start
            fault_tolerance = dataclasses.replace(fault_tolerance, actor_resources={"CPU": num_cpus_per_env_runner})
            make = lambda i, recreated: remote_cls.remote(settings, worker_index=i, recreated=recreated, **extra)  # noqa: E731
        ids = [0] if num_env_runners == 0 else list(range(1, num_env_runners + 1))
        name = ("policy server" if self.servers else "offline reader" if offline is not None else
                "evaluation env runner" if settings.in_evaluation else "env runner")
        self._start_check = (max(fault_tolerance.start_timeout_s, fault_tolerance.probe_timeout_s or 0.0),
                             f"num_cpus_per_env_runner={num_cpus_per_env_runner}")
        try:
            self.manager = ActorManager(make, ids, fault_tolerance, on_restart=self._restore, name=name,
                                        in_process=num_env_runners == 0)
            if check_started:
                self.manager.check_started(*self._start_check)
        except BaseException:
            if self.inference is not None:
                self.inference.stop()
            raise
        self._weights: Any = None  # what a recreated runner gets (an object ref, or the dict in-process)
        self._weights_version = 0
        self._timestep: int | None = None
        self._stream_args: dict[str, Any] | None = None
        self.receiver_counts_env_steps = True
        """While streaming, env steps count where the receiver gets them (``AsyncPlan``) and the runners'
        own counts are left out; a multi-agent plan turns this off: its chunks hold agent steps only."""
        self._streaming: set[int] = set()  # runners told to stream
        self._metrics_pending: set[int] = set()  # runners with a get_metrics request in flight
        self._last_answer: dict[int, float] = {}  # runner -> when it last answered any request
        self._last_metrics_at = 0.0
        self._ft_logged = {"num_remote_worker_restarts": 0, "num_remote_worker_failures": 0,
                           "num_dropped_requests": 0, "restart_wait_s": 0.0}  # manager counts already in the metrics
        self._lost_streams: list[int] = []  # runners that failed while streaming, not yet taken by the plan
        self._connector_state: Any = None  # the driver's merged connector state, for replacements
        self._tasks: dict[int, list] = {}  # curriculum: each runner's sub-env tasks, for recreated runners
        self._last_delivered: dict[int, list] = {}  # policy servers: chunk ids of each slot's latest answer

    # --- views --------------------------------------------------------------------------------
    @property
    def local(self) -> EnvRunner | None:
        """The in-process runner (``num_env_runners=0``), for debugging; None with remote runners."""
        return self.manager.handle(0) if self.manager.in_process else None

    @property
    def num_runners(self) -> int:
        """Remote runners (0 when sampling in-process)."""
        return 0 if self.manager.in_process else len(self.manager.members)

    def num_healthy(self) -> int:
        return self.manager.num_healthy()

    # --- weights ------------------------------------------------------------------------------
    def sync_weights(self, weights: dict, version: int, timestep: int | None = None, wait: bool = True) -> None:
        """Send ``weights`` (and the run's env-step count ``timestep``, for exploration schedules)
        to every healthy runner. ``wait=False`` (streaming): fire and forget -- a streaming runner
        applies them between fragments, and ``poll`` collects the answers."""
        self._weights, self._weights_version, self._timestep = self.manager.share(weights), version, timestep
        if self.inference is not None:  # the servers act with the weights; runners need only version and timestep
            self.inference.set_weights(self._weights, version, timestep)
            self._weights = None
        if wait:
            self.manager.foreach_actor("set_weights", self._weights, version, timestep)
            self.restart_failed()
        else:
            self.manager.submit("set_weights", self._weights, version, timestep, tag="weights")

    # --- connectors ---------------------------------------------------------------------------
    def pop_connector_deltas(self) -> list[Any]:
        """Each healthy runner's connector deltas (``EnvRunner.pop_connector_deltas``); a runner that fails
        meanwhile loses what it had gathered (it is replaced as usual)."""
        return [res.value for res in self.manager.foreach_actor("pop_connector_deltas") if res.ok]

    def sync_connectors(self, state: Any, wait: bool = True) -> None:
        """The driver's merged connector state to every runner (and to replacements, when they come up).
        ``wait=False``: queued like weights (an evaluator may be busy with a request)."""
        self._connector_state = state
        if wait:
            self.manager.foreach_actor("sync_connectors", state)
        else:
            self.manager.submit("sync_connectors", state, tag="connectors")

    def _restore(self, index: int, handle: Any) -> None:
        # the replacement has answered a ping: these are quick, and bounded in case its node goes too
        timeout = self.manager.settings.probe_timeout_s
        if self._weights is not None or self.inference is not None:  # central: the version and timestep only
            ray.get(handle.set_weights.remote(self._weights, self._weights_version, self._timestep), timeout=timeout)
        if index in self._tasks:
            ray.get(handle.set_env_tasks.remote(self._tasks[index]), timeout=timeout)
        if self._connector_state is not None:
            ray.get(handle.sync_connectors.remote(self._connector_state), timeout=timeout)
        if index in self._last_delivered:  # what the dead server handed on but could not acknowledge
            ray.get(handle.confirm_delivered.remote(self._last_delivered[index]), timeout=timeout)

    def restart_failed(self, force: bool = False) -> list[int]:
        """Swap in replacements that came up and start new ones for failed runners (never waits)."""
        return self._rejoined(self.manager.probe_unhealthy_and_restart(force=force))

    def wait_for_restarts(self, timeout_s: float) -> list[int]:
        """Wait up to ``timeout_s`` for a replacement to come up (nothing else to do: no runner healthy)."""
        return self._rejoined(self.manager.wait_for_restarts(timeout_s))

    def wait_until_whole(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every runner is healthy again (each failed one replaced and up);
        False if some are not (restarts off, or replacements still waiting for room on the cluster)."""
        deadline = time.monotonic() + timeout_s
        while self.num_healthy() < len(self.manager.members) and time.monotonic() < deadline:
            self.wait_for_restarts(deadline - time.monotonic())
            if not self.manager.num_starting():
                break  # nothing on its way: restarts are off, or over their limit
        return self.num_healthy() == len(self.manager.members)

    def _rejoined(self, restarted: list[int]) -> list[int]:
        for i in restarted:
            self._streaming.discard(i)
            self._metrics_pending.discard(i)
            self._last_answer[i] = time.monotonic()
        if restarted and self.on_recreated is not None:
            self.on_recreated(restarted)
        return restarted

    # --- synchronous sampling -----------------------------------------------------------------
    def sample(self, num_timesteps: int, metrics: MetricsLogger, explore: bool | None = None) -> list[EpisodeChunk]:
        """At least ``num_timesteps`` env steps in total from the healthy runners (split evenly);
        their metrics go into ``metrics``."""
        chunks: list[EpisodeChunk] = []
        collected = 0
        while collected < num_timesteps:
            self.restart_failed()
            ids = self.manager.healthy_ids()
            if not ids:  # nothing can sample until a replacement is up
                log.warning("no %s is healthy: waiting for a replacement to start (%d starting)",
                            self.manager.name, self.manager.num_starting())
                self.wait_for_restarts(max(self.manager.settings.restart_delay_s, 5.0))
                continue
            per_runner = -(-(num_timesteps - collected) // len(ids))
            for res in self.manager.foreach_actor("sample_encoded", actor_ids=ids, num_timesteps=per_runner,
                                                  explore=explore, compress=self.compress_frames):
                if res.ok:
                    frame, runner_metrics = res.value
                    got = decode(frame)
                    chunks.extend(got)
                    if self.servers:
                        self._last_delivered[res.actor_id] = [[c.episode_id, c.chunk_index] for c in got]
                    collected += self.count_steps(got, runner_metrics)
                    self.fold_metrics(res.actor_id, runner_metrics, metrics)
        return chunks

    def fold_metrics(self, runner_id: int, export: dict[str, Any], metrics: MetricsLogger) -> None:
        """A runner's ``get_metrics()`` into ``metrics``: bare keys under ``env_runners/``, others as named."""
        if self._stream_args is not None and self.receiver_counts_env_steps:  # counted where received (AsyncPlan)
            export = {k: v for k, v in export.items() if not k.startswith("num_env_steps_sampled")}
        metrics.merge({k: v for k, v in export.items() if "/" in k})
        metrics.merge({k: v for k, v in export.items() if "/" not in k}, prefix="env_runners")
        if self._stream_args is not None and "weights_version" in export:
            metrics.log_value(f"stream/runner_weights_versions/{runner_id}", export["weights_version"]["value"],
                              reduce="max")

    # --- streaming ----------------------------------------------------------------------------
    def start_streaming(self, **stream_args: Any) -> None:
        """Have every healthy runner stream to ``stream_args["address"]`` (see
        ``EnvRunner.start_streaming``) -- or, given a list of addresses (one receiver per learner),
        runner i to ``address[i % len(address)]``, the same one after a restart; runners recreated
        later are started by ``poll``. New arguments (a receiver that moved) reach every runner."""
        if stream_args != self._stream_args:
            self._streaming.clear()
        self._stream_args = stream_args
        ids = [i for i in self.manager.healthy_ids() if i not in self._streaming]
        if ids:
            address, rest = stream_args["address"], {k: v for k, v in stream_args.items() if k != "address"}
            addresses = [address] if isinstance(address, str) else list(address)
            per_runner = {i: (addresses[i % len(addresses)],) for i in ids}
            for res in self.manager.foreach_actor("start_streaming", actor_ids=ids, per_actor_args=per_runner, **rest):
                if res.ok:
                    self._streaming.add(res.actor_id)

    def poll(self, metrics: MetricsLogger, interval_s: float, force: bool = False) -> None:
        """Fold finished requests (metrics, weight acks), ask for metrics every ``interval_s``,
        probe runners that stopped answering, recreate failed ones and restart their streams."""
        manager = self.manager
        now = time.monotonic()
        for res in manager.fetch_ready(0.0):
            self._last_answer[res.actor_id] = now
            if res.tag == "metrics":
                self._metrics_pending.discard(res.actor_id)
                if res.ok:
                    self.fold_metrics(res.actor_id, res.value, metrics)
        for i in list(self._streaming):
            if not manager.members[i].healthy:
                self._streaming.discard(i)
                self._metrics_pending.discard(i)
                self._lost_streams.append(i)
        if force or now - self._last_metrics_at >= interval_s:
            self._last_metrics_at = now
            for i in manager.healthy_ids():
                if i not in self._metrics_pending and manager.submit("get_metrics", actor_ids=[i], tag="metrics"):
                    self._metrics_pending.add(i)
        # A runner whose requests go unanswered for probe_timeout_s (its main thread hangs too, e.g. an env
        # stuck in C code holding the GIL) gets a health probe, which marks it failed if it does not answer.
        timeout = manager.settings.probe_timeout_s
        silent = [i for i in manager.healthy_ids() if timeout is not None and manager.num_in_flight(i)
                  and now - self._last_answer.setdefault(i, now) > timeout]
        if silent:
            failed = set(manager.probe_health())
            for i in silent:
                self._last_answer[i] = time.monotonic()
                if i in failed:
                    self._metrics_pending.discard(i)
                    if i in self._streaming:
                        self._streaming.discard(i)
                        self._lost_streams.append(i)
        self.restart_failed()
        if self._stream_args is not None:
            self.start_streaming(**self._stream_args)

    def take_lost_streams(self) -> list[int]:
        """Runners that failed while streaming since the last call (the plan tells its receiver: their
        open episodes end there)."""
        lost, self._lost_streams = self._lost_streams, []
        return lost

    def stop_streaming(self, timeout_s: float = 15.0) -> None:
        """Stop every healthy runner's sampling thread (best effort: the actors are killed next anyway)."""
        if self._stream_args is None:
            return
        self._stream_args = None
        self._streaming.clear()
        try:
            self.manager.foreach_actor("stop_streaming", actor_ids=self.manager.healthy_ids(), timeout_s=timeout_s)
        except Exception as err:  # noqa: BLE001 - the actors are stopped or killed next anyway
            log.warning("stopping the env runners' streams: %s", err)

    # --- state ----------------------------------------------------------------------------------
    def get_state(self) -> dict[int, dict[str, Any]]:
        """Each healthy runner's state, by runner index (what a checkpoint keeps)."""
        return {r.actor_id: r.value for r in self.manager.foreach_actor("get_state") if r.ok}

    def set_state(self, states: dict[int, dict[str, Any]]) -> None:
        """Give runners their saved states back (runners with no saved state keep theirs)."""
        for i, state in states.items():
            if state.get("env_tasks") is not None:
                self._tasks[i] = state["env_tasks"]
        ids = [i for i in self.manager.healthy_ids() if i in states]
        if ids:
            self.manager.foreach_actor("set_state", actor_ids=ids, per_actor_args={i: (states[i],) for i in ids})

    # --- results, user functions, shutdown ----------------------------------------------------
    def log_fault_tolerance(self, metrics: MetricsLogger) -> None:
        """``fault_tolerance/``: healthy runners and replacements still starting (at the end of the
        iteration), restarts, failures and dropped requests (lifetime), and the seconds this iteration
        spent in restart handling (``restart_wait_s``: creating replacements never waits for them)."""
        m = self.manager
        metrics.log_value("fault_tolerance/num_healthy_workers", 0 if m.in_process else m.num_healthy(),
                          reduce="max")
        metrics.log_value("fault_tolerance/num_workers_starting", m.num_starting(), reduce="max")
        for key, value in (("num_remote_worker_restarts", m.num_restarts),
                           ("num_remote_worker_failures", m.num_failures),
                           ("num_dropped_requests", m.num_dropped_results)):
            metrics.log_value(f"fault_tolerance/{key}", value - self._ft_logged[key], reduce="lifetime_sum")
            self._ft_logged[key] = value
        metrics.log_value("fault_tolerance/restart_wait_s", m.restart_wait_s - self._ft_logged["restart_wait_s"],
                          reduce="sum")
        self._ft_logged["restart_wait_s"] = m.restart_wait_s
        metrics.log_value("fault_tolerance/num_sub_env_restarts", 0, reduce="lifetime_sum")  # runners add theirs
        if self.inference is not None:
            self.inference.log_metrics(metrics)

    def foreach_env_runner(self, fn: Callable[[EnvRunner], Any] | None = None, local: bool = True,
                           remote_worker_ids: list[int] | None = None, **kwargs: Any) -> list[Any]:
        """``fn(runner)`` on every healthy runner (or those of ``remote_worker_ids``); the results in
        runner order. ``local=False`` leaves out the in-process runner (RLlib's ``local_env_runner``).

        An exception ``fn`` raises is the caller's: it is raised here as that exception (a note names the
        runner), and the runner, which is healthy, is not restarted. A runner that dies or does not answer
        within ``env_runner_health_probe_timeout_s`` is a runner failure: its result is left out and it is
        recreated (or given up) under the fault-tolerance settings."""
        local = kwargs.pop("local_env_runner", kwargs.pop("local_worker", local))
        fn = kwargs.pop("func", fn)
        if kwargs:
            raise TypeError(f"foreach_env_runner() got unexpected arguments {sorted(kwargs)}")
        if not callable(fn):
            raise TypeError(f"foreach_env_runner(fn) takes a function of one runner, e.g. "
                            f"lambda runner: runner.worker_index; got {fn!r}")
        if self.manager.in_process and not local:
            return []
        ids = None if self.manager.in_process else remote_worker_ids
        return [r.value for r in self.manager.foreach_actor("apply", fn, actor_ids=ids) if r.ok]

    def foreach_worker(self, func: Callable[[EnvRunner], Any], local_worker: bool = True,
                       remote_worker_ids: list[int] | None = None, **kwargs: Any) -> list[Any]:
        """RLlib's older name for ``foreach_env_runner``."""
        return self.foreach_env_runner(func, local=local_worker, remote_worker_ids=remote_worker_ids, **kwargs)

    def apply_env_task_fn(self, env_task_fn: Callable, train_results: dict) -> None:
        """Curriculum: each runner picks and sets its sub-envs' tasks; a recreated runner gets them back."""
        for res in self.manager.foreach_actor("apply_env_task_fn", env_task_fn, train_results):
            if res.ok:
                self._tasks[res.actor_id] = res.value

    def check_started(self) -> None:
        """Wait until every runner is up; a runner that failed to start raises, naming it (and the group stops)."""
        try:
            self.manager.check_started(*self._start_check)
        except BaseException:
            if self.inference is not None:
                self.inference.stop()
            raise

    def stop(self) -> None:
        # Servers acknowledge what was trained on; recording runners close their shards (index,
        # trailer, fsync) and write the episodes still running. Others are simply killed.
        if (self.servers or self.settings.recording is not None) and not self.manager.in_process:
            try:
                self.manager.foreach_actor("stop", timeout_s=15.0)
            except Exception as err:  # noqa: BLE001 - they are killed next anyway
                log.warning("stopping the %ss: %s", self.manager.name, err)
        self.manager.stop()
        if self.inference is not None:
            self.inference.stop()


def _chunk_steps(chunks: list[EpisodeChunk], runner_metrics: dict[str, Any]) -> int:
    return sum(len(c) for c in chunks)
