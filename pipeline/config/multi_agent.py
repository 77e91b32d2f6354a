"""The ``multi_agent`` group and the ``rl_module_spec`` setting: which modules exist, which agent acts
with which, which are trained, and how steps are counted.

``.multi_agent(policies=..., policy_mapping_fn=..., policies_to_train=..., count_steps_by=...)`` takes
RLlib's forms: ``policies`` as module ids (a set or list) or ``{module_id: PolicySpec | None | 4-tuple}``;
the mapping fn as ``fn(agent_id, episode, **kwargs)`` (``fn(agent_id, episode)`` and the old stack's
``fn(agent_id, episode, worker, **kwargs)`` work too); ``policies_to_train`` as ids or
``fn(module_id, batch) -> bool``. Defaults are RLlib's: one module ``default_policy``, every agent mapped
to it, every module trained, steps counted per env step. The checks here run at ``build()``; what the
stages get is resolved from the built config and the env by ``pipeline.config.multi_agent_plan``.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from actors.modules.rl_module import RLModule
from actors.modules.rl_module_spec import DEFAULT_MODULE_ID, MultiRLModuleSpec, RLModuleSpec, spec_problems
from pipeline.config.plain import from_plain, resolve_import_path
from protocols.multi_agent_episode import map_to_default_module

COUNT_STEPS_BY = ("env_steps", "agent_steps")
BAD_ID_CHARS = ("/", ".")
"""Characters a module id may not hold: ``MultiRLModule`` joins ids and parameter names with them."""


@dataclass
class PolicySpec:
    """RLlib's per-policy entry of ``policies``: every field optional. ``policy_class`` may be an
    ``RLModule`` subclass (the module class); ``config`` holds this module's setting overrides, of which
    ``model_config`` applies to its module."""

    policy_class: Any = None
    observation_space: Any = None
    action_space: Any = None
    config: dict[str, Any] | None = None


class MultiAgentFlag:
    """``config.is_multi_agent``: true or false, read as a property (RLlib before 2.40) or called as a
    method (RLlib 2.40 and later)."""

    def __init__(self, value: bool) -> None:
        self.value = bool(value)

    def __bool__(self) -> bool:
        return self.value

    def __call__(self) -> bool:
        return self.value

    def __eq__(self, other: object) -> bool:
        return self.value == bool(other) if isinstance(other, (bool, MultiAgentFlag)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


# --- reading the settings into one form ---------------------------------------------------------------
def as_policy_spec(value: Any) -> PolicySpec | None:
    """One ``policies`` entry as a ``PolicySpec`` (None, a 4-tuple, RLlib's own ``PolicySpec``, or the
    plain dict a saved config holds); None if it is none of these."""
    if value is None:
        return PolicySpec()
    if isinstance(value, PolicySpec):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 4:
        return PolicySpec(*value)
    names = [f.name for f in dataclasses.fields(PolicySpec)]
    if isinstance(value, dict) and set(value) <= set(names):  # as to_dict() wrote it
        return PolicySpec(**{k: _restore(v) for k, v in value.items()})
    if all(hasattr(value, n) for n in names):  # ray.rllib.policy.policy.PolicySpec
        return PolicySpec(*(getattr(value, n) for n in names))
    return None


def normalize_policies(policies: Any) -> Any:
    """``policies`` as ``{module_id: PolicySpec}`` where it has a known form; anything else is kept as
    given, for ``multi_agent_problems`` to name."""
    if policies is None:
        return None
    if isinstance(policies, dict):
        specs = {mid: as_policy_spec(v) for mid, v in policies.items()}
        return specs if all(s is not None for s in specs.values()) else policies
    if isinstance(policies, (set, frozenset, list, tuple)):
        return {mid: PolicySpec() for mid in policies}
    return policies


def as_rl_module_spec(value: Any) -> Any:
    """``rl_module_spec`` as a spec object: a saved config's plain dict is made a spec again; any other
    value is returned as given."""
    if not isinstance(value, dict):
        return value
    if "rl_module_specs" in value:
        inner = value["rl_module_specs"]
        inner = {mid: as_rl_module_spec(v) for mid, v in inner.items()} if isinstance(inner, dict) and not \
            _is_plain_rl_module_spec(inner) else as_rl_module_spec(inner)
        rest = {k: _restore(v) for k, v in value.items() if k != "rl_module_specs"}
        if isinstance(rest.get("multi_rl_module_class"), str):
            rest["multi_rl_module_class"] = resolve_import_path(rest["multi_rl_module_class"], "multi_rl_module_class")
        return MultiRLModuleSpec(**rest, rl_module_specs=inner)
    if _is_plain_rl_module_spec(value):
        return RLModuleSpec(**{k: _restore(v) for k, v in value.items()})
    return value


def _is_plain_rl_module_spec(d: dict) -> bool:
    return bool(d) and set(d) <= {f.name for f in dataclasses.fields(RLModuleSpec)}


def _restore(value: Any) -> Any:
    return from_plain(value)


def restore_plain(config: Any) -> None:
    """After ``from_dict``: the multi-agent settings a saved config holds as plain data become specs again
    (functions stay import paths; they are imported when the plan is resolved)."""
    config.policies = normalize_policies(config.policies)
    config.rl_module_spec = as_rl_module_spec(config.rl_module_spec)


def module_ids(config: Any) -> list[str]:
    """The modules the config asks for: ``policies``' ids, else the ids of a ``MultiRLModuleSpec``, else
    ``default_policy``."""
    policies = normalize_policies(config.policies)
    if isinstance(policies, dict):
        return list(policies)
    spec = as_rl_module_spec(config.rl_module_spec)
    if isinstance(spec, MultiRLModuleSpec) and spec.module_ids is not None:
        return spec.module_ids
    return [DEFAULT_MODULE_ID]


def is_multi_agent(config: Any) -> bool:
    """RLlib's rule: more than one module, or one that is not ``default_policy``."""
    ids = module_ids(config)
    return len(ids) > 1 or ids != [DEFAULT_MODULE_ID]


