"""The stage groups of a multi-agent run: a learner group of ``MultiLearner``s and the env runners' counts.

``MultiLearnerGroup`` is a ``LearnerGroup`` whose members are ``ConfiguredMultiLearner``s: one
algorithm learner per module, each built from the run's config with that module's spec and
``PolicySpec.config`` overrides (its own seed, so modules start apart). An update takes the flat
chunk list the multi-agent env runners return, groups it by module id, shards each module's chunks
across the learners (each module's batch one codec frame) and logs each module's statistics under
``learners/<module_id>/``, as RLlib's results hold them.

Modules may be added and removed while training (``add_module``/``remove_module``: every learner builds
or drops the module; with several learners, rank 0's initial weights go to all), set per module
(``set_module_weights``/``set_module_state``), and which train may change (``set_should_update``): ids go
to the learners, a ``policies_to_train`` function ``(module_id, batch) -> bool`` is asked here in the
driver, per module and update, with that module's chunks. A module's class may be its own, a subclass
of the algorithm learner's module class (``check_module_class``): its learner is the algorithm's learner
with that ``module_class``.

``steps_counter`` tells ``EnvRunnerGroup.sample`` how many steps a runner's answer brought, in the
plan's ``count_steps_by`` unit: chunk lengths are agent steps, so the runner's own metrics say it.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Callable

import numpy as np

from actors.env.multi_agent_runner_parts import chunks_by_module
from actors.learner import Learner
from actors.learner.multi_learner import ALL_MODULES, MultiLearner
from actors.metrics import MetricsLogger
from actors.modules import ModuleSpec
from actors.modules.multi import SEP
from pipeline.config.checks import ConfigError
from pipeline.config.connectors import learner_side_pipeline
from pipeline.groups.learner_group import LearnerGroup, log_learner_stats, shard_chunks, shard_transitions
from protocols.codec import encode
from protocols.episode import EpisodeChunk


def module_config(config: Any, module_id: str, index: int, spec: ModuleSpec, overrides: Mapping[str, Any]) -> Any:
    """The run's config as module ``module_id``'s learner sees it: its model config and overrides, and a
    seed of its own (``seed + index``) so that modules of one spec do not start identical."""
    out = config.copy()
    try:
        out.update_from_dict(dict(overrides))
    except Exception as err:  # noqa: BLE001 - whatever the config rejects, named with the module
        raise ConfigError(f"module {module_id!r}: PolicySpec(config={dict(overrides)!r}): {err}") from err
    out.model_config = dict(spec.model_config)
    if config.seed is not None:
        out.seed = config.seed + index
    return out


class ConfiguredMultiLearner(MultiLearner):
    """A ``MultiLearner`` that builds its modules' learners itself (in the process that hosts it: a Ray
    learner actor is given the plan's pieces, never learners), and builds modules added later the same
    way (``add_module_from_spec``)."""

    def __init__(self, config: Any, observation_space: Any = None, action_space: Any = None, *,
                 learner_class: type[Learner], module_specs: Mapping[str, ModuleSpec],
                 trainable: Collection[str] | None, config_overrides: Mapping[str, Mapping[str, Any]],
                 device: str = "cpu", rank: int = 0, world_size: int = 1,
                 observation_views: Mapping[str, Any] | None = None) -> None:
        """``observation_views``: module id -> the ``ObservationView`` its learner rebuilds its env-to-module
        view with (frame stacks), for modules whose pipeline has one."""
        self.config, self.learner_class = config, learner_class
        self.observation_views = dict(observation_views or {})
        self.build_device, self.rank, self.world_size = device, rank, world_size
        self.num_modules_built = 0
        """Modules built over this learner's life: the next one's seed offset (one per module, so modules
        of one spec start apart, the same on every rank)."""
        learners = {mid: self._build(mid, spec, config_overrides.get(mid, {}))
                    for mid, spec in sorted(module_specs.items())}
        super().__init__(learners, trainable)

    def _build(self, module_id: str, spec: ModuleSpec, overrides: Mapping[str, Any]) -> Learner:
        check_module_class(self.learner_class, module_id, spec)
        cfg = module_config(self.config, module_id, self.num_modules_built, spec, overrides)
        self.num_modules_built += 1
        cls = learner_for_module_class(self.learner_class, spec.module_class)
        view = self.observation_views.get(module_id)
        # a learner connector reads the chunks after the view is rebuilt: what the module saw
        pipeline = learner_side_pipeline(self.config, spec.observation_space, spec.action_space)
        kwargs = {"learner_connector": pipeline} if pipeline is not None else {}
        if view is not None:
            kwargs["observation_view"] = view
        return cls(cfg, spec.observation_space, spec.action_space, device=self.build_device, rank=self.rank,
                   world_size=self.world_size, **kwargs)

    def add_module_from_spec(self, module_id: str, spec: ModuleSpec, overrides: Mapping[str, Any],
                             trainable: bool) -> None:
        """Build module ``module_id``'s learner from the run's config (and ``overrides``) and add it."""
        self.add_module(module_id, self._build(module_id, spec, overrides), trainable=trainable)

    def drop_module(self, module_id: str) -> None:
        """``remove_module`` without returning the learner (which must not travel back from an actor)."""
        self.remove_module(module_id)

    def set_trainable(self, module_ids: Collection[str]) -> None:
        self.trainable = module_ids


def learner_for_module_class(learner_class: type[Learner], module_class: type) -> type[Learner]:
    """``learner_class`` training ``module_class`` (a subclass of its own module class) instead: the
    learner builds ``self.module_class``, so a subclass of the learner with that attribute changed."""
    if module_class is learner_class.module_class:
        return learner_class
    key = (learner_class, module_class)
    if key not in _LEARNERS_FOR_CLASSES:
        _LEARNERS_FOR_CLASSES[key] = type(learner_class.__name__, (learner_class,),
                                          {"module_class": module_class, "__module__": learner_class.__module__})
    return _LEARNERS_FOR_CLASSES[key]


_LEARNERS_FOR_CLASSES: dict[tuple[type, type], type] = {}


def check_module_class(learner_class: type[Learner], module_id: str, spec: ModuleSpec) -> None:
    """A module's class must be the learner's module class or a subclass of it: the learner's loss reads
    that class's outputs (``forward_train``'s keys, its value head, its action distribution)."""
    needed = learner_class.module_class
    if not (isinstance(spec.module_class, type) and issubclass(spec.module_class, needed)):
        name = getattr(spec.module_class, "__name__", repr(spec.module_class))
        raise ConfigError(f"module {module_id!r} asks for module class {name}, which {learner_class.__name__} cannot "
                          f"train: its loss needs a {needed.__name__} ({needed.__module__}). Give a subclass of "
                          f"{needed.__name__} (override its encoder or heads), or leave module_class/policy_class unset")


class MultiLearnerGroup(LearnerGroup):
    def __init__(self, learner_class: type[Learner], config: Any, plan: Any,
                 observation_views: Mapping[str, Any] | None = None) -> None:
        """``plan``: the run's ``MultiAgentPlan`` (module specs, which train, per-module overrides);
        ``observation_views``: as ``ConfiguredMultiLearner`` takes them."""
        for mid, spec in plan.module_specs.items():  # in the driver, before any actor starts
            check_module_class(learner_class, mid, spec)
        self.module_ids = sorted(plan.module_specs)
        self.learner_class = learner_class
        self.should_update: Callable[[str, Any], bool] | None = plan.policies_to_train
        """``policies_to_train`` as a function ``(module_id, batch) -> bool``, asked here in the driver
        before each update (the learners then train every module they are sent); None: the learners'
        own set of trainable modules decides."""
        kwargs = {"learner_class": learner_class, "module_specs": plan.module_specs,
                  "trainable": plan.trainable, "config_overrides": plan.config_overrides}
        if observation_views:
            kwargs["observation_views"] = dict(observation_views)
        super().__init__(ConfiguredMultiLearner, config, None, None, learner_kwargs=kwargs)

    def update(self, batch: list[EpisodeChunk] | Mapping[str, list[EpisodeChunk]], timestep: int,
               metrics: MetricsLogger | None = None, with_outputs: bool = False, num_env_steps: int | None = None
               ) -> tuple[dict[str, dict[str, float]], dict[str, Any]]:
        """One update of every trainable module on its agents' chunks of ``batch`` (a flat list, or
        already grouped by module id: a streamed ``ModuleBatches``); returns the statistics per module
        (the learners' mean). ``num_env_steps``: the env steps the batch holds (its chunks count agent
        steps), for ``num_env_steps_trained``."""
        if with_outputs:
            raise NotImplementedError("per-row learner outputs of a multi-agent update (prioritized replay) are "
                                      "not built yet (issue 27)")
        by_module = dict(batch) if isinstance(batch, Mapping) else chunks_by_module(batch)
        # chunks of a module the learners no longer hold are not trained on; with a policies_to_train
        # function, the user's function decides per batch, here in the driver
        keep = {mid: mid in self.module_ids and (self.should_update is None or bool(self.should_update(mid, chunks)))
                for mid, chunks in by_module.items()}
        refused = sum(1 for k in keep.values() if not k)
        by_module = {mid: chunks for mid, chunks in by_module.items() if keep[mid]}
        ids = self.manager.healthy_ids()
        shards: dict[int, dict[str, Any]] = {i: {} for i in ids}
        for mid, chunks in by_module.items():
            for i, shard in zip(ids, [chunks] if len(ids) == 1 else shard_chunks(chunks, len(ids))):
                shards[i][mid] = shard if self.manager.in_process else encode(shard, compress=False)
        results = self.call("update", per_actor_args={i: (shards[i], timestep) for i in ids})
        steps = {mid: sum(len(c) for c in chunks) for mid, chunks in by_module.items()}
        return self.record_module_update([r.value for r in results], steps, metrics, num_env_steps, refused), {}

    def record_module_update(self, all_stats: list[dict[str, dict[str, float]]], steps: Mapping[str, int],
                             metrics: MetricsLogger | None, num_env_steps: int | None = None, refused: int = 0
                             ) -> dict[str, dict[str, float]]:
        """Account for one update of the learners (``all_stats``: each learner's statistics per module;
        ``steps``: agent steps of each module's batches, all learners together; ``num_env_steps``: the env steps
        they stand for, None: as many as the agent steps trained): the mean statistics per module, logged into
        ``metrics``, and a new weights version unless no module trained."""
        stats = {mid: {k: float(np.mean([s[mid][k] for s in all_stats])) for k in all_stats[0][mid]}
                 for mid in all_stats[0]}
        if refused:
            stats[ALL_MODULES]["num_frozen_batches_dropped"] += refused
        trained = [mid for mid in stats if mid != ALL_MODULES and "num_batches_refused" not in stats[mid]]
        if trained:
            self.weights_version += 1
        if metrics is not None:
            agent_steps = sum(steps.get(mid, 0) for mid in trained)
            env_steps = agent_steps if num_env_steps is None else num_env_steps
            for mid, module_stats in stats.items():
                log_learner_stats(metrics, module_stats, f"learners/{mid}")
            for key, value in (("num_env_steps_trained", env_steps), ("num_agent_steps_trained", agent_steps),
                               ("num_updates", 1 if trained else 0)):
                metrics.log_value(f"learners/{ALL_MODULES}/{key}", value, reduce="sum")
            for key, value in (("num_env_steps_trained_lifetime", env_steps if trained else 0),
                               ("num_agent_steps_trained_lifetime", agent_steps)):
                metrics.log_value(f"learners/{ALL_MODULES}/{key}", value, reduce="lifetime_sum")
        return stats

    def module_weights(self, module_id: str) -> dict[str, np.ndarray]:
        """One module's weights, its own parameter names (no module prefix)."""
        if module_id not in self.module_ids:
            raise KeyError(f"no module {module_id!r}; the modules are {self.module_ids}")
        first = self.manager.healthy_ids()[:1]
        flat = self.call("get_weights", False, [module_id], actor_ids=first)[0].value
        prefix = f"{module_id}{SEP}"
        return {k[len(prefix):]: v for k, v in flat.items()}

    def update_replayed(self, batches: Mapping[str, dict[str, Any]], timestep: int, metrics: MetricsLogger | None = None,
                        with_outputs: bool = False) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, np.ndarray]]]:
        """One update of every module in ``batches`` on its own replayed batch of transitions (off-policy:
        each sampled from that module's buffer), each batch split by rows over the learners. Returns the
        statistics per module and, ``with_outputs``, each trained module's per-row outputs in its batch's
        row order (TD errors, for that module's priorities). A replayed row is one agent step; the env
        steps trained are counted as the largest module batch (each module's rows stand for env steps
        of its own agents)."""
        if self.should_update is not None:  # a policies_to_train function decides per batch, here in the driver
            batches = {mid: b for mid, b in batches.items() if bool(self.should_update(mid, b))}
            if not batches:
                return {}, {}
        ids = self.manager.healthy_ids()
        shards: dict[int, dict[str, Any]] = {i: {} for i in ids}
        for mid, batch in batches.items():
            for i, part in zip(ids, [batch] if len(ids) == 1 else shard_transitions(batch, len(ids))):
                shards[i][mid] = part if self.manager.in_process else encode(part, compress=False)
        method = "update_with_outputs" if with_outputs else "update"
        answers = [r.value for r in self.call(method, per_actor_args={i: (shards[i], timestep) for i in ids})]
        per_learner = [a[0] for a in answers] if with_outputs else answers
        stats = {mid: {k: float(np.mean([s[mid][k] for s in per_learner])) for k in per_learner[0][mid]}
                 for mid in per_learner[0]}
        outputs: dict[str, dict[str, np.ndarray]] = {}
        for mid in (answers[0][1] if with_outputs else {}):
            outputs[mid] = {k: np.concatenate([a[1][mid][k] for a in answers]) for k in answers[0][1][mid]}
        trained = [mid for mid in stats if mid != ALL_MODULES and "num_batches_refused" not in stats[mid]]
        if trained:
            self.weights_version += 1
        if metrics is not None:
            log_replayed_update(metrics, stats, [len(batches[mid]["rewards"]) for mid in trained])
        return stats, outputs


    # --- modules added and removed while training (the self-play pattern) -------------------------
    def add_module(self, module_id: str, spec: ModuleSpec, overrides: Mapping[str, Any], trainable: bool) -> None:
        """Every learner builds module ``module_id`` from the run's config (and ``overrides``)."""
        if module_id in self.module_ids:
            raise ValueError(f"module {module_id!r} exists already (modules: {self.module_ids}); remove_module() it "
                             f"first or pick another id")
        check_module_class(self.learner_class, module_id, spec)  # here, before any actor is asked
        self.manager.foreach_actor("add_module_from_spec", module_id, spec, dict(overrides), trainable,
                                   timeout_s=self.manager.settings.build_timeout_s)  # builds a module: start-up work
        self.module_ids = sorted([*self.module_ids, module_id])
        self._follow_modules(add=(module_id, spec, overrides, trainable))
        if len(self.manager.healthy_ids()) > 1:  # ranks draw apart without a seed: rank 0's weights for all
            self.set_module_weights(module_id, self.module_weights(module_id))

    def remove_module(self, module_id: str) -> None:
        if module_id not in self.module_ids:
            raise KeyError(f"no module {module_id!r} to remove; the modules are {self.module_ids}")
        self.manager.foreach_actor("drop_module", module_id)
        self.module_ids = [mid for mid in self.module_ids if mid != module_id]
        self._follow_modules(remove=module_id)

    def _follow_modules(self, add: tuple[str, ModuleSpec, Mapping[str, Any], bool] | None = None,
                        remove: str | None = None) -> None:
        """A learner recreated after a failure is built with ``learner_kwargs``: keep its modules those of
        the run now (the recovery then gives it the state of every module)."""
        kw = self.learner_kwargs
        specs, overrides = dict(kw["module_specs"]), dict(kw["config_overrides"])
        trainable = None if kw["trainable"] is None else set(kw["trainable"])
        if add is not None:
            module_id, spec, module_overrides, train = add
            specs[module_id], overrides[module_id] = spec, dict(module_overrides)
            if trainable is not None and train:
                trainable.add(module_id)
        if remove is not None:
            specs.pop(remove, None)
            overrides.pop(remove, None)
            if trainable is not None:
                trainable.discard(remove)
        kw.update(module_specs=specs, config_overrides=overrides, trainable=trainable)

    def set_should_update(self, which: Collection[str] | Callable[[str, Any], bool]) -> None:
        """Which modules train from now on: module ids, or a function ``(module_id, batch) -> bool``
        (RLlib's ``should_module_be_updated``)."""
        if callable(which):
            self.should_update = which
            which = self.module_ids
        else:
            if isinstance(which, str) or not isinstance(which, Collection):
                raise TypeError(f"modules to train: give module ids (a set or list) or a function "
                                f"fn(module_id, batch) -> bool, got {which!r}")
            self.should_update = None
        self.manager.foreach_actor("set_trainable", sorted(which))

    def set_module_weights(self, module_id: str, weights: Mapping[str, Any]) -> None:
        """Module ``module_id``'s weights (its own parameter names) on every learner; a new weights version."""
        if module_id not in self.module_ids:
            raise KeyError(f"no module {module_id!r}; the modules are {self.module_ids}")
        self.set_weights({f"{module_id}{SEP}{k}": v for k, v in weights.items()})
        self.weights_version += 1

    def set_module_state(self, module_id: str, state: Mapping[str, Any]) -> None:
        """Module ``module_id``'s whole learner state (weights, optimizers, algorithm fields) on every learner."""
        if module_id not in self.module_ids:
            raise KeyError(f"no module {module_id!r}; the modules are {self.module_ids}")
        self.manager.foreach_actor("set_module_state", module_id, self.manager.share(dict(state)))
        self.weights_version += 1


