"""The ``inference`` config group: env runners act with their own module ("local") or through inference
servers that batch every runner's observations ("central", SEED style). runnel's own: RLlib has no
inference server.

``config.inference(mode="central", num_inference_servers=1, num_gpus_per_inference_server=0,
max_batch=256, max_wait_s=0.0)``; the keys are ``actors.inference.settings.InferenceSettings``'s fields
(documented there), checked here at ``build()``. Central inference serves single-agent runs whose env
runners step envs (PPO, IMPALA, APPO, DQN, SAC...); multi-agent runs, external clients and recordings
read in the runners' place are refused with the setting to change. Evaluators keep acting locally.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from actors.inference.settings import MODES, PRECISIONS, RUNNER_BACKENDS, InferenceSettings
from pipeline.config.keys import dict_setting_problems
from pipeline.config.multi_agent import settings_used
from pipeline.config.offline import mixes_sampler

KEYS = tuple(f.name for f in dataclasses.fields(InferenceSettings))


def inference_settings(config: Any) -> InferenceSettings | None:
    """The servers' settings under central inference; None when runners act locally."""
    d = config.inference_config
    if not d:
        return None
    x = InferenceSettings(**d)
    return x if x.mode == "central" else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def inference_problems(config: Any) -> list[str]:
    d = config.inference_config
    problems = [] if d is None else dict_setting_problems(d, KEYS, "inference")
    if d is None or problems:
        return problems
    x = InferenceSettings(**d)
    if x.mode not in MODES:
        return [f"inference mode={x.mode!r} is not one of {list(MODES)}"]
    for key in ("shared_memory", "cuda_graphs", "double_buffer"):
        if not isinstance(getattr(x, key), bool):
            problems.append(f"inference {key} must be True or False, got {getattr(x, key)!r}")
    if x.runner_backend not in RUNNER_BACKENDS:
        problems.append(f"inference runner_backend={x.runner_backend!r} is not one of {list(RUNNER_BACKENDS)}")
    if x.precision not in PRECISIONS:
        problems.append(f"inference precision={x.precision!r} is not one of {list(PRECISIONS)}")
    elif x.precision != "float32" and x.runner_backend == "numpy":
        problems.append(f"inference precision={x.precision!r} needs torch acting; numpy acting computes in float32: "
                        f"set runner_backend='auto' or 'torch', or precision='float32'")
    for key in ("num_inference_servers", "max_batch"):
        value = getattr(x, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"inference {key} must be an int >= 1, got {value!r}")
    for key in ("num_cpus_per_inference_server", "num_gpus_per_inference_server", "max_wait_s"):
        value = getattr(x, key)
        if not _number(value) or value < 0:
            problems.append(f"inference {key} must be a number >= 0, got {value!r}")
    for key in ("resend_after_s", "reply_timeout_s", "health_check_interval_s"):
        value = getattr(x, key)
        if not _number(value) or value <= 0:
            problems.append(f"inference {key} must be a number > 0, got {value!r}")
    if not problems and x.reply_timeout_s < x.resend_after_s:
        problems.append(f"inference reply_timeout_s={x.reply_timeout_s} must be >= resend_after_s={x.resend_after_s} "
                        f"(a runner resends after resend_after_s and gives up after reply_timeout_s)")
    if x.mode == "central":
        problems += _central_problems(config, x)
    return problems


def _central_problems(config: Any, x: InferenceSettings) -> list[str]:
    """What central inference cannot serve, each with the setting to change."""
    fix = "or keep .inference(mode='local')"
    problems = []
    if settings_used(config):
        problems.append("inference mode='central' serves single-agent runs; this config has multi-agent settings "
                        "(policies/policy_mapping_fn), whose runners act with each module themselves: drop "
                        ".inference(mode='central') or set .inference(mode='local') (the default)")
    if config.external_clients_config is not None:
        problems.append(f"inference mode='central' is for env runners; with external_clients() the policy servers "
                        f"act for their clients themselves (same batching engine): drop .inference(...) {fix}")
    if (config.offline_data_config or {}).get("input_") is not None and not mixes_sampler(config):
        problems.append(f"inference mode='central' needs env runners that act; with offline_data(input_=...) readers "
                        f"take their place: drop .inference(...) {fix}")
    runners = config.num_env_runners
    if isinstance(runners, int) and runners > 0 and isinstance(x.num_inference_servers, int) \
            and x.num_inference_servers > runners:
        problems.append(f"num_inference_servers={x.num_inference_servers} is more than num_env_runners={runners}: "
                        f"runner i asks server i % num_inference_servers, so some would serve nobody")
    return problems
