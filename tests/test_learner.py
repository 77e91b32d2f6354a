"""Learner mechanics without an environment: lr schedules, gradient clipping, state round trip."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.learner import piecewise
from pipeline.algorithms.ppo.config import PPOConfig
from pipeline.algorithms.ppo.learner import PPOLearner

OBS, ACT = gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(2)


class NoOpPPOLearner(PPOLearner):
    """PPO's learner with an update that does nothing: the base mechanics on their own."""

    def train_on_batch(self, chunks, timestep):
        return {}


def make_learner(**training):
    cfg = PPOConfig(seed=0, model_config={"fcnet_hiddens": [8]}, **training)
    return NoOpPPOLearner(cfg, OBS, ACT)


def big_loss(learner):
    out = learner.module.forward_train(torch.ones(4, 3))
    return 1e4 * (out["action_dist_inputs"].sum() + out["vf_preds"].sum())


def test_piecewise_schedule_interpolates_and_holds():
    sched = [[0, 1.0], [100, 0.5], [300, 0.1]]
    assert piecewise(sched, 0) == 1.0
    assert piecewise(sched, 50) == pytest.approx(0.75)
    assert piecewise(sched, 200) == pytest.approx(0.3)
    assert piecewise(sched, 10_000) == pytest.approx(0.1)
    assert piecewise(3e-4, 123) == 3e-4


def test_lr_follows_the_schedule_by_sampled_timesteps():
    learner = make_learner(lr=[[0, 1e-2], [1000, 1e-3]])
    assert learner.update([], timestep=500)["curr_lr"] == pytest.approx(5.5e-3)
    assert learner.optimizers["default"].optimizer.param_groups[0]["lr"] == pytest.approx(5.5e-3)


@pytest.mark.parametrize("by", ["value", "norm", "global_norm"])
def test_gradient_clipping_modes(by):
    learner = make_learner(grad_clip=0.5, grad_clip_by=by)
    learner.optimizers["default"].optimizer.step = lambda: None  # inspect the clipped gradients, keep the weights
    norm = learner.apply_gradients(big_loss(learner))
    grads = [p.grad for p in learner.module.parameters() if p.grad is not None]
    if by == "value":
        assert max(float(g.abs().max()) for g in grads) <= 0.5 + 1e-6
    elif by == "norm":
        assert all(float(torch.linalg.vector_norm(g)) <= 0.5 + 1e-5 for g in grads)
    else:
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        assert float(total) == pytest.approx(0.5, rel=1e-4)
        assert norm > 0.5  # the reported norm is the one before clipping


