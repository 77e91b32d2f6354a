"""Math shared by the algorithms: GAE, V-trace, and the adaptive KL coefficient.

Both work on a *flat batch of chunks*: the steps of all chunks laid end to end, where
``values`` has one more entry per chunk than steps (the value of the chunk's closing
observation, used to bootstrap when the chunk is not terminated). ``lengths`` gives each chunk's
step count. The recursions run over time with numpy vector ops across chunks (chunks are
padded to the longest one), never as a Python loop over single steps.
"""
from __future__ import annotations

from typing import Any

import numpy as np


def _pad(flat: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """Flat per-step values -> ``[num_chunks, width]`` right-padded with zeros."""
    out = np.zeros((len(lengths), width), dtype=flat.dtype)
    mask = np.arange(width)[None, :] < lengths[:, None]
    out[mask] = flat
    return out


def _unpad(padded: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    return padded[np.arange(padded.shape[1])[None, :] < lengths[:, None]]


def split_values(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``values`` with T+1 entries per chunk -> (per-step values V(s_t), next values V(s_{t+1}))."""
    ends = np.cumsum(lengths + 1)
    is_last = np.zeros(len(values), bool)
    is_last[ends - 1] = True
    step_rows = np.flatnonzero(~is_last)
    return values[step_rows], values[step_rows + 1]


def gae(rewards: np.ndarray, values: np.ndarray, lengths: np.ndarray, terminated: np.ndarray,
        gamma: float, lambda_: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation over a flat batch of chunks.

    Args:
        rewards: ``[sum(lengths)]``.
        values: ``[sum(lengths) + num_chunks]`` value predictions of every observation.
        lengths: steps per chunk.
        terminated: per chunk, whether its last step ended the episode in a terminal state
            (then nothing is bootstrapped after it; a truncated chunk bootstraps from its last value).

    Returns:
        ``(advantages, value_targets)``, both ``[sum(lengths)]`` float32.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    v, v_next = split_values(np.asarray(values, np.float32), lengths)
    not_terminal = np.ones(len(rewards), np.float32)
    not_terminal[np.cumsum(lengths)[np.asarray(terminated, bool)] - 1] = 0.0
    deltas = rewards + gamma * v_next * not_terminal - v
    width = int(lengths.max())
    d = _pad(deltas.astype(np.float32), lengths, width)
    adv = np.zeros_like(d)
    running = np.zeros(len(lengths), np.float32)
    decay = np.float32(gamma * lambda_)
    for t in range(width - 1, -1, -1):  # padding is zero and sits after each chunk's end
        running = d[:, t] + decay * running
        adv[:, t] = running
    advantages = _unpad(adv, lengths)
    return advantages, (advantages + v).astype(np.float32)


def normalized(adv: Any) -> Any:
    """Advantages (a torch tensor) scaled to zero mean and unit standard deviation; a single value as it is.
    PPO always, APPO with ``normalize_advantages``, per minibatch."""
    if adv.numel() > 1:
        return (adv - adv.mean()) / (adv.std() + 1e-8)
    return adv


def explained_variance(targets: Any, preds: Any) -> Any:
    """``1 - Var(targets - preds) / Var(targets)`` as a tensor (0 where the targets do not vary, or there is one).
    Decided on the device: a Python ``if`` on the variance would wait for the GPU in the middle of every
    minibatch's loss."""
    if targets.numel() < 2:
        return targets.new_zeros(())
    var = targets.var()
    varies = var > 0
    return (1 - (targets - preds).var() / var.where(varies, var.new_ones(()))).where(varies, var.new_zeros(()))


def adapt_kl_coeff(coeff: float, kl: float, kl_target: float) -> float:
    """PPO's adaptive KL penalty: x1.5 when the measured KL exceeds twice the target, /2 below half of it."""
    if kl > 2.0 * kl_target:
        return coeff * 1.5
    if kl < 0.5 * kl_target:
        return coeff * 0.5
    return coeff


def vtrace(behaviour_logp: np.ndarray, target_logp: np.ndarray, rewards: np.ndarray, values: np.ndarray,
           lengths: np.ndarray, terminated: np.ndarray, gamma: float, clip_rho_threshold: float = 1.0,
           clip_pg_rho_threshold: float = 1.0, clip_c_threshold: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """V-trace targets (Espeholt et al., 2018) over a flat batch of chunks.

    ``values`` has T+1 entries per chunk, as in :func:`gae`. Returns ``(vs, pg_advantages)``,
    each ``[sum(lengths)]``: the value targets ``v_s`` and the policy-gradient advantages
    ``clip(rho_s) * (r_s + gamma * v_{s+1} - V(x_s))``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    v, v_next = split_values(np.asarray(values, np.float32), lengths)
    log_rhos = (target_logp - behaviour_logp).astype(np.float32)
    rhos = np.exp(log_rhos)
    clipped_rhos = np.minimum(clip_rho_threshold, rhos) if clip_rho_threshold is not None else rhos
    cs = np.minimum(clip_c_threshold, rhos) if clip_c_threshold is not None else rhos
    not_terminal = np.ones(len(rewards), np.float32)
    not_terminal[np.cumsum(lengths)[np.asarray(terminated, bool)] - 1] = 0.0
    discounts = gamma * not_terminal
    deltas = clipped_rhos * (rewards + discounts * v_next - v)
    width = int(lengths.max())
    d = _pad(deltas.astype(np.float32), lengths, width)
    dc = _pad((discounts * cs).astype(np.float32), lengths, width)
    acc = np.zeros_like(d)
    running = np.zeros(len(lengths), np.float32)
    for t in range(width - 1, -1, -1):
        running = d[:, t] + dc[:, t] * running
        acc[:, t] = running
    vs = _unpad(acc, lengths) + v
    # v_{s+1}: the next step's target inside a chunk, the bootstrap value at a chunk's end.
    vs_next = np.empty_like(vs)
    vs_next[:-1] = vs[1:]
    ends = np.cumsum(lengths) - 1
    vs_next[ends] = v_next[ends]
    pg_rhos = np.minimum(clip_pg_rho_threshold, rhos) if clip_pg_rho_threshold is not None else rhos
    pg_adv = pg_rhos * (rewards + discounts * vs_next - v)
    return vs.astype(np.float32), pg_adv.astype(np.float32)
