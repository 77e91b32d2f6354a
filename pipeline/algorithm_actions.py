"""Computing actions in the driver: ``algo.compute_single_action(obs)`` and ``algo.compute_actions(obs)``.

The driver keeps its own copy of the policy module, refreshed from the learner only when the
weights have moved on; it is separate from ``Algorithm`` because none of training needs it (it
serves users, ``runnel evaluate``, native-model export and off-policy estimates).
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

from actors.connectors.module_to_env import ModuleToEnvPipeline
from actors.env.actions import EnvActions
from actors.env.exploration import make_exploration
from actors.modules import ModuleSpec, RLModule, to_torch
from pipeline.config.base import AlgorithmConfig, ConfigError
from pipeline.groups.learner_group import LearnerGroup
from protocols import nested


class DriverPolicy:
    """The driver's copy of the module (``algo.module``), its exploration and the env-action mapping."""

    def __init__(self, module: RLModule, exploration: Any, env_actions: EnvActions, observation_space: Any) -> None:
        self.module = module
        self.exploration = exploration
        self.env_actions = env_actions
        self.observation_space = observation_space
        self.module_version = -1  # weights version self.module holds (refreshed by current_module)
        self.module_to_env: ModuleToEnvPipeline | None = None
        """The driver's own copy of the run's module-to-env pipeline (``module_to_env_connector``), which the
        actions computed here pass through as a runner's do; its pieces' state is this copy's own (a runner's
        state stays in that runner). None without one."""

    @classmethod
    def build(cls, module_spec: ModuleSpec, config: AlgorithmConfig, observation_space: Any,
              action_space: Any) -> "DriverPolicy":
        """The module ``module_spec`` describes, with the env-action mapping and exploration ``config``
        asks for; what they reject is a ConfigError, raised here in the driver with the space named,
        not later inside an actor."""
        try:
            module = module_spec.build()
        except ValueError as err:
            raise ConfigError(str(err)) from err
        env_actions = EnvActions(action_space, config.normalize_actions, config.clip_actions)
        try:
            exploration = make_exploration(config.exploration_settings(), module.dist_spec)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        return cls(module, exploration, env_actions, observation_space)

    def current_module(self, learner_group: LearnerGroup) -> RLModule:
        """The module with the learner's latest weights (fetched only when their version moved on)."""
        if self.module_version != learner_group.weights_version:
            self.module.set_state(learner_group.get_weights())
            self.module_version = learner_group.weights_version
        return self.module

    def compute_actions(self, learner_group: LearnerGroup, obs: Any, explore: bool, timestep: int) -> np.ndarray:
        """A batch of observations -> a batch of env actions; ``timestep`` drives exploration schedules."""
        module = self.current_module(learner_group)
        obs = as_arrays(obs, self.observation_space)
        with torch.inference_mode():
            inputs = module.forward_inference(to_torch(obs))["action_dist_inputs"]
            dist = module.action_dist(inputs)
            actions = self.exploration.actions(dist, explore, timestep)
            return self.to_env(actions, dist, inputs, obs, explore)

    def to_env(self, actions: torch.Tensor, dist: Any, inputs: torch.Tensor, obs: Any, explore: bool) -> np.ndarray:
        """The module's actions as the env gets them: through the module-to-env pipeline when there is one
        (its ``actions_for_env``, else its ``actions`` converted), else converted."""
        if self.module_to_env is None:
            return self.env_actions(actions.numpy())
        out = self.module_to_env({"actions": actions.numpy(), "action_logp": dist.logp(actions).numpy(),
                                  "action_dist_inputs": inputs.numpy()}, obs, explore)
        for_env = out.get("actions_for_env")
        return self.env_actions(np.asarray(out["actions"])) if for_env is None else np.asarray(for_env)


    def compute_recurrent(self, learner_group: LearnerGroup, obs: Any, state: Any, explore: bool,
                          timestep: int) -> tuple[np.ndarray, np.ndarray]:
        """A recurrent module: (env actions, next states) for a batch of observations and their states
        ``[B, 2, cell]`` (None: fresh ones)."""
        module = self.current_module(learner_group)
        obs = as_arrays(obs, self.observation_space)
        with torch.inference_mode():
            t_obs = to_torch(obs)
            n = nested.batch_len(t_obs)
            if state is None:
                state = module.initial_state(n)
            t_state = torch.as_tensor(np.asarray(state, np.float32))
            out = module.forward_inference(t_obs, t_state)
            dist = module.action_dist(out["action_dist_inputs"])
            actions = self.exploration.actions(dist, explore, timestep)
            return self.to_env(actions, dist, out["action_dist_inputs"], obs, explore), out["state_out"].numpy()


