"""DQN (Mnih et al., 2015) with the Rainbow parts RLlib offers: double Q, dueling heads, n-step
returns, prioritized replay, distributional atoms (C51); Discrete actions, and MultiDiscrete
actions as branches.

Each training step: env runners sample with epsilon-greedy exploration, the chunks go into the
replay stage, and the learner trains on replayed batches as often as the replay ratio
(``training_intensity``) allows; the target network follows every ``target_network_update_freq``
env steps (``tau`` < 1: Polyak averaging). The loop is ``pipeline.plans.offpolicy.OffPolicyPlan``.
Here: ``config.py`` (``DQNConfig``), ``learner.py`` (``dqn_loss``, a pure function of module, target,
batch and config, and ``DQNLearner``), ``recurrent.py`` (R2D2's loss) and ``algorithm.py`` (``DQN``).
"""
from pipeline.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ["DQNConfig"],
    ".learner": ["dqn_loss", "categorical_projection", "DQNLearner"],
    ".recurrent": ["r2d2_loss"],
    ".algorithm": ["DQN"],
}, first=".algorithm")
