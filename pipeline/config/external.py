"""The ``external_clients`` config group: env runner slots hosting policy servers for remote clients.

``config.environment(observation_space=..., action_space=...)`` with no env, plus
``config.external_clients(address="tcp://0.0.0.0:9900", inference_mode="remote", ...)``: each env
runner slot (or the driver, with ``num_env_runners=0``) runs an ``actors.external.policy_server.PolicyServer``
instead of an ``EnvRunner``, and the algorithm trains on what clients send. A multi-agent run
(``.multi_agent(...)``) takes its modules' spaces from its MultiAgentEnv class, which the driver only
reads (``.environment(MultiAgentEnvClass)``; clients play the episodes). The keys are the
fields of ``ExternalSettings`` (documented there); they are checked here at ``build()``.
"""
from __future__ import annotations

import dataclasses
from typing import Any
from urllib.parse import urlsplit

from actors.external.security import SecurityError, ServerSecurity, is_loopback
from actors.external.settings import ExternalSettings
from pipeline.config.keys import dict_setting_problems
from pipeline.config.multi_agent import settings_used

KEYS = tuple(f.name for f in dataclasses.fields(ExternalSettings))


def external_settings(config: Any) -> ExternalSettings | None:
    """The policy servers' settings, or None when the config has no external clients."""
    d = config.external_clients_config
    if d is None:
        return None
    d = dict(d)
    if "fragment_length" not in d:
        rfl = config.rollout_fragment_length
        d["fragment_length"] = int(rfl) if rfl != "auto" else 200
    seq_len = recurrent_seq_len(config)
    if seq_len is not None:  # clients act with the exported cell and cut chunks a learner unrolls from state_in
        d.setdefault("inference_mode", "local")
        if isinstance(d["fragment_length"], int):
            d["fragment_length"] = min(d["fragment_length"], seq_len)
    x = ExternalSettings(**d)
    fresh = config.synchronous_sampling and config.trains_on_policy  # PPO: experience from the current weights
    if x.hold_acts_while_training is None:
        x.hold_acts_while_training = fresh
    if x.max_policy_lag is None and fresh:
        x.max_policy_lag = 1
    if x.max_unacked_steps is None:
        x.max_unacked_steps = x.max_pending_steps
        try:  # bad values of these are reported by the config's own checks
            if fresh:
                batch = int(config.train_batch_size_per_learner) * max(1, int(config.num_learners or 0))
                x.max_unacked_steps = -(-batch // max(1, int(config.num_env_runners or 0))) + int(x.fragment_length)
        except (TypeError, ValueError):
            pass
    return x


def recurrent_seq_len(config: Any) -> int | None:
    """A recurrent module's ``max_seq_len`` (the longest chunk its clients may cut), None for other modules."""
    mc = config.model_config
    if not (isinstance(mc, dict) and mc.get("use_lstm")):
        return None
    from actors.modules import ModelConfig

    seq_len = mc.get("max_seq_len", ModelConfig.max_seq_len)
    return seq_len if isinstance(seq_len, int) and seq_len >= 1 else None


def external_problems(config: Any) -> list[str]:
    d = config.external_clients_config
    if d is None:
        return []
    problems = dict_setting_problems(d, KEYS, "external_clients")
    if problems:
        return problems
    x = external_settings(config)
    parts = urlsplit(x.address) if isinstance(x.address, str) else None
    try:
        port = parts.port if parts is not None else None
    except ValueError:
        port = None
    if parts is None or parts.scheme != "tcp" or not parts.hostname or port is None:
        problems.append(f"external_clients address={x.address!r} must look like 'tcp://HOST:PORT' "
                        f"(e.g. 'tcp://0.0.0.0:9900' for all interfaces)")
    elif port + max(1, config.num_env_runners) - 1 > 65535:
        problems.append(f"external_clients address port {port} + {config.num_env_runners} servers exceeds 65535")
    if x.inference_backend not in ("auto", "numpy", "torch"):
        problems.append(f"external_clients inference_backend={x.inference_backend!r} is not one of "
                        f"['auto', 'numpy', 'torch']")
    if x.inference_mode not in ("remote", "local"):
        problems.append(f"external_clients inference_mode={x.inference_mode!r} is not one of ['remote', 'local']")
    for key in ("max_batch", "max_pending_steps", "max_clients", "max_open_episodes", "max_requests_in_flight",
                "max_agents", "max_frame_bytes", "max_chunk_steps", "fragment_length", "max_unacked_steps"):
        value = getattr(x, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"external_clients {key} must be an int >= 1, got {value!r}")
    if x.max_policy_lag is not None and (not isinstance(x.max_policy_lag, int) or isinstance(x.max_policy_lag, bool)
                                         or x.max_policy_lag < 0):
        problems.append(f"external_clients max_policy_lag must be None (no limit) or an int >= 0, "
                        f"got {x.max_policy_lag!r}")
    if not isinstance(x.hold_acts_while_training, bool):
        problems.append(f"external_clients hold_acts_while_training must be None (the algorithm's choice), True or "
                        f"False, got {x.hold_acts_while_training!r}")
    for key in ("batch_wait_s", "sample_wait_s", "idle_timeout_s", "max_act_hold_s"):
        value = getattr(x, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            problems.append(f"external_clients {key} must be a number >= 0, got {value!r}")
    if not isinstance(x.allow_nonfinite_observations, bool):
        problems.append(f"external_clients allow_nonfinite_observations must be True or False, "
                        f"got {x.allow_nonfinite_observations!r}")
    if x.server_secret_key is None and not problems:
        try:  # the plaintext rule, checked here so the error comes before anything starts
            if not is_loopback(x.address) and not x.allow_plaintext:
                ServerSecurity(None, x.address, None, x.allowed_client_keys, False)
            elif x.allowed_client_keys:
                raise SecurityError("allowed_client_keys needs server_secret_key (CURVE)")
        except SecurityError as err:
            problems.append(f"external_clients: {err}")
    multi_agent_env = config.env is not None and settings_used(config)  # each module's spaces come from the env
    if (config.observation_space is None or config.action_space is None) and not multi_agent_env:
        problems.append("external clients need the spaces they act in: .environment(observation_space=..., "
                        "action_space=...) (gymnasium spaces)")
    if config.evaluation_interval and config.env is None:
        problems.append("evaluation runs an env in evaluators, and this config has none: set .environment(env=...) "
                        "or turn evaluation_interval off")
    return problems
