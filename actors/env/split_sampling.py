"""Double-buffered sampling: a runner under central inference steps one half of its sub-envs while the server
infers the other half's actions.

With one request out at a time, a runner's envs and its inference server take turns: the envs wait for the
answer, the server waits for the next request. Here the runner's sub-envs are two halves, each with its
own request out (``RemoteActing.send``/``receive`` on lanes 0 and 1): the runner receives half 0's actions,
steps half 0, sends its next observations, then does the same for half 1 -- whose answer was computed while
half 0 stepped (Sample Factory's double-buffered sampling; SEED RL's actors keep many envs busy the same way).

The fragment is the same ``[T, num_envs]`` one ``FragmentSampler.run`` writes: every sub-env steps exactly
``steps`` times, the halves' rows side by side, so chunks, episodes and counts look alike either way. What
differs: a seeded run draws each half's exploration noise separately (still the same run for the same seed,
but not the same actions as local inference, which draws for all sub-envs at once).

Used only where the per-step loop has nothing that needs every sub-env at once (``split_problem``); else the
runner steps all its sub-envs together, as without double buffering.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from actors.env.episode_slots import Fragment
from protocols import nested


def split_problem(sampler: Any) -> str | None:
    """Why ``sampler`` cannot double-buffer (None: it can)."""
    if len(getattr(sampler.acting, "lanes", ())) < 2:
        return "its acting piece keeps one request out at a time"
    if not hasattr(sampler.env, "step_rows"):
        return f"its vector env ({type(sampler.env).__name__}) steps all its sub-envs at once"
    if sampler.num_envs < 2:
        return "it has one sub-env"
    for what, present in (("a connector pipeline", sampler.connector is not None or sampler.module_to_env is not None),
                          ("kept infos", sampler.with_infos),
                          ("a recurrent module", getattr(sampler.acting, "recurrent", False))):
        if present:
            return f"it has {what}, which acts on every sub-env at once"
    return None


def run_split(sampler: Any, steps: int, explore: bool, t0: int) -> Fragment:
    """``steps`` steps of every sub-env of ``sampler`` (a ``FragmentSampler`` that passed ``split_problem``),
    two halves in turn, each half's next request out while the other steps."""
    acting, env, env_actions, hooks = sampler.acting, sampler.env, sampler.env_actions, sampler.hooks
    n = sampler.num_envs
    parts = ((0, n // 2), (n // 2, n))
    half_obs = [nested.map_structure(lambda a, lo=lo, hi=hi: a[lo:hi], sampler.obs) for lo, hi in parts]
    for k, obs in enumerate(half_obs):
        acting.send(k, obs, explore, t0)
    obs_rows, act_rows, logp_rows, dist_rows = [sampler.obs], [], [], []
    rewards = np.zeros((steps, n), np.float32)
    terminated = np.zeros((steps, n), bool)
    truncated = np.zeros((steps, n), bool)
    final_obs: dict[tuple[int, int], Any] = {}
    oldest = None
    for t in range(steps):
        answers = []
        for k, (lo, hi) in enumerate(parts):
            actions, logp, dist_inputs, version = acting.receive(k)
            if oldest is None or version < oldest:
                oldest = version
            res = env.step_rows(lo, hi, env_actions(actions))
            rewards[t, lo:hi], terminated[t, lo:hi], truncated[t, lo:hi] = res.rewards, res.terminated, res.truncated
            for i, o in res.final_obs.items():
                final_obs[(t, i)] = o
            if hooks is not None:
                hooks.step_all(actions, res.rewards, res.obs, res, lo)
            half_obs[k] = res.obs
            if t + 1 < steps:
                acting.send(k, res.obs, explore, t0 + (t + 1) * n)
            answers.append((actions, logp, dist_inputs))
        act_rows.append(np.concatenate([a[0] for a in answers]))
        logp_rows.append(np.concatenate([a[1] for a in answers]))
        dist_rows.append(np.concatenate([a[2] for a in answers]))
        obs_rows.append(nested.concat(half_obs))
    sampler.obs = sampler.module_obs = obs_rows[-1]
    sampler.oldest_version = oldest if oldest is not None else acting.weights_version
    return Fragment(obs_rows, act_rows, logp_rows, dist_rows, rewards, terminated, truncated, final_obs,
                    None, {}, None, None, None)
