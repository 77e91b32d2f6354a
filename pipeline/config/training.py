"""The ``training``, ``learners`` and ``rl_module`` groups: what the learners are built with.

Checks of the shared training settings and of ``model_config``, and the two things built from these
groups: the learners' ``LearnerSettings`` and the module's ``ModuleSpec``. An algorithm config's own
training settings are checked by its ``_problems``.
"""
from __future__ import annotations

from typing import Any

from actors.learner import LearnerSettings
from pipeline.config.checks import ConfigError, check_schedule, is_number


def training_problems(config: Any) -> list[str]:
    problems = []
    if not is_number(config.gamma) or not 0.0 <= config.gamma <= 1.0:
        problems.append(f"gamma must be in [0, 1], got {config.gamma!r}")
    problems += check_schedule("lr", config.lr)
    if config.grad_clip is not None and (not is_number(config.grad_clip) or config.grad_clip <= 0):
        problems.append(f"grad_clip must be > 0 or None, got {config.grad_clip!r}")
    if config.adam_epsilon is not None and (not is_number(config.adam_epsilon) or not 0 < config.adam_epsilon < 1):
        problems.append(f"adam_epsilon must be a number in (0, 1), or None for the learner's own default, got "
                        f"{config.adam_epsilon!r}")
    return problems


def rl_module_problems(config: Any) -> list[str]:
    if not isinstance(config.model_config, dict):
        return [f"model_config must be a dict, got {type(config.model_config).__name__}"]
    return model_config_problems(config.model_config) + statistics_problems(config, config.model_config)


def statistics_problems(config: Any, model_config: dict) -> list[str]:
    """``normalize_input`` or ``normalize_returns`` where the algorithm's learner never updates those statistics
    (the pixels would stay scaled by 1/255, the value targets unscaled)."""
    out = []
    for key, flag, what in (("normalize_input", "updates_input_stats", "input statistics"),
                            ("normalize_returns", "updates_return_stats", "value targets' statistics")):
        if model_config.get(key) and not getattr(type(config), flag, False):
            out.append(f"model_config {key}=True: {config.algo_name}'s learner does not update the {what} "
                       f"(PPO's, IMPALA's and APPO's do); leave it False here")
    return out


def recurrent_problems(config: Any, multi_agent: bool) -> list[str]:
    """Where a recurrent module (``use_lstm``) cannot go yet, each with what to do instead."""
    out = []
    if not getattr(type(config), "supports_recurrent", False):
        out.append(f"model_config use_lstm=True: {config.algo_name} does not train recurrent modules yet (PPO, "
                   f"IMPALA, APPO and DQN do); use one of those, or leave use_lstm off")
    external = config.external_clients_config
    # a multi-agent server acts for its clients and keeps each agent's state itself; a single-agent one's
    # clients act with the exported cell and carry their states
    if external is not None and external.get("inference_mode") == "remote" and not multi_agent:
        out.append("model_config use_lstm=True with external_clients(inference_mode='remote'): a policy server does "
                   "not keep its clients' recurrent states; the clients act with the exported cell and carry them: "
                   "external_clients(inference_mode='local') (the default with use_lstm)")
    return out


def model_config_problems(model_config: dict) -> list[str]:
    """``model_config`` keys the default modules do not read (RLlib's old ``model`` keys are named as such)."""
    from actors.modules import ModelConfig

    try:
        ModelConfig.from_dict(model_config)
    except (TypeError, ValueError) as err:
        return [f"model_config: {err}"]
    return []


def learner_settings(config: Any) -> LearnerSettings:
    external = config.external_clients_config  # policy servers that accept non-finite observations
    return LearnerSettings(lr=config.lr, grad_clip=config.grad_clip, grad_clip_by=config.grad_clip_by,
                           adam_epsilon=config.adam_epsilon, seed=config.seed,
                           model_config=config.model_config, module_kwargs=config.module_kwargs(),
                           precision=config.learner_precision,
                           callbacks=config.callbacks_spec(), allow_nonfinite_observations=isinstance(external, dict)
                           and bool(external.get("allow_nonfinite_observations", False)))


def module_spec(config: Any, env: Any = None, spaces: Any = None) -> Any:
    """A module spec for the config's module on ``env``'s spaces (or ``spaces=(obs, act)``, or the
    config's own spaces)."""
    from actors.modules import ModuleSpec

    if env is not None:
        obs_space, act_space = env.observation_space, env.action_space
    elif spaces is not None:
        obs_space, act_space = spaces
    else:
        obs_space, act_space = config.observation_space, config.action_space
    if obs_space is None or act_space is None:
        raise ConfigError("get_multi_rl_module_spec needs spaces: pass env=gym.make(...) or spaces=(obs, act)")
    return ModuleSpec(obs_space, act_space, config.model_config, config.get_default_learner_class().module_class,
                      config.module_kwargs())