def mapping_function(fn: Any) -> Callable[[Any, Any], str]:
    """The mapping fn as ``(agent_id, episode) -> module_id``, however it was written (an import path, two
    arguments, RLlib's ``**kwargs``, or the old stack's ``worker`` argument, which gets None)."""
    if fn is None:
        return map_to_default_module
    if isinstance(fn, str):
        fn = resolve_import_path(fn, "policy_mapping_fn")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: call it as RLlib's new stack does
        return fn
    for kwargs in ({}, {"worker": None}):
        try:
            sig.bind("agent", "episode", **kwargs)
        except TypeError:
            continue
        return functools.partial(fn, **kwargs) if kwargs else fn
    raise TypeError(f"policy_mapping_fn{sig} cannot be called as fn(agent_id, episode); write it as "
                    f"def fn(agent_id, episode, **kwargs) -> module_id")


# --- checks at build() ---------------------------------------------------------------------------------
def multi_agent_problems(config: Any) -> list[str]:
    policies = normalize_policies(config.policies)
    problems = _policies_problems(policies)
    spec = as_rl_module_spec(config.rl_module_spec)
    if spec is not None:
        if isinstance(spec, (RLModuleSpec, MultiRLModuleSpec)):
            problems += spec_problems(spec, "rl_module_spec")
        else:
            problems.append(f"rl_module_spec must be RLModuleSpec(...) or MultiRLModuleSpec(rl_module_specs={{...}}), "
                            f"got {spec!r}")
    if isinstance(policies, dict) and isinstance(spec, MultiRLModuleSpec) and spec.module_ids is not None \
            and set(policies) != set(spec.module_ids):
        problems.append(f"multi_agent(policies=...) and rl_module(rl_module_spec=...) name different modules: "
                        f"only in policies: {sorted(map(str, set(policies) - set(spec.module_ids)))}, only in "
                        f"rl_module_specs: {sorted(map(str, set(spec.module_ids) - set(policies)))}; give the same "
                        f"ids to both, or leave policies out (the spec's ids are then the modules)")
    ids = module_ids(config) if policies is None or isinstance(policies, dict) else []
    if isinstance(spec, MultiRLModuleSpec) and spec.module_ids is not None and policies is None:
        problems += _id_problems(spec.module_ids, "rl_module_specs")
    problems += _module_config_problems(config, policies, spec)
    problems += _mapping_problems(config.policy_mapping_fn)
    problems += _training_problems(config.policies_to_train, ids)
    if config.count_steps_by not in COUNT_STEPS_BY:
        problems.append(f"count_steps_by={config.count_steps_by!r} is not one of {list(COUNT_STEPS_BY)}: "
                        f"'env_steps' counts each env step once, 'agent_steps' counts each agent's step")
    if settings_used(config):
        problems += unbuilt_problems(config)
    return problems


