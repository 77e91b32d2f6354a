"""Action masks (``observation["action_mask"]``) honoured by every discrete-action module.

Millions of draws from masked modules -- the actor-critic's sampling and greedy action, DQN's
epsilon-greedy and the other exploration pieces -- take 0 illegal actions; the env runner stepping
PettingZoo tic-tac-toe (which records every illegal move) takes none, with a policy biased towards
the centre square; ``compute_single_action`` takes none; PPO's, IMPALA's and DQN's losses on masked
batches are finite and put no probability (or bootstrap) on masked actions; a mask with no legal
action is an error when acting and ignored in a finished episode's closing observation.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.exploration import EpsilonGreedy, SoftQ, StochasticSampling
from actors.env.multi_agent_runner import MultiAgentEnvRunner
from actors.env.settings import EnvRunnerSettings
from actors.modules import ActorCriticModule, ModuleSpec, QModule
from examples.tictactoe_selfplay import MODULE, TicTacToe, to_shared
from pipeline import PPOConfig
from pipeline.algorithms.dqn.config import DQNConfig
from pipeline.algorithms.dqn.learner import dqn_loss
from pipeline.algorithms.impala.config import IMPALAConfig
from pipeline.algorithms.impala.learner import impala_loss
from pipeline.algorithms.ppo.learner import ppo_loss

N = 9
OBS = gym.spaces.Dict({"observation": gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
                       "action_mask": gym.spaces.MultiBinary(N)})
ACT = gym.spaces.Discrete(N)
BATCH, ROUNDS = 250_000, 4  # 1,000,000 draws


def masks(n: int, width: int = N, seed: int = 0) -> torch.Tensor:
    """Random masks, each row with at least one legal action (many with exactly one)."""
    g = torch.Generator().manual_seed(seed)
    density = torch.rand(n, 1, generator=g)  # from nearly empty to nearly full rows
    mask = torch.rand(n, width, generator=g) < density
    mask[torch.arange(n), torch.randint(0, width, (n,), generator=g)] = True
    return mask


def observations(mask: torch.Tensor, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return {"observation": torch.rand(len(mask), 4, generator=g) * 2 - 1, "action_mask": mask.to(torch.int8)}


def peaked(module: torch.nn.Module) -> torch.nn.Module:
    """Scale the output layer so the unmasked policy is far from uniform: most of its probability sits
    on one action per row, often an illegal one, so a leak through the mask would show."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith(("pi_head", "advantage", "value")):
                p.mul_(300.0)
    return module


def illegal(actions: torch.Tensor, mask: torch.Tensor) -> int:
    return int((~mask.gather(1, actions.long().view(-1, 1))).sum())


def test_the_actor_critic_never_samples_or_picks_a_masked_action_in_a_million_draws():
    torch.manual_seed(0)
    module = peaked(ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [32]}, inference_only=True))
    drawn, hits, leaked = 0, torch.zeros(N), 0
    with torch.inference_mode():
        for r in range(ROUNDS):
            mask = masks(BATCH, seed=r)
            obs = observations(mask, seed=r)
            inputs = module.forward_inference(obs)["action_dist_inputs"]
            dist = module.action_dist(inputs)
            sampled, greedy = dist.sample(), dist.deterministic()
            drawn += len(sampled)
            leaked += illegal(sampled, mask) + illegal(greedy, mask)
            hits += torch.bincount(sampled, minlength=N)
            # the same logits without the mask: the test's policy would take illegal actions
            raw = module.pi_head(module.pi_trunk(module.encoder(obs["observation"])))
            assert illegal(module.action_dist(raw).deterministic(), mask) > BATCH // 10
    assert drawn >= 1_000_000
    assert leaked == 0
    assert bool((hits > 0).all()), "every action is legal somewhere and must be drawn somewhere"


def test_multi_discrete_branches_are_masked_each_on_its_own_block():
    space = gym.spaces.Dict({"observation": gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
                             "action_mask": gym.spaces.MultiBinary(7)})
    module = peaked(ActorCriticModule(space, gym.spaces.MultiDiscrete([3, 4]), {"fcnet_hiddens": [32]}))
    first, second = masks(200_000, 3, seed=5), masks(200_000, 4, seed=6)
    obs = observations(torch.cat([first, second], -1))
    with torch.inference_mode():
        dist = module.action_dist(module.forward_inference(obs)["action_dist_inputs"])
        for actions in (dist.sample(), dist.deterministic()):
            assert illegal(actions[:, 0], first) == 0 and illegal(actions[:, 1], second) == 0


