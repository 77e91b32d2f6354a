"""Learner: owns the trainable module and its optimizer, and applies an algorithm's update.

The algorithm supplies ``update_fn(learner, chunks, timestep) -> stats``: it builds its batch
(``chunks_to_batch``), computes its loss and calls ``learner.apply_gradients(loss)`` as often as
it wants. The learner does the rest: gradient clipping, the learning-rate schedule, and — with
several learners — averaging gradients across them (torch.distributed; gloo on CPU, nccl on GPU)
so every learner applies the same update and keeps identical weights.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from actors.module import RLModule
from protocols import nested
from protocols.episode import EpisodeChunk


def piecewise(schedule: float | list, t: int) -> float:
    """A constant, or ``[[t0, v0], [t1, v1], ...]`` interpolated linearly (held after the last)."""
    if not isinstance(schedule, (list, tuple)):
        return float(schedule)
    points = sorted((int(a), float(b)) for a, b in schedule)
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t < t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return points[-1][1]


@dataclass
class Batch:
    """Steps of many chunks laid end to end (torch tensors on the learner's device)."""

    obs: Any
    """Observations at which each step's action was taken, ``[N, ...]``."""
    all_obs: Any
    """Every observation incl. each chunk's closing one, ``[N + num_chunks, ...]`` (for values)."""
    actions: Any
    rewards: np.ndarray
    lengths: np.ndarray
    terminated: np.ndarray
    extra: dict[str, Any]
    weights_versions: np.ndarray

    def __len__(self) -> int:
        return len(self.rewards)


def chunks_to_batch(chunks: list[EpisodeChunk], device: torch.device) -> Batch:
    lengths = np.fromiter((len(c) for c in chunks), np.int64, len(chunks))
    all_obs = nested.concat([c.obs for c in chunks])
    ends = np.cumsum(lengths + 1) - 1
    keep = np.ones(int(lengths.sum() + len(chunks)), bool)
    keep[ends] = False
    to_t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device)  # noqa: E731
    all_obs_t = nested.map_structure(to_t, all_obs)
    keep_t = torch.as_tensor(keep, device=device)
    return Batch(
        obs=nested.map_structure(lambda a: a[keep_t], all_obs_t),
        all_obs=all_obs_t,
        actions=nested.map_structure(to_t, nested.concat([c.actions for c in chunks])),
        rewards=np.concatenate([c.rewards for c in chunks]).astype(np.float32, copy=False),
        lengths=lengths,
        terminated=np.fromiter((c.terminated for c in chunks), bool, len(chunks)),
        extra={k: nested.map_structure(to_t, nested.concat([c.extra[k] for c in chunks])) for k in chunks[0].extra},
        weights_versions=np.repeat([c.weights_version for c in chunks], lengths),
    )


class Learner:
    def __init__(self, observation_space, action_space, model_config: dict, config: Any,
                 update_fn: Callable[["Learner", list[EpisodeChunk], int], dict],
                 device: str = "cpu", rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.update_fn = update_fn
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        if config.seed is not None:
            torch.manual_seed(config.seed)  # same seed on every learner: identical initial weights
        self.module = RLModule(observation_space, action_space, model_config).to(self.device)
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=piecewise(config.lr, 0), eps=1e-5)
        self.rng = np.random.default_rng(None if config.seed is None else config.seed + rank)
        self.algo_state: dict[str, Any] = {}
        self.num_updates = 0
        self.timestep = 0

    # --- distributed --------------------------------------------------------------------------
    def setup_distributed(self, master_addr: str, master_port: int) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if master_addr in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all learners on this machine
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=self.rank, world_size=self.world_size)

    def allreduce_mean(self, values: np.ndarray) -> np.ndarray:
        """Average numbers across learners (e.g. the KL that adapts the KL coefficient)."""
        if self.world_size == 1:
            return values
        t = torch.as_tensor(np.asarray(values, np.float64))
        dist.all_reduce(t)
        return (t / self.world_size).numpy()

    # --- updating -----------------------------------------------------------------------------
    def update(self, chunks: list[EpisodeChunk], timestep: int) -> dict[str, float]:
        """Run the algorithm's update on these chunks; ``timestep`` drives the schedules."""
        self.timestep = timestep
        lr = piecewise(self.config.lr, timestep)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        stats = self.update_fn(self, chunks, timestep)
        stats["curr_lr"] = lr
        return stats

    update_from_episodes = update  # RLlib's name for the same call

    def apply_gradients(self, loss: torch.Tensor) -> float:
        """Backward, average gradients across learners, clip, step. Returns the global grad norm."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        if self.world_size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat)
            flat /= self.world_size
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        clip, by = self.config.grad_clip, self.config.grad_clip_by
        if clip is not None and by == "value":
            torch.nn.utils.clip_grad_value_(params, clip)
        elif clip is not None and by == "norm":
            for p in params:
                torch.nn.utils.clip_grad_norm_([p], clip)
        if clip is not None and by == "global_norm":
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        self.optimizer.step()
        self.num_updates += 1
        return float(norm)

    def minibatches(self, n: int, minibatch_size: int, num_minibatches: int) -> list[np.ndarray]:
        """Index sets for one epoch. The count is fixed by the config, not by ``n``, so every
        learner of a data-parallel group takes the same number of steps (and meets at each
        gradient all-reduce) even when their shards differ in size."""
        perm = self.rng.permutation(n)
        if num_minibatches * minibatch_size > n:
            perm = np.resize(perm, num_minibatches * minibatch_size)
        return [perm[i * minibatch_size : (i + 1) * minibatch_size] for i in range(num_minibatches)]

    def sgd(self, tensors: dict[str, Any], loss_fn: Callable[[dict[str, Any]], tuple[torch.Tensor, dict]],
            n: int, minibatch_size: int, num_minibatches: int, num_epochs: int) -> dict[str, float]:
        """``num_epochs`` passes of ``num_minibatches`` minibatches of ``tensors`` (``n`` rows each
        leaf), one gradient step per minibatch; returns the mean of ``loss_fn``'s stats. A single
        minibatch covering all rows uses the batch as it is."""
        whole = num_minibatches == 1 and minibatch_size >= n
        sums: dict[str, float] = {}
        count = 0
        for _ in range(num_epochs):
            for idx in [None] if whole else self.minibatches(n, minibatch_size, num_minibatches):
                if idx is None:
                    mb = tensors
                else:
                    idx_t = torch.as_tensor(idx, device=self.device)
                    mb = nested.map_structure(lambda t: t[idx_t], tensors)
                loss, stats = loss_fn(mb)
                stats["gradients_global_norm"] = self.apply_gradients(loss)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                count += 1
        return {k: v / count for k, v in sums.items()}

    # --- state --------------------------------------------------------------------------------
    def get_weights(self, inference_only: bool = False) -> dict[str, np.ndarray]:
        return self.module.get_state(inference_only=inference_only)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.module.set_state(weights)

    def get_state(self) -> dict[str, Any]:
        """Module and optimizer tensors plus counters: everything to continue exactly."""
        return {
            "module": {k: v.detach().cpu() for k, v in self.module.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "algo_state": dict(self.algo_state),
            "num_updates": self.num_updates,
            "rng": self.rng.bit_generator.state,
            "torch_rng": torch.get_rng_state(),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.algo_state = dict(state.get("algo_state", {}))
        self.num_updates = int(state.get("num_updates", 0))
        if "rng" in state:
            self.rng.bit_generator.state = state["rng"]
        if "torch_rng" in state:
            torch.set_rng_state(state["torch_rng"])

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["Learner"], Any]) -> Any:
        return fn(self)

    def stop(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
