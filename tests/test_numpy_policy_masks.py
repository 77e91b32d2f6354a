"""Action masks in the numpy export (format version 2's ``mask`` key, EXTERNAL.md 9.9): the exported policy
splits the mask out of each observation, sets illegal actions' distribution inputs to float32's minimum as the
torch module does, and never samples, picks or draws at random an illegal action -- a million draws each way;
local-inference clients and env runners act with it."""
from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.env.exploration import EpsilonGreedy, StochasticSampling
from actors.env.numpy_acting import NumpyActing
from actors.modules import ActorCriticModule
from actors.modules.export import acting_plan, describe_exploration, export_policy
from actors.modules.q_module import QModule
from protocols.errors import ProtocolError
from protocols.numpy_policy import MASKED, NumpyPolicy
from tests.test_action_masks import ACT, BATCH, N, OBS, masks, observations, peaked


def numpy_obs(mask: torch.Tensor, seed: int = 0) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in observations(mask, seed).items()}


def illegal(actions: np.ndarray, mask: np.ndarray) -> int:
    return int((~mask[np.arange(len(mask)), actions.astype(np.int64)]).sum())


def test_the_export_masks_as_the_module_does():
    torch.manual_seed(0)
    module = peaked(ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [16]}, inference_only=True))
    desc = export_policy(module)
    assert desc["version"] == 2 and desc["mask"] == {"key": "action_mask", "width": N, "features": "observation"}
    policy = NumpyPolicy(desc)
    mask = masks(500, seed=3)
    want = module.forward_inference(observations(mask, 3))["action_dist_inputs"].detach().numpy()
    got = policy.dist_inputs(numpy_obs(mask, 3))
    np.testing.assert_array_equal(got == MASKED, ~mask.numpy())
    np.testing.assert_allclose(got[mask.numpy()], want[mask.numpy()], rtol=1e-5, atol=1e-4)
    assert (want[~mask.numpy()] == MASKED).all()


@pytest.mark.parametrize("rule", ["sample", "random", "epsilon_greedy", "softmax"])
def test_no_illegal_action_in_a_million_draws(rule):
    torch.manual_seed(1)
    desc = export_policy(peaked(ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [16]}, inference_only=True)))
    desc["exploration"] = {"sample": {"type": "sample"}, "random": {"type": "random"},
                           "epsilon_greedy": {"type": "epsilon_greedy", "epsilon": 0.5},
                           "softmax": {"type": "softmax", "temperature": 2.0}}[rule]
    policy, rng = NumpyPolicy(desc), np.random.default_rng(0)
    leaked, drawn, hits = 0, 0, np.zeros(N, np.int64)
    for r in range(4):
        mask = masks(BATCH, seed=10 + r)
        inputs = policy.dist_inputs(numpy_obs(mask, r))
        chosen = policy.choose(inputs, True, rng)
        legal = mask.numpy()
        leaked += illegal(chosen, legal) + illegal(policy.greedy(inputs), legal)
        drawn += len(chosen)
        hits += np.bincount(chosen, minlength=N)
        actions, logp = policy.choose_with_logp(inputs[:8], True, rng)  # a client's few rows, in plain floats
        leaked += illegal(actions, legal[:8])
        assert np.isfinite(logp).all()
    assert drawn >= 1_000_000 and leaked == 0
    assert (hits > 0).all()


def test_a_q_network_with_a_mask_and_a_dueling_head():
    torch.manual_seed(2)
    module = QModule(OBS, ACT, {"fcnet_hiddens": [16]}, inference_only=True, dueling=True)
    policy = NumpyPolicy(export_policy(module, None))
    mask = masks(300, seed=4)
    want = module.forward_inference(observations(mask, 4))["action_dist_inputs"].detach().numpy()
    np.testing.assert_allclose(policy.dist_inputs(numpy_obs(mask, 4)), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rule", ["sample", "random", "epsilon_greedy"])
def test_an_evaluator_written_from_the_spec_masks_as_runnel_does(rule):
    """tests/spec_policy.py follows EXTERNAL.md 9.9 alone: the same masked inputs, and only legal actions drawn."""
    from tests.spec_policy import SpecPolicy

    torch.manual_seed(3)
    desc = export_policy(peaked(ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [16]}, inference_only=True)))
    desc["exploration"] = {"type": rule, "epsilon": 0.5} if rule == "epsilon_greedy" else {"type": rule}
    mask = masks(400, seed=8)
    batch = numpy_obs(mask, 8)
    rows = [{k: v[i] for k, v in batch.items()} for i in range(len(mask))]
    spec, policy = SpecPolicy(desc), NumpyPolicy(desc)
    got, want = spec.dist_inputs(rows), policy.dist_inputs(batch)
    np.testing.assert_array_equal(got == MASKED, want == MASKED)
    np.testing.assert_allclose(got[mask.numpy()], want[mask.numpy()], rtol=1e-5, atol=1e-4)
    actions, logp, _ = spec.act(rows, True, np.random.default_rng(0))
    assert illegal(actions, mask.numpy()) == 0 and np.isfinite(logp).all()


