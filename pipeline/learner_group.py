"""LearnerGroup: one learner in the driver, or n Ray learner actors training data-parallel.

With several learners each gets a shard of the train batch (whole chunks, balanced by steps);
their gradients are averaged with torch.distributed every minibatch, so all hold identical
weights after every update.
"""
from __future__ import annotations

import socket
from typing import Any, Callable

import numpy as np
import ray

from actors.learner import Learner
from protocols.episode import EpisodeChunk


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


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
    def __init__(self, config: Any, observation_space, action_space, update_fn: Callable) -> None:
        self.config = config
        n = config.num_learners
        device = "cuda" if config.num_gpus_per_learner > 0 else "cpu"
        if n == 0:
            if device == "cuda":
                import torch

                if not torch.cuda.is_available():
                    raise RuntimeError("num_gpus_per_learner > 0 but torch sees no CUDA device in the driver; "
                                       "use num_learners >= 1 to place learners on GPU nodes, or set num_gpus_per_learner=0")
            self.local = Learner(observation_space, action_space, config.model_config, config, update_fn, device=device)
            self.remote: list[Any] = []
            return
        self.local = None
        cls = ray.remote(num_cpus=config.num_cpus_per_learner, num_gpus=config.num_gpus_per_learner)(Learner)
        self.remote = [
            cls.remote(observation_space, action_space, config.model_config, config, update_fn,
                       device=device, rank=r, world_size=n)
            for r in range(n)
        ]
        try:
            ray.get([l.ping.remote() for l in self.remote], timeout=config.learner_placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.stop()
            raise RuntimeError(
                f"{n} learner actor(s) with {config.num_cpus_per_learner} CPU(s) and {config.num_gpus_per_learner} "
                f"GPU(s) each could not be placed within {config.learner_placement_timeout_s:.0f} s; the cluster "
                f"has {ray.available_resources()} available. Lower num_learners/num_cpus_per_learner/"
                f"num_gpus_per_learner or add nodes.") from None
        if n > 1:
            addr = ray.get(self.remote[0].apply.remote(_node_ip))
            port = ray.get(self.remote[0].apply.remote(lambda _l: _free_port()))
            ray.get([l.setup_distributed.remote(addr, port) for l in self.remote])

    def update(self, chunks: list[EpisodeChunk], timestep: int) -> dict[str, float]:
        if self.local is not None:
            return self.local.update(chunks, timestep)
        shards = shard_chunks(chunks, len(self.remote))
        stats = ray.get([l.update.remote(s, timestep) for l, s in zip(self.remote, shards)])
        return {k: float(np.mean([s[k] for s in stats])) for k in stats[0]}

    def _call(self, method: str, *args: Any) -> Any:
        if self.local is not None:
            return getattr(self.local, method)(*args)
        return ray.get(getattr(self.remote[0], method).remote(*args))

    def get_weights(self, inference_only: bool = False) -> dict[str, np.ndarray]:
        return self._call("get_weights", inference_only)

    def get_state(self) -> dict[str, Any]:
        return self._call("get_state")

    def set_state(self, state: dict[str, Any]) -> None:
        if self.local is not None:
            self.local.set_state(state)
        else:
            ray.get([l.set_state.remote(state) for l in self.remote])

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        if self.local is not None:
            self.local.set_weights(weights)
        else:
            ray.get([l.set_weights.remote(weights) for l in self.remote])

    def foreach_learner(self, fn: Callable[[Learner], Any]) -> list[Any]:
        if self.local is not None:
            return [fn(self.local)]
        return ray.get([l.apply.remote(fn) for l in self.remote])

    def stop(self) -> None:
        for l in self.remote:
            try:
                ray.get(l.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort on shutdown
                pass
            ray.kill(l)
        self.remote = []


def _node_ip(_learner: Learner) -> str:
    return ray.util.get_node_ip_address()
