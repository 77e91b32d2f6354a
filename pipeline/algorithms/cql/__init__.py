"""CQL: conservative Q-learning (Kumar et al., 2020) on top of SAC, trained from recordings.

Offline RL's failure mode is a critic that overrates actions the data never took: the actor
climbs toward them and the policy falls apart. CQL adds a regularizer to SAC's critic loss that
pushes Q down on actions drawn from outside the data (uniform random actions, and the current
policy's actions at ``s`` and ``s'``) -- a soft maximum over them, ``temperature * logsumexp(Q /
temperature)`` -- and up on the recorded actions, weighted by ``min_q_weight``. With
``lagrangian=True`` that weight is learned instead, so the gap stays near ``lagrangian_thresh``.
For the first ``bc_iters`` updates the actor imitates the recorded actions (behaviour cloning)
before it follows the critic.

Data flow: readers (``actors.offline.OfflineReader``) take the env runners' place and hand
recorded chunks to SAC's off-policy plan, whose replay stage stores them and samples transitions
(``next_obs``, n-step discounts) exactly as for online SAC; so CQL reuses the plan, the replay
and SAC's losses unchanged and adds only its regularizer. The replay acts as a large shuffle
buffer over the recording (``replay_buffer_config.capacity`` >= the recording's steps keeps all
of it). CQL extends SAC as in the paper: ``CQLConfig`` adds CQL's settings to ``SACConfig`` and
``CQLLearner`` replaces the critic step of ``SACLearner`` -- one level, nothing deeper.
"""
from pipeline.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ["CQLConfig"],
    ".learner": ["cql_regularizer", "CQLLearner", "bc_actor_loss"],
    ".algorithm": ["CQL"],
}, first=".algorithm")
