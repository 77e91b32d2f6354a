"""MARWIL: monotonic advantage re-weighted imitation learning (Wang et al., 2018), from recordings.

Trains on recorded experience (``config.offline_data(input_=DIR)``; readers take the env
runners' place, so no env is stepped -- an env, if given, serves evaluation only). Each training
step reads ``train_batch_size_per_learner`` recorded steps; the learner estimates advantages with
its own value function (GAE with ``lambda_``, 1.0 by default: discounted returns bootstrapped at
a chunk's cut-off end), and fits the policy by log-likelihood of the recorded actions weighted by
``exp(beta * advantage / sqrt(c))``, where ``c`` is a slow moving average of squared advantages.
``beta = 0`` is plain behaviour cloning (``pipeline.algorithms.bc``). Here: ``config.py``
(``MARWILConfig``), ``learner.py`` (``marwil_loss``, pure, and ``MARWILLearner``: its one piece of state is
the moving average) and ``algorithm.py`` (``MARWIL``).
"""
from pipeline.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ["MARWILConfig"],
    ".learner": ["marwil_loss", "MARWILLearner"],
    ".algorithm": ["offline_training_step", "MARWIL"],
}, first=".algorithm")