def test_masks_with_no_legal_action_or_of_another_width_are_refused():
    policy = NumpyPolicy(export_policy(ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [8]}, inference_only=True)))
    mask = masks(4, seed=5)
    mask[2] = False
    with pytest.raises(ValueError, match=r"allows no action \(row 2"):
        policy.dist_inputs(numpy_obs(mask))
    with pytest.raises(ProtocolError, match="expected 4 rows of 9 numbers"):
        policy.dist_inputs({"observation": np.zeros((4, 4), np.float32), "action_mask": np.ones((4, 8), np.int8)})
    with pytest.raises(ProtocolError, match="with an 'action_mask' key"):
        policy.dist_inputs(np.zeros((4, 4), np.float32))


def test_hostile_mask_descriptions_are_refused():
    desc = export_policy(ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [8]}, inference_only=True))
    for bad, message in [({**desc, "version": 1}, "version 2's"),
                         ({**desc, "mask": {**desc["mask"], "width": N + 1}}, "is not dist.dim"),
                         ({**desc, "mask": {**desc["mask"], "features": 3}}, "mask.features"),
                         ({**desc, "mask": {"width": N}}, "mask.key must be a str")]:
        with pytest.raises(ProtocolError, match=message):
            NumpyPolicy(bad)


@pytest.mark.parametrize("rule", ["sample", "random", "epsilon_greedy"])
def test_runners_acting_with_numpy_take_only_legal_actions(rule):
    """A runner's numpy acting piece (``actors.env.numpy_acting``) of a masked module: the torch module's
    distribution inputs, and no illegal action sampled, drawn in the random warm-up or by epsilon-greedy."""
    torch.manual_seed(0)
    if rule == "epsilon_greedy":
        module = peaked(QModule(OBS, ACT, {"fcnet_hiddens": [16]}, inference_only=True))
        exploration = EpsilonGreedy(module.dist_spec, initial_epsilon=0.5, final_epsilon=0.5)
    else:
        module = peaked(ActorCriticModule(OBS, ACT, {"fcnet_hiddens": [16]}, inference_only=True))
        exploration = StochasticSampling(module.dist_spec, random_timesteps=10**9 if rule == "random" else 0)
    acting = NumpyActing(acting_plan(module, exploration), seed=0, worker_index=1)
    acting.set_weights({k: v.detach().numpy() for k, v in module.state_dict().items()}, 1)
    mask = masks(BATCH, seed=5)
    obs = numpy_obs(mask, 5)
    want = module.forward_inference(observations(mask, 5))["action_dist_inputs"].detach().numpy()
    bad = 0
    for _ in range(1_000_000 // BATCH):
        actions, logp, inputs, _ = acting.act(obs, True, 0)
        bad += illegal(actions, mask.numpy())
    np.testing.assert_allclose(inputs[mask.numpy()], want[mask.numpy()], rtol=1e-5, atol=1e-4)
    assert (inputs[~mask.numpy()] == MASKED).all() and np.isfinite(logp).all()
    assert bad == 0
    assert describe_exploration(None, 0) == {"type": "sample"}


def test_a_local_client_takes_only_legal_moves(tmp_path):
    """A local-inference client plays a masked env through the server's exported policy: no illegal move."""
    from actors.env.settings import EnvRunnerSettings
    from actors.external.policy_server import PolicyServer
    from actors.external.settings import ExternalSettings
    from protocols.client import PolicyClient
    from tests.test_external import free_port

    space = gym.spaces.Dict({"observation": gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
                             "action_mask": gym.spaces.MultiBinary(N)})
    server = PolicyServer(EnvRunnerSettings(env_creator=None, observation_space=space, action_space=ACT,
                                            model_config={"fcnet_hiddens": [8]}, seed=0), 0,
                          external=ExternalSettings(address=f"tcp://127.0.0.1:{free_port()}", fragment_length=20,
                                                    journal_dir=str(tmp_path / "j"), inference_mode="local"))
    rng = np.random.default_rng(0)
    try:
        with PolicyClient(server.address, "local", timeout_s=20, throttle=False) as client:
            for _ in range(5):
                eid = client.start_episode()
                for _ in range(40):
                    mask = (rng.random(N) < 0.3).astype(np.int8)
                    mask[rng.integers(N)] = 1
                    action = client.get_action(eid, {"observation": rng.uniform(-1, 1, 4).astype(np.float32),
                                                     "action_mask": mask})
                    assert mask[int(action)] == 1
                    client.log_returns(eid, 1.0)
                client.end_episode(eid, {"observation": np.zeros(4, np.float32), "action_mask": np.ones(N, np.int8)})
            got = server.sample(200)
            client.close(flush=False)
        assert sum(len(c) for c in got) == 200
    finally:
        server.stop()
