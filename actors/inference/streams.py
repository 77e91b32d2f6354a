"""RunnerStreams: each env runner's exploration, kept on the inference server that acts for it.

A runner acting locally explores with its own ``Exploration`` piece (its schedule state, an OU
process per sub-env...) and draws noise from its own process's torch generator, seeded with
``seed + 7919 * worker_index`` and then advanced by building its module. The server keeps the same
per runner: an ``Exploration`` piece, and -- in a seeded run -- a CPU generator state that starts
where that runner's own would (the server seeds, builds a throwaway module, and keeps the state),
swapped in around that runner's exploration call. The server answers each runner's rows with the
same draws, in the same order, as the runner would have made itself: with the same seed and
weights, central and local inference take the same actions. Unseeded, every runner draws from the
server's one generator.

Unseeded, with a built-in exploration piece that keeps no state of its own (``STATELESS``), one piece
chooses for a whole batch at once (``shared``), at the batch's oldest ``timestep``: one sampling call
per forward pass instead of one per runner, and the same schedule within a fraction of an iteration.

A runner that would act with numpy (``EnvRunnerSettings.numpy_policy``, ``actors.env.numpy_acting``) draws
from a numpy generator instead: the server keeps one per runner, seeded as that runner seeds its own, and
chooses with the same ``NumpyChooser`` -- so central and local inference still take the same actions
(up to float rounding of the distribution inputs, which torch computes here and numpy there).

The swap changes process-wide state, so ``DRAWING`` serialises it across every server of a process (two
in-process servers, ``num_env_runners=0``, serve from two threads). Another thread of the same process
that draws from torch's generator meanwhile (an in-process SAC learner's ``rsample``) still interleaves
with a swap: both get valid random numbers, but a seeded run is then not repeatable bit for bit. Servers
hosted as actors have their process to themselves.

A recreated server starts each runner's noise afresh from its seed (exploration schedules follow
the runner's ``timestep``, which every request carries, so they are unaffected).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

from actors.env.exploration import EpsilonGreedy, Exploration, GaussianNoise, SoftQ, StochasticSampling
from actors.env.numpy_acting import NumpyChooser, acting_rng, rng_state, set_rng_state

STATELESS = (StochasticSampling, EpsilonGreedy, SoftQ, GaussianNoise)
"""Built-in pieces whose choice depends only on the distribution, the timestep and the generator
(``OrnsteinUhlenbeckNoise`` keeps a process per row; a user's piece may keep anything)."""


DRAWING = threading.Lock()
"""Held while a runner's generator state is swapped into torch's process-wide CPU generator."""


class RunnerStream:
    __slots__ = ("exploration", "rng")

    def __init__(self, exploration: Exploration, rng: torch.Tensor | np.random.Generator | None) -> None:
        self.exploration, self.rng = exploration, rng

    @contextlib.contextmanager
    def drawing(self) -> Iterator[None]:
        """Within: torch's CPU generator is this runner's (seeded runs); after, the server's again."""
        if self.rng is None or isinstance(self.rng, np.random.Generator):
            yield
            return
        with DRAWING:
            outer = torch.get_rng_state()
            torch.set_rng_state(self.rng)
            try:
                yield
            finally:
                self.rng = torch.get_rng_state()
                torch.set_rng_state(outer)


class RunnerStreams:
    def __init__(self, make_exploration: Callable[[], Exploration], build_module: Callable[[], Any],
                 seed: int | None, chooser: NumpyChooser | None = None) -> None:
        """``build_module()`` builds the module exactly as a runner does (the draws it takes advance a
        runner's generator before its first action). ``chooser``: the runners would act with numpy; their
        draws come from numpy generators through it."""
        self.make_exploration, self.build_module, self.seed = make_exploration, build_module, seed
        self.chooser = chooser
        self.streams: dict[int, RunnerStream] = {}
        piece = make_exploration()
        self.shared: Exploration | None = piece if seed is None and type(piece) in STATELESS else None
        """The one piece that chooses for whole batches, or None: each runner's own, per request."""
        self.shared_rng = np.random.default_rng() if chooser is not None and seed is None else None
        """Unseeded numpy draws: one generator (and one choice) for whole batches."""

    @property
    def batch_wide(self) -> bool:
        """One choice for a whole batch, at its oldest timestep (no runner needs draws of its own)."""
        return self.shared_rng is not None if self.chooser is not None else self.shared is not None

    def choose(self, forward: Any, runner: int | None, inputs: torch.Tensor, explore: bool, timestep: int
               ) -> tuple[np.ndarray, np.ndarray]:
        """(actions, log-probabilities) for ``inputs``, drawn as runner ``runner`` draws (None: the batch-wide
        choice, ``batch_wide``)."""
        if self.chooser is not None:
            rng = self.shared_rng if runner is None else self.of(runner).rng
            return self.chooser.choose(inputs.numpy(), explore, timestep, rng)
        if runner is None:
            actions, logp = forward.choose(inputs, self.shared, explore, timestep)
            return actions.numpy(), logp.numpy()
        stream = self.of(runner)
        with stream.drawing():
            actions, logp = forward.choose(inputs, stream.exploration, explore, timestep)
        return actions.numpy(), logp.numpy()

    def of(self, runner: int) -> RunnerStream:
        stream = self.streams.get(runner)
        if stream is None:
            stream = self.streams[runner] = RunnerStream(self.make_exploration(), self._first_state(runner))
        return stream

    def _first_state(self, runner: int) -> torch.Tensor | np.random.Generator | None:
        """The generator state runner ``runner`` starts sampling from, as ``actors.env.process`` seeds it (or as
        ``actors.env.numpy_acting`` does)."""
        if self.seed is None:
            return None
        if self.chooser is not None:
            return acting_rng(self.seed, runner)
        with DRAWING, torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(self.seed + 7919 * runner)  # CPU only, as a runner's draws are
            self.build_module()
            return torch.get_rng_state()

    def get_state(self) -> dict[str, Any]:
        return {str(i): {"exploration": s.exploration.get_state(), "rng": _rng_state(s.rng)} for i, s in self.streams.items()}

    def set_state(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            stream = self.of(int(key))
            stream.exploration.set_state(value.get("exploration", {}))
            saved = value.get("rng")
            if isinstance(saved, dict) and isinstance(stream.rng, np.random.Generator):
                set_rng_state(stream.rng, saved)
            elif saved is not None and not isinstance(saved, dict) and not isinstance(stream.rng, np.random.Generator):
                stream.rng = torch.as_tensor(np.array(saved, np.uint8))


def _rng_state(rng: Any) -> Any:
    if rng is None:
        return None
    return rng_state(rng) if isinstance(rng, np.random.Generator) else rng.numpy().copy()
