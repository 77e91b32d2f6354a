"""PPO: proximal policy optimization (Schulman et al., 2017), synchronous.

Each training step: every env runner samples its share of ``train_batch_size_per_learner``
steps with the current weights; the learner(s) compute GAE with their own value function and
run ``num_epochs`` passes of minibatch SGD on the clipped surrogate loss; new weights go out.
Here: ``config.py`` (``PPOConfig``), ``learner.py`` (``ppo_loss``, a pure function of module, batch
and config, and ``PPOLearner``: its update and its one piece of state, the KL coefficient) and
``algorithm.py`` (``PPO``: the step).

The defaults solve CartPole-v1 and are sound elsewhere (``tuned/cartpole-ppo.yaml`` holds CartPole's faster
settings: half the env steps); scale ``train_batch_size_per_learner`` up for harder tasks.
"""
from pipeline.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ["PPOConfig"],
    ".learner": ["ppo_loss", "PPOLearner"],
    ".algorithm": ["PPO"],
}, first=".algorithm")
