"""IMPALA: importance-weighted actor-learner architecture (Espeholt et al., 2018), asynchronous.

Runners stream fragments, the learner trains on whatever arrives and corrects the policy lag with
V-trace (the ratio of the learner's and the behaviour policy's action probabilities); the loop is
``pipeline.plans.asynchronous.AsyncPlan``. Here: ``config.py`` (``IMPALAConfig``), ``learner.py``
(``impala_loss``, a pure function of module, batch and config, and ``IMPALALearner``) and ``algorithm.py``
(``IMPALA``). With ``num_learners=0`` the learner runs in
the driver beside the loader thread that receives every stream; with ``num_learners=n`` it runs as n Ray
actors, each receiving the streams of its own env runners (runner i feeds learner ``i mod n``) and
cutting its own batches of ``train_batch_size_per_learner`` steps, gradients averaged every minibatch
and weights broadcast from learner 0 (``actors.learner.feed``, ``pipeline.plans.learner_feeds``); with
external clients the slots' policy servers feed the learners as runners do; in multi-agent runs each
learner is a ``MultiLearner`` whose feed keeps every module's batches apart (``actors.learner.feed.ModuleFeed``).
"""
from pipeline.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ["IMPALAConfig"],
    ".learner": ["impala_loss", "IMPALALearner"],
    ".algorithm": ["IMPALA"],
}, first=".algorithm")