NOT_YET = "is not built for multi-agent runs yet (issue 27)"

MULTI_AGENT_ALGORITHMS = ("APPO", "BC", "CQL", "DQN", "IMPALA", "MARWIL", "PPO", "SAC")
"""The algorithms whose plans train several modules."""
OFFLINE_MULTI_AGENT = ("BC", "CQL", "MARWIL")
"""Those that train several modules from a multi-agent recording (``offline_data(input_=DIR)``)."""


def unbuilt_problems(config: Any) -> list[str]:
    """What a config with multi-agent settings asks for that multi-agent runs do not do yet, each naming the
    setting to change."""
    offline = config.offline_data_config or {}
    algo = getattr(config, "algo_name", type(config).__name__)
    problems = []
    input_ = offline.get("input_")
    mixes = isinstance(input_, dict) and "sampler" in input_  # DQN's and SAC's replay take recorded steps too
    if input_ not in ("sampler", None) and algo not in OFFLINE_MULTI_AGENT and not mixes:
        problems.append(f"offline_data(input_=...) with {algo} {NOT_YET} (BC, MARWIL and CQL train several modules "
                        f"from a multi-agent recording; DQN and SAC mix one in with input_={{'sampler': p, DIR: q}}): "
                        f"leave it unset for multi-agent training, or train one module without multi_agent(...) "
                        f"settings on its recording, DIR/<module_id>")
    if algo not in MULTI_AGENT_ALGORITHMS:
        problems.append(f"{algo} with multi_agent(...) or rl_module(rl_module_spec=...) settings is not built yet "
                        f"(issue 27): only {list(MULTI_AGENT_ALGORITHMS)} train several modules so far")
    return problems


def _policies_problems(policies: Any) -> list[str]:
    if policies is None:
        return []
    if not isinstance(policies, dict):
        return [f"policies must be module ids (a set or list of str) or a dict {{module_id: PolicySpec(...) or "
                f"None}}, got {policies!r}"]
    problems = [f"policies[{mid!r}]={v!r} is not a PolicySpec: give PolicySpec(policy_class=None, "
                f"observation_space=..., action_space=..., config={{...}}), a 4-tuple of those, or None"
                for mid, v in policies.items() if as_policy_spec(v) is None]
    if problems:
        return problems
    if not policies:
        return ["policies is empty: give at least one module id, e.g. .multi_agent(policies={'p0', 'p1'}, "
                "policy_mapping_fn=...), or leave it out for the one module 'default_policy'"]
    problems += _id_problems(list(policies), "policies")
    for mid, ps in policies.items():
        cls = ps.policy_class
        if cls is not None and not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, RLModule)):
            problems.append(f"policies[{mid!r}].policy_class={cls!r} is not an RLModule subclass (RLlib's old Policy "
                            f"classes have no counterpart): give the module class, or "
                            f"rl_module(rl_module_spec=MultiRLModuleSpec(rl_module_specs={{{mid!r}: "
                            f"RLModuleSpec(module_class=...)}}))")
        if ps.config is not None and not isinstance(ps.config, dict):
            problems.append(f"policies[{mid!r}].config must be a dict of settings (AlgorithmConfig.overrides(...)), "
                            f"got {ps.config!r}")
    return problems


