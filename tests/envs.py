"""Small deterministic environments for tests."""
from __future__ import annotations

import gymnasium as gym
import numpy as np

from actors.env.multi_agent_env import SingleAgentCopies
from actors.env.task_settable import TaskSettableEnv


class CountingEnv(gym.Env):
    """obs = [step index]; reward 1 per step; terminates after ``length`` steps (truncates if ``truncate``)."""

    def __init__(self, config=None):
        config = config or {}
        self.length = int(config.get("length", 5))
        self.truncate = bool(config.get("truncate", False))
        self.observation_space = gym.spaces.Box(0, 1e6, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        done = self.t >= self.length
        return np.array([self.t], np.float32), 1.0, done and not self.truncate, done and self.truncate, {}


class DictObsEnv(gym.Env):
    """Dict observation; reward 1 when the action equals ``target`` (encoded one-hot in obs), else 0.

    A policy can only do well by reading the Discrete part of the observation: a learning test.
    """

    def __init__(self, config=None):
        self.observation_space = gym.spaces.Dict({
            "target": gym.spaces.Discrete(3),
            "noise": gym.spaces.Box(-1, 1, (2,), np.float32),
            "pair": gym.spaces.Tuple((gym.spaces.MultiBinary(2), gym.spaces.MultiDiscrete([2, 3]))),
        })
        self.action_space = gym.spaces.Discrete(3)
        self.t = 0
        self._target = 0

    def _obs(self):
        rng = self.np_random
        self._target = int(rng.integers(3))
        return {"target": self._target, "noise": rng.uniform(-1, 1, 2).astype(np.float32),
                "pair": (rng.integers(0, 2, 2).astype(np.int8), np.array([rng.integers(2), rng.integers(3)]))}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = 1.0 if int(action) == self._target else 0.0
        self.t += 1
        return self._obs(), reward, False, self.t >= 20, {}


class FlakyEnv(gym.Env):
    """CartPole that raises in ``step`` at configured global step counts on chosen runner indices.

    config: ``fail_on_runners`` (list of worker indices), ``fail_at_steps`` (list of step counts of
    this env instance), ``fail_on_reset`` (bool), ``hang`` (sleep instead of raising),
    ``fail_when_recreated`` (a recreated runner's envs fail too: a fault no restart fixes).
    """

    def __init__(self, config=None):
        config = config or {}
        self.env = gym.make("CartPole-v1")
        self.observation_space, self.action_space = self.env.observation_space, self.env.action_space
        on_this = getattr(config, "worker_index", 0) in config.get("fail_on_runners", [])
        recreated = getattr(config, "recreated", False)
        fails = on_this and (not recreated or config.get("fail_when_recreated", False))
        self.fail_at = set(config.get("fail_at_steps", [])) if fails else set()
        self.hang = config.get("hang", False)
        self.steps = 0

    def reset(self, *, seed=None, options=None):
        return self.env.reset(seed=seed)

    def step(self, action):
        self.steps += 1
        if self.steps in self.fail_at:
            if self.hang:
                import time

                time.sleep(3600)
            raise RuntimeError(f"injected env failure at step {self.steps}")
        return self.env.step(action)


class GILHangEnv(FlakyEnv):
    """FlakyEnv that, at its failing step, hangs in C code holding the GIL (a runaway regex): the runner's
    main thread cannot answer either, so only the driver's probe of silent runners can catch it."""

    def step(self, action):
        if self.steps + 1 in self.fail_at:
            import re

            re.match(r"(a+)+$", "a" * 64 + "b")
        return super().step(action)


class BrokenEnv(FlakyEnv):
    """Builds in the driver (worker_index 0) but raises when a remote env runner builds it."""

    def __init__(self, config=None):
        if getattr(config, "worker_index", 0) > 0:
            raise RuntimeError("BrokenEnv cannot be built on an env runner")
        super().__init__(config)


class SimpleCorridor(gym.Env):
    """RLlib's corridor: walk right (action 1) from cell 0 to the end; reward 1 at the end, else 0.
    ``corridor_length`` from the config; ``set_corridor_length`` and the task API change it."""

    def __init__(self, config=None):
        config = config or {}
        self.end_pos = int(config.get("corridor_length", 5))
        self.cur_pos = 0
        self.action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.spaces.Box(0.0, 999.0, (1,), np.float32)

    def set_corridor_length(self, length):
        self.end_pos = int(length)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.cur_pos = 0
        return np.array([self.cur_pos], np.float32), {}

    def step(self, action):
        if action == 0 and self.cur_pos > 0:
            self.cur_pos -= 1
        elif action == 1:
            self.cur_pos += 1
        done = self.cur_pos >= self.end_pos
        return np.array([self.cur_pos], np.float32), 1.0 if done else 0.0, done, False, {"pos": self.cur_pos}


class EvalFaultEnv(FlakyEnv):
    """CartPole whose copies on the evaluators named in ``eval_fail_on`` raise (or, with ``hang``,
    block) at their 20th step; training runners' copies never fail. Recreated copies fail again."""

    def __init__(self, config=None):
        config = config or {}
        super().__init__({})
        failing = getattr(config, "in_evaluation", False) and getattr(config, "worker_index", 0) in config.get(
            "eval_fail_on", [])
        self.fail_at = {20} if failing else set()
        self.hang = config.get("hang", False)


class FrameEnv(gym.Env):
    """Atari-sized frames, cheap to step (benchmarks of the inference path): 84x84x4 uint8 observations
    drawn from a few frames made at construction -- a flat background with a few bright blocks, so they
    compress about as well as Atari screens do --, 6 actions, reward 1 for action 0, ``length`` steps
    (default 500) an episode."""

    def __init__(self, config=None):
        config = config or {}
        self.length = int(config.get("length", 500))
        self.observation_space = gym.spaces.Box(0, 255, (84, 84, 4), np.uint8)
        self.action_space = gym.spaces.Discrete(6)
        rng = np.random.default_rng(0)
        self.frames = np.full((8, 84, 84, 4), 40, np.uint8)
        for frame in self.frames:
            for y, x in rng.integers(0, 76, (6, 2)):
                frame[y:y + 8, x:x + 8] = rng.integers(100, 256)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.frames[0], {}

    def step(self, action):
        self.t += 1
        return self.frames[self.t % 8], float(action == 0), False, self.t >= self.length, {}


class ScaledCartPole(gym.ObservationWrapper):
    """CartPole-v1 whose observations are shifted and scaled far from unit size (``obs * scale + shift``):
    what a policy sees raw when a sensor reports in odd units. A running mean/std filter undoes it."""

    SCALE = np.array([40.0, 25.0, 400.0, 15.0], np.float32)
    SHIFT = np.array([300.0, -200.0, 900.0, 150.0], np.float32)

    def __init__(self, config=None):
        super().__init__(gym.make("CartPole-v1"))
        inner = self.env.observation_space
        self.observation_space = gym.spaces.Box(inner.low * self.SCALE + self.SHIFT,
                                                inner.high * self.SCALE + self.SHIFT, (4,), np.float32)

    def observation(self, observation):
        return (observation * self.SCALE + self.SHIFT).astype(np.float32)


class StatelessCartPole(gym.ObservationWrapper):
    """CartPole-v1 with the velocities hidden: the observation is (cart position, pole angle) only, so a
    policy must remember earlier steps to act well (what a recurrent module is for)."""

    def __init__(self, config=None):
        super().__init__(gym.make("CartPole-v1"))
        inner = self.env.observation_space
        self.observation_space = gym.spaces.Box(inner.low[[0, 2]], inner.high[[0, 2]], (2,), np.float32)

    def observation(self, observation):
        return observation[[0, 2]].astype(np.float32)


class PlainAndScaledCartPoles(SingleAgentCopies):
    """Two agents: agent 0 plays CartPole-v1 as it is, agent 1 a ``ScaledCartPole`` (observations shifted by
    hundreds and scaled up to 400x). Mapped to two modules, each module's ``MeanStdFilter`` must learn its own
    statistics."""

    def __init__(self, config=None):
        self._made = 0
        super().__init__({**(config or {}), "num_agents": 2})

    def make_single(self, config):
        self._made += 1
        return gym.make("CartPole-v1") if self._made == 1 else ScaledCartPole()


class ActionEcho(gym.Env):
    """Observes the action it got last (and pays it as the reward): what the env received, step by step."""

    observation_space = gym.spaces.Box(-10, 10, (1,), np.float32)
    action_space = gym.spaces.Discrete(3)

    def __init__(self, length: int = 6) -> None:
        self.length, self.t = length, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        assert self.action_space.contains(action), action
        self.t += 1
        return np.array([float(action)], np.float32), float(action), False, self.t >= self.length, {}


class ActionEchoes(SingleAgentCopies):
    """``ActionEcho`` copies, one per agent (``num_agents``, default 2): each agent observes the action its env
    got last and is paid it, so chunks show what each env received."""

    def __init__(self, config=None):
        config = dict(config or {})
        config.setdefault("num_agents", 2)
        super().__init__(config)

    def make_single(self, config):
        return ActionEcho()


class CurriculumEnv(SimpleCorridor, TaskSettableEnv):
    """The page's MyEnv: a corridor whose length grows with the task (difficulty)."""

    def __init__(self, config=None):
        super().__init__(config)
        self.current_difficulty = 1

    def get_task(self):
        return self.current_difficulty

    def set_task(self, task):
        self.current_difficulty = task
        self.set_corridor_length(2 + task)


def curriculum_fn(train_results, task_settable_env, env_ctx):
    # Very simple curriculum function (the page's).
    current_task = task_settable_env.get_task()
    new_task = current_task + 1
    return new_task
