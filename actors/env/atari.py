"""Atari games through ``ale-py``: ALE ids and the standard preprocessing in one call.

``config.environment("ALE/Pong-v5")`` (or ``"ale_py:ALE/Pong-v5"``, or a v4 id such as
``"PongNoFrameskip-v4"``) builds each env with ``make_atari``: the ALE env at one frame per step with
greyscale screens, then ``actors.env.atari_wrappers``: up to 30 no-op frames after a reset, the action
repeated for 4 frames with the max of the last two frames as the observation, a lost life ending the
training episode, the frame area-averaged to 84x84x1 uint8, rewards clipped to their sign. Training
runners get episodic lives and clipped rewards; evaluation runners (``EnvContext.in_evaluation``) play
whole games and report the game's own score. ``repeat_action_probability`` (sticky actions) stays the
id's default (v5: 0.25, v4: 0) unless ``env_config`` sets it.

``env_config`` holds the ALE's own arguments (``repeat_action_probability``, ``full_action_space``,
``mode``, ``difficulty``, ``max_num_frames_per_episode``, ``render_mode``) and, under the key
``"atari"``, the preprocessing: ``False`` for the bare ALE env, or a dict of ``AtariSettings`` fields.
A registered name gets the same with ``register_env("pong", lambda ctx: make_atari("ALE/Pong-v5", ctx))``.

The ROMs ship inside the ``ale-py`` wheel (``pip install -e '.[atari]'``; ``make setup`` installs it).
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import gymnasium as gym

from actors.env import atari_wrappers as wrappers

ATARI_KEY = "atari"
"""The ``env_config`` key of the preprocessing settings."""
INSTALL_HINT = "pip install -e '.[atari]' in a runnel checkout, or pip install 'runnel-rl[atari]'"
_PREFIX = "ale_py:"


@dataclass
class AtariSettings:
    """The preprocessing of ``make_atari`` (``env_config={"atari": {...}}``)."""

    noop_max: int = 30
    """At most this many NOOP frames after each reset (drawn from 1..noop_max); 0: none."""
    frame_skip: int = 4
    """Frames each action is repeated for; the observation is the max of the last two."""
    screen_size: int = 84
    """Observations are ``(screen_size, screen_size, 1)`` uint8 greyscale."""
    episodic_life: bool | None = None
    """A lost life ends the episode (the game goes on); None: in training runners, not in evaluation."""
    clip_rewards: bool | None = None
    """Rewards become their sign (-1, 0, 1); None: in training runners, not in evaluation."""

    @classmethod
    def from_config(cls, value: Any) -> "AtariSettings":
        """``env_config["atari"]``: True/None (the defaults) or a dict of fields."""
        if value is None or value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(f"env_config[{ATARI_KEY!r}]={value!r} must be True, False or a dict of "
                             f"{[f.name for f in fields(cls)]}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(valid))
        if unknown:
            raise ValueError(f"unknown env_config[{ATARI_KEY!r}] key(s) {unknown}; valid keys: {valid}")
        settings = cls(**value)
        settings.check()
        return settings

    def check(self) -> None:
        ints = {"noop_max": 0, "frame_skip": 1, "screen_size": 8}
        for key, low in ints.items():
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"env_config[{ATARI_KEY!r}][{key!r}] must be an int >= {low}, got {v!r}")
        for key in ("episodic_life", "clip_rewards"):
            if getattr(self, key) not in (None, True, False):
                raise ValueError(f"env_config[{ATARI_KEY!r}][{key!r}] must be True, False or None (training "
                                 f"runners yes, evaluation no), got {getattr(self, key)!r}")


def import_ale() -> Any:
    """``ale_py``, its envs registered with gymnasium and its start-up banner silenced."""
    try:
        ale_py = importlib.import_module("ale_py")
    except ImportError as err:
        raise ImportError(f"Atari envs need the ale-py package (the ROMs ship inside it): {INSTALL_HINT}") from err
    gym.register_envs(ale_py)
    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)
    return ale_py


def ale_env_id(env: str) -> str | None:
    """The gymnasium id of the ALE env that ``env`` names ("ALE/Pong-v5", "ale_py:ALE/Pong-v5",
    "PongNoFrameskip-v4"), else None. An ``ALE/`` or ``ale_py:`` name without ale-py installed raises
    ImportError with the install command."""
    name = env[len(_PREFIX):] if env.startswith(_PREFIX) else env
    if name not in gym.registry:
        if name != env or name.startswith("ALE/"):
            import_ale()
        elif ":" in name:  # "module:Class", an import path
            return None
        else:  # maybe a v4 id ("Breakout-v4"): ale-py registers those too, once imported
            try:
                import_ale()
            except ImportError:
                return None
    spec = gym.registry.get(name)
    return name if spec is not None and str(spec.entry_point).startswith("ale_py") else None


def make_atari(env_id: str, env_config: Mapping[str, Any] | None = None) -> gym.Env:
    """The ALE env ``env_id`` with the standard preprocessing (module docstring); ``env_config`` as
    ``config.environment(env_config=...)`` gives it (an ``EnvContext`` in a runner, whose
    ``in_evaluation`` picks the evaluation defaults)."""
    import_ale()
    name = ale_env_id(env_id)
    if name is None:
        raise ValueError(f"make_atari: {env_id!r} is not an ALE env id (e.g. 'ALE/Pong-v5', 'ale_py:ALE/Pong-v5', "
                         f"'PongNoFrameskip-v4')")
    config = dict(env_config or {})
    atari = config.pop(ATARI_KEY, True)
    if atari is False:
        return seeded_once(gym.make(name, **config))
    settings = AtariSettings.from_config(atari)
    evaluation = bool(getattr(env_config, "in_evaluation", False))
    for key, allowed, instead in (("frameskip", 1, "frame_skip"), ("obs_type", "grayscale", "screen_size")):
        if key in config and config[key] != allowed:
            raise ValueError(f"env_config[{key!r}]={config[key]!r} conflicts with the Atari preprocessing, which "
                             f"builds the ALE env with {key}={allowed!r}: set env_config[{ATARI_KEY!r}][{instead!r}] "
                             f"instead, or env_config[{ATARI_KEY!r}]=False for the bare ALE env")
    config.update(frameskip=1, obs_type="grayscale")
    env = gym.make(name, **config)
    direct = direct_frames(env, config)
    env = wrappers.NoopReset(env, settings.noop_max)
    if settings.frame_skip > 1:
        env = wrappers.MaxPoolFrameSkip(env, settings.frame_skip, direct)
    if settings.episodic_life if settings.episodic_life is not None else not evaluation:
        env = wrappers.EpisodicLife(env)
    env = wrappers.AreaResize(env, settings.screen_size)
    if settings.clip_rewards if settings.clip_rewards is not None else not evaluation:
        env = wrappers.clip_rewards(env)
    return seeded_once(env)


# wrappers gym.make adds that neither count steps nor change them (a TimeLimit counts them: not here)
_STEP_TRANSPARENT = (gym.wrappers.OrderEnforcing, gym.wrappers.PassiveEnvChecker)


def direct_frames(env: gym.Env, config: Mapping[str, Any]) -> wrappers.DirectFrames | None:
    """The ALE under ``env`` (``gym.make`` of an ALE id with ``config``, greyscale screens) for a frame skip to
    emulate its frames on, or None where that would not be the same as stepping ``env``: a wrapper that counts
    steps (``max_episode_steps``), continuous actions, sound in the observations."""
    ale_env = env.unwrapped
    layer = env
    while layer is not ale_env:
        if not isinstance(layer, _STEP_TRANSPARENT):
            return None
        layer = layer.env
    if config.get("continuous") or config.get("sound_obs") or config.get("obs_type") != "grayscale":
        return None
    ale = ale_env.ale
    # the ALE env's own choice of action set (ale_py.env.AtariEnv.__init__)
    action_set = ale.getLegalActionSet() if config.get("full_action_space") else ale.getMinimalActionSet()
    if not isinstance(env.action_space, gym.spaces.Discrete) or len(action_set) != env.action_space.n:
        return None
    return wrappers.DirectFrames(ale, list(action_set))


def seeded_once(env: gym.Env) -> gym.Env:
    """``env`` marked for runnel's vector env: seed its first reset only (``reseed_each_episode``). A seeded ALE
    reset reloads the ROM (``ale_py.env.AtariEnv.reset`` calls ``load_game``), about 80 ms each episode."""
    env.reseed_each_episode = False
    return env