class LoopAdamLearner(NoOpPPOLearner):
    """Adam's unfused path (IMPALA's and APPO's on a CPU): ``sgd`` reads each step's norm before stepping."""
    fused_adam = False


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("by", ["global_norm", "value", None])
def test_a_step_with_a_non_finite_gradient_is_skipped_and_the_next_one_trains(caplog, bad, by, fused):
    """Skipped alike whether the step is decided at once (``apply_gradients``, an unfused Adam in ``sgd``) or by
    a fused Adam told the norm was not finite, its norm read after the minibatch loop (``sgd``)."""
    cfg = PPOConfig(seed=0, model_config={"fcnet_hiddens": [8]}, grad_clip=None if by is None else 0.5,
                    grad_clip_by=by or "global_norm")
    learner = (NoOpPPOLearner if fused else LoopAdamLearner)(cfg, OBS, ACT)
    assert bool(learner.optimizers["default"].optimizer.defaults.get("fused")) == fused
    learner.apply_gradients(big_loss(learner))  # the optimizer has moments to spoil
    weights = {k: v.clone() for k, v in learner.module.state_dict().items()}
    moments = {i: {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
               for i, st in learner.optimizers["default"].optimizer.state_dict()["state"].items()}
    updates = learner.num_updates
    with caplog.at_level("WARNING", logger="runnel"):
        norm = learner.apply_gradients(big_loss(learner) * bad)
    assert not np.isfinite(norm)
    assert learner.num_gradient_steps_skipped == 1 and learner.num_updates == updates
    assert "skipped a gradient step with a non-finite gradient norm" in caplog.text
    for k, v in learner.module.state_dict().items():
        assert torch.equal(v, weights[k]), k
    for i, st in learner.optimizers["default"].optimizer.state_dict()["state"].items():
        for k, v in moments[i].items():
            assert torch.equal(st[k], v), (i, k)
    # a minibatch loop leaves the skipped step out of its means and says how many it skipped
    losses = iter([big_loss(learner) * bad, big_loss(learner)])
    stats = learner.sgd({"x": torch.zeros(8, 1)}, lambda mb: (next(losses), {"policy_loss": torch.tensor(2.0)}),
                        8, 4, 2, 1)
    assert stats["num_gradient_steps_skipped"] == 1.0 and stats["policy_loss"] == 2.0
    assert np.isfinite(stats["gradients_global_norm"])
    assert learner.num_gradient_steps_skipped == 2 and learner.num_updates == updates + 1
    assert all(torch.isfinite(p).all() for p in learner.module.parameters())
    assert any(not torch.equal(v, weights[k]) for k, v in learner.module.state_dict().items())
    # the skipped step left the optimizer's step count alone: one step in sgd after the one before
    assert all(int(st["step"]) == 2 for st in learner.optimizers["default"].optimizer.state_dict()["state"].values())
    # and a skipped sgd step leaves nothing behind that would skip the next direct step
    weights = {k: v.clone() for k, v in learner.module.state_dict().items()}
    assert np.isfinite(learner.apply_gradients(big_loss(learner))) and learner.num_updates == updates + 2
    assert any(not torch.equal(v, weights[k]) for k, v in learner.module.state_dict().items())


def test_state_round_trip_restores_module_optimizer_and_rng():
    a = make_learner()
    a.apply_gradients(big_loss(a))
    a.kl_coeff = 0.3
    state = a.get_state()
    b = make_learner()
    b.set_state(state)
    for k, v in a.module.state_dict().items():
        torch.testing.assert_close(b.module.state_dict()[k], v, rtol=0, atol=0)
    assert b.kl_coeff == 0.3
    np.testing.assert_array_equal(a.minibatches(10, 5, 2)[0], b.minibatches(10, 5, 2)[0])


def test_minibatch_count_is_fixed_by_config_even_for_small_shards():
    learner = make_learner()
    batches = learner.minibatches(n=7, minibatch_size=4, num_minibatches=3)
    assert len(batches) == 3 and all(len(b) == 4 for b in batches)
    assert set(np.concatenate(batches)) == set(range(7))


# --- a learner with two optimizers, a target network and its own fields ---------------------------
class TwinLearner(PPOLearner):
    """Actor and critic trained by separate optimizers with their own lr schedules, a target copy
    of the module refreshed by Polyak averaging, and a temperature field -- the shape SAC will have."""

    state_fields = ("kl_coeff", "alpha", "num_target_updates")

    def __init__(self, cfg):
        self.alpha = 0.5
        self.num_target_updates = 0
        super().__init__(cfg, OBS, ACT)

    def build_targets(self):
        target = self.module_class(OBS, ACT, self.settings.model_config)
        target.set_state(self.module.get_state())
        return {"target": target}

    def build_optimizers(self):
        from actors.learner import Optimizer

        actor = [p for n, p in self.module.named_parameters() if not n.startswith("vf_")]
        critic = [p for n, p in self.module.named_parameters() if n.startswith("vf_")]
        return {"actor": Optimizer(torch.optim.Adam(actor, lr=1e-3), actor, [[0, 1e-3], [100, 1e-4]]),
                "critic": Optimizer(torch.optim.Adam(critic, lr=5e-3), critic, 5e-3)}

    def train_on_batch(self, obs, timestep):
        out = self.module.forward_train(obs)
        self.apply_gradients(out["action_dist_inputs"].pow(2).mean(), "actor")
        out = self.module.forward_train(obs)
        self.apply_gradients((out["vf_preds"] - 1.0).pow(2).mean(), "critic")
        with torch.no_grad():
            for t, s in zip(self.targets["target"].parameters(), self.module.parameters()):
                t.mul_(0.9).add_(0.1 * s)
        self.num_target_updates += 1
        self.alpha *= 0.9
        return {}


def test_each_optimizer_follows_its_own_schedule():
    learner = TwinLearner(PPOConfig(seed=0, model_config={"fcnet_hiddens": [8]}))
    stats = learner.update(torch.randn(6, 3), timestep=50)
    assert stats["curr_lr_actor"] == pytest.approx(5.5e-4) and stats["curr_lr_critic"] == pytest.approx(5e-3)
    assert learner.optimizers["actor"].optimizer.param_groups[0]["lr"] == pytest.approx(5.5e-4)
    assert learner.num_updates == 2  # one step per optimizer


def test_one_backward_for_two_slots_steps_each_as_its_own_backward_would():
    # SAC's update: losses that each reach only their own optimizer's parameters, summed and minimised in
    # one backward pass, give each optimizer the gradients (norms, steps) of its own loss
    cfg = PPOConfig(seed=0, model_config={"fcnet_hiddens": [8]}, grad_clip=0.05)
    together, apart = TwinLearner(cfg), TwinLearner(cfg)
    obs = torch.randn(6, 3, generator=torch.Generator().manual_seed(2))

    def losses(learner):
        out = learner.module.forward_train(obs)
        return out["action_dist_inputs"].pow(2).mean(), (out["vf_preds"] - 1.0).pow(2).mean()

    for _ in range(3):
        actor_loss, critic_loss = losses(together)
        norms = together.apply_gradients_to(actor_loss + critic_loss, ("actor", "critic"))
        actor_loss, critic_loss = losses(apart)
        expected = [apart.apply_gradients(actor_loss, "actor"), apart.apply_gradients(critic_loss, "critic")]
        assert norms == pytest.approx(expected, rel=1e-6)
    assert together.num_updates == apart.num_updates == 6
    for (name, a), b in zip(together.module.named_parameters(), apart.module.parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_state_round_trip_with_two_optimizers_a_target_and_fields_through_torch_save():
    import io

    cfg = PPOConfig(seed=0, model_config={"fcnet_hiddens": [8]})
    a = TwinLearner(cfg)
    g = torch.Generator().manual_seed(1)
    for t in range(3):
        a.update(torch.randn(6, 3, generator=g), timestep=t)
    buf = io.BytesIO()
    torch.save(a.get_state(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # what a checkpoint's learner.pt goes through

    b = TwinLearner(cfg.copy().debugging(seed=7))  # other initial weights: everything must come from the state
    b.set_state(state)
    for name in ("module",):
        for k, v in a.module.state_dict().items():
            torch.testing.assert_close(b.module.state_dict()[k], v, rtol=0, atol=0)
    for k, v in a.targets["target"].state_dict().items():
        torch.testing.assert_close(b.targets["target"].state_dict()[k], v, rtol=0, atol=0)
    assert not torch.equal(a.targets["target"].pi_head.weight, a.module.pi_head.weight)  # the target lags
    for opt in ("actor", "critic"):
        sa, sb = a.optimizers[opt].optimizer.state_dict(), b.optimizers[opt].optimizer.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        for k in sa["state"]:
            for name in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(sa["state"][k][name], sb["state"][k][name], rtol=0, atol=0)
    assert (b.alpha, b.num_target_updates, b.kl_coeff, b.num_updates) == (a.alpha, 3, a.kl_coeff, 6)
    # both continue identically: same update, same weights afterwards
    obs = torch.randn(6, 3, generator=g)
    a.update(obs, timestep=3)
    b.update(obs, timestep=3)
    for k, v in a.module.state_dict().items():
        torch.testing.assert_close(b.module.state_dict()[k], v, rtol=0, atol=0)


def test_update_accepts_a_codec_frame_of_chunks():
    """What a remote learner receives: the same chunks as one frame."""
    from protocols import EpisodeChunk, encode

    seen = []

    class Recording(NoOpPPOLearner):
        def train_on_batch(self, chunks, timestep):
            seen.extend(chunks)
            return {}

    chunk = EpisodeChunk("ep", 0, obs=np.zeros((4, 3), np.float32), actions=np.zeros(3, np.int64),
                         rewards=np.ones(3, np.float32))
    Recording(PPOConfig(seed=0), OBS, ACT).update(encode([chunk], compress=False), timestep=0)
    assert len(seen) == 1 and seen[0].episode_id == "ep" and len(seen[0]) == 3


def adam_epsilons(learner):
    return {name: group["eps"] for name, slot in learner.optimizers.items() for group in slot.optimizer.param_groups}


def test_adam_epsilon_defaults_to_each_learners_own_and_the_setting_reaches_every_optimizer():
    """``.training(adam_epsilon=...)`` reaches every optimizer slot; left at None each learner keeps its class's
    ``adam_eps`` (IMPALA 1e-2, SAC and CQL torch's 1e-8, the others 1e-5), the values their runs were measured at."""
    from pipeline.algorithms.cql.config import CQLConfig
    from pipeline.algorithms.cql.learner import CQLLearner
    from pipeline.algorithms.impala.config import IMPALAConfig
    from pipeline.algorithms.impala.learner import IMPALALearner
    from pipeline.algorithms.sac.config import SACConfig
    from pipeline.algorithms.sac.learner import SACLearner
    box = gym.spaces.Box(-1, 1, (1,), np.float32)
    cases = [(PPOConfig, PPOLearner, ACT, 1e-5), (IMPALAConfig, IMPALALearner, ACT, 1e-2),
             (SACConfig, SACLearner, box, 1e-8), (CQLConfig, CQLLearner, box, 1e-8)]
    for config_class, learner_class, act, default in cases:
        extra = {"lagrangian": True} if config_class is CQLConfig else {}  # CQL's fourth optimizer
        learner = learner_class(config_class(seed=0, **extra), OBS, act)
        assert set(adam_epsilons(learner).values()) == {default}, learner_class.__name__
        learner = learner_class(config_class(seed=0, adam_epsilon=3e-3, **extra), OBS, act)
        slots = adam_epsilons(learner)
        assert set(slots.values()) == {3e-3}, (learner_class.__name__, slots)
    assert len(slots) == 4  # CQL: actor, critic, alpha and alpha_prime


def test_adam_epsilon_goes_from_the_algorithm_config_to_the_learner():
    from pipeline import PPOConfig as AlgorithmPPOConfig
    config = AlgorithmPPOConfig().environment("CartPole-v1").training(adam_epsilon=1e-3)
    assert config.learner_settings().adam_epsilon == 1e-3
    assert AlgorithmPPOConfig().learner_settings().adam_epsilon is None


def test_a_restored_learner_steps_with_its_own_adam_epsilon_not_the_saved_one():
    """torch's ``load_state_dict`` puts back the saved groups' hyperparameters; a learner restored from a state saved
    at another epsilon (an older checkpoint, or a changed ``adam_epsilon``) keeps the one its settings name."""
    saved = make_learner(adam_epsilon=1e-3).get_state()
    learner = make_learner(adam_epsilon=1e-6)
    learner.set_state(saved)
    assert set(adam_epsilons(learner).values()) == {1e-6}
    default = make_learner()
    default.set_state(saved)
    assert set(adam_epsilons(default).values()) == {PPOLearner.adam_eps}
