"""BC: behaviour cloning from recordings -- MARWIL with ``beta = 0`` and no value function.

The policy is fit by maximum likelihood of the recorded actions
(``pipeline.algorithms.marwil.learner.marwil_loss`` with unit weights); everything else, reading and
evaluation included, is MARWIL's (``MARWILLearner``, ``offline_training_step``).
"""
from pipeline.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ["BCConfig"],
    ".algorithm": ["BC"],
}, first=".algorithm")
