"""RLModuleSpec and MultiRLModuleSpec: RLlib's names for what a user writes to describe modules.

``.rl_module(rl_module_spec=MultiRLModuleSpec(rl_module_specs={"p0": RLModuleSpec(...), ...}))`` gives
each module its own class, spaces and model config. Every field may stay ``None``: the config fills
in the algorithm's default module class, the spaces of the agents mapped to the module and the
config's ``model_config`` (``pipeline.config.multi_agent_plan``). What a stage builds from is the
complete ``ModuleSpec``; these two only describe what the user chose.

Fields are RLlib's. Those that ask for what runnel has no counterpart for (catalogs, loading weights
from a path, learner-only modules, components shared inside a MultiRLModule) are kept so that an RLlib
script constructs, and refused at ``build()`` when set (``spec_problems``), never silently dropped.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import gymnasium as gym

from actors.modules.multi import MultiRLModule
from actors.modules.rl_module import RLModule

DEFAULT_MODULE_ID = "default_policy"


@dataclass
class RLModuleSpec:
    """One module: its class (None: the algorithm's default), spaces (None: the agents') and model config
    (None: the config's ``model_config``; given keys override it)."""

    module_class: type[RLModule] | str | None = None
    """An ``RLModule`` subclass, or its ``"pkg.module:Class"`` import path."""
    observation_space: gym.Space | None = None
    action_space: gym.Space | None = None
    inference_only: bool = False
    """RLlib's: runnel decides per stage (runners build the inference-only copy, learners the full one)."""
    learner_only: bool = False
    """RLlib's: a module built on learners only (refused: runnel builds every module on both)."""
    model_config: dict[str, Any] | Any | None = None
    """A dict or ``DefaultModelConfig``; its keys override the config's ``model_config`` for this module."""
    catalog_class: Any = None
    """RLlib's (refused: runnel has no catalogs; give a ``module_class``)."""
    load_state_path: str | None = None
    """RLlib's (refused: load weights after ``build()`` with ``algo.get_module(id).set_state(...)``)."""

    def model_config_dict(self) -> dict[str, Any]:
        if dataclasses.is_dataclass(self.model_config):
            return dataclasses.asdict(self.model_config)
        return dict(self.model_config or {})

    def build(self, inference_only: bool | None = None) -> RLModule:
        """The module itself, once class and spaces are all given (as RLlib's ``RLModuleSpec.build``)."""
        missing = [name for name in ("module_class", "observation_space", "action_space") if getattr(self, name) is None]
        if missing or isinstance(self.module_class, str):
            raise ValueError(f"RLModuleSpec.build() needs module_class (a class), observation_space and action_space; "
                             f"missing {missing or ['module_class as a class, not a path']}")
        only = self.inference_only if inference_only is None else inference_only
        return self.module_class(self.observation_space, self.action_space, self.model_config_dict(),
                                 inference_only=only)

    def as_multi_rl_module_spec(self) -> "MultiRLModuleSpec":
        """This spec as the only module, ``default_policy`` (RLlib's name)."""
        return MultiRLModuleSpec(rl_module_specs={DEFAULT_MODULE_ID: self})


@dataclass
class MultiRLModuleSpec:
    """Modules keyed by module id: ``rl_module_specs`` is a dict ``{module_id: RLModuleSpec}``, or one
    ``RLModuleSpec`` that every module uses."""

    multi_rl_module_class: type = MultiRLModule
    """RLlib's (only ``MultiRLModule`` itself: runnel's modules share no components)."""
    observation_space: gym.Space | None = None
    """RLlib's space of components shared inside the MultiRLModule (refused when set)."""
    action_space: gym.Space | None = None
    """As ``observation_space`` (refused when set)."""
    inference_only: bool | None = None
    """RLlib's (runnel decides per stage, as for ``RLModuleSpec.inference_only``)."""
    model_config: dict | None = None
    """RLlib's config of shared components (refused when set: give each module its own ``model_config``)."""
    rl_module_specs: RLModuleSpec | dict[str, RLModuleSpec] | None = None

    def __post_init__(self) -> None:
        if self.rl_module_specs is None:
            raise ValueError("MultiRLModuleSpec needs rl_module_specs: a dict {module_id: RLModuleSpec(...)} or one "
                             "RLModuleSpec(...) for every module")

    @property
    def module_ids(self) -> list[str] | None:
        """The modules it names (None when one spec serves every module)."""
        return list(self.rl_module_specs) if isinstance(self.rl_module_specs, dict) else None

    def spec_for(self, module_id: str) -> RLModuleSpec | None:
        if isinstance(self.rl_module_specs, dict):
            return self.rl_module_specs.get(module_id)
        return self.rl_module_specs

    def __contains__(self, module_id: object) -> bool:
        return isinstance(self.rl_module_specs, dict) and module_id in self.rl_module_specs

    def __getitem__(self, module_id: str) -> RLModuleSpec:
        spec = self.spec_for(module_id)
        if spec is None:
            raise KeyError(f"no module {module_id!r} in this MultiRLModuleSpec; it holds {self.module_ids}")
        return spec

    def as_multi_rl_module_spec(self) -> "MultiRLModuleSpec":
        return self


def spec_problems(spec: Any, where: str) -> list[str]:
    """What in an ``RLModuleSpec`` or ``MultiRLModuleSpec`` runnel refuses; ``where`` names it in messages."""
    if isinstance(spec, MultiRLModuleSpec):
        problems = []
        if spec.multi_rl_module_class is not MultiRLModule:
            problems.append(f"{where}.multi_rl_module_class={spec.multi_rl_module_class!r}: runnel's modules share "
                            f"no components, so only MultiRLModule is supported; leave it out")
        for name in ("observation_space", "action_space", "model_config"):
            if getattr(spec, name) is not None:
                problems.append(f"{where}.{name} is for components shared inside a MultiRLModule, which runnel does "
                                f"not have; give it to each module's RLModuleSpec(...) instead")
        inner = spec.rl_module_specs
        if isinstance(inner, dict):
            for module_id, one in inner.items():
                problems += spec_problems(one, f"{where}.rl_module_specs[{module_id!r}]")
        else:
            problems += spec_problems(inner, f"{where}.rl_module_specs")
        return problems
    if not isinstance(spec, RLModuleSpec):
        return [f"{where} must be an RLModuleSpec(...), got {spec!r}"]
    problems = []
    cls = spec.module_class
    if cls is not None and not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, RLModule)):
        problems.append(f"{where}.module_class must be an RLModule subclass or its 'pkg.module:Class' path, got {cls!r}")
    if spec.learner_only:
        problems.append(f"{where}.learner_only=True is not supported: runnel builds every module on runners and "
                        f"learners; leave it out")
    if spec.catalog_class is not None:
        problems.append(f"{where}.catalog_class: runnel has no catalogs; give module_class=YourModule instead")
    if spec.load_state_path is not None:
        problems.append(f"{where}.load_state_path is not supported: load weights after build() with "
                        f"algo.get_module(module_id).set_state(state)")
    for name in ("observation_space", "action_space"):
        if getattr(spec, name) is not None and not isinstance(getattr(spec, name), gym.Space):
            problems.append(f"{where}.{name} must be a gymnasium space or None, got {getattr(spec, name)!r}")
    mc = spec.model_config
    if mc is not None and not isinstance(mc, dict) and not dataclasses.is_dataclass(mc):
        problems.append(f"{where}.model_config must be a dict or DefaultModelConfig(...), got {type(mc).__name__}")
    return problems
