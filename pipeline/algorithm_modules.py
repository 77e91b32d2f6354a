"""Modules added, removed and loaded while a multi-agent run goes on: RLlib's ``algo.add_module`` /
``algo.remove_module`` (the self-play league pattern) and runnel's ``algo.load_module``.

``add_module`` builds the module on every learner (from the run's config, its seed offset of its own),
on the env runners and on the evaluators, gives the driver a policy copy of it, and switches to the
new mapping and the new set of modules to train where given. ``remove_module`` undoes that. Both
also rewrite the algorithm's config (``policies``, ``policy_mapping_fn``, ``policies_to_train``),
so a checkpoint saved afterwards restores the same module set with ``Algorithm.from_checkpoint``;
and the runners' construction arguments, so a runner recreated after a crash holds the same modules.
Learners, env runners and evaluators always hold the same modules: RLlib's ``add_to_learners=False``
and its siblings are refused (``refuse_partial``). Mapping and policies_to_train functions are kept by
their import paths in a checkpoint: write them as module-level functions, not lambdas.

A new module's weights come from its learners (initialised like any module of the run). To start it
from another module's weights (a frozen snapshot of "main"), set them after adding it, in RLlib's
spelling ``algo.set_state({"learner_group": {"learner": {"rl_module": {"main_v1": state}}}})`` with
``state = algo.get_module("main").get_state()``; ``set_module_weights`` does that.

``load_module(module_id, checkpoint_dir, source_module_id=...)`` restores one module's weights from a
checkpoint of another run, of any algorithm whose module has the same class, spaces and model config:
a multi-agent checkpoint's ``modules/<id>/learner.pt``, or a single-agent checkpoint's ``learner.pt`` as
module ``default_policy``. It is RLlib's ``algo.restore_from_path(path/learner_group/learner/rl_module/<id>,
component="learner_group/learner/rl_module/<id>")``. ``weights_only=False`` restores the module's whole
learner state (optimizer, algorithm fields, RNGs too), from a checkpoint of the same algorithm.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from actors.modules import ModuleSpec
from actors.modules.rl_module_spec import MultiRLModuleSpec, RLModuleSpec
from pipeline.algorithm_actions import DriverPolicy
from pipeline.checkpoints.directory import read_module_state
from pipeline.config.base import ConfigError
from pipeline.config.keys import setting_names
from pipeline.config.multi_agent import PolicySpec, as_policy_spec, mapping_function, normalize_policies
from pipeline.groups.multi_agent import check_module_class
from pipeline.offline.record import write_run_manifest
from pipeline.plans.asynchronous import AsyncPlan

ModuleSpecLike = ModuleSpec | RLModuleSpec | PolicySpec | None


def add_module(algo: Any, module_id: str, module_spec: ModuleSpecLike = None, *,
               config_overrides: Mapping[str, Any] | None = None,
               new_agent_to_module_mapping_fn: Callable | None = None,
               new_should_module_be_updated: Collection[str] | Callable | None = None,
               add_to_learners: bool = True, add_to_env_runners: bool = True,
               add_to_eval_env_runners: bool = True) -> None:
    """See the module docstring; ``Algorithm.add_module`` documents the arguments."""
    setup = multi_agent_of(algo, "add_module")
    if module_id in setup.plan.module_specs:
        raise ValueError(f"add_module: module {module_id!r} exists already (modules: {setup.module_ids}); "
                         f"remove_module({module_id!r}) first or pick another id")
    if setup.connectors is not None:
        raise NotImplementedError(f"add_module({module_id!r}): this run has env_to_module_connector, and a pipeline "
                                  f"for a module added while training is not built yet; list every module in "
                                  f".multi_agent(policies=...) from the start")
    refuse_partial("add_module", add_to_learners=add_to_learners, add_to_env_runners=add_to_env_runners,
                   add_to_eval_env_runners=add_to_eval_env_runners)
    check_should_update(new_should_module_be_updated, [*setup.module_ids, module_id])
    overrides = dict(config_overrides or {})
    spec = complete_spec(algo, module_id, module_spec, overrides)
    mapping = None if new_agent_to_module_mapping_fn is None else mapping_function(new_agent_to_module_mapping_fn)
    if new_should_module_be_updated is None:  # as before: all train (or a function decides), or the listed ones
        trains = setup.plan.trainable is None or algo.config.policies_to_train is None
    else:
        trains = callable(new_should_module_be_updated) or module_id in new_should_module_be_updated
    policy = DriverPolicy.build(spec, algo.config, spec.observation_space, spec.action_space)  # checks, first
    if isinstance(algo.plan, AsyncPlan):
        # before anything changes: runners change the module tables their sampling threads read, and an
        # in-process runner shares the run's mapping object, so a thread still sampling would map agents to the
        # new module before its runner holds it (the next training step starts the streams again)
        algo.plan.pause_streams()
    algo.learner_group.add_module(module_id, spec, overrides, trains)
    if isinstance(algo.plan, AsyncPlan):  # streamed chunks are checked against the modules' spaces on arrival
        algo.plan.add_module(module_id, spec.observation_space, spec.action_space)
    setup.change_modules(added={module_id: spec}, mapping=mapping)
    setup.driver_policies[module_id] = policy
    if algo.recording is not None:  # its recording's manifest before any runner records for it
        write_run_manifest(algo, [module_id])
    for group in runner_groups(algo):
        # building a module is start-up work (an evaluator busy with a parallel evaluation answers after it):
        # the start timeout, not the probe's, before a slow answer counts as a failure
        group.manager.foreach_actor("add_module", module_id, spec, timeout_s=group.manager.settings.build_timeout_s)
        if mapping is not None:
            group.manager.foreach_actor("set_policy_mapping_fn", mapping)
    remember_in_config(algo.config, setup.module_ids, module_id, spec, overrides, new_agent_to_module_mapping_fn)
    if new_should_module_be_updated is not None:
        set_should_update(algo, new_should_module_be_updated)
    algo.sync_weights()  # the runners' copy of the new module gets the learners' weights


def remove_module(algo: Any, module_id: str, *, new_agent_to_module_mapping_fn: Callable | None = None,
                  new_should_module_be_updated: Collection[str] | Callable | None = None,
                  remove_from_learners: bool = True, remove_from_env_runners: bool = True,
                  remove_from_eval_env_runners: bool = True) -> None:
    """See the module docstring; ``Algorithm.remove_module`` documents the arguments."""
    setup = multi_agent_of(algo, "remove_module")
    if module_id not in setup.plan.module_specs:
        raise KeyError(f"remove_module: no module {module_id!r}; the modules are {setup.module_ids}")
    if len(setup.plan.module_specs) == 1:
        raise ValueError(f"remove_module: {module_id!r} is the run's last module; add_module() another first")
    refuse_partial("remove_module", remove_from_learners=remove_from_learners,
                   remove_from_env_runners=remove_from_env_runners,
                   remove_from_eval_env_runners=remove_from_eval_env_runners)
    check_should_update(new_should_module_be_updated, [mid for mid in setup.module_ids if mid != module_id])
    mapping = None if new_agent_to_module_mapping_fn is None else mapping_function(new_agent_to_module_mapping_fn)
    if isinstance(algo.plan, AsyncPlan):  # runners reset episodes of the module, which must not race their streams
        algo.plan.pause_streams()  # (the next training step starts them again)
    for group in runner_groups(algo):
        group.manager.foreach_actor("remove_module", module_id, mapping)
    algo.learner_group.remove_module(module_id)
    if isinstance(algo.plan, AsyncPlan):
        algo.plan.remove_module(module_id)
    setup.change_modules(removed=module_id, mapping=mapping)
    setup.driver_policies.pop(module_id, None)
    algo.metrics.delete(f"learners/{module_id}")  # its last update's statistics would otherwise stay in the results
    config = algo.config
    policies = normalize_policies(config.policies)
    if isinstance(policies, dict):
        policies.pop(module_id, None)
        config.policies = policies
    if isinstance(config.rl_module_spec, MultiRLModuleSpec) and isinstance(config.rl_module_spec.rl_module_specs, dict):
        config.rl_module_spec.rl_module_specs.pop(module_id, None)
    if new_agent_to_module_mapping_fn is not None:
        config.policy_mapping_fn = new_agent_to_module_mapping_fn
    if new_should_module_be_updated is not None:
        set_should_update(algo, new_should_module_be_updated)
    elif is_id_collection(config.policies_to_train):
        config.policies_to_train = sorted(set(config.policies_to_train) - {module_id})


def set_should_update(algo: Any, which: Collection[str] | Callable) -> None:
    """Which modules train from now on (ids, or ``fn(module_id, batch) -> bool``), in the learners and
    the config."""
    setup = multi_agent_of(algo, "new_should_module_be_updated")
    check_should_update(which, setup.module_ids)
    algo.learner_group.set_should_update(which)
    setup.set_trainable(which)
    algo.config.policies_to_train = which if callable(which) else sorted(which)


def set_module_weights(algo: Any, module_id: str, weights: Mapping[str, Any]) -> None:
    """Module ``module_id``'s weights (``RLModule.get_state()`` of a module of the same spec) on the
    learners, then on every env runner."""
    if algo.multi_agent is None and module_id == "default_policy":
        algo.set_weights(dict(weights))
        return
    multi_agent_of(algo, "set_module_weights").policy(module_id, "set_module_weights")
    algo.learner_group.set_module_weights(module_id, dict(weights))
    algo.sync_weights()


def set_rllib_state(algo: Any, state: Mapping[str, Any]) -> bool:
    """RLlib's ``algo.set_state({"learner_group": {"learner": {"rl_module": {module_id: weights}}}})``:
    those modules' weights, on the learners and then every env runner. False when ``state`` holds no
    ``learner_group`` (it is the driver's own state, for ``set_driver_state``)."""
    if "learner_group" not in state:
        return False
    modules = state["learner_group"].get("learner", {}).get("rl_module", {})
    if not modules:
        raise ValueError(f"set_state: the learner_group state holds no modules' weights; give "
                         f"{{'learner_group': {{'learner': {{'rl_module': {{module_id: weights}}}}}}}}, got keys "
                         f"{sorted(state['learner_group'])}")
    for module_id, weights in modules.items():
        set_module_weights(algo, module_id, weights)
    return True


def load_module(algo: Any, module_id: str, checkpoint_dir: str, source_module_id: str | None = None, *,
                weights_only: bool = True) -> None:
    """See the module docstring; ``Algorithm.load_module`` documents the arguments."""
    source = source_module_id or module_id
    state = read_module_state(checkpoint_dir, source)
    if algo.multi_agent is not None:
        algo.multi_agent.policy(module_id, "load_module")
    elif module_id != "default_policy":
        raise KeyError(f"load_module: module {module_id!r}; this run trains one module, 'default_policy'")
    try:
        if weights_only:  # RLlib's rl_module component: the module's weights, not its optimizer
            set_module_weights(algo, module_id, {k: v.numpy() for k, v in state["module"].items()})
            return
        if algo.multi_agent is not None:
            algo.learner_group.set_module_state(module_id, state)
        else:
            algo.learner_group.set_state(state)
            algo.weights_version += 1
    except (KeyError, RuntimeError, ValueError) as err:
        raise ValueError(f"load_module: module {source!r} of {checkpoint_dir!r} does not fit module {module_id!r} "
                         f"of this run ({err}); load a module of the same class, spaces and model config"
                         f"{'' if weights_only else ', saved by the same algorithm'}") from err
    algo.sync_weights()


def is_id_collection(policies_to_train: Any) -> bool:
    """``policies_to_train`` holds module ids (not None, a function or a function's import path)."""
    return policies_to_train is not None and not callable(policies_to_train) and not isinstance(policies_to_train, str)


# --- the pieces ---------------------------------------------------------------------------------
def multi_agent_of(algo: Any, where: str) -> Any:
    if algo.multi_agent is None:
        raise ValueError(f"{where} changes the modules of a multi-agent run; this run trains one module "
                         f"('default_policy'): configure .multi_agent(policies=..., policy_mapping_fn=...)")
    return algo.multi_agent


def runner_groups(algo: Any) -> list[Any]:
    """The env runners, and the evaluators once built (evaluators built later take the plan's modules)."""
    return [algo.env_runner_group] + ([algo.evaluators.group] if algo.evaluators is not None else [])


def refuse_partial(where: str, **flags: bool) -> None:
    """Learners, env runners and evaluators hold one module set in runnel: the weights sync, evaluators
    built later and checkpoints rely on it, so RLlib's flags to leave one of them out are refused."""
    off = [name for name, on in flags.items() if not on]
    if off:
        raise NotImplementedError(f"{where}({', '.join(f'{name}=False' for name in off)}) is not built: runnel's "
                                  f"learners, env runners and evaluators always hold the same modules (a frozen "
                                  f"module is never trained; leave it out of new_should_module_be_updated instead)")


def check_should_update(which: Any, module_ids: list[str]) -> None:
    """``new_should_module_be_updated``: None, a function, or ids of ``module_ids``."""
    if which is None or callable(which):
        return
    if isinstance(which, str) or not isinstance(which, Collection) or set(which) - set(module_ids):
        raise ValueError(f"new_should_module_be_updated={which!r}: give ids of the run's modules {sorted(module_ids)} "
                         f"(a set or list), or a function fn(module_id, batch) -> bool")


def complete_spec(algo: Any, module_id: str, given: ModuleSpecLike, overrides: Mapping[str, Any]) -> ModuleSpec:
    """``given`` as a complete ``ModuleSpec``: what it leaves out is the run's (the algorithm's module
    class, the spaces of the run's first module, the config's model config with ``overrides``')."""
    if isinstance(given, ModuleSpec):
        spec = given
    else:
        if given is None or isinstance(given, RLModuleSpec):
            rl = given or RLModuleSpec()
            cls, obs, act, model = rl.module_class, rl.observation_space, rl.action_space, rl.model_config_dict()
        elif as_policy_spec(given) is not None:
            ps = as_policy_spec(given)
            cls, obs, act = ps.policy_class, ps.observation_space, ps.action_space
            model = dict((ps.config or {}).get("model_config") or {})
            overrides.update({k: v for k, v in (ps.config or {}).items() if k != "model_config"})
        else:
            raise TypeError(f"add_module({module_id!r}, module_spec={given!r}): give an RLModuleSpec(...), a "
                            f"PolicySpec(...) or None (the run's module class, spaces and model config)")
        default_class = algo.learner_class.module_class
        first_obs, first_act = algo.multi_agent.first_spaces()
        cls = cls or default_class
        if isinstance(cls, str):
            from pipeline.config.plain import resolve_import_path

            cls = resolve_import_path(cls, f"module class of {module_id!r}")
        model_config = {**algo.config.model_config, **dict(overrides.pop("model_config", None) or {}), **model}
        kwargs = algo.config.module_kwargs() if isinstance(cls, type) and issubclass(cls, default_class) else {}
        spec = ModuleSpec(first_obs if obs is None else obs, first_act if act is None else act, model_config, cls,
                          kwargs)
    unknown = sorted(set(overrides) - set(setting_names(algo.config)))
    if unknown:
        raise ConfigError(f"add_module({module_id!r}): config_overrides keys {unknown} are not settings of "
                          f"{type(algo.config).__name__}")
    check_module_class(algo.learner_class, module_id, spec)
    return spec


def remember_in_config(config: Any, module_ids: list[str], module_id: str, spec: ModuleSpec,
                       overrides: Mapping[str, Any], mapping_fn: Callable | None) -> None:
    """The new module in ``config``'s ``policies`` (and a ``MultiRLModuleSpec``'s specs), so a saved
    config rebuilds it."""
    policies = normalize_policies(config.policies)
    if not isinstance(policies, dict):  # the modules came from a MultiRLModuleSpec's ids alone
        policies = {mid: PolicySpec() for mid in module_ids if mid != module_id}
    policies[module_id] = PolicySpec(spec.module_class, spec.observation_space, spec.action_space,
                                     {**dict(overrides), "model_config": dict(spec.model_config)})
    config.policies = policies
    rl_spec = config.rl_module_spec
    if isinstance(rl_spec, MultiRLModuleSpec) and isinstance(rl_spec.rl_module_specs, dict):
        rl_spec.rl_module_specs[module_id] = RLModuleSpec(spec.module_class, spec.observation_space,
                                                          spec.action_space, model_config=dict(spec.model_config))
    if mapping_fn is not None:
        config.policy_mapping_fn = mapping_fn
