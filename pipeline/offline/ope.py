"""Off-policy estimation: a policy's return estimated from recorded episodes of another policy.

``config.evaluation(off_policy_estimation_methods={"is": {"type": "ImportanceSampling"},
"wis": {"type": "WeightedImportanceSampling"}})`` makes each evaluation also read whole recorded
episodes (``off_policy_estimation_episodes`` of them, from the offline input) whose steps carry the
behaviour policy's ``action_logp`` (runnel's recordings do), and estimate what the current policy
would have returned. Results go under ``evaluation/off_policy_estimator/<name>/``:
``v_behavior`` (the recorded discounted return), ``v_target`` (the estimate), ``v_gain``
(``v_target / v_behavior``) and ``v_delta`` (``v_target - v_behavior``), means over the episodes.

Estimators (Precup et al., 2000), per-decision forms, with ``w_t = prod_{k<=t} pi(a_k|s_k) / mu(a_k|s_k)``:
- ImportanceSampling: ``mean over episodes of sum_t gamma^t * w_t * r_t`` -- unbiased, high variance.
- WeightedImportanceSampling: the same with ``w_t`` divided by its mean over the episodes at step
  ``t`` -- biased, far lower variance.
Estimates are only as good as the overlap between the two policies: a target policy that takes
actions the behaviour policy never took gets weights near 0 or huge ones; ``ratio_clip`` bounds
each step's ratio.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

KINDS = {"is": "is", "importancesampling": "is", "wis": "wis", "weightedimportancesampling": "wis"}
"""Accepted ``type`` names (case and underscores ignored; RLlib's class names included) -> kind."""


@dataclass
class RecordedEpisode:
    rewards: np.ndarray
    behavior_logp: np.ndarray
    target_logp: np.ndarray


def estimator_kinds(methods: Any) -> tuple[dict[str, str], list[str]]:
    """``{name: kind}`` from the config setting, and the problems found in it."""
    if not methods:
        return {}, []
    if not isinstance(methods, dict):
        return {}, [f"off_policy_estimation_methods must be a dict like {{'wis': {{'type': 'WeightedImportanceSampling'}}}}, "
                    f"got {type(methods).__name__}"]
    kinds, problems = {}, []
    for name, spec in methods.items():
        kind_name = spec.get("type") if isinstance(spec, dict) else spec
        if not isinstance(kind_name, str):
            kind_name = getattr(kind_name, "__name__", repr(kind_name))
        key = kind_name.rsplit(".", 1)[-1].replace("_", "").lower()
        if key not in KINDS:
            problems.append(f"off_policy_estimation_methods[{name!r}] has type {kind_name!r}; runnel estimates with "
                            f"'ImportanceSampling' ('is') or 'WeightedImportanceSampling' ('wis')")
            continue
        kinds[str(name)] = KINDS[key]
    return kinds, problems


def estimate(episodes: list[RecordedEpisode], gamma: float, kind: str, ratio_clip: float = 1e3) -> dict[str, float]:
    """One estimator's figures over ``episodes`` (pure: no module, no I/O)."""
    if not episodes:
        raise ValueError("off-policy estimation needs at least one whole recorded episode")
    horizon = max(len(e.rewards) for e in episodes)
    n = len(episodes)
    weights = np.zeros((n, horizon))
    discounted = np.zeros((n, horizon))
    mask = np.zeros((n, horizon), bool)
    for i, e in enumerate(episodes):
        t = len(e.rewards)
        ratio = np.clip(np.exp(np.asarray(e.target_logp, np.float64) - np.asarray(e.behavior_logp, np.float64)),
                        0.0, ratio_clip)
        weights[i, :t] = np.cumprod(ratio)
        discounted[i, :t] = np.asarray(e.rewards, np.float64) * gamma ** np.arange(t)
        mask[i, :t] = True
    v_behavior = discounted.sum(axis=1)
    if kind == "wis":
        # normalize each step's weights by their mean over the episodes still running at that step
        # (an ended episode counts with its last weight, as if it stayed in its absorbing state)
        filled = np.where(mask, weights, np.take_along_axis(weights, (mask.sum(1) - 1)[:, None], 1))
        norm = filled.mean(axis=0)
        weights = np.divide(weights, norm, out=np.zeros_like(weights), where=norm > 0)
    v_target = (weights * discounted).sum(axis=1)
    vb, vt = float(v_behavior.mean()), float(v_target.mean())
    return {"v_behavior": vb, "v_target": vt, "v_delta": vt - vb,
            "v_gain": vt / vb if vb != 0 else float("nan"), "v_target_std": float(v_target.std()),
            "num_episodes": float(n)}


def estimate_all(chunks: list[Any], target_logp: Callable[[Any, Any], np.ndarray], gamma: float,
                 kinds: dict[str, str]) -> dict[str, dict[str, float]]:
    """Every configured estimator over whole recorded episodes (``chunks``, each one episode)."""
    episodes = []
    for c in chunks:
        if "action_logp" not in c.extra:
            raise ValueError("recorded episodes carry no action_logp (the behaviour policy's log-probabilities): "
                             "off-policy estimation needs recordings made by runnel's runners or `runnel record`")
        obs = _rows(c.obs, len(c))
        episodes.append(RecordedEpisode(np.asarray(c.rewards), np.asarray(c.extra["action_logp"]),
                                        np.asarray(target_logp(obs, c.actions))))
    return {name: estimate(episodes, gamma, kind) for name, kind in kinds.items()}


def _rows(obs: Any, n: int) -> Any:
    if isinstance(obs, dict):
        return {k: _rows(v, n) for k, v in obs.items()}
    if isinstance(obs, (list, tuple)):
        return type(obs)(_rows(v, n) for v in obs)
    return np.array(obs[:n])  # a copy: decoded arrays are read-only views of the frame
