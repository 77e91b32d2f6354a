"""LearnerGroup: one learner in the driver, or n Ray learner actors training data-parallel.

An ``ActorManager`` hosts them either way. With several learners each gets a shard of the train
batch (whole chunks, balanced by steps) as one codec frame; their gradients are averaged with
torch.distributed every minibatch, so all hold identical weights after every update.

A remote learner that dies is rebuilt inside the job (``pipeline.groups.learner_recovery``: from a
surviving learner's state or the latest snapshot, the all-reduce group re-formed), and the call that
found it dead is made again -- an update is retried on the same batch, so the iteration goes on.
``max_num_learner_restarts`` bounds how often; ``fault_tolerance/num_learner_recoveries`` and
``num_learner_restarts`` count it in the results. A learner method that raises still ends the run
with an error naming the learner.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import ray

from actors.learner import Learner
from actors.manager import ActorManager, CallResult, FaultToleranceSettings
from actors.metrics import MetricsLogger
from pipeline.groups.learner_recovery import LearnerRecovery, Recovery, RecoverySettings, free_address
from protocols import nested
from protocols.codec import encode
from protocols.episode import EpisodeChunk


def batch_steps(batch: list[EpisodeChunk] | dict[str, Any]) -> int:
    """Env steps in a batch: a list of chunks, or a replayed batch of transitions (a dict of arrays; of
    sequences, with the ``mask`` of their real steps)."""
    if isinstance(batch, dict):
        return int(np.asarray(batch["mask"]).sum()) if "mask" in batch else len(batch["rewards"])
    return sum(len(c) for c in batch)


def shard_rows(num_rows: int, n: int, num_batches: int = 1) -> list[np.ndarray]:
    """The rows of each of ``n`` learners' shards of a replayed batch that is ``num_batches`` batches in
    a row: every batch split into ``n`` contiguous ranges, a learner's shard its range of each batch in
    order -- so it is ``num_batches`` equal slices again, and all learners step together."""
    size = num_rows // num_batches
    bounds = np.linspace(0, size, n + 1).astype(int)
    starts = np.arange(num_batches)[:, None] * size
    return [(starts + np.arange(lo, hi)[None, :]).reshape(-1) for lo, hi in zip(bounds, bounds[1:])]


def in_batch_order(outputs: np.ndarray, rows: list[np.ndarray] | None) -> np.ndarray:
    """Per-row outputs of the shards (``rows``: each shard's rows, ``shard_rows``), concatenated in shard
    order, back in the batch's row order (None: one shard, in order already)."""
    if rows is None:
        return outputs
    ordered = np.empty_like(outputs)
    ordered[np.concatenate(rows)] = outputs
    return ordered


def take_rows(batch: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    return {k: nested.map_structure(lambda a: a[rows], v) for k, v in batch.items()}


def shard_transitions(batch: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """A replayed batch split into ``n`` shards of contiguous rows."""
    return [take_rows(batch, rows) for rows in shard_rows(len(batch["rewards"]), n)]


def shard_chunks(chunks: list[EpisodeChunk], n: int) -> list[list[EpisodeChunk]]:
    """Greedy split into ``n`` shards of about equal step counts (longest chunks first)."""
    shards: list[list[EpisodeChunk]] = [[] for _ in range(n)]
    sizes = np.zeros(n, np.int64)
    for c in sorted(chunks, key=len, reverse=True):
        k = int(sizes.argmin())
        shards[k].append(c)
        sizes[k] += len(c)
    return shards


def log_learner_stats(metrics: MetricsLogger, stats: dict[str, float], prefix: str) -> None:
    """One module's update statistics into ``metrics`` under ``prefix``: means, except the gradient steps
    ``Learner.sgd`` skipped for a non-finite norm, which add up over the run."""
    skipped = stats.get("num_gradient_steps_skipped", 0.0)
    if skipped:
        metrics.log_value(f"{prefix}/num_gradient_steps_skipped", skipped, reduce="lifetime_sum")
        stats = {k: v for k, v in stats.items() if k != "num_gradient_steps_skipped"}
    metrics.log_dict(stats, prefix=prefix)


class LearnerGroup:
    def __init__(self, learner_class: type[Learner], config: Any, observation_space: Any, action_space: Any,
                 learner_kwargs: dict[str, Any] | None = None) -> None:
        """``learner_kwargs``: more arguments for ``learner_class`` (a multi-agent learner's plan)."""
        n = config.num_learners
        self.learner_kwargs: dict[str, Any] = dict(learner_kwargs or {})
        """What a learner is built with beyond the config: a recreated learner gets the current ones."""
        device = "cuda" if config.num_gpus_per_learner > 0 else "cpu"
        if n == 0:
            if device == "cuda":
                import torch

                if not torch.cuda.is_available():
                    raise RuntimeError("num_gpus_per_learner > 0 but torch sees no CUDA device in the driver; "
                                       "use num_learners >= 1 to place learners on GPU nodes, or set num_gpus_per_learner=0")
            make: Callable[[int, bool], Any] = lambda rank, _: learner_class(  # noqa: E731
                config, observation_space, action_space, device=device, **self.learner_kwargs)
        else:
            cls = ray.remote(num_cpus=config.num_cpus_per_learner, num_gpus=config.num_gpus_per_learner,
                             max_restarts=0)(learner_class)
            make = lambda rank, _: cls.remote(config, observation_space, action_space, device=device,  # noqa: E731
                                              rank=rank, world_size=n, **self.learner_kwargs)
        # remote learners: a failed call comes back as a failed result, and the recovery decides what to do
        # (restart_failed only keeps the manager from raising; it never restarts learners by itself)
        settings = FaultToleranceSettings(restart_failed=n > 0, ignore_failures=False, probe_timeout_s=None,
                                          fatal_hint="")
        self.manager = ActorManager(make, list(range(max(1, n))), settings, name="learner", in_process=n == 0)
        self.manager.check_started(config.learner_placement_timeout_s,
                                   f"{config.num_cpus_per_learner} CPU(s) and {config.num_gpus_per_learner} GPU(s)")
        self.recovery: LearnerRecovery | None = None
        """Rebuilds dead remote learners (None with the learner in the driver)."""
        if n > 0:
            self.recovery = LearnerRecovery(self.manager, RecoverySettings(
                config.max_num_learner_restarts, config.learner_snapshot_interval_s,
                config.learner_placement_timeout_s), distributed=n > 1)
        if n > 1:
            first = self.manager.handle(0)
            addr, port = ray.get(first.apply.remote(free_address))
            self.manager.foreach_actor("setup_distributed", addr, port)
        self.weights_version = 0
        """Bumped by every update: the version stamped on the weights the runners act with."""
        self._ft_logged = {"num_learner_recoveries": 0, "num_learner_restarts": 0}  # counts already in the metrics

    @property
    def local(self) -> Learner | None:
        """The in-process learner (``num_learners=0``); None with remote learners."""
        return self.manager.handle(0) if self.manager.in_process else None

    def update(self, batch: list[EpisodeChunk] | dict[str, Any], timestep: int, metrics: MetricsLogger | None = None,
               with_outputs: bool = False, num_batches: int = 1) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """One update on ``batch`` -- a list of chunks, or a replayed batch of transitions -- sharded
        across learners; ``timestep`` drives the schedules. Returns the learners' mean statistics
        (also logged into ``metrics``) and, ``with_outputs``, their per-row outputs in batch order
        (e.g. TD errors for prioritized replay; none when the learners refused the batch).
        ``num_batches`` > 1: a replayed batch that is that many batches in a row, one update each,
        all in one call (``Learner.train_on_batches``)."""
        ids = self.manager.healthy_ids()
        transitions = isinstance(batch, dict)
        rows = None
        if len(ids) == 1:
            shards = [batch]
        elif transitions:
            rows = shard_rows(len(batch["rewards"]), len(ids), num_batches)
            shards = [take_rows(batch, r) for r in rows]
        else:
            shards = shard_chunks(list(batch), len(ids))
        # in-process the batch is handed over as it is (a loader may have laid it out already);
        # to another process it goes as one codec frame
        if self.manager.in_process:
            ship = lambda s: s  # noqa: E731
        else:
            ship = lambda s: encode(s if transitions else list(s), compress=False)  # noqa: E731
        results = self.call("update_with_outputs" if with_outputs else "update", per_actor_args={
            i: (ship(s), timestep, num_batches) for i, s in zip(ids, shards)})
        values = [r.value for r in results]
        all_stats = [v[0] for v in values] if with_outputs else values
        outputs = {k: in_batch_order(np.concatenate([v[1][k] for v in values]), rows)
                   for k in (values[0][1] if with_outputs else ())}
        stats = self.record_update(all_stats, batch_steps(batch), metrics, num_batches)
        self.snapshot_if_due()
        return stats, outputs

    # --- calls that survive dead learners -----------------------------------------------------
    def call(self, method: str, *args: Any, **kwargs: Any) -> list[CallResult]:
        """``manager.foreach_actor(method, ...)`` on the learners; when learners died in it, the group is
        rebuilt (``recover``) and the call made again, with the same arguments for the same indices."""
        while True:
            results = self.manager.foreach_actor(method, *args, **kwargs)
            if self.recover(results) is None:
                return results

    def recover(self, results: list[CallResult]) -> Recovery | None:
        """If learners died in the call that gave ``results``, rebuild the group and say what was done;
        None when all went through. Raises when a learner raised (nothing died), or past the budget."""
        if self.recovery is None or all(r.ok for r in results):
            return None
        recovery = self.recovery.recover(results)
        if recovery.donor is None:  # the learners went back to a snapshot: new weights
            self.weights_version += 1
        return recovery

    def snapshot_if_due(self) -> None:
        """Keep a copy of the learners' state when ``learner_snapshot_interval_s`` has passed (remote learners)."""
        if self.recovery is not None and self.recovery.snapshot_due():
            self.recovery.keep(self._first("get_state"), f"the snapshot of weights version {self.weights_version}")

    def log_fault_tolerance(self, metrics: MetricsLogger) -> None:
        """Learner recoveries and learner actors recreated, as lifetime counts in the results."""
        counts = {"num_learner_recoveries": 0, "num_learner_restarts": 0}
        if self.recovery is not None:
            counts = {"num_learner_recoveries": self.recovery.num_recoveries,
                      "num_learner_restarts": self.recovery.num_restarts}
        for key, value in counts.items():
            metrics.log_value(f"fault_tolerance/{key}", value - self._ft_logged[key], reduce="lifetime_sum")
            self._ft_logged[key] = value

    def record_update(self, all_stats: list[dict[str, float]], steps: int, metrics: MetricsLogger | None,
                      num_updates: int = 1) -> dict[str, float]:
        """Account for the ``num_updates`` updates the learners made in one call (``all_stats``: each learner's
        statistics; ``steps``: env steps of all their batches together): the mean statistics, logged into
        ``metrics``, and a new weights version -- unless the learners refused the batch."""
        if len(all_stats) == 1:  # the common case, per update on the hot path: no mean to take
            stats = {k: float(v) for k, v in all_stats[0].items()}
        else:
            stats = {k: float(np.mean([s[k] for s in all_stats])) for k in all_stats[0]}
        if "num_batches_refused" in stats:  # the learners dropped the batch (``Learner._refuse``): nothing trained
            if metrics is not None:
                metrics.log_value("learners/default_policy/num_batches_refused", 1, reduce="lifetime_sum")
            return stats
        self.weights_version += 1
        if metrics is not None:
            log_learner_stats(metrics, stats, "learners/default_policy")
            metrics.log_value("learners/__all_modules__/num_env_steps_trained", steps, reduce="sum")
            metrics.log_value("learners/__all_modules__/num_env_steps_trained_lifetime", steps, reduce="lifetime_sum")
            metrics.log_value("learners/__all_modules__/num_updates", num_updates, reduce="sum")
        return stats

    def _first(self, method: str, *args: Any) -> Any:
        return self.call(method, *args, actor_ids=self.manager.healthy_ids()[:1])[0].value

    def get_weights(self, inference_only: bool = False) -> dict[str, np.ndarray]:
        return self._first("get_weights", inference_only)

    def get_state(self) -> dict[str, Any]:
        """Learner 0's state (all hold the same); also kept as the snapshot a recovery may start from."""
        state = self._first("get_state")
        if self.recovery is not None:
            self.recovery.keep(state, f"the state of weights version {self.weights_version} (read for a checkpoint)")
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self.call("set_state", self.manager.share(state))
        if self.recovery is not None:
            self.recovery.keep(state, "the state last restored (a checkpoint's)")

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.call("set_weights", self.manager.share(weights))

    def foreach_learner(self, fn: Callable[[Learner], Any]) -> list[Any]:
        return [r.value for r in self.call("apply", fn)]

    def stop(self) -> None:
        """Leave the gradient all-reduce group, then end the learners (best effort: shutting down)."""
        try:
            self.manager.foreach_actor("stop", timeout_s=10)
        except Exception:  # noqa: BLE001 - a learner that cannot stop cleanly is killed next
            pass
        self.manager.stop()

