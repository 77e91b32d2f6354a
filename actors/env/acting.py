"""How an env runner gets its actions: the pluggable acting piece of its sampling loop.

``FragmentSampler`` calls ``act(obs, explore, timestep)`` once per step and gets (module actions,
their log-probabilities, the distribution inputs, the weights version that acted) -- what the
chunks carry. Two pieces offer it:

* ``LocalActing`` (here): the runner's own inference-only module and exploration piece, one batched
  forward pass per step in this process (RLlib's way, and runnel's default);
* ``actors.env.numpy_acting.NumpyActing``: the same policy exported to numpy (built-in modules and
  exploration only; chosen by the driver, which sends the export in ``settings.numpy_policy``): no torch
  in the runner's process, and a fraction of torch's per-call cost for small networks;
* ``actors.inference.client.RemoteActing``: central inference -- the step's observations go to an
  inference server, which batches them with other runners' and answers; that runner imports no torch.

``make_acting`` picks by ``settings.inference`` and imports only what the piece needs.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from actors.inference.recurrent_states import KeepsSubEnvStates, SubEnvStates
from protocols.nested import first_leaf as nested_first


class LocalActing(KeepsSubEnvStates):
    holds_weights = True

    def __init__(self, settings: Any, observation_space: Any, action_space: Any) -> None:
        import torch

        from actors.env.exploration import make_exploration
        from actors.env.settings import module_class_of
        from actors.inference.forward import PolicyForward

        self._torch = torch
        module = module_class_of(settings)(observation_space, action_space, settings.model_config,
                                           inference_only=True, **settings.module_kwargs)
        self.forward = PolicyForward(module, precision=settings.precision)
        self.module = self.forward.module
        self.exploration = make_exploration(settings.exploration_config, module.dist_spec)
        self.weights_version = 0
        self.recurrent = bool(getattr(module, "is_recurrent", False))
        """The module carries a state from step to step (``model_config`` ``use_lstm``)."""
        self._states = SubEnvStates(module.config.lstm_cell_size if self.recurrent else 0)
        self.max_seq_len = module.config.max_seq_len if self.recurrent else None
        """A recurrent module's longest sequence: the runner cuts chunks to it."""

    def session(self) -> Any:
        """Held around a sampling run (and the chunk cut, whose postprocessing hooks run in it too)."""
        return self._torch.inference_mode()

    def act(self, obs: Any, explore: bool, timestep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        if self.recurrent:
            inputs, self.state = self.forward.recurrent_dist_inputs(obs, self.states(len(nested_first(obs))), explore)
            actions, logp = self.forward.choose(inputs, self.exploration, explore, timestep)
            return actions.numpy(), logp.numpy(), inputs.numpy(), self.weights_version
        inputs = self.forward.dist_inputs(obs, explore)
        actions, logp = self.forward.choose(inputs, self.exploration, explore, timestep)
        return actions.numpy(), logp.numpy(), inputs.numpy(), self.weights_version

    def set_weights(self, weights: dict[str, Any], weights_version: int) -> None:
        self.forward.set_state(weights)
        self.weights_version = weights_version

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.module.get_state()

    def get_state(self) -> dict[str, Any]:
        """Exploration, this process's torch generator and a recurrent module's states: a restored runner
        draws and remembers on where it was."""
        return {"exploration": self.exploration.get_state(), "torch_rng": self._torch.get_rng_state().numpy(),
                "recurrent_state": None if self.state is None else self.state.copy()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.exploration.set_state(state.get("exploration", {}))
        if self.recurrent and state.get("recurrent_state") is not None:
            self.state = np.array(state["recurrent_state"], np.float32)
        if state.get("torch_rng") is not None:
            self._torch.set_rng_state(self._torch.as_tensor(np.array(state["torch_rng"], np.uint8)))  # a writable copy

    def log_metrics(self, metrics: Any) -> None:
        """Nothing beyond what the runner logs itself."""

    def close(self) -> None:
        pass


def make_acting(settings: Any, observation_space: Any, action_space: Any, worker_index: int) -> Any:
    """The runner's acting piece: central inference when ``settings.inference`` says so, else its own module
    (in numpy when the driver exported it)."""
    if settings.inference is not None:
        from actors.inference.client import RemoteActing

        return RemoteActing(settings.inference, worker_index)
    if settings.numpy_policy is not None:
        from actors.env.numpy_acting import NumpyActing

        return NumpyActing(settings.numpy_policy, settings.seed, worker_index)
    return LocalActing(settings, observation_space, action_space)
