"""SubEnvStates: a recurrent module's state per sub-env of a runner, zeros where an episode starts.

Whichever way a runner acts -- its own module (``actors.env.acting.LocalActing``) or through a central server
(``actors.inference.client.RemoteActing``, which sends them with each request) -- it keeps its sub-envs' states
itself, and this is that record. numpy only: a thin runner imports no torch.
"""
from __future__ import annotations

from typing import Any

import numpy as np


class SubEnvStates:
    def __init__(self, cell: int) -> None:
        self.cell = cell
        self.value: np.ndarray | None = None
        """``[n, 2, cell]`` float32 (hidden and cell state per sub-env), once the runner acted; None before."""

    def current(self, n: int) -> np.ndarray:
        """The states the next step acts from (zeros before the first step, or for another number of sub-envs)."""
        if self.value is None or len(self.value) != n:
            self.value = np.zeros((n, 2, self.cell), np.float32)
        return self.value

    def reset(self, rows: Any = None) -> None:
        """Episodes start in these sub-envs (None: all): their states start afresh."""
        if self.value is not None:
            if rows is None:
                self.value = None
            else:
                self.value[rows] = 0.0


class KeepsSubEnvStates:
    """What a runner's acting piece offers its sampler for a recurrent module (``states``, ``reset_states``),
    over the ``SubEnvStates`` it keeps as ``_states``."""

    _states: SubEnvStates

    @property
    def state(self) -> np.ndarray | None:
        """The state per sub-env ``[n, 2, cell]`` after the last step (None before the first)."""
        return self._states.value

    @state.setter
    def state(self, value: np.ndarray | None) -> None:
        self._states.value = value

    def states(self, n: int) -> np.ndarray:
        """The state per sub-env ``[n, 2, cell]`` the next step acts from (zeros before the first step)."""
        return self._states.current(n)

    def reset_states(self, rows: Any = None) -> None:
        """Episodes start in these sub-envs (None: all): their states start afresh."""
        self._states.reset(rows)
