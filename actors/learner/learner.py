"""Learner: the mechanics every algorithm's learner shares; the algorithm supplies the rest.

An algorithm's learner (``PPOLearner``, ``APPOLearner``...) subclasses this and provides:

* ``module_class`` (or ``build_module()``): the trainable module (``self.module``);
* ``build_targets()``: frozen copies it keeps, e.g. a target network (``self.targets``), optional;
* ``build_optimizers()``: named optimizers, each with its own parameters and learning-rate
  schedule (default: one Adam, ``"default"``, over the module at ``settings.lr``);
* ``state_fields``: the names of its own numbers (a KL coefficient, an entropy ``alpha``, update
  counters) that belong to its state;
* ``train_on_batch(batch, timestep)``: what to do with a batch -- typically a loss that is a pure
  function of ``(module, batch, config)``, minimised with ``sgd`` or ``apply_gradients``.

This class does the rest: learning-rate schedules by sampled timestep, the gradient step
(backward, averaging across data-parallel learners with torch.distributed -- gloo on CPU, nccl on
GPU -- clipping, optimizer step), minibatch epochs, and a complete ``get_state``/``set_state``
(``actors.learner.state``: module, targets, every optimizer, the named fields, RNGs) that a checkpoint stores with
``torch.save`` and reads back with ``weights_only=True``. A remote learner of IMPALA or APPO also
receives its own share of the chunk streams (``FedByStreams``, ``actors.learner.feed``).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from actors.callbacks import CallbacksSpec, build_callbacks, call_hook, overrides
from actors.core import LearnerRole
from actors.learner.adam import Adam
from actors.learner.batch import ChunkBatch, batch_slices, check_num_batches, combined_stats, mean_stats, read_stats
from actors.batch_checks import BatchCheck
from actors.learner.feed import FedByStreams
from actors.learner.gradients import FlatGrads, finish_flat, finish_tensors
from actors.learner.state import learner_state, load_learner_state
from actors.modules import ActorCriticModule, RLModule
from actors.modules.normalizers import input_normalizers, return_normalizers
from actors.modules.rl_module import set_autocast
from actors.schedules import piecewise
from protocols import nested
from protocols.codec import decode

log = logging.getLogger("runnel")


def step_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """One step: a fused runnel Adam straight to its kernel (``Adam.fused_step``), any other optimizer's ``step``."""
    if isinstance(optimizer, Adam) and optimizer.defaults.get("fused"):
        optimizer.fused_step()
    else:
        optimizer.step()


@dataclass
class LearnerSettings:
    """What every learner needs beyond its algorithm's own settings."""

    lr: float | list = 3e-4
    """Learning rate of the default optimizer, or a piecewise-linear schedule ``[[timestep, lr], ...]``."""
    grad_clip: float | None = None
    """Clip threshold for gradients (None: no clipping)."""
    grad_clip_by: str = "global_norm"
    """value: each element; norm: each tensor's norm; global_norm: the norm of all of an optimizer's gradients."""
    adam_epsilon: float | None = None
    """Adam's epsilon in every optimizer of the learner; None: the learner class's ``adam_eps``."""
    seed: int | None = None
    """Seeds torch (same on every learner: identical initial weights) and the minibatch shuffling."""
    model_config: dict = field(default_factory=dict)
    """Settings of the module (``actors.modules.ModelConfig``)."""
    module_kwargs: dict = field(default_factory=dict)
    """Options of the algorithm's module class beyond the model config (e.g. DQN's ``dueling``)."""
    callbacks: CallbacksSpec | None = None
    """The user's callbacks; the learner runs ``on_learn_on_batch`` before each update."""
    allow_nonfinite_observations: bool = False
    """Train on batches whose Box observations hold NaN or infinities (a module that handles them);
    by default such a batch is refused, like one with an action outside the action space."""
    precision: str = "float32"
    """"bfloat16": the module's and the targets' forward passes run under bfloat16 autocast (``RLModule.
    autocast_dtype``), their outputs cast back to float32; weights, gradients and optimizer state stay float32."""


