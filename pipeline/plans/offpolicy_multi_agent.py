"""The off-policy plan's multi-agent training step: each trainable module replays its own experience.

``OffPolicyPlan`` hands a multi-agent run's training step here. Each step samples one round from
the runners (per-agent chunks tagged with module ids), routes every module's chunks into that
module's own buffer (``actors.replay.MultiAgentReplay``; frozen modules keep none), then runs the
update rounds owed: in each round every trainable module whose buffer holds a batch samples its own
batch, and all of them are updated in one ``MultiLearnerGroup.update_replayed`` call (one optimizer
set and one target network per module, in that module's learner). Prioritized replay's TD errors go
back to the buffer each batch came from.

The replay ratio counts in the run's ``count_steps_by`` unit, as RLlib's off-policy algorithms count
it: ``training_intensity`` (transitions trained per step sampled, per module) owes
``training_intensity / train_batch_size_per_learner`` update rounds per env step -- or per agent step
with ``count_steps_by="agent_steps"`` -- sampled once ``num_steps_sampled_before_learning_starts``
such steps were sampled; without it, one round per training step. The debt is counted here, not by
each buffer's rate limiter, because a buffer only sees its own module's agent steps: with a module
shared by two agents, or agents that act in turns, those are not the steps the ratio is set in. A
round in which no trainable module holds a batch yet is skipped, and the debt with it, so a module
that rarely plays never unlocks a burst of updates later. The learners' schedules, the target
network's update frequency and the runners' exploration all follow the same count.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from actors.metrics import MetricsLogger
from actors.replay import MultiAgentReplay, ReplaySettings
from actors.replay.intake import ReplayIntake
from pipeline.groups.env_runner_group import EnvRunnerGroup
from pipeline.config.connectors import replay_side_intake
from pipeline.groups.multi_agent import MultiLearnerGroup


class MultiAgentOffPolicy:
    def __init__(self, config: Any, settings: ReplaySettings, env_runners: EnvRunnerGroup,
                 learners: MultiLearnerGroup, metrics: MetricsLogger, multi_agent: Any, mix: Any = None) -> None:
        """``settings``: the run's replay settings (``OffPolicySettings.replay_settings``); ``multi_agent``:
        the run's ``MultiAgentSetup`` (its plan's trainable modules and ``count_steps_by``); ``mix``: recorded
        steps mixed into each round (``input_={"sampler": p, "DIR": q}`` of a multi-agent recording; its chunks
        carry their module ids to the modules' buffers), or None."""
        self.config, self.env_runners, self.learners, self.metrics = config, env_runners, learners, metrics
        self.mix = mix
        self.multi_agent = multi_agent
        self.batch_size = int(config.train_batch_size_per_learner)
        self.steps_per_training_step = config.steps_per_training_step()
        self.prioritized = settings.prioritized
        self.rounds_per_step = float(settings.samples_per_insert) / self.batch_size
        """Update rounds owed per step sampled (``count_steps_by`` units)."""
        self.learning_starts = int(settings.min_size_to_sample)
        """Steps sampled (``count_steps_by`` units) before the first update round."""
        # no limiter per buffer: the run-wide start and the ratio are counted here, and a module is
        # sampled for once its buffer holds a batch (``ready``)
        per_module = replace(settings, samples_per_insert=None, min_size_to_sample=1, error_buffer=None)
        # read from the live plan: modules added, removed, frozen or unfrozen while training
        self.replay = MultiAgentReplay(per_module, [m for m in multi_agent.module_ids if self.replays(m)],
                                       keeps=self.replays, intake_for=self.intake_for, view_for=self.view_for)
        self.rounds_owed = 0.0
        self._dropped_reported = 0

    def intake_for(self, module_id: str) -> ReplayIntake | None:
        """The run's learner pipeline for module ``module_id``'s spaces (for what its chunks hold: the recorded
        frames where a view stacks them), run by its buffer (None without one)."""
        spec = self.multi_agent.plan.module_specs.get(module_id)
        if spec is None:
            return None
        view = self.view_for(module_id)
        obs_space = spec.observation_space if view is None else view.recorded_space
        return replay_side_intake(self.config, obs_space, spec.action_space)

    def view_for(self, module_id: str) -> Any:
        """Module ``module_id``'s env-to-module view (frame stacking), rebuilt by its buffer; None without."""
        connectors = self.multi_agent.connectors
        if connectors is None or module_id not in connectors.look_back:
            return None
        return connectors.observation_view(module_id)

    def replays(self, module_id: str) -> bool:
        """Whether the run trains ``module_id`` now (a ``policies_to_train`` function: every module
        replays, and the function decides per batch in the learner group)."""
        plan = self.multi_agent.plan
        return module_id in plan.module_specs and (plan.trainable is None or module_id in plan.trainable)

    def sampled_lifetime(self) -> int:
        """Steps the run sampled so far, in its ``count_steps_by`` unit."""
        m = self.metrics
        return int(self.multi_agent.runner_timestep(m, int(m.peek("env_runners/num_env_steps_sampled_lifetime", 0))))

    def training_step(self) -> None:
        m = self.metrics
        before = self.sampled_lifetime()
        with m.log_time("timers/env_runner_sampling_timer"):
            chunks = self.env_runners.sample(self.steps_per_training_step, m)
        timestep = self.sampled_lifetime()
        if self.mix is not None:  # in proportion to the steps sampled (count_steps_by units)
            chunks = chunks + self.mix.sample(timestep - before, m)
        with m.log_time("timers/replay_insert"):
            for mid in self.replay.module_ids:
                if mid not in self.multi_agent.plan.module_specs:  # removed from the run
                    self.replay.drop(mid)
            self.replay.add(chunks)
        self.rounds_owed += self.rounds_per_step * max(0, timestep - max(before, self.learning_starts))
        with m.log_time("timers/learner_update_timer", reduce="sum"):
            # one round per learner call: drawing the rounds owed together (as the single-agent plan does)
            # left the two-agent CartPole test's seed 0 at 666 of 800 by 300k env steps, and seeds 0-4
            # spread wider (136k-251k to 800) than one round at a time (149k-192k)
            while self.rounds_owed >= 1:
                ready = self.replay.ready(self.batch_size)
                if not ready:
                    self.rounds_owed = 0.0
                    break
                self.update_round(ready, timestep)
                self.rounds_owed -= 1
        with m.log_time("timers/synch_weights"):
            weights = self.learners.get_weights(inference_only=True)
            self.env_runners.sync_weights(weights, self.learners.weights_version, timestep)
        self.report_replay()

    def update_round(self, module_ids: list[str], timestep: int) -> None:
        """One batch per module from its own buffer, one update of them all, priorities back where they came from."""
        batches = self.replay.sample(self.batch_size, module_ids)
        _, outputs = self.learners.update_replayed(batches, timestep, self.metrics, with_outputs=self.prioritized)
        for mid, out in outputs.items():
            if "td_error" in out:  # none: the learners refused that module's batch
                self.replay.update_priorities(mid, batches[mid]["indices"], out["td_error"])

    def report_replay(self) -> None:
        m = self.metrics
        for mid, exported in self.replay.get_metrics().items():
            m.merge(exported, prefix=f"replay/{mid}")
        dropped = self.replay.num_steps_dropped
        m.log_value("replay/num_frozen_steps_dropped", dropped - self._dropped_reported, reduce="lifetime_sum")
        self._dropped_reported = dropped

    def get_state(self) -> dict[str, Any]:
        return {"replay": self.replay.get_state(), "rounds_owed": self.rounds_owed}

    def set_state(self, state: dict[str, Any]) -> None:
        self.replay.set_state(state["replay"])
        self.rounds_owed = float(state["rounds_owed"])
        self._dropped_reported = self.replay.num_steps_dropped

    def stop(self) -> None:
        self.replay.stop()
