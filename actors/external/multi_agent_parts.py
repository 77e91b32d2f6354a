"""What a multi-agent policy server reports and takes from the driver, as ``MultiAgentEnvRunner`` does:
the flat ``{"<module_id>/<param>": array}`` weights split per module, and a sample's counts and
ended episodes under the runner's metrics keys.

Apart from the act path (``multi_agent_acts``), which runs on the server thread: these run on the
driver's side of the server (``set_weights``, ``sample``).
"""
from __future__ import annotations

from typing import Any

from actors.metrics import MetricsLogger
from actors.modules.multi import SEP
from protocols.episode import EpisodeChunk
from protocols.multi_agent_episode import MultiAgentEpisode


def split_module_weights(weights: dict[str, Any], modules: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"<module_id>/<param>": array}`` -> ``{module_id: {param: array}}``, every module one of ``modules``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in weights.items():
        mid, sep, param = key.partition(SEP)
        if not sep or not param or mid not in modules:
            raise ValueError(f"weights key {key!r} names none of this server's modules {sorted(modules)}: a "
                             f"multi-agent server takes '<module_id>{SEP}<param>' keys")
        out.setdefault(mid, {})[param] = value
    return out


def log_multi_agent_samples(metrics: MetricsLogger, window: int | None, chunks: list[EpisodeChunk], env_steps: int,
                            ended: list[MultiAgentEpisode]) -> None:
    """A multi-agent sample's counts and the ended episodes' statistics, under the keys
    ``MultiAgentEnvRunner`` reports (``env_runners/`` spelled out where a key has a '/' of its own)."""
    m = metrics
    agent_steps = sum(len(c) for c in chunks)
    m.log_value("num_env_steps_sampled", env_steps, reduce="sum")
    m.log_value("num_env_steps_sampled_lifetime", env_steps, reduce="lifetime_sum")
    m.log_value("num_agent_steps_sampled", agent_steps, reduce="sum")
    m.log_value("num_agent_steps_sampled_lifetime", agent_steps, reduce="lifetime_sum")
    per_module: dict[str, int] = {}
    for c in chunks:
        per_module[c.module_id] = per_module.get(c.module_id, 0) + len(c)
    for mid, n in per_module.items():
        m.log_value(f"env_runners/num_module_steps_sampled/{mid}", n, reduce="sum")
        m.log_value(f"env_runners/num_module_steps_sampled_lifetime/{mid}", n, reduce="lifetime_sum")
    m.log_episodes([ep.get_return() for ep in ended], [ep.env_steps() for ep in ended], window)
    for ep in ended:
        for key, value in ep.return_metrics().items():
            m.log_value(f"env_runners/{key}", value, window=window)
