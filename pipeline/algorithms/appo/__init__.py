"""APPO: asynchronous PPO with V-trace and a target network (IMPACT, Luo et al., 2020), as in RLlib.

The loop is IMPALA's (``pipeline.plans.asynchronous.AsyncPlan``); APPO changes what a learner does with a
batch and where batches come from:

* **Target network**: a frozen copy of the policy, refreshed every ``target_network_update_freq``
  updates. It is the "old" policy of the PPO clip ratio and of the KL term, and the target policy
  of V-trace (the behaviour policy is the runners' slightly older one).
* **Surrogate**: ``ratio = clip(pi_behaviour / pi_target, 0, target_worker_clipping) * pi / pi_behaviour``
  (about ``pi / pi_target``), clipped to ``1 +- clip_param`` as in PPO, times the V-trace
  policy-gradient advantages; value loss to the V-trace targets; entropy bonus; optionally an
  adaptive KL(target || current) penalty whose coefficient is tuned at each target update.
* **Circular buffer**: each train batch from the queue joins a buffer of
  ``circular_buffer_num_batches``; every update trains on a random buffered batch, and a batch
  leaves after ``circular_buffer_iterations_per_batch`` updates (or when it is the oldest and a new
  batch comes in). A learner faster than the runners reuses data up to K times instead of waiting.

With ``num_learners=n > 0`` each learner actor keeps its own circular buffer and target network and
is fed by its own env runners (``actors.learner.feed``); their gradients are averaged, so the learners'
weights -- and hence their target networks -- stay identical.
"""
from pipeline.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ["APPOConfig"],
    ".learner": ["appo_loss", "APPOLearner", "CircularBuffer"],
    ".algorithm": ["APPO"],
}, first=".algorithm")
