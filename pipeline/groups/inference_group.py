"""InferenceGroup: the driver's handle on its inference servers (central inference).

An ``ActorManager`` hosts the servers (``actors.inference.server.InferenceServer``) like every stage:
in the driver's process when the env runners are (``num_env_runners=0``), else as Ray actors with
``num_cpus_per_inference_server`` CPUs and ``num_gpus_per_inference_server`` GPUs each. The group

* publishes each server's address in the directory runners look it up in (``actors.inference.directory``:
  the object itself in-process, else a small named Ray actor);
* sends weights to every server (the same object ref the runners would get) and waits until they act;
* watches the servers from a thread of its own: every ``health_check_interval_s`` it pings them,
  recreates a dead or hung one at its index, gives it the latest weights and publishes its new
  address -- also while the driver's main thread waits on the runners, which are waiting on that
  very server (a synchronous ``sample`` call);
* reports the servers' ``inference/...`` metrics and its restarts under ``fault_tolerance/``.

Every use of the manager holds one lock: the watch thread and the driver's thread take turns.
"""
from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import replace
from typing import Any

import ray

from actors.env.settings import EnvRunnerSettings
from actors.inference.directory import InferenceDirectory
from actors.inference.server import InferenceServer
from actors.inference.settings import InferenceClientSettings, InferenceSettings
from actors.manager import ActorManager, FaultToleranceSettings
from actors.metrics import MetricsLogger

log = logging.getLogger("runnel")


class InferenceGroup:
    def __init__(self, settings: EnvRunnerSettings, inference: InferenceSettings, in_process: bool,
                 probe_timeout_s: float | None = 30.0) -> None:
        """``settings``: the runners' settings, whose module, spaces, exploration and seed the servers use."""
        self.x = inference
        self.in_process = in_process
        self._lock = threading.RLock()
        self._weights: Any = None
        self._weights_version = 0
        self._restarts_logged = 0
        self._namespace: str | None = None
        if in_process:
            self.directory: Any = InferenceDirectory()
            self._directory_name: str | None = None
            make = lambda i, recreated: InferenceServer(settings, inference, i)  # noqa: E731
        else:
            self._directory_name = f"runnel-inference-directory-{uuid.uuid4().hex[:12]}"
            self._namespace = ray.get_runtime_context().namespace
            self.directory = ray.remote(num_cpus=0)(InferenceDirectory).options(
                name=self._directory_name, namespace=self._namespace).remote()
            cpus, gpus = inference.num_cpus_per_inference_server, inference.num_gpus_per_inference_server
            remote_cls = ray.remote(num_cpus=cpus, num_gpus=gpus, max_restarts=0)(InferenceServer)
            threads = max(1, int(cpus))
            make = lambda i, recreated: remote_cls.remote(settings, inference, i, torch_threads=threads)  # noqa: E731
        ft = FaultToleranceSettings(restart_failed=True, ignore_failures=False, restart_delay_s=0.0,
                                    probe_timeout_s=probe_timeout_s,
                                    fatal_hint="Inference servers are always recreated; this one could not be.")
        self.manager = ActorManager(make, list(range(inference.num_inference_servers)), ft,
                                    on_restart=self._restore, name="inference server", in_process=in_process)
        try:
            self.manager.check_started(ft.start_timeout_s, f"num_cpus_per_inference_server={inference.num_cpus_per_inference_server}"
                                                           f" and num_gpus_per_inference_server={inference.num_gpus_per_inference_server}")
            for i in self.manager.healthy_ids():
                self._publish(i, self.manager.handle(i))
        except BaseException:
            self.stop()
            raise
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        if not in_process:
            self._watch = threading.Thread(target=self._watch_loop, name="runnel-inference-watch", daemon=True)
            self._watch.start()

    def client_settings(self) -> InferenceClientSettings:
        """What each runner needs to find its server."""
        return InferenceClientSettings(
            num_servers=self.x.num_inference_servers,
            directory=self.directory if self.in_process else self._directory_name, namespace=self._namespace,
            resend_after_s=self.x.resend_after_s, reply_timeout_s=self.x.reply_timeout_s,
            shared_memory=self.x.shared_memory, double_buffer=self.x.double_buffer)

    def runner_settings(self, settings: EnvRunnerSettings) -> EnvRunnerSettings:
        """The runners' copy of ``settings``: acting through the servers, and without the module class and
        exploration (which live in the servers; unpickling them would import torch into the runner)."""
        client = self.client_settings()
        mc = settings.model_config
        if isinstance(mc, dict) and mc.get("use_lstm"):
            from actors.modules import ModelConfig

            model = ModelConfig.from_dict(mc)
            client = replace(client, state_size=model.lstm_cell_size, max_seq_len=model.max_seq_len)
        return replace(settings, inference=client, module_class=None, module_kwargs={}, exploration_config={})

    # --- servers ------------------------------------------------------------------------------
    def _call(self, handle: Any, method: str, *args: Any) -> Any:
        if self.in_process:
            return getattr(handle, method)(*args)
        timeout = self.manager.settings.start_timeout_s
        return ray.get(getattr(handle, method).remote(*args), timeout=timeout)

    def _publish(self, index: int, handle: Any) -> None:
        address = self._call(handle, "address")
        if self.in_process:
            self.directory.publish(index, address)
        else:
            ray.get(self.directory.publish.remote(index, address))
        log.info("inference server %d at %s", index, address)

    def _restore(self, index: int, handle: Any) -> None:
        """A recreated server: the latest weights, then its address for the runners."""
        if self._weights is not None:
            self._call(handle, "set_weights", self._weights, self._weights_version)
        self._publish(index, handle)

    def set_weights(self, weights: Any, weights_version: int, timestep: int | None = None) -> None:
        """Every server acts with ``weights`` (a dict, or the object ref of one) once this returns."""
        with self._lock:
            self._weights, self._weights_version = weights, weights_version
            self.manager.foreach_actor("set_weights", weights, weights_version, timestep)

    def restart_failed(self) -> list[int]:
        """Ping the servers; recreate the failed ones (weights and address restored)."""
        with self._lock:
            self.manager.probe_health()
            return self.manager.probe_unhealthy_and_restart(force=True)

    def _watch_loop(self) -> None:
        while not self._stopping.wait(self.x.health_check_interval_s):
            try:
                restarted = self.restart_failed()
            except Exception as err:  # noqa: BLE001 - the next round tries again; the log says why
                log.warning("inference servers: health check failed: %s", err)
                continue
            if restarted:
                log.warning("inference server(s) %s recreated; runners find them through the directory", restarted)

    # --- results, shutdown ----------------------------------------------------------------------
    def log_metrics(self, metrics: MetricsLogger) -> None:
        """The servers' ``inference/...`` figures and the group's restarts into ``metrics``."""
        with self._lock:
            results = self.manager.foreach_actor("get_metrics")
            restarts = self.manager.num_restarts
        for res in results:
            if res.ok:
                metrics.merge(res.value)
        metrics.log_value("fault_tolerance/num_inference_server_restarts", restarts - self._restarts_logged,
                          reduce="lifetime_sum")
        self._restarts_logged = restarts
        metrics.log_value("inference/num_healthy_servers", self.manager.num_healthy(), reduce="max", window=1)

    def stop(self) -> None:
        stopping = getattr(self, "_stopping", None)
        if stopping is not None:
            stopping.set()
        if getattr(self, "_watch", None) is not None:
            self._watch.join(timeout=30.0)
        with self._lock:
            self.manager.stop()
        if not self.in_process:
            try:
                ray.kill(self.directory, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