def batch_of_one(obs: Any, space: Any) -> Any:
    """One observation (no batch dim) as a batch of one."""
    return nested.map_structure(lambda a: a[None], as_arrays(obs, space))


def single_action(actions: np.ndarray) -> Any:
    """The one action of a batch of one, as a python scalar where it is one."""
    action = actions[0]
    return action.item() if np.ndim(action) == 0 else action


def as_arrays(obs: Any, space: Any) -> Any:
    """``obs`` as numpy arrays nested like ``space`` (Dict/Tuple); anything else, lists included
    (``[0.0, 0.1, ...]`` for a Box), becomes one array."""
    if isinstance(space, gym.spaces.Dict) and isinstance(obs, dict):
        return {k: as_arrays(obs[k], space[k]) if k in space.spaces else np.asarray(obs[k]) for k in obs}
    if isinstance(space, gym.spaces.Tuple) and isinstance(obs, (list, tuple)):
        return tuple(as_arrays(o, s) for o, s in zip(obs, space.spaces))
    return np.asarray(obs)


# --- the Algorithm's actions API (``algo.compute_actions``, ``algo.compute_single_action``) --------------
def compute_actions(algo: Any, obs: Any, explore: bool | None, policy_id: str | None) -> np.ndarray:
    """A batch of env observations -> env actions: through the driver's copy of the env-to-module pipeline
    (recording pieces only, learning nothing), then the module of ``policy_id``."""
    explore = algo.config.explore if explore is None else explore
    timestep = algo.counters["num_env_steps_sampled_lifetime"]
    if algo.multi_agent is not None:
        if algo.connector is not None:  # env observations, through the pipeline of the module that acts
            mid = algo.multi_agent.module_id(policy_id, "compute_actions")
            if algo.connector.views(mid):
                raise ValueError(view_refusal(algo.connector.views(mid)[0]))
            obs = algo.connector.record(mid, as_arrays(obs, algo.connector.input_space(mid)), update=False)
        return algo.multi_agent.compute_actions(algo.learner_group, obs, explore, timestep, policy_id)
    if policy_id not in (None, "default_policy"):
        raise KeyError(f"policy_id={policy_id!r}: this run has one module, 'default_policy'")
    if algo.connector is not None:  # env observations, as the runners' modules get them
        if algo.connector.views:
            raise ValueError(view_refusal(algo.connector.views[0]))
        obs = as_arrays(obs, algo.env_observation_space)
        obs = algo.connector.record(obs, np.zeros(nested.batch_len(obs), bool), update=False)
    return algo.driver_policy.compute_actions(algo.learner_group, obs, explore, timestep)


def view_refusal(view: Any) -> str:
    return (f"this run's module acts on what {view!r} builds from the episode so far, which one observation "
            f"does not give: evaluate with algo.evaluate(), or call algo.get_module() on stacked observations")


def compute_single_action(algo: Any, obs: Any, explore: bool | None, policy_id: str | None, state: Any) -> Any:
    """One env observation -> one action; a recurrent module's ``(action, state_out, {})``."""
    if algo.multi_agent is None and getattr(algo.driver_policy.module, "is_recurrent", False):
        explore = algo.config.explore if explore is None else explore
        batch = batch_of_one(obs, algo.env_observation_space)
        if algo.connector is not None:
            batch = algo.connector.record(batch, np.zeros(1, bool), update=False)
        actions, state_out = algo.driver_policy.compute_recurrent(
            algo.learner_group, batch, None if state is None else np.asarray(state, np.float32)[None],
            explore, algo.counters["num_env_steps_sampled_lifetime"])
        return single_action(actions), state_out[0], {}
    if state is not None:
        raise ValueError("state= is for recurrent modules (model_config use_lstm=True); this one has none")
    space = algo.env_observation_space
    if algo.multi_agent is not None:
        space = algo.multi_agent.env_observation_space(policy_id, "compute_single_action")
    return single_action(compute_actions(algo, batch_of_one(obs, space), explore, policy_id))
