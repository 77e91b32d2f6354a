"""EnvRunnerGroup: the driver's handle on its env runners, local or remote.

With ``num_env_runners=0`` one EnvRunner samples in the driver process. Otherwise the runners are
Ray actors owned by an ActorManager, which recreates dead ones and restores their weights.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import ray

from actors.env_runner import EnvRunner, EnvRunnerSettings
from actors.manager import ActorManager, FaultToleranceSettings
from protocols.episode import EpisodeChunk


class EnvRunnerGroup:
    def __init__(self, settings: EnvRunnerSettings, num_env_runners: int, num_cpus_per_env_runner: float,
                 fault_tolerance: FaultToleranceSettings, on_recreated: Callable[[list[int]], None] | None = None) -> None:
        self.settings = settings
        self.local = EnvRunner(settings, worker_index=0) if num_env_runners == 0 else None
        self.manager: ActorManager | None = None
        self._weights_ref: Any = None
        self._weights_version = 0
        self.on_recreated = on_recreated
        self.sub_env_restarts: dict[int, int] = {}
        self.dropped_requests = 0
        if num_env_runners > 0:
            remote_cls = ray.remote(num_cpus=num_cpus_per_env_runner, max_restarts=0)(EnvRunner)
            self.manager = ActorManager(
                lambda i, recreated: remote_cls.remote(settings, worker_index=i, recreated=recreated), num_env_runners, fault_tolerance,
                on_restart=self._restore, name="env runner",
            )
            self._check_started(max(120.0, fault_tolerance.probe_timeout_s))

    def _check_started(self, timeout_s: float) -> None:
        """Surface construction errors (a broken env creator, unplaceable actors) at build time,
        as one clear error, instead of as a loop of restarts."""
        refs = {m.handle.ping.remote(): i for i, m in self.manager.members.items()}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        try:
            if pending:
                raise RuntimeError(
                    f"env runner(s) {sorted(refs[r] for r in pending)} did not start within {timeout_s:.0f} s; "
                    f"the cluster has {ray.available_resources()} available for {len(refs)} runners needing "
                    f"num_cpus_per_env_runner each. Lower num_env_runners or add nodes.")
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as err:
                    cause = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
                    raise RuntimeError(f"env runner {refs[ref]} failed to start: {cause}") from None
        except RuntimeError:
            self.stop()
            raise

    @property
    def num_runners(self) -> int:
        return 0 if self.manager is None else len(self.manager.members)

    def num_healthy(self) -> int:
        return 1 if self.manager is None else self.manager.num_healthy()

    def _restore(self, index: int, handle: Any) -> None:
        if self._weights_ref is not None:
            ray.get(handle.set_weights.remote(self._weights_ref, self._weights_version))

    def sync_weights(self, weights: dict, version: int) -> None:
        self._weights_version = version
        if self.local is not None:
            self.local.set_weights(weights, version)
            return
        self._weights_ref = ray.put(weights)  # one copy in the object store, read by every runner
        self.manager.foreach_actor("set_weights", self._weights_ref, version)
        self.restart_failed()

    def sample(self, num_timesteps: int, explore: bool | None = None) -> tuple[list[EpisodeChunk], list[dict]]:
        """At least ``num_timesteps`` env steps in total from the healthy runners (split evenly),
        plus each runner's metrics. A runner that fails mid-request is counted and replaced; its
        share is re-requested from the rest."""
        if self.local is not None:
            chunks = self.local.sample(num_timesteps=num_timesteps, explore=explore)
            return chunks, [self._collect_local_metrics()]
        chunks: list[EpisodeChunk] = []
        metrics: list[dict] = []
        collected = 0
        while collected < num_timesteps:
            self.restart_failed()
            ids = self.manager.healthy_ids()
            if not ids:
                time.sleep(self.manager.settings.restart_delay_s)
                self.restart_failed(force=True)
                continue
            per_runner = -(-(num_timesteps - collected) // len(ids))
            timeout = self.manager.settings.probe_timeout_s
            for res in self.manager.foreach_actor("sample_with_metrics", actor_ids=ids, timeout_s=timeout,
                                                  num_timesteps=per_runner, explore=explore):
                if res.ok:
                    runner_chunks, runner_metrics = res.value
                    chunks.extend(runner_chunks)
                    collected += sum(len(c) for c in runner_chunks)
                    metrics.append(runner_metrics)
                    self.sub_env_restarts[res.actor_id] = runner_metrics["num_sub_env_restarts"]
        return chunks, metrics

    def _collect_local_metrics(self) -> dict:
        m = self.local.get_metrics()
        self.sub_env_restarts[0] = m["num_sub_env_restarts"]
        return m

    def restart_failed(self, force: bool = False) -> list[int]:
        if self.manager is None:
            return []
        restarted = self.manager.probe_unhealthy_and_restart(force=force)
        if restarted and self.on_recreated is not None:
            self.on_recreated(restarted)
        return restarted

    def foreach_env_runner(self, fn: Callable[[EnvRunner], Any], local: bool = True) -> list[Any]:
        if self.local is not None:
            return [fn(self.local)] if local else []
        return [r.value for r in self.manager.foreach_actor("apply", fn) if r.ok]

    def stop(self) -> None:
        if self.local is not None:
            self.local.stop()
        if self.manager is not None:
            self.manager.stop()
