"""Playing whole episodes with a trained policy in the driver process (``runnel evaluate``)."""
from __future__ import annotations

from typing import Any

import numpy as np

from actors.env import EnvContext


def run_episodes(algo: Any, num_episodes: int, explore: bool = False, render: bool = False) -> dict[str, Any]:
    """Play ``num_episodes`` episodes one after another; returns returns, lengths and their means."""
    env_config = dict(algo.config.env_config)
    if render:
        env_config.setdefault("render_mode", "human")
    env = algo.env_creator(EnvContext(env_config))
    returns, lengths = [], []
    try:
        for i in range(num_episodes):
            seed = None if algo.config.seed is None else algo.config.seed + 100_000 + i
            obs, _ = env.reset(seed=seed)
            done, ret, length = False, 0.0, 0
            while not done:
                obs, reward, terminated, truncated, _ = env.step(algo.compute_single_action(obs, explore=explore))
                ret += float(reward)
                length += 1
                done = terminated or truncated
            returns.append(ret)
            lengths.append(length)
    finally:
        env.close()
    return {"episode_returns": returns, "episode_lengths": lengths,
            "episode_return_mean": float(np.mean(returns)), "episode_len_mean": float(np.mean(lengths))}
