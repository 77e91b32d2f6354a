"""NumpyActing: an env runner's acting piece that evaluates its policy with numpy, never importing torch.

For the small networks env runners usually act with (CartPole's 64x64 MLP, a DQN head), one torch
forward pass and a ``torch.distributions`` draw cost their per-call dispatch, not their arithmetic:
about 120 us per vector step of 32 rows, where the same layers and draw in numpy take about 45 us.
And a runner process that never imports torch starts a couple of seconds sooner and holds a few
hundred MB less. So when the module and exploration are built-ins the numpy export covers
(``actors.modules.export.acting_plan``), the driver sends each runner that export -- its arrays
named by the state-dict entries they come from -- and the runner acts with
``protocols.numpy_policy.NumpyPolicy``, refilling the arrays from every weights update. A recurrent policy's
LSTM steps in numpy too, each sub-env's state kept here (``KeepsSubEnvStates``, as the torch piece keeps them);
an action mask in the observations is applied as the torch module applies it.

``NumpyChooser`` applies the exploration rule at a timestep (random warm-up, epsilon schedule,
softmax temperature) and draws from a numpy generator; the central inference server uses the same
chooser for a runner that would act this way, so both draw the same actions from the same seed.
Chosen by ``.inference(runner_backend=...)`` (``pipeline.groups.env_runners.acting_backend``).
"""
from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from actors.inference.recurrent_states import KeepsSubEnvStates, SubEnvStates
from actors.schedules import piecewise
from protocols.nested import first_leaf as nested_first
from protocols.numpy_policy import NumpyPolicy

SEED_TAG = 0x5EED_AC75
"""Mixed into an acting generator's seed, so its draws never repeat an env's (gymnasium seeds envs from
plain ints, and runners' env seeds are ints near the run's seed)."""


def acting_rng(seed: int | None, worker_index: int) -> np.random.Generator:
    """Runner ``worker_index``'s generator for action draws (fresh entropy when the run is unseeded)."""
    return np.random.default_rng(None if seed is None else [int(seed), int(worker_index), SEED_TAG])


def rng_state(rng: np.random.Generator) -> dict[str, Any]:
    """A generator's state as plain data the checkpoint codec carries (its 128-bit integers as text)."""
    return _ints_to_text(rng.bit_generator.state)


def set_rng_state(rng: np.random.Generator, state: dict[str, Any]) -> None:
    rng.bit_generator.state = _text_to_ints(state)


def _ints_to_text(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _ints_to_text(v) for k, v in value.items()}
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _text_to_ints(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (int(v) if k != "bit_generator" and isinstance(v, str) else _text_to_ints(v)) for k, v in value.items()}
    return value


