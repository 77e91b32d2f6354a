"""SAC: soft actor-critic (Haarnoja et al., 2018) with twin critics, target critics and automatic
entropy tuning, for Box actions.

Each training step: env runners sample from the squashed-Gaussian policy, the chunks go into the
replay stage, and the learner trains on replayed batches as often as the replay ratio allows
(``pipeline.plans.offpolicy.OffPolicyPlan``). One update: the critics toward
``r + discount * (min target Q(s', a') - alpha * log pi(a'|s'))``, the actor toward
``min Q(s, a) - alpha * log pi(a|s)``, the temperature toward ``target_entropy``, each with its own
optimizer and learning rate; the target critics follow by Polyak averaging (``tau``). Here:
``config.py`` (``SACConfig``), ``learner.py`` (the three losses, pure functions of module, batch and
config, and ``SACLearner``) and ``algorithm.py`` (``SAC``).
"""
from pipeline.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    ".config": ["SACConfig"],
    ".learner": ["sac_critic_loss", "sac_actor_loss", "sac_alpha_loss", "SACLearner"],
    ".algorithm": ["SAC"],
}, first=".algorithm")
