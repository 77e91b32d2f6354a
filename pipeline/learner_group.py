"""LearnerGroup: one learner in the driver, or n Ray learner actors training data-parallel.

An ``ActorManager`` hosts them either way. With several learners each gets a shard of the train
batch (whole chunks, balanced by steps) as one codec frame; their gradients are averaged with
torch.distributed every minibatch, so all hold identical weights after every update. A learner
that fails ends the run with an error naming it (learners are not restarted: their gradient
all-reduce group cannot lose a member).
"""
from __future__ import annotations

import socket
from typing import Any, Callable

import numpy as np
import ray

from actors.learner import Learner
from actors.manager import ActorManager, FaultToleranceSettings
from actors.metrics import MetricsLogger
from protocols.codec import encode
from protocols.episode import EpisodeChunk


def shard_chunks(chunks: list[EpisodeChunk], n: int) -> list[list[EpisodeChunk]]:
    """Greedy split into ``n`` shards of about equal step counts (longest chunks first)."""
    shards: list[list[EpisodeChunk]] = [[] for _ in range(n)]
    sizes = np.zeros(n, np.int64)
    for c in sorted(chunks, key=len, reverse=True):
        k = int(sizes.argmin())
        shards[k].append(c)
        sizes[k] += len(c)
    return shards


class LearnerGroup:
    def __init__(self, learner_class: type[Learner], config: Any, observation_space: Any, action_space: Any) -> None:
        n = config.num_learners
        device = "cuda" if config.num_gpus_per_learner > 0 else "cpu"
        if n == 0:
            if device == "cuda":
                import torch

                if not torch.cuda.is_available():
                    raise RuntimeError("num_gpus_per_learner > 0 but torch sees no CUDA device in the driver; "
                                       "use num_learners >= 1 to place learners on GPU nodes, or set num_gpus_per_learner=0")
            make: Callable[[int, bool], Any] = lambda rank, _: learner_class(  # noqa: E731
                config, observation_space, action_space, device=device)
        else:
            cls = ray.remote(num_cpus=config.num_cpus_per_learner, num_gpus=config.num_gpus_per_learner)(learner_class)
            make = lambda rank, _: cls.remote(config, observation_space, action_space, device=device,  # noqa: E731
                                              rank=rank, world_size=n)
        fatal = FaultToleranceSettings(restart_failed=False, ignore_failures=False, probe_timeout_s=None, fatal_hint="")
        self.manager = ActorManager(make, list(range(max(1, n))), fatal, name="learner", in_process=n == 0)
        self.manager.check_started(config.learner_placement_timeout_s,
                                   f"{config.num_cpus_per_learner} CPU(s) and {config.num_gpus_per_learner} GPU(s)")
        if n > 1:
            first = self.manager.handle(0)
            addr, port = ray.get(first.apply.remote(_free_address))
            self.manager.foreach_actor("setup_distributed", addr, port)
        self.weights_version = 0
        """Bumped by every update: the version stamped on the weights the runners act with."""

    @property
    def local(self) -> Learner | None:
        """The in-process learner (``num_learners=0``); None with remote learners."""
        return self.manager.handle(0) if self.manager.in_process else None

    def update(self, batch: list[EpisodeChunk], timestep: int, metrics: MetricsLogger | None = None) -> dict[str, float]:
        """One update on ``batch`` (sharded across learners); ``timestep`` drives the schedules.
        Returns the learners' mean statistics and logs them into ``metrics``."""
        ids = self.manager.healthy_ids()
        shards = [batch] if len(ids) == 1 else shard_chunks(list(batch), len(ids))
        # in-process the batch is handed over as it is (a loader may have laid it out already);
        # to another process it goes as one codec frame
        ship = (lambda s: s) if self.manager.in_process else (lambda s: encode(list(s), compress=False))
        results = self.manager.foreach_actor("update", per_actor_args={
            i: (ship(s), timestep) for i, s in zip(ids, shards)})
        all_stats = [r.value for r in results]
        stats = {k: float(np.mean([s[k] for s in all_stats])) for k in all_stats[0]}
        self.weights_version += 1
        if metrics is not None:
            steps = sum(len(c) for c in batch)
            metrics.log_dict(stats, prefix="learners/default_policy")
            metrics.log_value("learners/__all_modules__/num_env_steps_trained", steps, reduce="sum")
            metrics.log_value("learners/__all_modules__/num_env_steps_trained_lifetime", steps, reduce="lifetime_sum")
            metrics.log_value("learners/__all_modules__/num_updates", 1, reduce="sum")
        return stats

    def _first(self, method: str, *args: Any) -> Any:
        return self.manager.foreach_actor(method, *args, actor_ids=self.manager.healthy_ids()[:1])[0].value

    def get_weights(self, inference_only: bool = False) -> dict[str, np.ndarray]:
        return self._first("get_weights", inference_only)

    def get_state(self) -> dict[str, Any]:
        return self._first("get_state")

    def set_state(self, state: dict[str, Any]) -> None:
        self.manager.foreach_actor("set_state", self.manager.share(state))

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.manager.foreach_actor("set_weights", self.manager.share(weights))

    def foreach_learner(self, fn: Callable[[Learner], Any]) -> list[Any]:
        return [r.value for r in self.manager.foreach_actor("apply", fn)]

    def stop(self) -> None:
        """Leave the gradient all-reduce group, then end the learners (best effort: shutting down)."""
        try:
            self.manager.foreach_actor("stop", timeout_s=10)
        except Exception:  # noqa: BLE001 - a learner that cannot stop cleanly is killed next
            pass
        self.manager.stop()


def _free_address(_learner: Learner) -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port