class OneModule:
    """What ``DriverPolicy`` reads of a learner group (``weights_version``, ``get_weights()``), for one
    module of a ``MultiLearnerGroup``: the driver keeps one policy copy per module."""

    def __init__(self, group: MultiLearnerGroup, module_id: str) -> None:
        self.group, self.module_id = group, module_id

    @property
    def weights_version(self) -> int:
        return self.group.weights_version

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.group.module_weights(self.module_id)


def steps_counter(count_steps_by: str) -> Callable[[list[EpisodeChunk], dict[str, Any]], int]:
    """How many ``count_steps_by`` units one multi-agent runner's answer (its chunks and ``get_metrics()``)
    brought: what ``EnvRunnerGroup.sample`` collects towards its ``num_timesteps``."""
    key = "num_agent_steps_sampled" if count_steps_by == "agent_steps" else "num_env_steps_sampled"

    def count(chunks: list[EpisodeChunk], runner_metrics: dict[str, Any]) -> int:
        entry = runner_metrics.get(key)
        return int(entry["value"]) if entry else 0

    return count


def log_replayed_update(metrics: MetricsLogger, stats: Mapping[str, Mapping[str, float]], rows: list[int]) -> None:
    """A replayed multi-agent update into ``metrics``: each module's statistics under ``learners/<module>/``
    and the update's counts (``rows``: the batch size of each trained module) under ``__all_modules__``."""
    for mid, module_stats in stats.items():
        metrics.log_dict(dict(module_stats), prefix=f"learners/{mid}")
    counts = {"num_agent_steps_trained": sum(rows), "num_env_steps_trained": max(rows, default=0)}
    for key, value in counts.items():
        metrics.log_value(f"learners/{ALL_MODULES}/{key}", value, reduce="sum")
        metrics.log_value(f"learners/{ALL_MODULES}/{key}_lifetime", value, reduce="lifetime_sum")
    metrics.log_value(f"learners/{ALL_MODULES}/num_updates", 1 if rows else 0, reduce="sum")
