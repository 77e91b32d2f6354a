"""AlgorithmConfig: the settings every algorithm shares, with RLlib's builder methods.

Each builder (``environment``, ``env_runners``, ``training``...) sets the fields of its group and
returns the config, so calls chain. A key a builder does not know is remembered and reported at
``build()``/``validate()`` together with the closest valid names, never silently ignored. RLlib's old
and renamed names go through the table in ``pipeline/config/compat.py``: accepted where they are the same
setting, otherwise reported as "X is RLlib's old name: use Y".
Algorithm configs (``PPOConfig``...) subclass this and add their own fields; those belong to the
``training`` group.

The settings stay flat fields of one dataclass (``config.lr``, ``config["lr"]``, ``to_dict()``, pickling,
subclasses overriding defaults), declared with their docstrings in ``pipeline/config/settings.py``; each
group's checks and what is built from it live in the group's module of ``pipeline/config/`` (``sampling``,
``training``, ``evaluation``, ``exploration``, ``callbacks``...).
"""
from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from actors.callbacks import HOOKS, CallbacksSpec
from actors.learner import LearnerSettings
from pipeline.config.callbacks import callbacks_spec
from pipeline.config.checks import ConfigError, range_problems
from pipeline.config.cluster import ray_address_problems
from pipeline.config.compat import (ACCEPTED, ACCEPTED_KIND, BUILDERS, IGNORED_KIND, NAMES, UNSUPPORTED_KIND,
                                    is_harmless)
from pipeline.config.evaluation import estimation_problems, evaluation_problems
from pipeline.config.exploration import exploration_problems, exploration_settings
from pipeline.config.multi_agent import (MultiAgentFlag, is_multi_agent, multi_agent_problems, normalize_policies,
                                         restore_plain)
from pipeline.config.keys import group_keys, ignore_setting, read_setting, setting_names, unknown_problem
from pipeline.config.settings import CommonSettings
from pipeline.config.plain import from_plain, function_problems, plain_settings
from pipeline.config.sampling import env_runner_problems, environment_problems, rollout_fragment_length
from pipeline.config.training import (learner_settings, module_spec, recurrent_problems, rl_module_problems,
                                      training_problems)

log = logging.getLogger("runnel")

RENAMED = ACCEPTED
"""RLlib's older names of the same settings -> runnel's (the accepted entries of ``pipeline.config.compat.NAMES``)."""


_MISSING = object()
ALGORITHM_OF: dict[type, Any] = {}
"""Config class -> the algorithm it builds (filled by ``pipeline.registry.register_algorithm``). Kept
here, not as a class attribute: a class attribute holding the algorithm class, whose own attributes
hold the config class, sends Ray's class fingerprinting (``dis`` over class attributes) in circles."""


