"""PrevActionsPrevRewards: the last actions and rewards of each sub-env's episode beside its observation.

What a recurrent policy (or a plain one on a partially observed task) often needs: the module sees a Dict
``{"_obs": <the observation>, "prev_n_actions": <the last n actions>, "prev_n_rewards": <the last n
rewards>}`` (RLlib's key names). Discrete actions are one-hot, Box actions flattened, in the module's form
(before ``normalize_actions``' rescaling), oldest first; an episode's first step sees zeros. The piece
records: chunks store the Dict, so learners train on exactly what the module saw (put
``FlattenObservations()`` after it for one vector).

It hears each step's actions and rewards from the runner (``on_step``) and keeps ``[num_envs, n]`` of each;
that memory is part of the runner's state, so a restored runner's running episodes go on with it.

In a multi-agent run (each module's pipeline its own copy) the memory is each agent's (``keyed``): an agent's
last actions and the rewards it got between its observations (summed, when it did not act every env step),
zeros when it enters the episode; a multi-agent runner starts fresh episodes when restored, so this memory
is not part of its state. ``multi_agent=True`` (RLlib's flag) is accepted and changes nothing.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

from actors.connectors.base import ConnectorV2

OBS_KEY, ACTIONS_KEY, REWARDS_KEY = "_obs", "prev_n_actions", "prev_n_rewards"


class PrevActionsPrevRewards(ConnectorV2):
    watches_steps = True
    keyed = True

    def __init__(self, input_observation_space: gym.Space | None = None, input_action_space: gym.Space | None = None,
                 *, n_prev_actions: int = 1, n_prev_rewards: int = 1, multi_agent: bool = False, **kwargs: Any) -> None:
        super().__init__(input_observation_space, input_action_space, **kwargs)
        for name, n in (("n_prev_actions", n_prev_actions), ("n_prev_rewards", n_prev_rewards)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"PrevActionsPrevRewards({name}={n!r}): give a whole number >= 0")
        if n_prev_actions == n_prev_rewards == 0:
            raise ValueError("PrevActionsPrevRewards with n_prev_actions=0 and n_prev_rewards=0 adds nothing: "
                             "give at least one of them >= 1")
        self.n_actions, self.n_rewards = n_prev_actions, n_prev_rewards
        self.actions: np.ndarray | None = None  # [num_envs, n_actions, action width], oldest first
        self.rewards: np.ndarray | None = None  # [num_envs, n_rewards]
        self.slot_of: dict[Any, int] = {}  # multi-agent runs: a key's row in key_actions / key_rewards
        self.key_actions = np.zeros((0, n_prev_actions, 1), np.float32)  # [slots, n_actions, width] once grown
        self.key_rewards = np.zeros((0, n_prev_rewards), np.float32)
        self.free_slots: list[int] = []
        self._restored = False  # set_state's memory survives the resumed runner's first call

    # --- spaces -------------------------------------------------------------------------------
    def _action_width(self) -> int:
        space = self.input_action_space
        if isinstance(space, gym.spaces.Discrete):
            return int(space.n)
        if isinstance(space, gym.spaces.Box):
            return int(np.prod(space.shape))
        raise ValueError(f"PrevActionsPrevRewards takes Discrete or Box actions, got {space}")

    def recompute_output_observation_space(self, input_observation_space: gym.Space,
                                           input_action_space: gym.Space) -> gym.Space:
        self.input_action_space = self.input_action_space or input_action_space
        width = self._action_width()
        low = 0.0 if isinstance(self.input_action_space, gym.spaces.Discrete) else -np.inf
        high = 1.0 if isinstance(self.input_action_space, gym.spaces.Discrete) else np.inf
        spaces = {OBS_KEY: input_observation_space}
        if self.n_actions:
            spaces[ACTIONS_KEY] = gym.spaces.Box(low, high, (self.n_actions * width,), np.float32)
        if self.n_rewards:
            spaces[REWARDS_KEY] = gym.spaces.Box(-np.inf, np.inf, (self.n_rewards,), np.float32)
        return gym.spaces.Dict(spaces)

    # --- the runner's calls -------------------------------------------------------------------
    def _sized(self, n: int) -> None:
        if self.actions is None or len(self.actions) != n:
            self.actions = np.zeros((n, self.n_actions, self._action_width()), np.float32)
            self.rewards = np.zeros((n, self.n_rewards), np.float32)

    def _action_rows(self, actions: Any, n: int) -> np.ndarray:
        """``n`` actions as rows of the module's form: one-hot for Discrete, flattened for Box."""
        a = np.asarray(actions)
        if isinstance(self.input_action_space, gym.spaces.Discrete):
            row = np.zeros((n, self._action_width()), np.float32)
            row[np.arange(n), np.clip(a.reshape(n).astype(np.int64) - int(self.input_action_space.start), 0,
                                      row.shape[1] - 1)] = 1.0
            return row
        return a.reshape(n, -1).astype(np.float32)

    def on_step(self, actions: Any, rewards: np.ndarray) -> None:
        n = len(rewards)
        self._sized(n)
        if self.n_actions:
            self.actions[:, :-1] = self.actions[:, 1:]
            self.actions[:, -1] = self._action_rows(actions, n)
        if self.n_rewards:
            self.rewards[:, :-1] = self.rewards[:, 1:]
            self.rewards[:, -1] = np.asarray(rewards, np.float32)

    # --- a multi-agent runner's calls: memory per (env index, agent id) ------------------------
    # Each key holds a slot of two growing arrays (freed slots reused), so a batch's memory moves in a few
    # array operations whatever the number of agents.
    @property
    def num_keys(self) -> int:
        """Keys (agents) with memory now."""
        return len(self.slot_of)

    def _slots(self, keys: list[Any]) -> np.ndarray:
        """Each key's slot, a fresh zeroed one for a key without."""
        slot_of, out = self.slot_of, np.empty(len(keys), np.intp)
        for r, key in enumerate(keys):
            slot = slot_of.get(key)
            if slot is None:
                if not self.free_slots:
                    self._grow()
                slot = slot_of[key] = self.free_slots.pop()
                self.key_actions[slot] = 0.0
                self.key_rewards[slot] = 0.0
            out[r] = slot
        return out

    def _grow(self) -> None:
        old = len(self.key_rewards)
        size = max(16, 2 * old)
        actions = np.zeros((size, self.n_actions, self._action_width()), np.float32)
        rewards = np.zeros((size, self.n_rewards), np.float32)
        actions[:old], rewards[:old] = self.key_actions, self.key_rewards
        self.key_actions, self.key_rewards = actions, rewards
        self.free_slots.extend(range(size - 1, old - 1, -1))

    def step_keyed(self, keys: list[Any], actions: Any, rewards: np.ndarray) -> None:
        slots = self._slots(keys)
        if self.n_actions:
            self.key_actions[slots, :-1] = self.key_actions[slots, 1:]
            self.key_actions[slots, -1] = self._action_rows(actions, len(keys))
        if self.n_rewards:
            self.key_rewards[slots, :-1] = self.key_rewards[slots, 1:]
            self.key_rewards[slots, -1] = np.asarray(rewards, np.float32)

    def call_keyed(self, obs: Any, keys: list[Any], starts: np.ndarray, update: bool) -> Any:
        slots = self._slots(keys)
        started = slots[np.asarray(starts, bool)]
        if len(started):
            self.key_actions[started] = 0.0
            self.key_rewards[started] = 0.0
        return self._dict(obs, self.key_actions[slots], self.key_rewards[slots])

    def forget_keys(self, keys: list[Any]) -> None:
        for key in keys:
            slot = self.slot_of.pop(key, None)
            if slot is not None:
                self.free_slots.append(slot)

    def __call__(self, obs: Any, *, episode_starts: np.ndarray, update: bool) -> Any:
        n = len(episode_starts)
        self._sized(n)
        if self._restored:
            self._restored = False
        else:
            starts = np.flatnonzero(episode_starts)
            if len(starts):
                self.actions[starts] = 0.0
                self.rewards[starts] = 0.0
        return self._dict(obs, self.actions, self.rewards)

    def final_observation(self, obs: Any, env_index: int) -> Any:
        return self._dict(obs, self.actions[env_index:env_index + 1], self.rewards[env_index:env_index + 1])

    def _dict(self, obs: Any, actions: np.ndarray, rewards: np.ndarray) -> dict[str, Any]:
        out = {OBS_KEY: obs}
        if self.n_actions:
            out[ACTIONS_KEY] = actions.reshape(len(actions), -1).copy()
        if self.n_rewards:
            out[REWARDS_KEY] = rewards.copy()
        return out

    def reset_stack(self, num_envs: int) -> None:
        self.actions = self.rewards = None
        self.slot_of.clear()
        self.free_slots = list(range(len(self.key_rewards) - 1, -1, -1))
        self._restored = False

    # --- state --------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        return {"actions": None if self.actions is None else self.actions.copy(),
                "rewards": None if self.rewards is None else self.rewards.copy()}

    def set_state(self, state: dict[str, Any]) -> None:
        actions, rewards = state.get("actions"), state.get("rewards")
        if actions is None or rewards is None:
            self.actions = self.rewards = None
            return
        self.actions, self.rewards = np.array(actions, np.float32), np.array(rewards, np.float32)
        self._restored = True

    def sync(self, state: dict[str, Any]) -> None:
        """The driver's copy holds no runner's memory: nothing to take from it."""

    def __repr__(self) -> str:
        return f"PrevActionsPrevRewards(n_prev_actions={self.n_actions}, n_prev_rewards={self.n_rewards})"