def _module_config_problems(config: Any, policies: Any, spec: Any) -> list[str]:
    """Each module's own settings: ``PolicySpec.config`` keys must be settings, and every module's model
    config keys the default modules read."""
    from pipeline.config.keys import setting_names
    from pipeline.config.training import statistics_problems, model_config_problems

    problems = []
    names = set(setting_names(config))
    for mid, ps in (policies.items() if isinstance(policies, dict) else ()):
        if not isinstance(ps, PolicySpec) or not isinstance(ps.config, dict):
            continue
        unknown = sorted(k for k in ps.config if k not in names)
        if unknown:
            problems.append(f"policies[{mid!r}].config has keys {unknown} that are not settings of "
                            f"{type(config).__name__}; write it with {type(config).__name__}.overrides(...)")
        if isinstance(ps.config.get("model_config"), dict):
            problems += [f"policies[{mid!r}].config: {p}" for p in model_config_problems(ps.config["model_config"])
                         + statistics_problems(config, ps.config["model_config"])]
    specs = {}
    if isinstance(spec, MultiRLModuleSpec):
        inner = spec.rl_module_specs
        specs = inner if isinstance(inner, dict) else {"(every module)": inner}
    elif isinstance(spec, RLModuleSpec):
        specs = {"(every module)": spec}
    for mid, one in specs.items():
        if isinstance(one, RLModuleSpec) and (isinstance(one.model_config, dict) or dataclasses.is_dataclass(one.model_config)):
            problems += [f"rl_module_specs[{mid!r}]: {p}" if mid != "(every module)" else f"rl_module_spec: {p}"
                         for p in model_config_problems(one.model_config_dict())
                         + statistics_problems(config, one.model_config_dict())]
    return problems


def settings_used(config: Any) -> bool:
    """Whether any multi-agent setting or ``rl_module_spec`` differs from its default (what single-agent
    training does not read)."""
    return bool(is_multi_agent(config)) or any(
        getattr(config, name) is not None for name in ("rl_module_spec", "policy_mapping_fn", "policies_to_train")) \
        or config.count_steps_by != "env_steps"


def _id_problems(ids: list[Any], where: str) -> list[str]:
    bad = [mid for mid in ids if not isinstance(mid, str) or not mid or any(c in mid for c in BAD_ID_CHARS)]
    if not bad:
        return []
    return [f"{where}: module ids {bad!r} are not allowed: a module id is a non-empty str without "
            f"{' or '.join(map(repr, BAD_ID_CHARS))} (they join module ids and parameter names in the weights); "
            f"rename them, e.g. {[_fixed_id(m) for m in bad]!r}"]


def _fixed_id(module_id: Any) -> str:
    text = str(module_id) or "module"
    for c in BAD_ID_CHARS:
        text = text.replace(c, "_")
    return text if isinstance(module_id, str) else f"p{text}"


def _mapping_problems(fn: Any) -> list[str]:
    if fn is None or isinstance(fn, str):
        return []
    if not callable(fn):
        return [f"policy_mapping_fn must be a function fn(agent_id, episode, **kwargs) -> module_id (or its "
                f"'pkg.module:name' path), got {fn!r}"]
    try:
        mapping_function(fn)
    except TypeError as err:
        return [str(err)]
    return []


def _training_problems(to_train: Any, ids: list[str]) -> list[str]:
    if to_train is None or callable(to_train) or isinstance(to_train, str) and ":" in to_train:
        return []
    if isinstance(to_train, str) or not isinstance(to_train, Collection):
        return [f"policies_to_train must be module ids (a list or set), a function fn(module_id, batch) -> bool, "
                f"or None (train all), got {to_train!r}"]
    unknown = [mid for mid in to_train if mid not in ids]
    if unknown and ids:
        return [f"policies_to_train names modules {unknown!r} that do not exist; the modules are {ids!r} (add them "
                f"to multi_agent(policies=...) or drop them from policies_to_train)"]
    return []
