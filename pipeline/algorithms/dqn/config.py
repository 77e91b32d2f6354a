"""DQN's settings: ``DQNConfig`` (the off-policy plan's, plus the Rainbow switches)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from pipeline.config.base import AlgorithmConfig
from pipeline.config.checks import check_schedule, is_int, is_number
from pipeline.plans.offpolicy import OffPolicySettings, recurrent, sequence_length

TD_ERROR_LOSS_FNS = ("huber", "mse")


@dataclass
class DQNConfig(OffPolicySettings, AlgorithmConfig):
    algo_name = "DQN"
    algorithm_module = "pipeline.algorithms.dqn.algorithm"
    supports_recurrent: ClassVar[bool] = True
    """``model_config`` ``use_lstm``: R2D2 -- sequences replayed with their stored states (``recurrent.py``)."""

    num_envs_per_env_runner: int = 8
    """Sub-environments each runner steps as one vector."""
    rollout_fragment_length: int | str = 4
    """Steps per sub-env per training step (then the learner catches up with the replay ratio)."""
    lr: float | list = 5e-4
    """Learning rate, or a piecewise-linear schedule ``[[timestep, lr], ...]``."""
    grad_clip: float | None = 10.0
    """Clip threshold for gradients (global norm by default)."""
    train_batch_size_per_learner: int = 128
    """Transitions per replayed batch (one learner update each). 128 rather than 64: on CartPole half the
    updates for the same replay ratio, and seeds 0-2 reached 450 in fewer env steps (68-91k against 86-143k)."""
    training_intensity: float | None = 16.0
    """Transitions trained per transition sampled (the replay ratio); None: one update per training step."""
    replay_buffer_config: dict = field(default_factory=lambda: {
        "type": "PrioritizedEpisodeReplayBuffer", "capacity": 50_000, "alpha": 0.6, "beta": 0.4})
    """See ``OffPolicySettings``: prioritized replay by default, as RLlib's DQN."""
    min_sample_timesteps_per_iteration: int = 1000
    """Env steps one ``train()`` samples at least (RLlib's DQN default): a training step samples only
    32, and a result for each would cost more than the step."""
    n_step: int | list = field(default_factory=lambda: [2, 5])
    """n-step returns, computed at sample time: an int, or ``[lo, hi]`` drawn per transition."""
    num_steps_sampled_before_learning_starts: int = 1000
    """Env steps stored before the first update."""
    target_network_update_freq: int = 500
    """Update the target network every this many env steps sampled."""
    tau: float = 1.0
    """Target update: 1.0 copies the network, smaller values average (target = tau * net + (1 - tau) * target)."""
    double_q: bool = True
    """Pick the next action with the online network, value it with the target network (van Hasselt et al.)."""
    dueling: bool = True
    """A state-value stream plus mean-centred advantages."""
    num_atoms: int = 1
    """Atoms of the return distribution (> 1: C51, Discrete actions only)."""
    v_min: float = -10.0
    """Lowest return the distribution's support covers."""
    v_max: float = 10.0
    """Highest return the distribution's support covers."""
    epsilon: list = field(default_factory=lambda: [[0, 1.0], [10_000, 0.02]])
    """Epsilon-greedy schedule ``[[timestep, epsilon], ...]`` over env steps sampled (off when explore=False)."""
    burn_in: bool = False
    """Recurrent modules (``use_lstm``): before a replayed sequence, the networks run without gradients over the
    chunk before it in its episode, from that chunk's stored state, to refresh the state the sequence starts
    from (R2D2's burn-in, over one previous chunk of up to ``max_seq_len`` steps)."""
    use_h_function: bool = False
    """Recurrent modules (R2D2): learn h-rescaled returns, h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x, so that
    large returns do not dominate the loss (RLlib's old R2D2 option; R2D2 used it on Atari's unclipped rewards)."""
    h_function_epsilon: float = 1e-3
    """The eps of ``use_h_function`` (> 0; it keeps h invertible)."""
    td_error_loss_fn: str = "huber"
    """Loss on the TD error: "huber" or "mse" (ignored with num_atoms > 1, which uses cross-entropy)."""
    model_config: dict = field(default_factory=lambda: {"fcnet_activation": "relu"})
    """Default module settings (see ``actors.modules.ModelConfig``): ReLU trunks of [64, 64] on flat observations,
    the Nature CNN alone on images."""

    def module_kwargs(self) -> dict[str, Any]:
        return {"dueling": self.dueling, "num_atoms": self.num_atoms, "v_min": self.v_min, "v_max": self.v_max}

    def default_exploration(self) -> dict[str, Any]:
        return {"type": "EpsilonGreedy", "epsilon_schedule": [list(p) for p in self.epsilon]}

    def _problems(self) -> list[str]:
        problems = super()._problems() + self.offpolicy_problems()
        if self.td_error_loss_fn not in TD_ERROR_LOSS_FNS:
            problems.append(f"td_error_loss_fn={self.td_error_loss_fn!r} is not one of {list(TD_ERROR_LOSS_FNS)}")
        if not is_int(self.num_atoms) or self.num_atoms < 1:
            problems.append(f"num_atoms must be an int >= 1, got {self.num_atoms!r}")
        if not (is_number(self.v_min) and is_number(self.v_max) and self.v_min < self.v_max):
            problems.append(f"v_min must be below v_max, got v_min={self.v_min!r}, v_max={self.v_max!r}")
        if not is_int(self.target_network_update_freq) or self.target_network_update_freq < 1:
            problems.append(f"target_network_update_freq must be an int >= 1, got {self.target_network_update_freq!r}")
        if not is_number(self.tau) or not 0 < self.tau <= 1:
            problems.append(f"tau must be in (0, 1], got {self.tau!r}")
        problems += [p.replace("epsilon must", "epsilon must be a schedule; it must") for p in
                     check_schedule("epsilon", self.epsilon) if not isinstance(self.epsilon, (int, float))]
        problems += self._recurrent_problems()
        if isinstance(self.epsilon, (int, float)):
            problems.append(f"epsilon must be a schedule [[timestep, epsilon], ...], got {self.epsilon!r}; "
                            f"a constant is [[0, {self.epsilon}]]")
        return problems


    def _recurrent_problems(self) -> list[str]:
        max_seq_len = sequence_length(self)
        if not isinstance(self.burn_in, bool):
            return [f"burn_in must be True or False, got {self.burn_in!r} (it unrolls one previous chunk of up to "
                    f"max_seq_len steps; set model_config max_seq_len for a longer burn-in)"]
        if not isinstance(self.use_h_function, bool):
            return [f"use_h_function must be True or False, got {self.use_h_function!r}"]
        if not is_number(self.h_function_epsilon) or self.h_function_epsilon <= 0:
            return [f"h_function_epsilon must be a number > 0, got {self.h_function_epsilon!r}"]
        if not recurrent(self):
            return [f"{key}=True is for recurrent modules (R2D2): set model_config use_lstm=True, or {key}=False"
                    for key in ("burn_in", "use_h_function") if getattr(self, key)]
        problems = []
        fragment = self.get_rollout_fragment_length()
        if is_int(max_seq_len) and is_int(fragment) and fragment < max_seq_len:
            problems.append(f"rollout_fragment_length={fragment} with use_lstm=True cuts sequences of {fragment} steps, "
                            f"each stored in a slot of max_seq_len={max_seq_len}: set rollout_fragment_length="
                            f"{max_seq_len} (or a multiple), or lower max_seq_len")
        if self.num_atoms != 1:
            problems.append(f"num_atoms={self.num_atoms} with use_lstm=True: recurrent DQN learns one Q-value per "
                            f"action; set num_atoms=1")
        c = self.replay_buffer_config if isinstance(self.replay_buffer_config, dict) else {}
        for key, why in (("remote", "the replay actor stores transitions"),
                         ("prefill_from", "recordings are replayed as transitions")):
            if c.get(key) not in (None, False):
                problems.append(f"replay_buffer_config {key}={c[key]!r} with use_lstm=True: not built for sequence "
                                f"replay ({why}); leave it unset")
        if (self.offline_data_config or {}).get("input_") is not None:
            problems.append("offline input with DQN use_lstm=True: recorded chunks carry no recurrent states; "
                            "leave input_ unset")
        if self.learner_connector is not None:
            problems.append("learner_connector with DQN use_lstm=True: the sequence replay runs no learner pipeline; "
                            "leave it unset")
        return problems

