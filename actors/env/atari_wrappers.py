"""The standard Atari preprocessing (Mnih et al. 2015; Machado et al. 2018) as gymnasium wrappers.

``actors.env.atari.make_atari`` stacks them on an ALE env built with ``frameskip=1`` and greyscale
screens: ``NoopReset`` -> ``MaxPoolFrameSkip`` -> ``EpisodicLife`` -> ``AreaResize`` -> reward sign.

Written here rather than taken from gymnasium's ``AtariPreprocessing`` for two reasons: its resize
needs OpenCV (a large dependency for one call; ``AreaResize`` is exact area averaging in numpy), and
its ``terminal_on_life_loss`` restarts the whole game at every lost life, so a policy would never see
the later lives. ``EpisodicLife`` ends the episode on a lost life but lets the game go on at the next
``reset()``, as DeepMind's and the baselines' wrappers do. Reward clipping is gymnasium's
``TransformReward``.

No frame stacking here on purpose: a stack of k frames per observation would make every stored and
shipped step k frames big. Stacks are built where they are used (the frame-stacking connectors).
"""
from __future__ import annotations

import math
from typing import Any

import gymnasium as gym
import numpy as np

NOOP = 0
"""ALE's action 0 is NOOP in every game's minimal action set (``NoopReset`` checks it)."""