@dataclass
class Optimizer:
    """A named optimizer slot: the torch optimizer, the parameters it steps, its lr schedule."""

    optimizer: torch.optim.Optimizer
    params: list[nn.Parameter]
    lr: float | list


class Learner(FedByStreams, LearnerRole):
    module_class: ClassVar[type[RLModule]] = ActorCriticModule
    """The module this learner trains; env runners carry its inference-only copy."""
    state_fields: ClassVar[tuple[str, ...]] = ()
    """Names of the subclass's own numbers (attributes) saved in and restored from the state."""
    fused_adam: ClassVar[bool] = False
    """Build Adam with ``fused=True``: about a quarter faster per step on small networks, which
    matters where updates dominate (DQN, SAC, PPO's many minibatches); rounding differs slightly from the
    default path, so IMPALA and APPO keep the default on a CPU and their seeded runs stay as measured. On a GPU
    every learner's Adam is fused."""
    adam_eps: ClassVar[float] = 1e-5
    """Adam's epsilon where the settings name none (``LearnerSettings.adam_epsilon``): the floor under each
    parameter's gradient scale. Where gradients fade once a task is solved, a small one lets Adam keep stepping
    at the full learning rate on noise."""

    def __init__(self, settings: LearnerSettings, observation_space: gym.Space | None = None,
                 action_space: gym.Space | None = None, *, module_spec: Any = None, device: str = "cpu", rank: int = 0,
                 world_size: int = 1, observation_view: Any = None, learner_connector: Any = None) -> None:
        """``observation_view`` (``actors.connectors.ObservationView``): the runners' connectors build a view
        (frame stacks) that chunks do not store; this learner rebuilds it from each chunk's look-back rows.
        ``learner_connector`` (``actors.connectors.learner.LearnerPipeline``): applied to the chunks of every
        train batch before the batch check and the loss (a stream loader applies it to the batches it cuts)."""
        if module_spec is not None:  # RLlib's spelling: the spaces come with the module spec
            observation_space = observation_space or module_spec.observation_space
            action_space = action_space or module_spec.action_space
        if observation_space is None or action_space is None:
            raise TypeError(f"{type(self).__name__} needs the observation and action spaces: pass "
                            f"observation_space=, action_space= or module_spec=config.get_multi_rl_module_spec(env=...)")
        self.settings = settings
        self.observation_space, self.action_space = observation_space, action_space
        self.observation_view = observation_view
        self.learner_connector = learner_connector
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        if settings.seed is not None:
            torch.manual_seed(settings.seed)  # same seed on every learner: identical initial weights
        self.module: nn.Module = self.build_module().to(self.device)
        self.targets: dict[str, nn.Module] = {}
        for name, target in self.build_targets().items():
            self.targets[name] = target.to(self.device).requires_grad_(False).eval()
        if settings.precision != "float32":
            for m in (self.module, *self.targets.values()):
                set_autocast(m, settings.precision, self.device.type)
        self.optimizers: dict[str, Optimizer] = self.build_optimizers()
        self.flat_grads: dict[str, FlatGrads] = FlatGrads.for_slots({n: s.params for n, s in self.optimizers.items()})
        """Per optimizer slot whose parameters are its own: its gradients as views of one buffer (``gradients``)."""
        self.rng = np.random.default_rng(None if settings.seed is None else settings.seed + rank)
        self.num_updates = 0
        self.timestep = 0
        self.last_outputs: dict[str, np.ndarray] = {}
        """Per-row outputs of the latest update (e.g. TD errors for prioritized replay)."""
        self.callbacks = build_callbacks(settings.callbacks)
        self._learn_hook = overrides(self.callbacks, "on_learn_on_batch")
        self.batch_check = BatchCheck(observation_space, action_space, settings.allow_nonfinite_observations)
        self.num_batches_refused = 0
        self.num_gradient_steps_skipped = 0
        """Gradient steps skipped for a non-finite gradient norm (``_step_slot``), over this learner's life."""

    @property
    def chunk_observation_space(self) -> gym.Space:
        """The observations chunks carry (a view's input; the module's own space without a view)."""
        return self.observation_view.recorded_space if self.observation_view is not None else self.observation_space

    # --- what an algorithm provides ---------------------------------------------------------
    def build_module(self) -> nn.Module:
        return self.module_class(self.observation_space, self.action_space, self.settings.model_config,
                                 **self.settings.module_kwargs)

    def build_targets(self) -> dict[str, nn.Module]:
        return {}

    def module_copy(self) -> nn.Module:
        """A new module holding this learner's current weights: where a target network starts."""
        copy = self.build_module()
        copy.load_state_dict(self.module.state_dict())
        return copy

    def build_optimizers(self) -> dict[str, Optimizer]:
        params = [p for p in self.module.parameters() if p.requires_grad]
        return {"default": Optimizer(self.adam(params, self.settings.lr), params, self.settings.lr)}

    @property
    def adam_epsilon(self) -> float:
        """The epsilon of this learner's Adam optimizers: the settings' ``adam_epsilon``, else the class's ``adam_eps``."""
        epsilon = self.settings.adam_epsilon
        return self.adam_eps if epsilon is None else float(epsilon)

    def adam(self, params: list[nn.Parameter], lr: float | list, **kwargs: Any) -> torch.optim.Adam:
        """Adam over ``params`` starting at the schedule's first learning rate: fused where the class chooses it
        and on a GPU (one kernel a step, and ``sgd`` need not read each step's norm, see ``_step_slot``); else
        torch's multi-tensor ``foreach`` path (on the CPU the same numbers, bit for bit, as its default loop
        over tensors, in a dozen calls per step instead of about ten per tensor). ``torch.optim.Adam`` minus its
        import of ``torch._dynamo`` (``actors.learner.adam``). Its epsilon is the settings' ``adam_epsilon``,
        else the class's ``adam_eps``."""
        kwargs.setdefault("eps", self.adam_epsilon)
        if self.fused_adam or self.device.type == "cuda":
            kwargs["fused"] = True
        else:
            kwargs.setdefault("foreach", True)
        return Adam(params, lr=piecewise(lr, 0), **kwargs)

    def train_on_batch(self, batch: Any, timestep: int) -> dict[str, float]:
        raise NotImplementedError

    def build(self) -> "Learner":
        """RLlib's two-step construction: a runnel learner is complete when constructed."""
        return self

    def update_from_episodes(self, episodes: list[Any], timesteps: dict | None = None, **kwargs: Any
                             ) -> dict[str, dict[str, float]]:
        """RLlib's spelling of ``update``: one update on whole or partial episodes (EpisodeChunks),
        results per module id."""
        return {"default_policy": self.update(list(episodes), self.timestep)}

    # --- updating -----------------------------------------------------------------------------
    def update(self, batch: Any, timestep: int, num_batches: int = 1) -> dict[str, float]:
        """Set every optimizer's learning rate for ``timestep`` (env steps sampled so far), then
        run the algorithm's ``train_on_batch``. Returns its statistics plus the current rates.
        ``batch`` is a list of chunks or a replayed batch of transitions, or a codec frame of either
        (how it crosses to a remote learner). ``num_batches`` > 1: a replayed batch that is that many
        batches of equal size in a row, one update each (``train_on_batches``)."""
        if isinstance(batch, (bytes, bytearray, memoryview)):
            batch = decode(batch)
        if num_batches != 1:
            check_num_batches(batch, num_batches)
        view_problem = None
        if self.observation_view is not None and isinstance(batch, list) and not isinstance(batch, ChunkBatch):
            try:  # a stream's batches were rebuilt by its loader already
                batch = self.observation_view.rebuild(batch)
            except ValueError as err:
                view_problem = str(err)
        if view_problem is None and self.learner_connector is not None and isinstance(batch, list) \
                and not isinstance(batch, ChunkBatch):
            try:  # a stream's batches went through it in their loader
                batch = self.learner_connector(batch)
            except Exception as err:  # a user's piece: its failure costs this batch, not the job
                view_problem = f"the learner connector failed on this batch: {err!r}"
        if view_problem is None and getattr(self.module, "is_recurrent", False) and isinstance(batch, list):
            view_problem = self._state_problem(batch)
        refused = self._refuse(batch, view_problem)
        if refused is not None:
            return refused
        self.timestep = timestep
        rates = {}
        for name, slot in self.optimizers.items():
            lr = piecewise(slot.lr, timestep)
            for group in slot.optimizer.param_groups:
                group["lr"] = lr
            rates["curr_lr" if name == "default" else f"curr_lr_{name}"] = lr
        extra: dict[str, Any] = {}
        if self._learn_hook:
            call_hook(self.callbacks, "on_learn_on_batch", f"learner {self.rank}", policy=self.module, learner=self,
                      train_batch=batch, result=extra)
        stats = self.train_on_batch(batch, timestep) if num_batches == 1 else \
            self.train_on_batches(batch, timestep, num_batches)
        return stats | rates | extra

    def train_on_batches(self, batch: dict[str, Any], timestep: int, num_batches: int) -> dict[str, float]:
        """``num_batches`` updates in a row, one per consecutive equal slice of a replayed batch (the
        off-policy plan hands over as many as the replay ratio allows at once); their statistics as one
        (``combined_stats``), their per-row outputs concatenated. A learner that can do it with less
        work (one tensor conversion, one read of its statistics) overrides this."""
        stats, outputs = [], []
        for part in batch_slices(batch, num_batches):
            stats.append(self.train_on_batch(part, timestep))
            outputs.append(self.last_outputs)
        self.last_outputs = {k: np.concatenate([o[k] for o in outputs]) for k in outputs[0]} \
            if all(outputs) else {}
        return combined_stats(stats)

    def _state_problem(self, chunks: list[Any]) -> str | None:
        """A recurrent module unrolls each chunk from its ``state_in``: what is wrong with them, or None."""
        want = self.module.initial_state(1).shape[1:]
        for c in chunks:
            if c.state_in is None or c.state_in.shape != want:
                got = "none" if c.state_in is None else f"shape {c.state_in.shape}"
                return (f"chunk {c.chunk_index} of episode {c.episode_id} has state_in {got}; this recurrent "
                        f"module unrolls each chunk from a state of shape {want}")
        return None

    def _refuse(self, batch: Any, problem: str | None = None) -> dict[str, float] | None:
        """The statistics of a refused update, or None to train on ``batch``. A batch with a value its
        spaces do not hold (``BatchCheck``: an action out of range, a NaN) is dropped, counted and
        logged rather than trained on: a bug anywhere upstream must not kill a long job, neither by
        an exception in the loss nor by NaN weights. One check per batch, vectorized."""
        if problem is None:
            problem = self.batch_check.problem(batch)
        if self.world_size > 1:  # learners meet at every gradient all-reduce: all drop the batch, or none
            if self.allreduce_mean(np.array([problem is not None], np.float64))[0] > 0 and problem is None:
                problem = "another learner refused its shard of this batch"
        if problem is None:
            return None
        self.num_batches_refused += 1
        self.last_outputs = {}
        log.warning("learner %d refused a train batch (%d so far) and goes on with the next: %s", self.rank,
                    self.num_batches_refused, problem)
        return {"num_batches_refused": 1.0}

    def update_with_outputs(self, batch: Any, timestep: int, num_batches: int = 1
                            ) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """``update`` and the per-row outputs it left in ``last_outputs``, in one call."""
        return self.update(batch, timestep, num_batches), self.last_outputs

    def apply_gradients(self, loss: torch.Tensor, optimizer: str = "default") -> float:
        """Backward, average gradients across learners, clip, step one optimizer. Returns the
        global norm of its gradients before clipping."""
        return self.apply_gradients_to(loss, (optimizer,))[0]

    def apply_gradients_to(self, loss: torch.Tensor, optimizers: tuple[str, ...]) -> list[float]:
        """One backward of ``loss`` for several optimizer slots, then each slot averaged, clipped and
        stepped as ``apply_gradients`` does one; returns each slot's global norm before clipping. For a
        sum of losses that each reach only their own slot's parameters (SAC's critic, actor and
        temperature): one pass through autograd instead of one per loss."""
        self.zero_and_backward(loss, optimizers)
        return [self._step_slot(name) for name in optimizers]

    def zero_and_backward(self, loss: torch.Tensor, optimizers: tuple[str, ...]) -> None:
        """The slots' gradients zeroed (each flat buffer's views kept), then ``loss.backward()`` fills them."""
        for name in optimizers:
            flat = self.flat_grads.get(name)
            if flat is not None:
                flat.zero()
            else:
                self.optimizers[name].optimizer.zero_grad(set_to_none=False)
        loss.backward()

    def _step_slot(self, name: str, defer: bool = False) -> float | torch.Tensor:
        """Clip and step one optimizer slot; its gradients' global norm before clipping. ``defer`` with a fused
        Adam: the norm stays a tensor and is never read here -- the optimizer skips a non-finite step by
        itself (its ``found_inf``), and the caller counts the step once it has read the norm
        (``count_gradient_step``); on a GPU that is one device read per update instead of one per step."""
        slot, flat = self.optimizers[name], self.flat_grads.get(name)
        clip, by = self.settings.grad_clip, self.settings.grad_clip_by
        norm = finish_flat(flat, self.world_size, clip, by) if flat is not None \
            else finish_tensors(slot.params, self.world_size, clip, by)
        if defer and slot.optimizer.defaults.get("fused"):
            slot.optimizer.found_inf = (~torch.isfinite(norm)).float()
            try:
                step_optimizer(slot.optimizer)
            finally:  # a later step of this optimizer (``apply_gradients``) is decided by its own norm
                del slot.optimizer.found_inf
            return norm
        return self.count_gradient_step(float(norm), lambda: step_optimizer(slot.optimizer))

    def count_gradient_step(self, norm: float, step: Callable[[], Any] | None = None) -> float:
        """Count a gradient step by its norm: a finite one as an update (after ``step`` runs it, where it has
        not run yet), a non-finite one as skipped. One infinite or NaN gradient would make every weight and
        the optimizer's moments NaN for good: the runners would then act on NaN (a categorical policy always
        picks action 0) and the job could not recover. So such a step is skipped -- not taken, or taken by a
        fused Adam told it was non-finite, which leaves weights, moments and its step count alone --
        counted and logged; learners of a group skip alike (their gradients were averaged first, so their
        norms agree)."""
        if not math.isfinite(norm):
            self.num_gradient_steps_skipped += 1
            (log.warning if self.num_gradient_steps_skipped == 1 else log.debug)(
                "learner %d skipped a gradient step with a non-finite gradient norm (%s; %d so far): the weights "
                "and optimizer state are left as they were", self.rank, norm, self.num_gradient_steps_skipped)
            return norm
        if step is not None:
            step()
        self.num_updates += 1
        return norm

    def minibatches(self, n: int, minibatch_size: int, num_minibatches: int) -> list[np.ndarray]:
        """Index sets for one epoch. The count is fixed by the caller, not by ``n``, so every
        learner of a data-parallel group takes the same number of steps (and meets at each
        gradient all-reduce) even when their shards differ in size."""
        perm = self.epoch_order(n, minibatch_size, num_minibatches)
        return [perm[i * minibatch_size : (i + 1) * minibatch_size] for i in range(num_minibatches)]

    def epoch_order(self, n: int, minibatch_size: int, num_minibatches: int) -> np.ndarray:
        """One epoch's rows, shuffled, repeated to fill ``num_minibatches`` minibatches when ``n`` is short."""
        perm = self.rng.permutation(n)
        if num_minibatches * minibatch_size > n:
            perm = np.resize(perm, num_minibatches * minibatch_size)
        return perm

    def sgd(self, tensors: dict[str, Any], loss_fn: Callable[[dict[str, Any]], tuple[torch.Tensor, dict]],
            n: int, minibatch_size: int, num_minibatches: int, num_epochs: int,
            optimizer: str = "default") -> dict[str, float]:
        """``num_epochs`` passes of ``num_minibatches`` minibatches of ``tensors`` (``n`` rows each
        leaf), one gradient step per minibatch; returns the mean of ``loss_fn``'s stats. A single
        minibatch covering all rows uses the batch as it is. The statistics stay tensors until the last
        step (on a GPU, reading each would wait for the device once per statistic and minibatch)."""
        whole = num_minibatches == 1 and minibatch_size >= n
        kept: list[dict[str, Any]] = []  # each trained minibatch's statistics, read once at the end
        skipped_at_start = self.num_gradient_steps_skipped
        for _ in range(num_epochs):
            if whole:
                minibatches = [tensors]
            else:  # one gather per tensor and epoch, each minibatch a slice (a view) of it: the same rows as
                # gathering each minibatch's indices, in a quarter of the calls at 4 minibatches
                order = torch.as_tensor(self.epoch_order(n, minibatch_size, num_minibatches), device=self.device)
                shuffled = nested.map_structure(lambda t: t[order], tensors)
                minibatches = [nested.map_structure(lambda t: t[i * minibatch_size : (i + 1) * minibatch_size], shuffled)
                               for i in range(num_minibatches)]
            for mb in minibatches:
                loss, stats = loss_fn(mb)
                self.zero_and_backward(loss, (optimizer,))
                stats["gradients_global_norm"] = self._step_slot(optimizer, defer=True)
                kept.append(stats)
        trained = []
        for raw, stats in zip(kept, read_stats(kept)):
            if isinstance(raw["gradients_global_norm"], torch.Tensor):  # stepped by the optimizer, not counted yet
                self.count_gradient_step(stats["gradients_global_norm"])
            if math.isfinite(stats["gradients_global_norm"]):  # a skipped step's NaN stays out of the means
                trained.append(stats)
        out = mean_stats(trained)
        if self.num_gradient_steps_skipped != skipped_at_start:
            out["num_gradient_steps_skipped"] = float(self.num_gradient_steps_skipped - skipped_at_start)
        return out

    # --- distributed --------------------------------------------------------------------------
    def setup_distributed(self, master_addr: str, master_port: int) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if master_addr in ("127.0.0.1", "localhost"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all learners on this machine
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=self.rank, world_size=self.world_size)

    def leave_distributed(self) -> None:
        """Leave the data-parallel group (if this process is in one). A group that lost a member cannot
        take a replacement: the learner group has every learner leave, then join a new one."""
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def update_input_stats(self, obs: Any) -> None:
        """``model_config normalize_input``: fold a train batch's observations (stacked frames included) into the
        module's running statistics, after the batch's update (which so saw the statistics it was acted with)."""
        normalizers = input_normalizers(self.module)
        if isinstance(self.module, RLModule) and normalizers:
            obs = self.module.split_mask(obs)[0]
        self._fold_in(normalizers, obs)

    def update_return_stats(self, targets: Any) -> None:
        """``model_config normalize_returns``: fold a train batch's value targets into the module's running
        statistics, before the batch's update (whose value loss so standardises them, as Sample Factory's does)."""
        self._fold_in(return_normalizers(self.module), torch.as_tensor(targets).reshape(-1))

    def _fold_in(self, normalizers: list, rows: Any) -> None:
        # data-parallel learners pool their batches' moments, so all keep the same statistics
        for norm in normalizers:
            norm.fold_in(rows, self.allreduce_mean if self.world_size > 1 else None, self.world_size)

    def allreduce_mean(self, values: np.ndarray) -> np.ndarray:
        """Average numbers across learners (e.g. the KL that adapts the KL coefficient)."""
        if self.world_size == 1:
            return values
        t = torch.as_tensor(np.asarray(values, np.float64))
        dist.all_reduce(t)
        return (t / self.world_size).numpy()

    # --- weights and state --------------------------------------------------------------------
    def get_weights(self, inference_only: bool = False) -> dict[str, np.ndarray]:
        return self.module.get_state(inference_only=inference_only)

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        self.module.set_state(weights)

    def get_state(self) -> dict[str, Any]:
        """Everything to continue exactly: tensors, optimizer states, named fields, counters, RNGs."""
        return learner_state(self)

    def set_state(self, state: dict[str, Any]) -> None:
        load_learner_state(self, state)

    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["Learner"], Any]) -> Any:
        return fn(self)

    def stop(self) -> None:
        self.close_feed()
        self.leave_distributed()