@pytest.mark.parametrize("piece", ["epsilon_greedy", "warm_up", "soft_q"])
def test_dqn_exploration_draws_random_actions_among_legal_ones_only(piece):
    torch.manual_seed(1)
    module = peaked(QModule(OBS, ACT, {"fcnet_hiddens": [32]}))
    exploration = {"epsilon_greedy": EpsilonGreedy(module.dist_spec, epsilon_schedule=[[0, 0.5]]),
                   "warm_up": StochasticSampling(module.dist_spec, random_timesteps=10),
                   "soft_q": SoftQ(module.dist_spec, temperature=0.5)}[piece]
    drawn, leaked, hits = 0, 0, torch.zeros(N)
    with torch.inference_mode():
        for r in range(ROUNDS):
            mask = masks(BATCH, seed=10 + r)
            dist = module.action_dist(module.forward_inference(observations(mask, seed=r))["action_dist_inputs"])
            actions = exploration.actions(dist, explore=True, timestep=0)
            drawn += len(actions)
            leaked += illegal(actions, mask)
            hits += torch.bincount(actions, minlength=N)
            assert illegal(dist.deterministic(), mask) == 0
    assert drawn >= 1_000_000
    assert leaked == 0
    assert bool((hits > 0).all())


def test_a_mask_with_no_legal_action_is_an_error_when_acting_and_ignored_when_learning():
    mask = masks(6)
    mask[3] = False  # e.g. a full board: the closing observation of a finished game
    obs = observations(mask)
    for module in (ActorCriticModule(OBS, ACT), QModule(OBS, ACT)):
        with pytest.raises(ValueError, match=r"allows no action \(row 3 of the batch"):
            module.forward_inference(obs)
        out = module.forward_train(obs)
        values = out["action_dist_inputs"] if "action_dist_inputs" in out else out["q_values"]
        assert bool(torch.isfinite(values).all())
    out = ActorCriticModule(OBS, ACT).forward_train(obs)
    probs = torch.softmax(out["action_dist_inputs"], -1)
    assert bool(torch.isfinite(out["vf_preds"]).all()) and bool(torch.isfinite(probs).all())


def test_masks_that_do_not_fit_the_action_space_are_refused_naming_the_width():
    with pytest.raises(ValueError, match=r"MultiBinary\(9\) or Box\(0, 1, \(9,\)\)"):
        ActorCriticModule(gym.spaces.Dict({"observation": OBS["observation"],
                                           "action_mask": gym.spaces.MultiBinary(5)}), ACT)
    with pytest.raises(ValueError, match="not discrete"):
        ActorCriticModule(OBS, gym.spaces.Box(-1.0, 1.0, (2,), np.float32))


def test_the_mask_is_no_network_input():
    module = ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [8]})
    assert module.encoder.out_dim == 4  # the observation alone, not observation + mask
    mask = masks(64)
    full = torch.ones_like(mask)
    a = module.forward_train(observations(mask))["vf_preds"]
    b = module.forward_train(observations(full))["vf_preds"]
    assert torch.equal(a, b)


def fake_batch(module: ActorCriticModule, n: int = 512) -> dict[str, Any]:
    mask = masks(n, seed=3)
    obs = observations(mask, seed=3)
    with torch.no_grad():
        inputs = module.forward_inference(obs)["action_dist_inputs"]
        dist = module.action_dist(inputs)
        actions = dist.sample()
    g = torch.Generator().manual_seed(4)
    return {"obs": obs, "mask": mask, "actions": actions, "action_logp": dist.logp(actions),
            "action_dist_inputs": inputs, "advantages": torch.randn(n, generator=g),
            "value_targets": torch.randn(n, generator=g), "pg_advantages": torch.randn(n, generator=g),
            "vtrace_targets": torch.randn(n, generator=g)}


@pytest.mark.parametrize("algo", ["ppo", "impala"])
def test_policy_gradient_losses_on_masked_batches_are_finite_with_no_mass_on_masked_actions(algo):
    torch.manual_seed(2)
    module = peaked(ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [32]}))
    batch = fake_batch(module)
    config = PPOConfig() if algo == "ppo" else IMPALAConfig()
    if algo == "ppo":
        loss, stats = ppo_loss(module, batch, config, kl_coeff=0.2, entropy_coeff=0.01)
    else:
        loss, stats = impala_loss(module, batch, config, entropy_coeff=0.01)
    loss.backward()
    assert bool(torch.isfinite(loss)) and all(bool(torch.isfinite(v)) for v in stats.values())
    assert all(bool(torch.isfinite(p.grad).all()) for p in module.parameters() if p.grad is not None)
    with torch.no_grad():
        probs = module.action_dist(module.forward_train(batch["obs"])["action_dist_inputs"]).logits.exp()
    assert float(probs[~batch["mask"]].max()) == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(len(probs)))