def categorical_draw(logits: np.ndarray, explore: bool, uniform: bool, rng: np.random.Generator
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Actions from categorical logits ``[N, K]`` and their log-probabilities: sampled (inverse CDF, one uniform
    a row), uniformly random (``uniform``: a warm-up; the log-probabilities are still the policy's), or the
    most likely (``explore`` False). A dozen numpy calls on the whole batch: a few rows cost microseconds."""
    z = logits - logits.max(axis=1, keepdims=True)
    weights = np.exp(z)
    total = weights.sum(axis=1)
    n, k = logits.shape
    if not explore:
        actions = z.argmax(axis=1)
    elif uniform:
        actions = rng.integers(0, k, n)
    elif k == 2:  # the same draw as below in fewer calls: the count of cumulative weights <= target, capped at 1
        actions = (weights[:, 0] <= rng.random(n) * total).astype(np.int64)
    else:
        targets = rng.random(n) * total
        actions = np.minimum((np.cumsum(weights, axis=1) <= targets[:, None]).sum(axis=1), k - 1)
    logp = z[np.arange(n), actions] - np.log(total)
    return actions.astype(np.int64, copy=False), logp.astype(np.float32, copy=False)


class NumpyChooser:
    """Actions and their log-probabilities from distribution inputs, by an exploration rule at a timestep."""

    def __init__(self, policy: NumpyPolicy, rule: dict[str, Any]) -> None:
        self.policy, self.rule = policy, rule
        self.kind = rule["type"]
        self._schedule = (sorted((int(t), float(e)) for t, e in rule["schedule"]) if self.kind == "epsilon_greedy"
                          else None)

    def epsilon(self, timestep: int) -> float:
        """An epsilon-greedy rule's epsilon at ``timestep`` (as ``EpsilonGreedy.epsilon``); 0 for other rules."""
        return piecewise(self._schedule, timestep) if self._schedule is not None else 0.0

    def get_state(self) -> dict[str, Any]:
        return {}  # the rule depends on the timestep only

    def choose(self, inputs: np.ndarray, explore: bool, timestep: int, rng: np.random.Generator
               ) -> tuple[np.ndarray, np.ndarray]:
        policy = self.policy
        if self.kind == "sample":
            policy.exploration = "random" if timestep < self.rule["random_timesteps"] else "sample"
        elif self.kind == "epsilon_greedy":
            policy.exploration, policy.epsilon = "epsilon_greedy", self.epsilon(timestep)
        else:
            policy.exploration, policy.temperature = "softmax", self.rule["temperature"]
        return policy.choose_with_logp(inputs, explore, rng)


class NumpyActing(KeepsSubEnvStates):
    module = None  # no torch module in this process
    holds_weights = True

    def __init__(self, plan: dict[str, Any], seed: int | None, worker_index: int) -> None:
        self.template = plan["policy"]
        """The exported policy whose arrays each weights update replaces (found by their ``keys``)."""
        self.policy = NumpyPolicy(self.template)
        self.recurrent = self.policy.recurrent
        """The policy carries a state from step to step (its ``lstm`` op): the sub-envs' states are kept here."""
        self._states = SubEnvStates(self.policy.initial_state(1).shape[-1] if self.recurrent else 0)
        self.max_seq_len = plan.get("max_seq_len") if self.recurrent else None
        """A recurrent module's longest sequence: the runner cuts chunks to it."""
        self.chooser = NumpyChooser(self.policy, plan["exploration"])
        self.exploration = self.chooser
        """What ``runner.exploration`` shows: the rule (``rule``, ``epsilon(timestep)``), in place of a torch piece."""
        self.rng = acting_rng(seed, worker_index)
        self.weights: dict[str, np.ndarray] = _arrays(self.template)
        self.keys = sorted(self.weights)
        """The state-dict names the policy reads (the same for every update: read once here)."""
        """The weights acted with (the export's own until the driver sends the learner's, at ``build()``)."""
        self.weights_version = 0

    def session(self) -> Any:
        return contextlib.nullcontext()

    def act(self, obs: Any, explore: bool, timestep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        if self.recurrent:
            inputs, self.state = self.policy.step(obs, self.states(len(nested_first(obs))))
        else:
            inputs = self.policy.dist_inputs(obs)
        actions, logp = self.chooser.choose(inputs, explore, timestep, self.rng)
        return actions, logp, inputs, self.weights_version

    def set_weights(self, weights: dict[str, Any], weights_version: int) -> None:
        missing = [k for k in self.keys if k not in weights]
        if missing:
            raise ValueError(f"weights lack {missing[:5]}: were they saved from another model config?")
        template = _refilled(self.template, weights)
        policy = NumpyPolicy(template)  # checks every shape again: a mismatch raises here, not mid-step
        self.template, self.policy, self.chooser.policy = template, policy, policy
        self.weights = dict(weights)
        self.weights_version = weights_version

    def get_weights(self) -> dict[str, np.ndarray]:
        return self.weights

    def get_state(self) -> dict[str, Any]:
        """The generator the draws come from and a recurrent policy's states: a restored runner draws and
        remembers on where it was."""
        return {"exploration": {}, "numpy_rng": rng_state(self.rng),
                "recurrent_state": None if self.state is None else self.state.copy()}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("numpy_rng") is not None:
            set_rng_state(self.rng, state["numpy_rng"])
        if self.recurrent and state.get("recurrent_state") is not None:
            self.state = np.array(state["recurrent_state"], np.float32)

    def log_metrics(self, metrics: Any) -> None:
        """Nothing beyond what the runner logs itself."""

    def close(self) -> None:
        pass


def _arrays(desc: Any) -> dict[str, np.ndarray]:
    """A keyed description's arrays by their state-dict names."""
    out: dict[str, np.ndarray] = {}
    if isinstance(desc, dict):
        out.update({key: desc[field] for field, key in (desc.get("keys") or {}).items()})
        for v in desc.values():
            if isinstance(v, (dict, list)):
                out.update(_arrays(v))
    elif isinstance(desc, list):
        for v in desc:
            out.update(_arrays(v))
    return out


def _refilled(desc: Any, weights: dict[str, Any]) -> Any:
    """A keyed description with its arrays replaced by ``weights``' entries of the same names, as float32 (a new
    structure: the one in use stays whole if the new one is refused)."""
    if isinstance(desc, dict):
        out = {k: _refilled(v, weights) if isinstance(v, (dict, list)) else v for k, v in desc.items()}
        for field, key in (desc.get("keys") or {}).items():
            out[field] = np.ascontiguousarray(weights[key], dtype=np.float32)
        return out
    if isinstance(desc, list):
        return [_refilled(v, weights) for v in desc]
    return desc
