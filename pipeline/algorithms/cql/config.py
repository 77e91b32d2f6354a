"""CQL's settings: ``CQLConfig``, SAC's plus the regularizer's."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.algorithms.sac.config import SACConfig
from pipeline.config.checks import is_number
from pipeline.config.offline import input_required_problems


@dataclass
class CQLConfig(SACConfig):
    algo_name = "CQL"
    algorithm_module = "pipeline.algorithms.cql.algorithm"

    bc_iters: int = 20_000
    """Updates during which the actor imitates the recorded actions (then it maximizes Q as SAC's)."""
    temperature: float = 1.0
    """Temperature of the soft maximum over out-of-data actions in the regularizer."""
    num_actions: int = 10
    """Actions sampled per state for that soft maximum (each of: uniform random, policy at s, policy at s')."""
    min_q_weight: float = 5.0
    """Weight of the regularizer (with ``lagrangian``: its scale before the learned multiplier)."""
    lagrangian: bool = False
    """Learn the regularizer's multiplier so that the Q gap stays near ``lagrangian_thresh``."""
    lagrangian_thresh: float = 5.0
    """Target gap between the soft maximum and the data's Q when ``lagrangian`` is on."""
    rollout_fragment_length: int | str = 1000
    """Recorded steps a reader hands to replay per training step."""
    min_sample_timesteps_per_iteration: int = 0
    """CQL samples no env (a training step reads ``rollout_fragment_length`` recorded steps): one per ``train()``."""
    training_intensity: float | None = 256.0
    """Transitions trained per transition read: 256 with batches of 256 is one update per recorded step read."""
    num_steps_sampled_before_learning_starts: int = 10_000
    """Recorded steps in replay before the first update."""
    replay_buffer_config: dict = field(default_factory=lambda: {"type": "EpisodeReplayBuffer", "capacity": 1_000_000})
    """See ``OffPolicySettings``: the replay holds (up to ``capacity`` steps of) the recording."""
    actor_lr: float | list = 1e-4
    """Learning rate of the policy (CQL's paper: lower than the critic's)."""
    critic_lr: float | list = 3e-4
    """Learning rate of the twin critics."""

    def _problems(self) -> list[str]:
        problems = super()._problems() + input_required_problems(self)
        for key in ("bc_iters", "num_actions"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "num_actions" else 0):
                problems.append(f"{key} must be an int >= {1 if key == 'num_actions' else 0}, got {value!r}")
        for key in ("temperature", "min_q_weight", "lagrangian_thresh"):
            value = getattr(self, key)
            if not is_number(value) or value < 0 or (key == "temperature" and value == 0):
                problems.append(f"{key} must be a number {'> 0' if key == 'temperature' else '>= 0'}, got {value!r}")
        return problems

