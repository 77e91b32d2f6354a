"""ServerPolicy: the policy copy a policy server acts with -- its weights, the numpy export that
local clients download (and remote inference may run), and the batched forward pass.

Separate from the act batching (the server thread's alone) because the driver's thread changes
this state too (``set_weights``): the module, its export and the weights version are read and
replaced under ``lock``.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from actors.env.actions import EnvActions
from actors.env.settings import EnvRunnerSettings, module_class_of
from actors.env.exploration import make_exploration
from actors.inference.forward import PolicyForward
from actors.modules import ModuleSpec
from protocols.numpy_policy import NumpyPolicy


class ServerPolicy:
    def __init__(self, settings: EnvRunnerSettings, worker_index: int, inference_backend: str,
                 spec: ModuleSpec | None = None) -> None:
        """Builds the module (from ``spec``, one module of a multi-agent run, else from ``settings``);
        ``refresh_export`` makes the first export."""
        self.s = settings
        self.inference_backend = inference_backend
        if spec is None:
            self.observation_space, self.action_space = settings.observation_space, settings.action_space
            self.module = module_class_of(settings)(self.observation_space, self.action_space, settings.model_config,
                                                    inference_only=True, **settings.module_kwargs)
        else:
            self.observation_space, self.action_space = spec.observation_space, spec.action_space
            self.module = spec.build(inference_only=True)
        self.torch_forward = PolicyForward(self.module)  # the torch backend's forward pass, as every acting stage's
        self.exploration = make_exploration(settings.exploration_config, self.module.dist_spec)
        self.env_actions = EnvActions(self.action_space, settings.normalize_actions, settings.clip_actions)
        self.box_actions = self.env_actions.box
        self.weights_version = 0
        self.num_env_steps_served = 0
        self.timestep_offset = 0
        self.lock = threading.Lock()  # the module, its export and weights version
        self.export_error = ""
        self._rng = np.random.default_rng(None if settings.seed is None else settings.seed + 7919 * worker_index)
        self._desc: dict | None = None  # the exported policy (local clients; numpy inference)
        self._numpy: NumpyPolicy | None = None

    @property
    def state_shape(self) -> tuple[int, int] | None:
        """A recurrent module's state ``(2, cell)`` (hidden, cell), which its clients carry; None when it has none."""
        lstm = getattr(self.module, "lstm", None)
        return None if lstm is None else (2, int(lstm.hidden_size))

    @property
    def seq_len(self) -> int | None:
        """A recurrent module's ``max_seq_len`` (the longest chunk a learner unrolls); None when it has no state."""
        return None if self.state_shape is None else int(self.module.config.max_seq_len)

    @property
    def timestep(self) -> int:
        return self.num_env_steps_served + self.timestep_offset

    def set_weights(self, weights: dict[str, Any], weights_version: int, timestep: int | None) -> None:
        with self.lock:
            self.module.set_state(weights)
            self.weights_version = weights_version
            if timestep is not None:
                self.timestep_offset = max(0, timestep - self.num_env_steps_served)
            self.refresh_export()

    def get_weights(self) -> dict[str, Any]:
        with self.lock:
            return self.module.get_state()

    def exported(self) -> dict | None:
        """The exported policy, or None when it has none (``export_error`` says why)."""
        with self.lock:
            return self._desc

    def action_mapping(self) -> dict:
        space = self.action_space
        if not self.box_actions:
            return {"kind": "cast", "dtype": str(np.dtype(space.dtype))}
        return {"kind": "box", "low": space.low.astype(np.float64).ravel().tolist(),
                "high": space.high.astype(np.float64).ravel().tolist(), "normalize": bool(self.s.normalize_actions),
                "clip": bool(self.s.clip_actions), "dtype": str(np.dtype(space.dtype))}

    def to_module_action(self, action: np.ndarray) -> np.ndarray:
        """An action the client took, in env units -> the module's (Box: [-1, 1] when normalized)."""
        if not (self.box_actions and self.s.normalize_actions):
            return action
        low, high = self.action_space.low, self.action_space.high
        return (2.0 * (action - low) / (high - low) - 1.0).astype(np.float32)

    def refresh_export(self) -> None:
        """Export the current weights and exploration (after every weights update; under the module lock)."""
        from actors.modules.export import export_policy

        try:
            self._desc = export_policy(self.module, self.exploration, self.timestep)
        except ValueError as err:
            self._desc, self.export_error = None, str(err)
            if self.inference_backend == "numpy":
                raise ValueError(f"inference_backend='numpy': {err}") from None
        backend = self.inference_backend
        if backend == "auto" and self._desc is not None:  # torch convolves images faster than numpy can
            backend = "torch" if any(op.get("op") == "conv2d" for op in self._desc["layers"]) else "numpy"
        # a recurrent policy acts for nobody here: its clients act locally, with their own states
        usable = self._desc is not None and backend == "numpy" and self.state_shape is None
        self._numpy = NumpyPolicy(self._desc) if usable else None

    def forward(self, obs: Any, explore: list[bool], given: dict[int, np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """``compute`` under the module lock, with the weights version that computed it."""
        with self.lock:
            module_actions, logp, dists = self.compute(obs, explore, given)
            version = self.weights_version
        return module_actions, logp, dists, version

    def compute(self, obs: Any, explore: list[bool], given: dict[int, np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A batch of observations -> (module actions, their log-probabilities, distribution inputs)."""
        policy = self._numpy
        if policy is None:
            return self._compute_torch(obs, explore, given)
        inputs = policy.dist_inputs(obs)
        if not given and all(explore):
            actions, logp = policy.choose_with_logp(inputs, True, self._rng)
            return actions, logp, inputs
        actions = policy.choose(inputs, True, self._rng)
        if not all(explore):
            keep = np.asarray(explore).reshape(len(explore), *([1] * (actions.ndim - 1)))
            actions = np.where(keep, actions, policy.greedy(inputs))
        for i, action in given.items():
            actions[i] = action
        return actions, policy.logp(inputs, actions), inputs

    @torch.inference_mode()
    def forward_recurrent(self, obs: Any, explore: list[bool], states: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
        """A recurrent module's step for rows acting from ``states`` ``[n, 2, cell]`` (a multi-agent server keeps
        each agent's): (module actions, log-probabilities, distribution inputs, weights version, next states),
        under the module lock."""
        with self.lock:
            dist_inputs, state_out = self.torch_forward.recurrent_dist_inputs(obs, states, True)
            dist = self.module.dist_spec.build(dist_inputs)
            actions = self.exploration.actions(dist, True, self.timestep)
            if not all(explore):
                keep = torch.tensor(explore).view(len(explore), *([1] * (actions.dim() - 1)))
                actions = torch.where(keep, actions, dist.deterministic())
            return actions.numpy(), dist.logp(actions).numpy(), dist_inputs.numpy(), self.weights_version, state_out

    @torch.inference_mode()
    def _compute_torch(self, obs: Any, explore: list[bool], given: dict[int, np.ndarray]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(explore)
        dist_inputs = self.torch_forward.dist_inputs(obs, True)
        dist = self.module.dist_spec.build(dist_inputs)
        actions = self.exploration.actions(dist, True, self.timestep)
        if not all(explore):
            keep = torch.tensor(explore).view(n, *([1] * (actions.dim() - 1)))
            actions = torch.where(keep, actions, dist.deterministic())
        for i, action in given.items():
            actions[i] = torch.as_tensor(action, dtype=actions.dtype)
        return actions.numpy(), dist.logp(actions).numpy(), dist_inputs.numpy()