@pytest.mark.parametrize("double_q", [False, True])
def test_dqn_bootstraps_from_the_best_legal_next_action(double_q):
    torch.manual_seed(3)
    module, target = QModule(OBS, ACT, dueling=False), QModule(OBS, ACT, dueling=False)
    n = 256
    mask, next_mask = masks(n, seed=7), masks(n, seed=8)
    next_obs = observations(next_mask, seed=9)
    actions = torch.multinomial(mask.float(), 1).squeeze(1)
    batch = {"obs": observations(mask, seed=7), "next_obs": next_obs, "actions": actions,
             "rewards": torch.randn(n), "discounts": torch.full((n,), 0.9), "weights": torch.ones(n)}
    config = DQNConfig(double_q=double_q, td_error_loss_fn="mse")
    loss, stats, td_error = dqn_loss(module, target, batch, config)
    loss.backward()
    assert bool(torch.isfinite(loss)) and all(bool(torch.isfinite(v)) for v in stats.values())
    with torch.no_grad():
        picker = module if double_q else target
        picked = picker.forward_inference(next_obs)["action_dist_inputs"].argmax(-1)  # masked: legal only
        next_q = target.forward_train(next_obs)["q_values"].gather(1, picked[:, None]).squeeze(1)
        q = module.forward_train(batch["obs"])["q_values"].gather(1, actions[:, None]).squeeze(1)
        expected = (batch["rewards"] + 0.9 * next_q - q).abs()
        unmasked = picker.forward_train(next_obs)["q_values"].argmax(-1)
    assert illegal(picked, next_mask) == 0
    assert int((unmasked != picked).sum()) > n // 10  # without the mask the bootstrap would differ
    torch.testing.assert_close(td_error, expected)


# --- in the env runner and the driver, on PettingZoo tic-tac-toe ------------------------------------
GAME = TicTacToe()
GAME_OBS, GAME_ACT = GAME.get_observation_space("player_1"), GAME.get_action_space("player_1")


def centre_loving(runner: MultiAgentEnvRunner) -> None:
    """Weights that want the centre square whatever the board: illegal from the second move on."""
    weights = runner.get_weights()
    key = next(k for k in weights if k.endswith(("pi_head.bias", "advantage.bias")))  # policy or Q head
    weights[key] = np.where(np.arange(N) == 4, 20.0, 0.0).astype(np.float32)
    runner.set_weights(weights)


@pytest.mark.parametrize("module_class,exploration", [(ActorCriticModule, {}),
                                                      (QModule, {"type": "EpsilonGreedy",
                                                                 "epsilon_schedule": [[0, 0.3]]})])
@pytest.mark.slow
def test_the_env_runner_takes_no_illegal_move_in_tic_tac_toe(module_class, exploration):
    settings = EnvRunnerSettings(env_creator=TicTacToe, num_envs=4, rollout_fragment_length=500, seed=0,
                                 model_config={"fcnet_hiddens": [16]}, exploration_config=exploration)
    spec = ModuleSpec(GAME_OBS, GAME_ACT, {"fcnet_hiddens": [16]}, module_class=module_class)
    runner = MultiAgentEnvRunner(settings, {MODULE: spec}, to_shared)
    try:
        centre_loving(runner)
        steps = sum(len(c.actions) for _ in range(11) for c in runner.sample())
        counts = runner.foreach_env(lambda env: (env.moves, env.illegal_moves))
    finally:
        runner.stop()
    moves = sum(m for m, _ in counts)
    # an action waits in the runner until its agent's next observation, so the chunks lag a few moves
    assert moves >= steps >= 20_000
    assert sum(i for _, i in counts) == 0


def test_the_tic_tac_toe_wrapper_records_an_illegal_move():
    env = TicTacToe()
    obs, _ = env.reset(seed=0)
    env.step({"player_1": 4})
    env.step({"player_2": 4})  # taken already
    assert (env.moves, env.illegal_moves) == (2, 1)


def test_compute_single_action_takes_only_legal_moves():
    algo = (PPOConfig().environment(TicTacToe).multi_agent(policies={MODULE}, policy_mapping_fn=to_shared)
            .env_runners(num_env_runners=0).rl_module(model_config={"fcnet_hiddens": [16]})
            .debugging(seed=0).build(logdir=None))
    try:
        mask = masks(300, seed=11).numpy().astype(np.int8)
        boards = np.zeros((300, 3, 3, 2), np.int8)
        for explore in (True, False):
            actions = [algo.compute_single_action({"observation": b, "action_mask": m}, explore=explore,
                                                  policy_id=MODULE) for b, m in zip(boards, mask)]
            assert all(m[a] == 1 for a, m in zip(actions, mask)), f"explore={explore}"
    finally:
        algo.stop()
