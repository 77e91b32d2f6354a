"""Chunks as padded sequences, for recurrent modules: each chunk one row, unrolled from its ``state_in``.

A learner of a recurrent module cannot shuffle single steps: each step's output depends on the steps
before it in its chunk. So the chunks become ``B`` rows of ``Tmax + 1`` observations (each chunk's own
``T + 1`` rows, then zeros), a mask of the ``T`` real steps per row, and each chunk's start state. Padding
sits after the real steps, so it never reaches a real step's output. ``step_index`` / ``obs_index`` map
the flat layout of ``actors.learner.batch.Batch`` (steps, or every observation, chunk after chunk) into
the padded one, so losses written for flat batches carry over (``pad_steps``, ``flat_values``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from protocols import nested
from protocols.episode import EpisodeChunk


@dataclass
class Sequences:
    obs: Any
    """``[B, Tmax + 1, ...]``: each chunk's observations, zero-padded."""
    state_in: torch.Tensor
    """``[B, ...]``: the recurrent state each chunk started from."""
    mask: torch.Tensor
    """``[B, Tmax]`` bool: the real steps."""
    step_index: torch.Tensor
    """For each step of the flat layout (chunk after chunk), its index in the ``[B * Tmax]`` padded layout."""
    obs_index: torch.Tensor
    """For each observation of the flat layout (``T + 1`` per chunk), its index in ``[B * (Tmax + 1)]``."""

    @property
    def num_sequences(self) -> int:
        return int(self.mask.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.mask.shape[1])

    def pad_steps(self, flat: Any) -> Any:
        """A flat per-step tensor (or nest) ``[N, ...]`` -> ``[B, Tmax, ...]`` (zeros where padded)."""
        def pad(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros((self.num_sequences * self.max_len, *t.shape[1:]), dtype=t.dtype, device=t.device)
            out[self.step_index] = t
            return out.reshape(self.num_sequences, self.max_len, *t.shape[1:])
        return nested.map_structure(pad, flat)

    def flat_values(self, padded: torch.Tensor) -> torch.Tensor:
        """``[B, Tmax + 1]`` per-observation outputs (values) -> the flat ``[N + B]`` layout."""
        return padded.reshape(-1)[self.obs_index]


def chunks_to_sequences(chunks: list[EpisodeChunk], device: torch.device) -> Sequences:
    """Raise ValueError naming a chunk without ``state_in`` (a recurrent policy's chunks all carry one)."""
    lengths = np.fromiter((len(c) for c in chunks), np.int64, len(chunks))
    b, tmax = len(chunks), int(lengths.max())
    missing = [c for c in chunks if c.state_in is None]
    if missing:
        c = missing[0]
        raise ValueError(f"chunk {c.chunk_index} of episode {c.episode_id} has no state_in: a recurrent module "
                         f"unrolls each chunk from the state its runner acted from ({len(missing)} such chunks)")
    states = np.stack([c.state_in for c in chunks])

    def padded(leaves: list[np.ndarray]) -> torch.Tensor:
        out = np.zeros((b, tmax + 1, *leaves[0].shape[1:]), leaves[0].dtype)
        for i, a in enumerate(leaves):
            out[i, : len(a)] = a
        return torch.as_tensor(out, device=device)

    first = chunks[0].obs
    if isinstance(first, np.ndarray):
        obs = padded([c.obs for c in chunks])
    else:
        flat = [nested.flatten(c.obs) for c in chunks]
        leaves = [padded([f[k] for f in flat]) for k in range(len(flat[0]))]
        it = iter(leaves)
        obs = nested.map_structure(lambda _: next(it), first)
    steps = np.concatenate([i * tmax + np.arange(n) for i, n in enumerate(lengths)])
    rows = np.concatenate([i * (tmax + 1) + np.arange(n + 1) for i, n in enumerate(lengths)])
    mask = np.arange(tmax)[None, :] < lengths[:, None]
    return Sequences(obs=obs, state_in=torch.as_tensor(states, device=device),
                     mask=torch.as_tensor(mask, device=device),
                     step_index=torch.as_tensor(steps, device=device), obs_index=torch.as_tensor(rows, device=device))


def sequence_outputs(module: Any, seq: Sequences) -> dict[str, torch.Tensor]:
    """A recurrent module over ``seq`` in the flat layouts: ``vf_all`` (every observation, chunk after chunk,
    the full module only) and ``action_dist_inputs`` (every step)."""
    out = module.forward_sequences(seq.obs, seq.state_in)
    result = {"action_dist_inputs": out["action_dist_inputs"][:, : seq.max_len][seq.mask]}
    if "vf_preds" in out:
        result["vf_all"] = seq.flat_values(out["vf_preds"])
    return result


def sequence_sgd(learner: Any, seq: Sequences, steps: dict[str, Any], loss_fn: Any, num_steps: int,
                 minibatch_size: int, num_minibatches: int, num_epochs: int) -> dict[str, float]:
    """``learner.sgd`` over whole sequences: ``steps`` (flat per-step tensors) are padded to ``[B, Tmax]``,
    each minibatch of about ``minibatch_size`` steps' worth of sequences is unrolled from its start states,
    and ``loss_fn(real_steps, out=real_outputs)`` sees only the real steps (``action_dist_inputs``,
    ``vf_preds``)."""
    tmax = seq.max_len
    tensors = {"obs": nested.map_structure(lambda t: t[:, :tmax], seq.obs), "state_in": seq.state_in,
               "mask": seq.mask, **{k: seq.pad_steps(v) for k, v in steps.items()}}
    per_minibatch = max(1, round(seq.num_sequences * minibatch_size / max(1, num_steps)))

    def loss(mb: dict[str, Any]) -> Any:
        mask = mb["mask"]
        out = learner.module.forward_sequences(mb["obs"], mb["state_in"])
        real = {k: nested.map_structure(lambda t: t[mask], mb[k]) for k in steps}
        return loss_fn(real, out={k: v[mask] for k, v in out.items()})

    return learner.sgd(tensors, loss, seq.num_sequences, per_minibatch, num_minibatches, num_epochs)