def area_weights(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Area-averaging ``n_in`` samples down to ``n_out``: ``(index [n_out, k], weight [n_out, k])`` such that
    ``out[i] = sum_j weight[i, j] * x[index[i, j]]``, each output the mean of the input interval it covers
    (the fractions of the samples at its edges weighted by their overlap), as OpenCV's INTER_AREA."""
    if not 0 < n_out <= n_in:
        raise ValueError(f"area resize shrinks only: cannot map {n_in} samples to {n_out}")
    scale = n_in / n_out
    k = int(np.ceil(scale)) + 1  # the most input samples one output interval can touch
    index = np.zeros((n_out, k), np.int64)
    weight = np.zeros((n_out, k), np.float32)
    for i in range(n_out):
        lo, hi = i * scale, (i + 1) * scale
        first = int(np.floor(lo))
        for j in range(k):
            src = first + j
            overlap = min(hi, src + 1) - max(lo, src)
            if src < n_in and overlap > 1e-9:
                index[i, j], weight[i, j] = src, overlap / scale
    return index, weight


def area_matrix(n_in: int, n_out: int) -> np.ndarray:
    """``area_weights`` as a dense ``[n_out, n_in]`` float64 matrix: ``out = matrix @ x``."""
    index, weight = area_weights(n_in, n_out)
    matrix = np.zeros((n_out, n_in))
    for i in range(n_out):
        np.add.at(matrix[i], index[i], weight[i])
    return matrix


def area_blocks(n_in: int, n_out: int) -> np.ndarray:
    """``area_matrix`` as one small ``[q, p]`` float32 block: with ``g = gcd(n_in, n_out)``, the input splits into
    ``g`` runs of ``p = n_in / g`` samples, each averaged down to ``q = n_out / g`` outputs by the same weights
    (210 rows -> 84: 42 runs of 5 rows to 2; 160 columns -> 84: 4 runs of 40 to 21)."""
    g = math.gcd(n_in, n_out)
    return area_matrix(n_in, n_out)[:n_out // g, :n_in // g].astype(np.float32)  # the first run's; all are alike


class AreaResize(gym.ObservationWrapper):
    """Greyscale ``(H, W)`` uint8 frames -> ``(size, size, 1)`` uint8 by area averaging: a channel axis,
    so the frame is an image (``H, W, C``) to the default CNN and frame stacking appends along it.

    Two batched products with ``area_blocks``' small matrices (rows, then columns): a third of the time of
    gathering each output's samples (about 50 us against 135 for Atari's 210x160 frame, a tenth of a step)."""

    def __init__(self, env: gym.Env, size: int = 84) -> None:
        super().__init__(env)
        space = env.observation_space
        if not (isinstance(space, gym.spaces.Box) and len(space.shape) == 2 and space.dtype == np.uint8):
            raise ValueError(f"AreaResize needs greyscale uint8 frames (a Box of shape (H, W)), got {space}: build "
                             f"the ALE env with obs_type='grayscale'")
        self.height, self.width = space.shape
        self.size = size
        self.rows = area_blocks(self.height, size)  # [q, p]: applied to each run of p rows
        self.cols_t = np.ascontiguousarray(area_blocks(self.width, size).T)  # [p, q]: to each run of p columns
        self.observation_space = gym.spaces.Box(0, 255, (size, size, 1), np.uint8)

    def observation(self, frame: np.ndarray) -> np.ndarray:
        size, width = self.size, self.width
        runs = frame.reshape(-1, self.rows.shape[1], width).astype(np.float32)
        tall = np.matmul(self.rows, runs).reshape(size, width)
        small = np.matmul(tall.reshape(size, -1, self.cols_t.shape[0]), self.cols_t).reshape(size, size)
        return np.rint(small, out=small).astype(np.uint8)[:, :, None]


class NoopReset(gym.Wrapper):
    """After every real reset, a random number (1 to ``noop_max``) of NOOP frames: the episode starts in
    one of many states, so a policy cannot memorise one action sequence."""

    def __init__(self, env: gym.Env, noop_max: int = 30) -> None:
        super().__init__(env)
        meanings = env.unwrapped.get_action_meanings()
        if meanings[NOOP] != "NOOP":
            raise ValueError(f"NoopReset needs action {NOOP} to be NOOP; this game's actions are {meanings}")
        self.noop_max = noop_max

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        obs, info = self.env.reset(**kwargs)
        if self.noop_max < 1:
            return obs, info
        for _ in range(int(self.np_random.integers(1, self.noop_max + 1))):
            obs, _, terminated, truncated, info = self.env.step(NOOP)
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


class DirectFrames:
    """A frame skip emulated on the ALE itself: ``MaxPoolFrameSkip`` hands its whole step here, which acts
    frame by frame and reads only the screens it pools (the second-to-last into a buffer kept for it), with
    none of the per-frame screen copies, info dicts and wrapper calls of env steps (about 12% of a 4-frame
    step of Pong). Valid only where no wrapper between the skip and the ALE env counts or changes steps
    (``actors.env.atari.direct_frames`` checks that); a step returns what the same frames as env steps of
    the ALE env (greyscale screens) would, bit for bit."""

    def __init__(self, ale: Any, action_set: list) -> None:
        self.ale = ale
        self.action_set = action_set
        self.before_last = np.empty(ale.getScreenDims(), np.uint8)

    def step(self, action: Any, skip: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        ale = self.ale
        ale_action = self.action_set[action]
        total, pooled = 0.0, False
        terminated = truncated = False
        for i in range(skip):
            total += float(ale.act(ale_action, 1.0))
            terminated, truncated = ale.game_over(with_truncation=False), ale.game_truncated()
            if terminated or truncated:
                break
            if i == skip - 2:
                ale.getScreenGrayscale(self.before_last)
                pooled = True
        frame = ale.getScreenGrayscale()
        if pooled:
            np.maximum(self.before_last, frame, out=frame)
        info = {"lives": ale.lives(), "episode_frame_number": ale.getEpisodeFrameNumber(),
                "frame_number": ale.getFrameNumber()}
        return frame, total, terminated, truncated, info


class MaxPoolFrameSkip(gym.Wrapper):
    """Each action repeated for ``skip`` frames; rewards summed; the observation is the element-wise max
    of the last two frames (Atari sprites flicker: some are drawn only on odd or even frames).

    ``direct``: the frames are emulated through it rather than as env steps of ``env`` (only the two pooled
    screens are read); the steps come out the same, bit for bit."""

    def __init__(self, env: gym.Env, skip: int = 4, direct: DirectFrames | None = None) -> None:
        super().__init__(env)
        self.skip = skip
        self.direct = direct

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        if self.direct is not None:
            return self.direct.step(action, self.skip)
        total = 0.0
        before_last = None
        for i in range(self.skip):
            obs, reward, terminated, truncated, info = self.env.step(action)
            total += float(reward)
            if terminated or truncated:
                break
            if i == self.skip - 2:
                before_last = obs  # the ALE env returns a new array every frame: keeping it is safe
        frame = obs if before_last is None else np.maximum(before_last, obs)
        return frame, total, terminated, truncated, info


class EpisodicLife(gym.Wrapper):
    """A lost life ends the episode (terminated) while the game goes on: the next ``reset()`` continues
    the game with one NOOP step instead of restarting it. The game restarts when it is over, when it
    was truncated, or when ``reset()`` comes without a lost life (a runner starting afresh).

    Value targets stop at a lost life, which speeds up learning that losing a life is bad; the
    episode returns a runner reports are then per life (evaluation plays whole games)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.ale = env.unwrapped.ale
        self.lives = 0
        self.life_lost = False

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        lives = self.ale.lives()
        # lives > 0: some games show 0 lives for a few frames before the game is over
        self.life_lost = not (terminated or truncated) and 0 < lives < self.lives
        self.lives = lives
        return obs, reward, terminated or self.life_lost, truncated, info

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        # a seed asks for a reproducible episode; the continuing game is reproducible from its own start
        if self.life_lost:
            obs, _, terminated, truncated, info = self.env.step(NOOP)
            if terminated or truncated:
                obs, info = self.env.reset(**kwargs)
        else:
            obs, info = self.env.reset(**kwargs)
        self.life_lost = False
        self.lives = self.ale.lives()
        return obs, info


def reward_sign(reward: float) -> float:
    """-1, 0 or +1: the reward clipping of DQN and its successors (scores differ by orders of magnitude
    between games; one learning rate serves them all)."""
    return float(np.sign(reward))


def clip_rewards(env: gym.Env) -> gym.Env:
    return gym.wrappers.TransformReward(env, reward_sign)
