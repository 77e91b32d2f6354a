"""ALE games stepped by EnvPool (``gym_env_vectorize_mode="envpool"`` with an ALE id such as ``"ALE/Pong-v5"``).

EnvPool runs the emulator and the standard preprocessing in C++ on its own threads. This module gives its
Atari envs the same observations, spaces and preprocessing settings as ``actors.env.atari.make_atari``, so a
run switches between the two with the vectorize mode alone:

* the same ``env_config``: the ALE's arguments (``repeat_action_probability`` -- the id's default, 0.25 for v5
  and 0 for v4 --, ``full_action_space``, ``mode``, ``difficulty``, ``max_num_frames_per_episode``) and, under
  ``"atari"``, ``AtariSettings`` (no-op starts, frame skip with the max of the last two frames, the frame size,
  episodic lives and clipped rewards in training runners, whole games with the game's score in evaluation);
* the same observations: ``(size, size, 1)`` uint8 greyscale frames (EnvPool's own are ``(1, size, size)``; one
  frame, not EnvPool's stack of four: frame stacking is a connector, built where it is used);
* no fire at reset (EnvPool's default presses FIRE; ``make_atari`` does not).

What differs: EnvPool's resize is OpenCV's area interpolation (``make_atari``'s is an exact area average, so
pixels may differ by one grey level), its random no-op counts come from its own generator, and episodes of the
same seed are not the same as ``make_atari``'s. What it refuses, with the setting to use instead: the bare ALE
env (``"atari": False``), rendering, and the ALE arguments it has no equivalent for.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from actors.env.atari import ATARI_KEY, AtariSettings

ALE_ARGS = ("repeat_action_probability", "full_action_space", "mode", "difficulty", "max_num_frames_per_episode",
            "max_episode_steps")
"""``env_config`` keys EnvPool's Atari envs take (besides ``"atari"``); ``max_episode_steps`` as ``make_atari``
reads it: emulator frames (its ALE env steps one frame at a time)."""
_SAME_AS_PREPROCESSING = {"frameskip": 1, "obs_type": "grayscale"}


def envpool_game_id(ale_id: str) -> str:
    """EnvPool's id for the game of a gymnasium ALE id: "ALE/Pong-v5", "PongNoFrameskip-v4", "Pong-v4" ->
    "Pong-v5" (EnvPool has one id per game; the id's defaults are passed as options)."""
    name = ale_id.split("/")[-1].rsplit("-v", 1)[0]
    for suffix in ("NoFrameskip", "Deterministic"):
        name = name.removesuffix(suffix)
    return f"{name}-v5"


def envpool_atari_options(ale_id: str, env_config: Mapping[str, Any], in_evaluation: bool) -> dict[str, Any]:
    """EnvPool's options for ``ale_id`` built as ``make_atari(ale_id, env_config)`` would build it (module
    docstring); a ValueError names a setting EnvPool cannot follow and what to use instead."""
    config = dict(env_config)
    atari = config.pop(ATARI_KEY, True)
    if atari is False:
        raise ValueError("env_config['atari']=False (the bare ALE env) is not what EnvPool steps: its Atari envs "
                         "always preprocess; use gym_env_vectorize_mode='sync' for the bare env")
    settings = AtariSettings.from_config(atari)
    if config.get("render_mode") is not None:
        raise ValueError(f"render_mode={config['render_mode']!r}: EnvPool's Atari envs do not render here; use "
                         f"gym_env_vectorize_mode='sync' to render")
    config.pop("render_mode", None)
    for key, allowed in _SAME_AS_PREPROCESSING.items():
        if key in config and config.pop(key) != allowed:
            raise ValueError(f"env_config[{key!r}] conflicts with the Atari preprocessing (as with make_atari): set "
                             f"env_config[{ATARI_KEY!r}] instead")
    unknown = sorted(set(config) - set(ALE_ARGS))
    if unknown:
        raise ValueError(f"env_config key(s) {unknown} have no equivalent in EnvPool's Atari envs; it takes "
                         f"{list(ALE_ARGS)} and {ATARI_KEY!r}: use gym_env_vectorize_mode='sync' for the others")
    spec = gym.spec(ale_id)
    defaults = dict(spec.kwargs)
    frames = config.get("max_num_frames_per_episode", config.get("max_episode_steps"))
    if frames is None:
        frames = defaults.get("max_num_frames_per_episode") or spec.max_episode_steps or 108_000
    if isinstance(frames, bool) or not isinstance(frames, (int, np.integer)) or frames < 1:
        raise ValueError(f"an episode's frame limit must be a whole number >= 1, got {frames!r}")
    training = not in_evaluation
    return {
        "frame_skip": settings.frame_skip, "noop_max": max(1, settings.noop_max),
        "img_height": settings.screen_size, "img_width": settings.screen_size, "stack_num": 1, "gray_scale": True,
        "episodic_life": settings.episodic_life if settings.episodic_life is not None else training,
        "reward_clip": settings.clip_rewards if settings.clip_rewards is not None else training,
        "use_fire_reset": False, "use_inter_area_resize": True,
        "repeat_action_probability": float(config.get("repeat_action_probability",
                                                      defaults.get("repeat_action_probability", 0.25))),
        "full_action_space": bool(config.get("full_action_space", defaults.get("full_action_space", False))),
        "mode": -1 if config.get("mode") is None else config["mode"],  # -1: the game's default
        "difficulty": -1 if config.get("difficulty") is None else config["difficulty"],
        "max_episode_steps": -(-int(frames) // settings.frame_skip),
    }


class EnvPoolFrames:
    """EnvPool's ALE vector env with ``make_atari``'s frame layout: ``(n, size, size, 1)`` instead of
    ``(n, 1, size, size)`` (a reshape of the same bytes: one channel)."""

    def __init__(self, env: Any, size: int) -> None:
        self.env, self.metadata = env, env.metadata
        self.single_observation_space = gym.spaces.Box(0, 255, (size, size, 1), np.uint8)
        self.single_action_space = env.single_action_space

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        obs, info = self.env.reset()  # EnvPool takes its seed when it is made
        return self._frames(obs), info

    def step(self, actions: np.ndarray) -> tuple:
        obs, rew, term, trunc, info = self.env.step(np.asarray(actions))
        return self._frames(obs), rew, term, trunc, info

    def close(self) -> None:
        self.env.close()

    @staticmethod
    def _frames(obs: np.ndarray) -> np.ndarray:
        n, _, h, w = obs.shape
        return obs.reshape(n, h, w, 1)


def make_envpool_atari(ale_id: str, num_envs: int, seed: int, env_config: Mapping[str, Any], in_evaluation: bool,
                       num_threads: int) -> EnvPoolFrames:
    """EnvPool's vector env of ``ale_id``'s game, preprocessed as ``make_atari`` does (module docstring)."""
    import envpool

    options = envpool_atari_options(ale_id, env_config, in_evaluation)
    env = envpool.make_gymnasium(envpool_game_id(ale_id), num_envs=num_envs, seed=seed, num_threads=num_threads,
                                 **options)
    return EnvPoolFrames(env, options["img_height"])
