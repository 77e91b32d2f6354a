"""IMPALA: importance-weighted actor-learner architecture (Espeholt et al., 2018), asynchronous.

Env runners never wait for the learner: each samples ``rollout_fragment_length`` steps per
sub-env at a time in a background thread and pushes the fragment's chunks over ZeroMQ to the
driver (``actors.stream``), stamped with the ``weights_version`` that acted. A loader thread in
the driver decodes and checks them and cuts train batches of ``train_batch_size_per_learner``
steps into a queue of ``learner_queue_size``; a full queue stops the loader reading, and the
sockets' high-water marks then block the runners -- memory stays bounded.

Each training step takes one batch from the queue and makes one update (``num_epochs`` passes of
``minibatch_size`` SGD steps; one step on the whole batch by default). The policy lags behind the
learner by a few updates; V-trace corrects for it with the ratio of the learner's and the
behaviour policy's action probabilities. Every ``broadcast_interval`` updates the weights are
``ray.put`` once and the object ref goes to every runner, which applies it between fragments.

The driver also folds runner metrics, probes runner health and recreates failed runners (at the
same index, with the current weights, streaming again), as the actor manager is configured.
Only ``num_learners=0`` (the learner in the driver, beside the loader thread) is supported.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import ray
import torch

from actors.learner import Learner, piecewise
from actors.module import RLModule
from actors.stream import ChunkBatch, ChunkReceiver, batch_from
from pipeline.algorithm import Algorithm, register_algorithm
from pipeline.algorithms.returns import vtrace
from pipeline.config import AlgorithmConfig, _is_int, _is_number, _check_schedule
from protocols.episode import EpisodeChunk

log = logging.getLogger("runnel")


@dataclass
class IMPALAConfig(AlgorithmConfig):
    algo_name = "IMPALA"

    # defaults tuned for CartPole-speed tasks; they are sound elsewhere (scale the batch up for harder ones)
    num_envs_per_env_runner: int = 16
    """Sub-environments each runner steps as one vector."""
    rollout_fragment_length: int | str = 50
    """Steps per sub-env in each streamed fragment (one ZeroMQ frame per fragment)."""
    lr: float | list = 1e-3
    """Learning rate, or a piecewise-linear schedule ``[[timestep, lr], ...]``."""
    grad_clip: float | None = 40.0
    """Clip threshold for gradients (by ``grad_clip_by``, global norm by default)."""
    train_batch_size_per_learner: int = 500
    """Env steps per train batch (per update)."""
    minibatch_size: int = 500
    """Steps per SGD step; equal to the train batch (the default) makes one step per batch."""
    min_time_s_per_iteration: float | None = 1.0
    """Each ``train()`` runs training steps for at least this long."""

    vtrace_clip_rho_threshold: float = 1.0
    """V-trace: clip the importance ratio of the value targets at this (rho-bar)."""
    vtrace_clip_pg_rho_threshold: float = 1.0
    """V-trace: clip the importance ratio of the policy-gradient advantages at this."""
    vf_loss_coeff: float = 0.5
    """Weight of the value loss (``0.5 * mean squared error to the V-trace targets``)."""
    entropy_coeff: float | list = 0.01
    """Weight of the entropy bonus, or a schedule ``[[timestep, coeff], ...]``."""
    broadcast_interval: int = 1
    """Send new weights to the runners every this many updates."""
    learner_queue_size: int = 4
    """Train batches the loader thread may hold ready for the learner; when full it stops reading
    (back-pressure reaches the runners through the sockets' high-water marks)."""
    learner_queue_timeout: float = 300.0
    """Raise (naming runners and drop counters) if no train batch arrives for this many seconds."""
    stream_hwm: int = 4
    """ZeroMQ high-water mark, in frames (fragments), of each runner's send queue and the receiver's
    per-runner receive queue."""
    stream_socket_buffer_bytes: int = 256 * 1024
    """Kernel send/receive buffer of each stream socket: bounds the data in flight beyond the high-water
    marks (0 = the OS default, which on loopback holds many MB, i.e. hundreds of stale fragments)."""
    stream_compress: bool | str = "auto"
    """LZ4-compress streamed frames: True, False, or "auto" = compress when observations hold integer
    (pixel-like) arrays, which shrink 20x and more, and not for float vectors, which shrink ~1.3x
    for ~17% of sampling throughput on CartPole."""
    env_runner_metrics_interval_s: float = 0.5
    """How often the driver fetches episode metrics (and liveness) from the streaming runners."""

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.stream_compress not in (True, False, "auto"):
            problems.append(f"stream_compress must be True, False or 'auto', got {self.stream_compress!r}")
        if self.num_learners != 0:
            problems.append(f"{self.algo_name} supports only num_learners=0 (the learner runs in the driver, next to "
                            f"the thread that receives the chunk streams); remote learners for the asynchronous "
                            f"algorithms are not implemented yet, got num_learners={self.num_learners}")
        if not _is_int(self.stream_socket_buffer_bytes) or self.stream_socket_buffer_bytes < 0:
            problems.append(f"stream_socket_buffer_bytes must be an int >= 0, got {self.stream_socket_buffer_bytes!r}")
        for key in ("broadcast_interval", "learner_queue_size", "stream_hwm"):
            if not _is_int(getattr(self, key)) or getattr(self, key) < 1:
                problems.append(f"{key} must be an int >= 1, got {getattr(self, key)!r}")
        for key in ("vtrace_clip_rho_threshold", "vtrace_clip_pg_rho_threshold", "learner_queue_timeout",
                    "env_runner_metrics_interval_s"):
            if not _is_number(getattr(self, key)) or getattr(self, key) <= 0:
                problems.append(f"{key} must be a number > 0, got {getattr(self, key)!r}")
        if not _is_number(self.vf_loss_coeff) or self.vf_loss_coeff < 0:
            problems.append(f"vf_loss_coeff must be >= 0, got {self.vf_loss_coeff!r}")
        problems += _check_schedule("entropy_coeff", self.entropy_coeff)
        if _is_int(self.minibatch_size) and _is_int(self.train_batch_size_per_learner) \
                and self.minibatch_size > self.train_batch_size_per_learner:
            problems.append(f"minibatch_size ({self.minibatch_size}) must not exceed train_batch_size_per_learner "
                            f"({self.train_batch_size_per_learner})")
        return problems


# --- loss -------------------------------------------------------------------------------------
def impala_loss(module: RLModule, batch: dict[str, Any], config: IMPALAConfig,
                entropy_coeff: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IMPALA's loss on one (mini)batch.

    ``batch`` holds ``obs``, ``actions`` and the V-trace results ``vtrace_targets`` (value
    targets v_s) and ``pg_advantages`` (``clip(rho_s) * (r_s + gamma * v_{s+1} - V(x_s))``).
    Policy loss ``-mean(logp * pg_advantages)``, value loss ``0.5 * mean((V - v_s)^2)``, minus
    the entropy bonus. ``entropy_coeff`` defaults to ``config.entropy_coeff`` (a number).
    """
    entropy_coeff = config.entropy_coeff if entropy_coeff is None else entropy_coeff
    out = module.forward_train(batch["obs"])
    dist = module.action_dist(out["action_dist_inputs"])
    logp = dist.logp(batch["actions"])
    policy_loss = -(logp * batch["pg_advantages"]).mean()
    targets = batch["vtrace_targets"]
    vf_loss = 0.5 * (out["vf_preds"] - targets).pow(2).mean()
    entropy = dist.entropy().mean()
    total = policy_loss + config.vf_loss_coeff * vf_loss - entropy_coeff * entropy
    var = targets.var() if targets.numel() > 1 else torch.tensor(0.0)
    stats = {"policy_loss": policy_loss.detach(), "vf_loss": vf_loss.detach(), "entropy": entropy.detach(),
             "total_loss": total.detach(),
             "vf_explained_var": (1 - (targets - out["vf_preds"]).var() / var).detach() if var > 0 else torch.tensor(0.0)}
    return total, stats


# --- update -----------------------------------------------------------------------------------
def step_rows(lengths: np.ndarray) -> np.ndarray:
    """Indices of ``all_obs`` rows at which an action was taken (all but each chunk's closing row)."""
    keep = np.ones(int(lengths.sum() + len(lengths)), bool)
    keep[np.cumsum(lengths + 1) - 1] = False
    return np.flatnonzero(keep)


def vtrace_inputs(learner: Learner, chunks: list[EpisodeChunk]):
    """The batch, V(x) of every observation (incl. each chunk's closing one) and the current
    policy's action distribution inputs at the action rows -- one forward pass, no gradient."""
    b = batch_from(chunks, learner.device)
    with torch.no_grad():
        out = learner.module.forward_train(b.all_obs)
    rows = torch.as_tensor(step_rows(b.lengths), device=learner.device)
    return b, out["vf_preds"], out["action_dist_inputs"][rows]


def sgd(learner: Learner, tensors: dict[str, Any], loss_fn, n: int) -> dict[str, float]:
    """``num_epochs`` passes of ``minibatch_size``-step minibatches over a batch of ``n`` steps."""
    cfg = learner.config
    mbs = min(cfg.minibatch_size, n)
    return learner.sgd(tensors, loss_fn, n, mbs, -(-n // mbs), cfg.num_epochs)


def impala_update(learner: Learner, chunks: list[EpisodeChunk], timestep: int) -> dict[str, float]:
    """V-trace targets with the learner's current policy and values, then SGD on ``impala_loss``."""
    cfg: IMPALAConfig = learner.config
    b, values, dist_inputs = vtrace_inputs(learner, chunks)
    with torch.no_grad():
        target_logp = learner.module.action_dist(dist_inputs).logp(b.actions)
    behaviour_logp = b.extra["action_logp"]
    vs, pg_adv = vtrace(behaviour_logp.cpu().numpy(), target_logp.cpu().numpy(), b.rewards, values.cpu().numpy(),
                        b.lengths, b.terminated, cfg.gamma, cfg.vtrace_clip_rho_threshold,
                        cfg.vtrace_clip_pg_rho_threshold)
    tensors = {"obs": b.obs, "actions": b.actions, "vtrace_targets": torch.as_tensor(vs, device=learner.device),
               "pg_advantages": torch.as_tensor(pg_adv, device=learner.device)}
    entropy_coeff = piecewise(cfg.entropy_coeff, timestep)
    out = sgd(learner, tensors, lambda mb: impala_loss(learner.module, mb, cfg, entropy_coeff), len(b))
    rho = torch.exp(target_logp - behaviour_logp)
    out["mean_rho"] = float(rho.mean())
    out["rho_clipped_fraction"] = float((rho > cfg.vtrace_clip_rho_threshold).float().mean())
    out["curr_entropy_coeff"] = entropy_coeff
    out["num_module_steps_trained"] = float(len(b))
    return out


# --- algorithm --------------------------------------------------------------------------------
class IMPALA(Algorithm):
    config_class = IMPALAConfig
    update_fn = staticmethod(impala_update)

    def setup(self) -> None:
        cfg = self.config
        # The learner shares the machine with the runners, which Ray starts at a lower priority:
        # torch's default (one intra-op thread per core) lets the driver take every core and starve
        # them. Use the CPUs the driver is counted for; stop() restores the previous setting.
        self._torch_threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, int(cfg.num_cpus_for_main_process)))
        self.receiver = ChunkReceiver(
            self.observation_space, self.action_space, cfg.train_batch_size_per_learner,
            queue_size=cfg.learner_queue_size, hwm=cfg.stream_hwm, rcvbuf=cfg.stream_socket_buffer_bytes,
            device=self.learner_group.local.device)
        self.receiver.start()
        self._streaming: set[int] = set()  # runner indices told to stream to the receiver
        self._last_metrics_at = 0.0
        self._metrics_pending: set[int] = set()  # runners with a get_stream_metrics call in flight
        self._last_answer: dict[int, float] = {}  # runner -> when it last answered any request
        self._last_batch_at = time.monotonic()
        self._last_stats: dict[str, Any] = {}
        self._stopped = False
        self._received_seen = 0  # env steps of the receiver already counted as sampled
        self._iter_reset()

    # --- weights ------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Broadcast without waiting: one ``ray.put``, one cheap call per runner (applied between fragments)."""
        weights = self.learner_group.get_weights(inference_only=True)
        group, version = self.env_runner_group, self.weights_version
        group._weights_version = version  # what a recreated runner gets (EnvRunnerGroup._restore)
        if group.local is not None:  # a copy: get_weights' arrays alias the learner's live tensors on CPU
            group.local.set_weights_async({k: np.array(v) for k, v in weights.items()}, version)
            return
        group._weights_ref = ray.put(weights)
        group.manager.submit("set_weights_async", group._weights_ref, version, tag="weights")

    # --- streaming ----------------------------------------------------------------------------
    def _stream_args(self) -> dict[str, Any]:
        cfg = self.config
        return {"address": self.receiver.address, "hwm": cfg.stream_hwm, "compress": self._compress_frames(),
                "sndbuf": cfg.stream_socket_buffer_bytes,
                "stall_timeout_s": cfg.env_runner_health_probe_timeout_s}

    def _compress_frames(self) -> bool:
        if self.config.stream_compress != "auto":
            return bool(self.config.stream_compress)
        return any(np.issubdtype(leaf.dtype, np.integer) and int(np.prod(leaf.shape)) >= 64
                   for leaf in _box_leaves(self.observation_space))

    def _ensure_streaming(self) -> None:
        group = self.env_runner_group
        if group.local is not None:
            if not self._streaming:
                group.local.start_streaming(**self._stream_args())
                self._streaming.add(0)
            return
        ids = [i for i in group.manager.healthy_ids() if i not in self._streaming]
        if ids:
            for res in group.manager.foreach_actor("start_streaming", actor_ids=ids, **self._stream_args()):
                if res.ok:
                    self._streaming.add(res.actor_id)

    def _poll_runners(self, force: bool = False) -> None:
        """Fold finished requests (metrics, weight acks), ask for metrics now and then, probe overdue
        runners, recreate failed ones and restart their streams. Never waits on a healthy runner."""
        group = self.env_runner_group
        now = time.monotonic()
        due = force or now - self._last_metrics_at >= self.config.env_runner_metrics_interval_s
        if group.local is not None:
            if due:
                self._last_metrics_at = now
                self._fold_metrics(0, group.local.get_stream_metrics())
            return
        manager = group.manager
        for res in manager.fetch_ready(0.0):
            self._last_answer[res.actor_id] = now
            if res.tag == "metrics":
                self._metrics_pending.discard(res.actor_id)
                if res.ok:
                    self._fold_metrics(res.actor_id, res.value)
        for i in list(self._streaming):
            if not manager.members[i].healthy:
                self._streaming.discard(i)
                self._metrics_pending.discard(i)
        if due:
            self._last_metrics_at = now
            for i in manager.healthy_ids():
                if i not in self._metrics_pending and manager.submit("get_stream_metrics", actor_ids=[i], tag="metrics"):
                    self._metrics_pending.add(i)
        # A runner whose requests go unanswered for probe_timeout_s (its main thread hangs too, e.g. an env
        # stuck in C code holding the GIL) gets a health probe, which marks it failed if it does not answer.
        timeout = manager.settings.probe_timeout_s
        silent = [i for i in manager.healthy_ids()
                  if manager.num_in_flight(i) and now - self._last_answer.setdefault(i, now) > timeout]
        if silent:
            failed = set(manager.probe_health())
            for i in silent:
                self._last_answer[i] = time.monotonic()
                if i in failed:
                    self._metrics_pending.discard(i)
                    self._streaming.discard(i)
        restarted = group.restart_failed()
        for i in restarted:
            self._streaming.discard(i)
            self._metrics_pending.discard(i)
            self._last_answer[i] = time.monotonic()
        self._ensure_streaming()

    def _fold_metrics(self, runner_id: int, m: dict[str, Any]) -> None:
        self._step_episodes += self.record_runner_metrics([m])
        self.env_runner_group.sub_env_restarts[runner_id] = m["num_sub_env_restarts"]
        self._runner_stream_stats[runner_id] = {k: m[k] for k in (
            "num_frames_sent", "send_blocked_s", "weights_version", "num_weight_updates_applied")}

    # --- training -----------------------------------------------------------------------------
    def _iter_reset(self) -> None:
        self._step_episodes = 0  # episodes folded since the last training step returned (Algorithm.train sums them)
        self._iter = {"t0": time.perf_counter(), "trained": 0, "updates": 0, "lag_sum": 0.0,
                      "lag_steps": 0, "lag_max": 0, "qsize_sum": 0, "qsize_n": 0, "wait_s": 0.0, "update_s": 0.0}
        self._runner_stream_stats: dict[int, dict] = getattr(self, "_runner_stream_stats", {})

    def train(self) -> dict[str, Any]:
        self._iter_reset()
        return super().train()

    def _next_batch(self) -> ChunkBatch | None:
        """Wait briefly for a train batch (the caller comes back soon to poll runners)."""
        batch = self.receiver.get_batch(timeout=0.1)
        now = time.monotonic()
        if batch is not None:
            self._last_batch_at = now
        elif now - self._last_batch_at > self.config.learner_queue_timeout:
            s = self.receiver.stats()
            raise RuntimeError(
                f"no train batch arrived for {now - self._last_batch_at:.0f} s (learner_queue_timeout="
                f"{self.config.learner_queue_timeout}); healthy env runners: {self.env_runner_group.num_healthy()}, "
                f"frames received: {s['num_frames_received']}, dropped: "
                f"{s['num_frames_dropped_decode_error'] + s['num_frames_dropped_bad_envelope']} frames and "
                f"{s['num_chunks_dropped_invalid']} chunks (see the log for why)")
        return batch

    def _update(self, batch: ChunkBatch) -> dict[str, Any]:
        """One learner update on ``batch``; counts, weights lag, broadcast."""
        it = self._iter
        versions, steps = batch.weights_versions()
        lag = self.weights_version - versions
        it["lag_sum"] += float((lag * steps).sum())
        it["lag_steps"] += int(steps.sum())
        it["lag_max"] = max(it["lag_max"], int(lag.max()))
        t0 = time.perf_counter()
        stats = self.learner_group.update(batch, self.counters["num_env_steps_sampled_lifetime"])
        it["update_s"] += time.perf_counter() - t0
        n = int(steps.sum())
        self.counters["num_env_steps_trained_lifetime"] += n
        it["trained"] += n
        it["updates"] += 1
        self.weights_version += 1
        if self.weights_version % self.config.broadcast_interval == 0:
            self.sync_weights()
        return stats

    def training_step(self) -> dict[str, Any]:
        self._ensure_streaming()
        t0 = time.perf_counter()
        batch = self._next_batch()
        self._iter["wait_s"] += time.perf_counter() - t0
        if batch is not None:
            self._iter["qsize_sum"] += self.receiver.qsize()
            self._iter["qsize_n"] += 1
            self._last_stats = self._update(batch)
        self._poll_runners()
        return self._step_result()

    def _step_result(self) -> dict[str, Any]:
        """Learner stats of the latest update plus this iteration's sections (the last training
        step of an iteration reports the whole iteration)."""
        it = self._iter
        received = self.receiver.counters["num_env_steps_received"]
        self.counters["num_env_steps_sampled_lifetime"] += received - self._received_seen
        self._received_seen = received
        elapsed = time.perf_counter() - it["t0"]
        s = self.receiver.stats()
        lag_mean = it["lag_sum"] / it["lag_steps"] if it["lag_steps"] else float("nan")
        stream = {
            "num_frames_received": s["num_frames_received"],
            "num_chunks_received": s["num_chunks_received"],
            "num_frames_dropped_decode_error": s["num_frames_dropped_decode_error"],
            "num_frames_dropped_bad_envelope": s["num_frames_dropped_bad_envelope"],
            "num_frames_dropped_not_chunks": s["num_frames_dropped_not_chunks"],
            "num_chunks_dropped_invalid": s["num_chunks_dropped_invalid"],
            "num_env_steps_dropped": s["num_env_steps_dropped"],
            "num_dropped_by_sender": dict(self.receiver.dropped_by_sender),
            "weights_lag_mean": lag_mean,
            "weights_lag_max": it["lag_max"] if it["lag_steps"] else float("nan"),
            "runner_send_blocked_s": float(sum(r["send_blocked_s"] for r in self._runner_stream_stats.values())),
            "runner_weights_versions": {str(i): r["weights_version"] for i, r in sorted(self._runner_stream_stats.items())},
        }
        queue = {"size": s["learner_queue_size"], "capacity": self.config.learner_queue_size,
                 "size_mean": it["qsize_sum"] / it["qsize_n"] if it["qsize_n"] else float("nan")}
        new_episodes, self._step_episodes = self._step_episodes, 0
        return self._last_stats | {
            "_new_episodes": new_episodes,
            "_timer_learner_wait_for_batch": it["wait_s"],
            "_timer_learner_update": it["update_s"],
            "_result_stream": stream,
            "_result_learner_queue": queue,
            "_result_num_env_steps_trained_per_s": it["trained"] / elapsed if elapsed > 0 else 0.0,
            "_result_num_learner_updates": it["updates"],
        }

    # --- shutdown -----------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the runners' sampling threads, the loader thread and sockets, then every actor."""
        if getattr(self, "_stopped", True):
            return super().stop()
        self._stopped = True
        group = self.env_runner_group
        try:
            if group.local is not None:
                group.local.stop_streaming()
            elif group.manager is not None:
                handles = [m.handle for m in group.manager.members.values() if m.healthy]
                ray.wait([h.stop_streaming.remote() for h in handles], num_returns=len(handles), timeout=15.0)
        except Exception as err:  # noqa: BLE001 - the actors are killed next anyway
            log.warning("stopping the env runners' streams: %s", err)
        finally:
            self.receiver.close()
            torch.set_num_threads(self._torch_threads_before)
            super().stop()


register_algorithm("IMPALA", IMPALAConfig, IMPALA)


def _box_leaves(space: gym.Space) -> list[gym.spaces.Box]:
    if isinstance(space, gym.spaces.Dict):
        return [b for s in space.spaces.values() for b in _box_leaves(s)]
    if isinstance(space, gym.spaces.Tuple):
        return [b for s in space.spaces for b in _box_leaves(s)]
    return [space] if isinstance(space, gym.spaces.Box) else []
