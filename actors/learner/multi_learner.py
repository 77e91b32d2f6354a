"""MultiLearner: one algorithm learner per module, for multi-agent training.

Multi-agent learning is not a second learner implementation. Each module id maps to an ordinary
algorithm learner (``PPOLearner``, ``DQNLearner``...) holding that module, its optimizers, schedules
and algorithm state (PPO's KL coefficient, DQN's target network), so every algorithm trains several
modules unchanged and each module keeps its own settings. This class only routes: a batch per
module in, statistics per module out; weights as one flat ``{"<module_id>/<param>": array}`` dict,
the format ``MultiRLModule.get_state``/``set_state`` use on the env runners; state nested by module
id, so one module's state can be restored into another learner's module (RLlib's "restore one
module into another algorithm").

Frozen modules (not in ``trainable``: fixed opponents, a league's past selves) are never stepped. A
batch given for one is dropped and counted (``__all_modules__/num_frozen_batches_dropped``): samplers
produce chunks for every module that acted, and dropping them here keeps the caller simple.

Data-parallel learners (``world_size > 1``) meet at a gradient all-reduce in every optimizer step, so
every rank must step the same modules in the same order: modules are stepped in sorted id order, and
each update first checks with one all-reduce that every rank got batches for the same modules
(an error on all ranks, not a hang, when they did not). The process group is the process's own,
shared by all modules' learners, so ``setup_distributed`` joins it once.

The class is a plain ``LearnerRole`` that a Ray actor hosts like a single ``Learner``; as a remote learner of
multi-agent IMPALA/APPO it hosts a ``ModuleFeed`` (``actors.learner.feed``: its own share of the streams, each
module's batches kept apart so that every rank steps the same modules).
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from actors.core import LearnerRole
from actors.learner.feed import FedByStreams
from actors.learner.learner import Learner
from actors.modules.multi import SEP
from protocols.codec import decode

log = logging.getLogger("runnel")

ALL_MODULES = "__all_modules__"
"""The statistics key for what concerns the update as a whole (RLlib's name)."""


class MultiLearner(FedByStreams, LearnerRole):
    def __init__(self, learners: Mapping[str, Learner], trainable: Collection[str] | None = None) -> None:
        """``learners``: module id -> that module's algorithm learner. ``trainable``: the module ids
        that train (None: all); the others are frozen."""
        if not learners:
            raise ValueError("MultiLearner needs at least one module's learner, got none")
        self._learners: dict[str, Learner] = {}
        for module_id, learner in learners.items():
            self._check_new(module_id, learner)
            self._learners[module_id] = learner
        self._trainable: set[str] = set()
        self.trainable = set(self._learners) if trainable is None else trainable
        self.num_frozen_batches_dropped = 0
        """Batches given for frozen modules and dropped, over this learner's life."""

    # --- the modules ----------------------------------------------------------------------------
    @property
    def module_ids(self) -> list[str]:
        """Every module id, sorted: the order modules are stepped in."""
        return sorted(self._learners)

    @property
    def learners(self) -> Mapping[str, Learner]:
        """Module id -> its algorithm learner (a read-only view)."""
        return MappingProxyType(self._learners)

    def module_connector(self, module_id: str) -> Any:
        """Module ``module_id``'s learner pipeline (None without one, or for a module no longer here): what a
        stream loader applies to the module's share of each batch."""
        learner = self._learners.get(module_id)
        return None if learner is None else learner.learner_connector

    def module_view(self, module_id: str) -> Any:
        """Module ``module_id``'s ``ObservationView`` (None without a view, or for a module no longer here): what a
        stream loader rebuilds the module's share of each batch with."""
        learner = self._learners.get(module_id)
        return None if learner is None else learner.observation_view

    @property
    def modules(self) -> Mapping[str, nn.Module]:
        """Module id -> the trainable module its learner holds (a read-only view)."""
        return MappingProxyType({mid: learner.module for mid, learner in self._learners.items()})

    @property
    def device(self) -> torch.device:
        """Where the modules train (every module's learner is placed alike): where a loader lays batches out."""
        return self._learners[self.module_ids[0]].device

    def learner(self, module_id: str) -> Learner:
        self._check_known([module_id], "learner()")
        return self._learners[module_id]

    def module(self, module_id: str) -> nn.Module:
        return self.learner(module_id).module

    @property
    def trainable(self) -> frozenset[str]:
        """The module ids that train; the others are frozen."""
        return frozenset(self._trainable)

    @trainable.setter
    def trainable(self, module_ids: Collection[str]) -> None:
        if isinstance(module_ids, str):
            raise TypeError(f"trainable must be a collection of module ids, got the str {module_ids!r}; "
                            f"write {{{module_ids!r}}}")
        self._check_known(module_ids, "trainable")
        self._trainable = set(module_ids)

    def add_module(self, module_id: str, learner: Learner, trainable: bool = True) -> None:
        """Add a module with its learner (the self-play pattern: a frozen copy of the main policy)."""
        if module_id in self._learners:
            raise ValueError(f"module {module_id!r} exists already (modules: {self.module_ids}); "
                             f"remove_module({module_id!r}) first to replace it")
        self._check_new(module_id, learner)
        self._learners[module_id] = learner
        if trainable:
            self._trainable.add(module_id)

    def remove_module(self, module_id: str) -> Learner:
        """Remove a module; returns its learner."""
        self._check_known([module_id], "remove_module()")
        if len(self._learners) == 1:
            raise ValueError(f"cannot remove {module_id!r}, the only module: a MultiLearner holds at least one")
        self._trainable.discard(module_id)
        return self._learners.pop(module_id)

    # --- updating --------------------------------------------------------------------------------
    def update(self, batches: Mapping[str, Any], timestep: int) -> dict[str, dict[str, float]]:
        """One update of every trainable module that got a non-empty batch, in sorted id order, each
        by its own learner (``Learner.update``: the algorithm's step, its schedules at ``timestep``).
        A module's batch is what its learner takes: a list of chunks, replayed transitions, or a
        codec frame of either (one frame per module: how batches cross to a remote learner).
        Returns the statistics per trained module, plus ``__all_modules__``: ``num_modules_trained``
        and ``num_frozen_batches_dropped`` (batches given for frozen modules, not trained on)."""
        return self._update(batches, timestep, with_outputs=False)[0]

    def update_with_outputs(self, batches: Mapping[str, Any], timestep: int
                            ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, np.ndarray]]]:
        """``update`` and, per trained module, the per-row outputs its learner left (e.g. TD errors)."""
        return self._update(batches, timestep, with_outputs=True)

    def _update(self, batches: Mapping[str, Any], timestep: int, with_outputs: bool
                ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, np.ndarray]]]:
        if isinstance(batches, (bytes, bytearray, memoryview)):
            raise TypeError("MultiLearner.update takes {module_id: batch}, each batch its own codec frame "
                            "(the codec encodes chunks only at the top level), not one frame for all")
        if not isinstance(batches, Mapping):
            raise TypeError(f"MultiLearner.update takes {{module_id: batch}} (modules: {self.module_ids}), got "
                            f"{type(batches).__name__}; a single-module batch goes to MultiLearner.learner(id).update")
        self._check_known(batches, "update() batches")
        # frames decoded here, so an empty one counts as no batch (the learners take either form)
        batches = {mid: decode(b) if isinstance(b, (bytes, bytearray, memoryview)) else b for mid, b in batches.items()}
        given = sorted(mid for mid, batch in batches.items() if not _empty(batch))
        to_train = [mid for mid in given if mid in self._trainable]
        dropped = len(given) - len(to_train)
        self._check_same_on_every_rank(to_train)
        stats: dict[str, dict[str, float]] = {}
        outputs: dict[str, dict[str, np.ndarray]] = {}
        for mid in to_train:
            learner = self._learners[mid]
            stats[mid] = learner.update(batches[mid], timestep)
            if with_outputs:
                outputs[mid] = learner.last_outputs
        if dropped:
            self.num_frozen_batches_dropped += dropped
            log.debug("dropped %d batch(es) for frozen modules %s", dropped,
                      [mid for mid in given if mid not in self._trainable])
        stats[ALL_MODULES] = {"num_modules_trained": float(len(to_train)),
                              "num_frozen_batches_dropped": float(dropped)}
        return stats, outputs

    def _check_same_on_every_rank(self, to_train: list[str]) -> None:
        """Data-parallel ranks must step the same modules, or their all-reduces pair up wrongly."""
        first = self._learners[self.module_ids[0]]
        if first.world_size == 1:
            return
        mask = np.array([mid in to_train for mid in self.module_ids], np.float64)
        mean = first.allreduce_mean(mask)
        differ = [mid for mid, m in zip(self.module_ids, mean) if 0 < m < 1]
        if differ:
            raise RuntimeError(f"learner rank {first.rank}: the data-parallel learners got batches for different "
                               f"modules ({differ} on some ranks only; this rank trains {to_train}). Give every "
                               f"rank a non-empty shard of each trainable module's batch")

    # --- weights and state -------------------------------------------------------------------------
    def get_weights(self, inference_only: bool = False, module_ids: Collection[str] | None = None
                    ) -> dict[str, np.ndarray]:
        """``{"<module_id>/<param>": array}`` of every module (or of ``module_ids``), the format of
        ``MultiRLModule.get_state``; ``inference_only`` leaves out what env runners do not use."""
        ids = self.module_ids if module_ids is None else sorted(module_ids)
        self._check_known(ids, "get_weights(module_ids=)")
        return {f"{mid}{SEP}{k}": v for mid in ids
                for k, v in self._learners[mid].get_weights(inference_only=inference_only).items()}

    def set_weights(self, weights: Mapping[str, Any]) -> None:
        """Set the modules named in a flat ``{"<module_id>/<param>": array}`` dict; others keep theirs."""
        per_module: dict[str, dict[str, Any]] = {}
        for key, value in weights.items():
            mid, sep, param = key.partition(SEP)
            if not sep:
                raise ValueError(f"weight {key!r} has no module id: MultiLearner weights are keyed "
                                 f"'<module_id>{SEP}<param>' (modules: {self.module_ids})")
            per_module.setdefault(mid, {})[param] = value
        self._check_known(per_module, "set_weights()")
        for mid in sorted(per_module):
            self._learners[mid].set_weights(per_module[mid])

    def get_state(self) -> dict[str, Any]:
        """Every module's learner state (``Learner.get_state``) keyed by module id, which modules train,
        and the counters: all a checkpoint needs to continue exactly."""
        return {"modules": {mid: self._learners[mid].get_state() for mid in self.module_ids},
                "trainable": sorted(self._trainable),
                "num_frozen_batches_dropped": self.num_frozen_batches_dropped}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a ``get_state`` of a MultiLearner with the same module ids (one module:
        ``set_module_state``)."""
        modules = state["modules"]
        if set(modules) != set(self._learners):
            raise ValueError(f"the state holds modules {sorted(modules)}, this MultiLearner {self.module_ids}: "
                             f"add_module/remove_module to match, or restore single modules with "
                             f"set_module_state(module_id, state['modules'][module_id])")
        for mid in self.module_ids:
            self.set_module_state(mid, modules[mid])
        self.trainable = state["trainable"]
        self.num_frozen_batches_dropped = int(state.get("num_frozen_batches_dropped", 0))

    def get_module_state(self, module_id: str) -> dict[str, Any]:
        """One module's learner state: module, optimizers, algorithm fields, RNGs."""
        return self.learner(module_id).get_state()

    def set_module_state(self, module_id: str, state: Mapping[str, Any]) -> None:
        """Restore one module's learner state, which may come from another MultiLearner's module of
        other id, as long as that learner had the same algorithm, spaces and model config. (As in
        ``Learner.set_state``, this also restores the process's torch RNG from that state.)"""
        learner = self.learner(module_id)
        try:
            learner.set_state(dict(state))
        except (KeyError, RuntimeError, ValueError) as err:
            raise ValueError(f"module {module_id!r} ({type(learner).__name__}, observations "
                             f"{learner.observation_space}, actions {learner.action_space}) cannot take this state: "
                             f"{err}. Restore a state saved from a learner of the same algorithm, spaces and "
                             f"model config") from err

    # --- distributed and stage role ------------------------------------------------------------------
    def setup_distributed(self, master_addr: str, master_port: int) -> None:
        """Join the data-parallel group once: every module's learner uses the process's default group."""
        self._learners[self.module_ids[0]].setup_distributed(master_addr, master_port)

    def leave_distributed(self) -> None:
        """Leave the process's data-parallel group (shared by every module's learner)."""
        self._learners[self.module_ids[0]].leave_distributed()

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["MultiLearner"], Any]) -> Any:
        return fn(self)

    def stop(self) -> None:
        self.close_feed()
        for mid in self.module_ids:  # the first leaves the process group; the rest find it gone
            self._learners[mid].stop()

    # --- checks ------------------------------------------------------------------------------------
    def _check_known(self, module_ids: Collection[str], where: str) -> None:
        unknown = sorted(str(mid) for mid in module_ids if mid not in self._learners)
        if unknown:
            raise KeyError(f"{where}: unknown module id(s) {unknown}; this MultiLearner holds {self.module_ids}")

    def _check_new(self, module_id: Any, learner: Any) -> None:
        if not isinstance(module_id, str) or not module_id or SEP in module_id or "." in module_id \
                or module_id == ALL_MODULES:
            raise ValueError(f"module id {module_id!r}: module ids are non-empty str without '{SEP}' or '.', "
                             f"and not {ALL_MODULES!r}")
        if not isinstance(learner, Learner):
            raise TypeError(f"module {module_id!r}: expected a Learner (e.g. PPOLearner(config, obs_space, "
                            f"act_space)), got {type(learner).__name__}")
        if self._learners:
            first = self._learners[self.module_ids[0]]
            if (learner.rank, learner.world_size) != (first.rank, first.world_size):
                raise ValueError(f"module {module_id!r}: its learner is rank {learner.rank} of {learner.world_size}, "
                                 f"the others rank {first.rank} of {first.world_size}; all modules' learners in "
                                 f"one process share its rank")


def _empty(batch: Any) -> bool:
    """A module given nothing to learn from (no chunks, no rows) is not stepped."""
    if batch is None:
        return True
    if isinstance(batch, Mapping):
        return "rewards" in batch and len(batch["rewards"]) == 0
    return isinstance(batch, (list, tuple)) and len(batch) == 0