@dataclass
class AlgorithmConfig(CommonSettings):
    algo_name: ClassVar[str] = "Algorithm"
    algorithm_module: ClassVar[str | None] = None
    """The module that defines this config's algorithm (and registers it on import): ``build()`` imports
    it on first use. A config module imports no Ray Tune, so learner actors, which unpickle the config,
    start without it."""
    synchronous_sampling: ClassVar[bool] = True
    """The algorithm asks its env runners for batches (PPO, DQN, SAC) rather than streaming from them."""
    trains_on_policy: ClassVar[bool] = False
    """Each update wants experience from the weights it updates (PPO): what policy servers hold
    clients to by default (``actors.external.settings``: lag, act holds, unacknowledged steps)."""

    _unknown: dict = field(default_factory=dict, repr=False, compare=False)

    # --- builders -----------------------------------------------------------------------------
    def _set(self, group: str, kwargs: dict[str, Any]) -> "AlgorithmConfig":
        valid = group_keys(self, group)
        for key, value in kwargs.items():
            if key in valid:
                setattr(self, key, value)
            else:
                self._set_other(key, value, group, valid)
        return self

    def _set_other(self, key: str, value: Any, group: str, valid: set[str]) -> None:
        """A key that is not one of ``valid``: RLlib's name of the same setting (set it), one that means
        nothing here (drop it), or one to report at ``validate()`` (an RLlib name refused, or unknown)."""
        entry = NAMES.get(key)
        if entry is not None and entry.kind == ACCEPTED_KIND and entry.runnel in valid:
            setattr(self, entry.runnel, value)  # RLlib's older name for the same setting
        elif entry is not None and entry.kind == IGNORED_KIND:
            ignore_setting(key, value)
        elif entry is not None and entry.kind == UNSUPPORTED_KIND and is_harmless(entry, value):
            log.debug("config setting %s=%r asks for nothing runnel does not do anyway: ignored", key, value)
        else:
            self._unknown[key] = (group, sorted(valid), value)

    def framework(self, framework: str | None = "torch", **kwargs: Any) -> "AlgorithmConfig":
        """RLlib's framework choice: runnel runs on PyTorch, so only "torch" is accepted (and changes
        nothing). RLlib's other framework settings go through the table (TensorFlow ones are ignored)."""
        ignore_setting("framework", framework)
        for key, value in kwargs.items():
            self._set_other(key, value, "framework", {"framework"})
        return self

    def api_stack(self, enable_rl_module_and_learner: Any = None, enable_env_runner_and_connector_v2: Any = None,
                  **kwargs: Any) -> "AlgorithmConfig":
        """RLlib's old/new API stack switch: runnel has one stack, RLlib's new one (RLModule, Learner,
        EnvRunner); accepted and ignored."""
        log.debug("api_stack(enable_rl_module_and_learner=%r, enable_env_runner_and_connector_v2=%r) means "
                  "nothing in runnel (one API stack): ignored", enable_rl_module_and_learner,
                  enable_env_runner_and_connector_v2)
        for key, value in kwargs.items():
            self._set_other(key, value, "api_stack",
                            {"enable_rl_module_and_learner", "enable_env_runner_and_connector_v2"})
        return self

    def rollouts(self, **kwargs: Any) -> "AlgorithmConfig":
        raise ConfigError(f".rollouts() is RLlib's old name: use {BUILDERS['rollouts']}")

    def environment(self, env: Any = None, **kwargs: Any) -> "AlgorithmConfig":
        if env is not None:
            kwargs["env"] = env
        return self._set("environment", kwargs)

    def external_clients(self, **kwargs: Any) -> "AlgorithmConfig":
        """Train on experience from remote clients (``protocols.client.PolicyClient``): each env runner
        slot hosts a policy server; keys are ``actors.external.settings.ExternalSettings``'s fields."""
        self.external_clients_config = {**(self.external_clients_config or {}), **kwargs}
        return self

    def offline_data(self, **kwargs: Any) -> "AlgorithmConfig":
        """``output="DIR"``: record every chunk the runners sample; ``input_="DIR"``: train from a
        recording (readers take the env runners' place). Keys: ``pipeline.config.offline.KEYS``."""
        self.offline_data_config = {**(self.offline_data_config or {}), **kwargs}
        return self

    def inference(self, **kwargs: Any) -> "AlgorithmConfig":
        """runnel's own: ``mode="central"`` has env runners send observations to inference servers that batch
        them across runners (on a GPU when given one); keys: ``actors.inference.settings.InferenceSettings``."""
        self.inference_config = {**(self.inference_config or {}), **kwargs}
        return self

    def env_runners(self, **kwargs: Any) -> "AlgorithmConfig":
        return self._set("env_runners", kwargs)

    def learners(self, **kwargs: Any) -> "AlgorithmConfig":
        return self._set("learners", kwargs)

    def training(self, **kwargs: Any) -> "AlgorithmConfig":
        return self._set("training", kwargs)

    def rl_module(self, **kwargs: Any) -> "AlgorithmConfig":
        if dataclasses.is_dataclass(kwargs.get("model_config")):  # RLlib's DefaultModelConfig(...)
            kwargs["model_config"] = dataclasses.asdict(kwargs["model_config"])
        return self._set("rl_module", kwargs)

    def multi_agent(self, **kwargs: Any) -> "AlgorithmConfig":
        """RLlib's multi-agent settings: ``policies``, ``policy_mapping_fn``, ``policies_to_train``,
        ``count_steps_by`` (see ``pipeline.config.multi_agent``)."""
        if "policies" in kwargs:
            kwargs["policies"] = normalize_policies(kwargs["policies"])
        if isinstance(kwargs.get("policies_to_train"), (set, frozenset)):  # a list keeps to_dict() plain
            kwargs["policies_to_train"] = sorted(kwargs["policies_to_train"], key=str)
        return self._set("multi_agent", kwargs)

    @property
    def is_multi_agent(self) -> MultiAgentFlag:
        """More than one module, or one not named ``default_policy`` (``config.is_multi_agent`` or, as in
        RLlib 2.40 and later, ``config.is_multi_agent()``)."""
        return MultiAgentFlag(is_multi_agent(self))

    def get_default_learner_class(self) -> type:
        """The learner class of this config's algorithm (RLlib's name)."""
        return self.algorithm_class().learner_class

    def algorithm_class(self) -> type:
        """The algorithm this config builds, its module imported if it is not yet."""
        algo_class = ALGORITHM_OF.get(type(self))
        if algo_class is None and type(self).algorithm_module:
            importlib.import_module(type(self).algorithm_module)
            algo_class = ALGORITHM_OF.get(type(self))
        if algo_class is None:
            raise ConfigError(f"{type(self).__name__} belongs to no algorithm; use an algorithm's config "
                              f"(PPOConfig, IMPALAConfig, APPOConfig...) or register one with "
                              f"pipeline.register_algorithm")
        return algo_class

    def get_multi_rl_module_spec(self, env: Any = None, spaces: Any = None, **kwargs: Any) -> Any:
        """A module spec for this config's module on ``env``'s spaces (or ``spaces=(obs, act)``); runnel
        trains one module, so this is that module's spec (RLlib's name)."""
        return module_spec(self, env, spaces)

    def resources(self, **kwargs: Any) -> "AlgorithmConfig":
        return self._set("resources", kwargs)

    def reporting(self, **kwargs: Any) -> "AlgorithmConfig":
        return self._set("reporting", kwargs)

    def checkpointing(self, **kwargs: Any) -> "AlgorithmConfig":
        return self._set("checkpointing", kwargs)

    def debugging(self, **kwargs: Any) -> "AlgorithmConfig":
        return self._set("debugging", kwargs)

    def fault_tolerance(self, **kwargs: Any) -> "AlgorithmConfig":
        return self._set("fault_tolerance", kwargs)

    def callbacks(self, callbacks_class: Any = None, **hooks: Any) -> "AlgorithmConfig":
        """A callbacks class (or import path, or list of them), and/or functions per hook:
        ``config.callbacks(on_episode_end=fn)``; a hook may get a list of functions."""
        if callbacks_class is not None:
            self.callbacks_class = callbacks_class
        for hook, fns in hooks.items():
            if hook in HOOKS:
                self.callbacks_functions[hook] = list(fns) if isinstance(fns, (list, tuple)) else [fns]
            else:
                self._unknown[hook] = ("callbacks", sorted(("callbacks_class",) + HOOKS), fns)
        return self

    def exploration(self, **kwargs: Any) -> "AlgorithmConfig":
        return self._set("exploration", kwargs)

    def evaluation(self, **kwargs: Any) -> "AlgorithmConfig":
        if isinstance(kwargs.get("evaluation_config"), AlgorithmConfig):  # kept as the settings it changes
            kwargs["evaluation_config"] = kwargs["evaluation_config"].changed_settings()
        return self._set("evaluation", kwargs)

    def changed_settings(self) -> dict[str, Any]:
        """The settings that differ from this config class's defaults."""
        defaults = type(self)()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "_unknown" and getattr(self, f.name) != getattr(defaults, f.name)}

    @classmethod
    def overrides(cls, **kwargs: Any) -> dict[str, Any]:
        """Settings to override for evaluators (``evaluation_config=...``); checked at ``build()``."""
        return dict(kwargs)

    def callbacks_spec(self) -> CallbacksSpec:
        return callbacks_spec(self)

    def evaluation_settings(self) -> "AlgorithmConfig":
        """This config with ``evaluation_config`` applied: what evaluators run with."""
        overrides = self.evaluation_config
        if isinstance(overrides, AlgorithmConfig):  # set directly, not through evaluation()
            overrides = overrides.changed_settings()
        out = self.copy()
        out.evaluation_config = None
        names = set(setting_names(out))
        for key, value in (overrides or {}).items():
            if key in names:
                setattr(out, key, copy.deepcopy(value))
            else:
                out._set_other(key, copy.deepcopy(value), "evaluation_config", names)
        return out

    # --- dict-style reads (RLlib's ``config["lr"]``; Ray Tune reads ``config.get(...)``) -------------
    def __getitem__(self, key: str) -> Any:
        """``config["lr"]``; RLlib's older names read the setting they name (``config["num_workers"]``
        raises KeyError saying to use ``num_env_runners``), ignored ones read what runnel does
        (``config["framework"]`` is "torch")."""
        return read_setting(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: str) -> bool:
        return self.get(key, _MISSING) is not _MISSING

    # --- (de)serialisation --------------------------------------------------------------------
    def copy(self) -> "AlgorithmConfig":
        return copy.deepcopy(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-able settings; classes and functions become ``"module:qualname"`` paths."""
        return plain_settings(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "AlgorithmConfig":
        cfg = cls()
        valid = set(setting_names(cls))
        for key, value in d.items():
            value = from_plain(value)
            if key in valid:
                setattr(cfg, key, value)
            else:
                cfg._set_other(key, value, "config", valid)
        restore_plain(cfg)
        return cfg

    def update_from_dict(self, d: dict[str, Any]) -> "AlgorithmConfig":
        other = type(self).from_dict(d)
        names = set(setting_names(self))
        for key in d:
            if key in other._unknown:
                self._unknown[key] = other._unknown[key]
            else:
                name = RENAMED.get(key, key)
                if name in names:  # not an ignored one
                    setattr(self, name, getattr(other, name))
        return self

    # --- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming every unknown key (with the closest valid ones) or bad value."""
        try:
            problems = self._problems()
        except (TypeError, ValueError) as err:  # a value of the wrong type deep in a check
            problems = [f"a setting has a value of the wrong type: {err}"]
        if problems:
            raise ConfigError(f"invalid {self.algo_name} config:\n  - " + "\n  - ".join(problems))

    def _problems(self) -> list[str]:
        """Every problem found; algorithm configs extend this list."""
        problems = []
        for key, (group, valid, *value) in self._unknown.items():
            problems.append(unknown_problem(self, key, group, valid, *value))
        # the groups' checks, in the order their problems are listed
        problems += range_problems(self)
        problems += env_runner_problems(self)
        problems += training_problems(self)
        problems += environment_problems(self)
        problems += rl_module_problems(self)
        if isinstance(self.model_config, dict) and self.model_config.get("use_lstm"):
            problems += recurrent_problems(self, is_multi_agent(self))
        problems += multi_agent_problems(self)
        problems += self._evaluation_problems()
        from pipeline.config.external import external_problems

        problems += external_problems(self)
        from pipeline.config.offline import offline_problems

        problems += offline_problems(self)
        from pipeline.config.inference import inference_problems

        problems += inference_problems(self)
        problems += estimation_problems(self)
        problems += function_problems(self)
        problems += exploration_problems(self)
        problems += ray_address_problems(self)
        return problems

    def _evaluation_problems(self) -> list[str]:
        problems = evaluation_problems(self)
        ec = self.evaluation_config
        if ec is not None and not isinstance(ec, (dict, AlgorithmConfig)):
            problems.append(f"evaluation_config must be a dict (AlgorithmConfig.overrides(...)) or a config, "
                            f"got {type(ec).__name__}")
        elif ec:
            nested_problems = self.evaluation_settings()._problems()
            problems += [f"evaluation_config: {p}" for p in nested_problems if p not in problems]
        return problems

    def learner_settings(self) -> LearnerSettings:
        return learner_settings(self)

    def module_kwargs(self) -> dict[str, Any]:
        """Options of the algorithm's module class beyond ``model_config`` (DQN: dueling, atoms...)."""
        return {}

    def default_exploration(self) -> dict[str, Any]:
        """The algorithm's own exploration piece (``{"type": ..., **kwargs}``); sampling by default."""
        return {}

    def exploration_settings(self) -> dict[str, Any]:
        """What runners use: ``exploration_config`` with a ``type`` replaces the algorithm's default; without
        one its keys update the default's arguments."""
        return exploration_settings(self)

    def get_rollout_fragment_length(self) -> int:
        return rollout_fragment_length(self)

    def build(self, **kwargs: Any):
        """Validate and build the algorithm this config belongs to."""
        algo_class = self.algorithm_class()
        self.validate()
        return algo_class(self.copy(), **kwargs)

    build_algo = build
