"""The pieces ``MultiAgentEnvRunner`` puts around a ``MultiAgentSampler``: the step checker as an env
wrapper, the episode listener (callbacks and start order), the chunks held back until their episode
ends, and ``chunks_by_module`` for a learner. (What every env runner does to its process and to the
user functions it runs is shared with ``EnvRunner``: ``actors.env.process.prepare_process``,
``actors.core.call_user_fn``.)

Apart from the runner so that it stays the stage (what it is asked, what it reports) and these stay
small enough to read at once. None of them knows the runner's internals: the listener gets the runner
object only to hand it to the user's callbacks as ``env_runner``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from actors.callbacks import call_hook, overrides
from actors.env.multi_agent_checks import MultiAgentStepChecker
from actors.metrics import MetricsLogger
from protocols.episode import EpisodeChunk
from protocols.multi_agent_episode import MultiAgentEpisode


class CheckedMultiAgentEnv:
    """A multi-agent env whose every ``reset``/``step`` result, and every action dict sent to it, goes
    through a ``MultiAgentStepChecker`` first: a malformed step raises ``MultiAgentEnvError`` naming
    the agent, where it happens, instead of a wrong batch later. Anything else is the env's own."""

    def __init__(self, env: Any, plain_step_values: bool = True) -> None:
        self.env = env
        self.checker = MultiAgentStepChecker.for_env(env, plain_step_values)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> Any:
        kwargs: dict[str, Any] = {"seed": seed}
        if options is not None:  # envs written without an options argument still reset
            kwargs["options"] = options
        return self.checker.check_reset(self.env.reset(**kwargs))

    def step(self, actions: dict) -> Any:
        self.checker.check_actions(actions)
        return self.checker.check_step(self.env.step(actions))

    def __getattr__(self, name: str) -> Any:  # possible_agents, spaces, close, render...
        return getattr(self.env, name)


class RunnerListener:
    """What the runner hears of each episode (``MultiAgentSampler``'s ``EpisodeListener``).

    Runs the user's ``on_episode_created``/``on_episode_start``/``on_episode_step``/``on_episode_end`` with the
    ``MultiAgentEpisode`` (only those the callbacks override), and, while ``order`` is a dict,
    numbers episodes in the order they start (``num_episodes`` sampling keeps the first ones)."""

    def __init__(self, runner: Any, callbacks: Any, where: str, metrics: MetricsLogger,
                 callback_metrics: MetricsLogger, envs: list[Any]) -> None:
        self.runner, self.callbacks, self.where = runner, callbacks, where
        self.metrics, self.callback_metrics, self.envs = metrics, callback_metrics, envs
        self.on_created = overrides(callbacks, "on_episode_created")
        self.on_start = overrides(callbacks, "on_episode_start")
        self.on_step = overrides(callbacks, "on_episode_step")
        self.on_end = overrides(callbacks, "on_episode_end")
        self.hears_steps = bool(self.on_step)
        """Whether ``episode_stepped`` runs a callback: the sampler calls it only then."""
        self.runs_callbacks = bool(self.on_created or self.on_start or self.on_step or self.on_end)
        """Whether any ``on_episode_*`` callback runs: they are handed ``MultiAgentEpisode`` objects."""
        self.order: dict[str, int] | None = None
        """Episode id -> how many episodes started before it, while counting (None: not counting)."""

    def episode_created(self, env_index: int, episode: MultiAgentEpisode) -> None:
        if self.on_created:
            self._hook("on_episode_created", env_index, episode)

    def episode_started(self, env_index: int, episode: MultiAgentEpisode) -> None:
        if self.order is not None:
            self.order[episode.id_] = len(self.order)
        if self.on_start:
            self._hook("on_episode_start", env_index, episode)

    def episode_stepped(self, env_index: int, episode: MultiAgentEpisode) -> None:
        if self.on_step:
            self._hook("on_episode_step", env_index, episode)

    def episode_ended(self, env_index: int, episode: MultiAgentEpisode) -> None:
        # RLlib's order: the last step's on_episode_step, then on_episode_end
        if self.on_step:
            self._hook("on_episode_step", env_index, episode)
        if self.on_end:
            self._hook("on_episode_end", env_index, episode)

    def _hook(self, hook: str, env_index: int, episode: MultiAgentEpisode) -> None:
        call_hook(self.callbacks, hook, self.where, self.metrics, episode=episode, env_runner=self.runner,
                  worker=self.runner, env=self.envs[env_index], rl_module=self.runner.module, env_index=env_index,
                  metrics_logger=self.callback_metrics)


class HeldChunks:
    """Chunks of running episodes, kept until the episode ends (``complete_episodes``, ``num_episodes``).

    Keyed by the chunk's episode id (each agent of an episode has its own), so an episode's chunks
    leave together, in the order they were cut, however many runs it spanned."""

    def __init__(self) -> None:
        self.held: dict[str, list[EpisodeChunk]] = {}

    def add(self, chunks: list[EpisodeChunk]) -> None:
        for chunk in chunks:
            self.held.setdefault(chunk.episode_id, []).append(chunk)

    def take(self, episode: MultiAgentEpisode) -> list[EpisodeChunk]:
        """Every chunk of ``episode`` (all its agents), now that it ended; nothing is left of it here."""
        return [c for eid in episode.agent_episode_ids.values() for c in self.held.pop(eid, [])]

    def clear(self) -> None:
        self.held.clear()

    def __len__(self) -> int:
        return sum(len(cs) for cs in self.held.values())


def chunks_by_module(chunks: Iterable[EpisodeChunk]) -> dict[str, list[EpisodeChunk]]:
    """A flat chunk list grouped by ``module_id``, in order: what ``MultiLearner.update`` takes."""
    out: dict[str, list[EpisodeChunk]] = {}
    for chunk in chunks:
        out.setdefault(chunk.module_id, []).append(chunk)
    return out
