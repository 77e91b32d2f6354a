"""Evaluation: evaluators as an env runner group of their own, how long they run, and their results.

``Evaluators`` hosts ``evaluation_num_env_runners`` runners (0: one in the driver process) built from
the config with ``evaluation_config`` applied, with their own weights sync and the same fault-tolerance
settings as the training runners. One evaluation (``run``) lasts

* ``evaluation_duration`` episodes: split among the healthy evaluators, the first ``n % k`` taking one
  more (the rest idle); each evaluator returns the first episodes *to start*, so short episodes are
  not favoured;
* ``evaluation_duration`` timesteps: rounded up to a multiple of the number of evaluators;
* "auto": requests to every evaluator until ``stop`` is set (the parallel training step ended); the
  evaluation ends then, with what has come back: a request still running is not waited for (its
  results are dropped), and the weights for the next evaluation queue behind it without blocking --
  unless nothing has come back yet (a training step shorter than one request), then the first answer is.
  ``evaluate()`` called on demand (no training step beside it) runs one episode per healthy evaluator.

An evaluator that fails or does not answer within ``evaluation_sample_timeout_s`` is given up for
this evaluation (and killed, to be recreated later if restarts are on); the healthy ones take over its
share. Results go under ``evaluation/``: the runners' metrics (``env_runners/episode_return_mean``...),
the weights version evaluated, the episodes' returns and lengths (``hist_stats``), and what failed.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

from actors.env import EnvRunnerSettings
from actors.manager import FaultToleranceSettings
from actors.metrics import MetricsLogger
from pipeline.groups.env_runner_group import EnvRunnerGroup

log = logging.getLogger("runnel")

AUTO_STEPS_PER_ENV = 50
EVALUATOR_REQUEST_SLOTS = 4
"""Requests an evaluator may have queued: an "auto" evaluation leaves at most one sample request
running, so the next weights always find a slot, even behind a weights update still queued."""
"""Steps per sub-env of one request in "auto" mode (a request unfinished when training ends is dropped)."""
AUTO_POLL_S = 0.05
"""How often an "auto" evaluation collects answers and sends new requests."""


class Evaluators:
    def __init__(self, config: Any, settings: EnvRunnerSettings, fault_tolerance: FaultToleranceSettings,
                 on_recreated: Callable[[list[int]], None] | None = None,
                 runner_args: dict[str, Any] | None = None, check_started: bool = True) -> None:
        """``runner_args``: ``EnvRunnerGroup``'s runner class and arguments (a multi-agent run's
        ``MultiAgentEnvRunner``s); none for single-agent runs. ``check_started=False``: return once the evaluator
        actors are asked for; ``check_started()`` waits for them."""
        self.config = config
        self.group = EnvRunnerGroup(settings, config.evaluation_num_env_runners, config.num_cpus_per_env_runner,
                                    fault_tolerance, on_recreated=on_recreated, check_started=check_started,
                                    **(runner_args or {}))
        self.lifetime = MetricsLogger()  # lifetime counters across evaluations
        self.weights_version = -1
        self._runs = 0  # tags "auto" requests, so a late answer from an earlier evaluation is dropped

    def check_started(self) -> None:
        """Wait until every evaluator is up; one that failed to start raises, naming it."""
        self.group.check_started()

    def sync_weights(self, weights: dict, version: int, timestep: int, wait: bool = True) -> None:
        """``wait=False``: queue the weights without waiting (an evaluator may still be finishing a
        request of the previous "auto" evaluation; its actor applies them before its next request)."""
        self.group.sync_weights(weights, version, timestep, wait=wait)
        self.weights_version = version

    def run(self, stop: threading.Event | None = None) -> dict[str, Any]:
        """One evaluation with the weights last synced; its results (the ``evaluation`` section)."""
        c, manager = self.config, self.group.manager
        metrics = MetricsLogger()
        episodes: list[tuple[float, int]] = []
        failures0 = manager.num_failures
        self._runs += 1
        self.group.restart_failed()
        requested: int | str = c.evaluation_duration
        if c.evaluation_duration == "auto" and stop is None:  # evaluate() on demand: no training step to end it
            requested = self._run_counted("episodes", max(1, manager.num_healthy()), metrics, episodes)
        elif c.evaluation_duration == "auto":
            self._run_auto(metrics, episodes, stop)
        else:
            requested = self._run_counted(c.evaluation_duration_unit, c.evaluation_duration, metrics, episodes)
        self.group.log_fault_tolerance(metrics)
        return self._result(metrics, episodes, requested, manager.num_failures - failures0)

    # --- the two ways an evaluation lasts ------------------------------------------------------
    def _run_counted(self, unit: str, duration: int, metrics: MetricsLogger, episodes: list) -> int:
        manager, c = self.group.manager, self.config
        k = max(1, manager.num_healthy())
        total = duration if unit == "episodes" else -(-duration // k) * k
        remaining, fresh, idle_rounds = total, c.evaluation_force_reset_envs_before_iteration, 0
        while remaining > 0 and idle_rounds < 3:
            self.group.restart_failed()
            ids = manager.healthy_ids()
            if not ids:
                break
            if unit == "episodes":
                shares = {i: remaining // len(ids) + (n < remaining % len(ids)) for n, i in enumerate(ids)}
                args = {i: (None, s, None, fresh) for i, s in shares.items() if s > 0}
            else:
                per = -(-remaining // len(ids))
                args = {i: (per, None, None, fresh) for i in ids}
            done = 0
            for res in manager.foreach_actor("sample_metrics", actor_ids=list(args), per_actor_args=args,
                                             timeout_s=c.evaluation_sample_timeout_s):
                if res.ok:
                    done += self._fold(res.actor_id, res.value, metrics, episodes, unit)
            remaining -= done
            fresh = True  # a share taken over from a failed evaluator starts fresh episodes
            idle_rounds = 0 if done else idle_rounds + 1
        if remaining > 0:
            log.warning("evaluation ran %d of %d %s: %d evaluator(s) healthy; see evaluation/fault_tolerance in the "
                        "results", total - max(0, remaining), total, unit, manager.num_healthy())
        return total

    def _run_auto(self, metrics: MetricsLogger, episodes: list, stop: threading.Event) -> None:
        manager, c = self.group.manager, self.config
        steps = AUTO_STEPS_PER_ENV * c.num_envs_per_env_runner
        fresh = set(manager.healthy_ids()) if c.evaluation_force_reset_envs_before_iteration else set()
        sent: dict[int, float] = {}
        tag = ("evaluation", self._runs)
        answered = False
        while not stop.is_set():
            now = time.monotonic()
            for i in manager.healthy_ids():
                if not manager.num_in_flight(i) and manager.submit(
                        "sample_metrics", num_timesteps=steps, force_reset=i in fresh, actor_ids=[i], tag=tag):
                    fresh.discard(i)
                    sent[i] = now
            # Sleep on the stop event, not in ray.wait: the training step's end wakes this thread at
            # once, and in between it takes the driver's GIL only a few times per second.
            stop.wait(AUTO_POLL_S)
            for res in manager.fetch_ready(timeout_s=0.0):
                if res.ok and res.tag == tag:
                    self._fold(res.actor_id, res.value, metrics, episodes, "timesteps")
                    answered = True
            if stop.is_set():
                if not answered:  # a training step shorter than one request: report that request
                    self._first_answer(tag, metrics, episodes)
                return
            hung = [i for i in manager.healthy_ids() if manager.num_in_flight(i)
                    and time.monotonic() - sent.get(i, now) > c.evaluation_sample_timeout_s]
            if hung:  # a hung evaluator does not answer a ping either: that fails (and kills) it
                manager.foreach_actor("ping", actor_ids=hung, timeout_s=1.0)

    def _first_answer(self, tag: tuple, metrics: MetricsLogger, episodes: list) -> None:
        manager = self.group.manager
        deadline = time.monotonic() + self.config.evaluation_sample_timeout_s
        while time.monotonic() < deadline and any(manager.num_in_flight(i) for i in manager.healthy_ids()):
            for res in manager.fetch_ready(timeout_s=AUTO_POLL_S):
                if res.ok and res.tag == tag:
                    self._fold(res.actor_id, res.value, metrics, episodes, "timesteps")
                    return

    def _fold(self, runner_id: int, value: dict, metrics: MetricsLogger, episodes: list, unit: str) -> int:
        export = value["metrics"]
        self.group.fold_metrics(runner_id, export, metrics)
        self.group.fold_metrics(runner_id, {k: v for k, v in export.items() if v.get("reduce") == "lifetime_sum"},
                                self.lifetime)
        episodes.extend(zip(value["episode_returns"], value["episode_lengths"]))
        return len(value["episode_returns"]) if unit == "episodes" else value["num_env_steps"]

    def _result(self, metrics: MetricsLogger, episodes: list, requested: int | str, failures: int) -> dict[str, Any]:
        result = metrics.reduce()
        lifetime = self.lifetime.reduce()
        for section, values in lifetime.items():
            if isinstance(values, dict):
                result.setdefault(section, {}).update(values)
        env = result.setdefault("env_runners", {})
        for key in ("episode_return_mean", "episode_return_min", "episode_return_max", "episode_len_mean"):
            env.setdefault(key, math.nan)
        for key in ("num_episodes", "num_env_steps_sampled", "num_env_steps_sampled_lifetime", "num_episodes_lifetime"):
            env.setdefault(key, 0)
        result["hist_stats"] = {"episode_return": [r for r, _ in episodes], "episode_lengths": [n for _, n in episodes]}
        result["weights_version"] = self.weights_version
        result["evaluation_duration"] = requested
        result["num_failed_env_runners"] = failures
        result["num_healthy_env_runners"] = self.group.manager.num_healthy()
        return result

    def stop(self) -> None:
        self.group.stop()


def summarize_episodes(runner_metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Runners' ``get_metrics()`` exports (see ``collect_episodes``) -> episode statistics, under
    runnel's names and RLlib's older ones (``episode_reward_mean``, ``episodes_this_iter``)."""
    metrics = MetricsLogger()
    for export in runner_metrics:
        metrics.merge({k: v for k, v in export.items() if "/" not in k})
    out = metrics.reduce()
    nan = math.nan
    out.update({"episode_reward_mean": out.get("episode_return_mean", nan),
                "episode_reward_min": out.get("episode_return_min", nan),
                "episode_reward_max": out.get("episode_return_max", nan),
                "episodes_this_iter": out.get("num_episodes", 0)})
    return out


def collect_episodes(workers: EnvRunnerGroup, timeout_seconds: float | None = None) -> list[dict[str, Any]]:
    """What each runner of ``workers`` logged since it was last asked (for ``summarize_episodes``)."""
    results = workers.manager.foreach_actor("get_metrics", timeout_s=timeout_seconds)
    return [r.value for r in results if r.ok]
