"""Default RLModule and distributions on the supported spaces."""
import gymnasium as gym
import numpy as np
import pytest
import torch

from actors.modules import ActorCriticModule as RLModule, to_torch
from actors.modules.distributions import Categorical, DiagGaussian, MultiCategorical
from protocols import nested

SPACES = {
    "box": gym.spaces.Box(-1, 1, (5,), np.float32),
    "discrete": gym.spaces.Discrete(4, start=1),
    "multidiscrete": gym.spaces.MultiDiscrete([2, 3]),
    "multibinary": gym.spaces.MultiBinary(3),
    "dict": gym.spaces.Dict({"a": gym.spaces.Box(0, 1, (2, 2)), "b": gym.spaces.Tuple((gym.spaces.Discrete(2),))}),
    "image": gym.spaces.Box(0, 255, (42, 42, 3), np.uint8),
}
ACTIONS = {"discrete": gym.spaces.Discrete(3), "multidiscrete": gym.spaces.MultiDiscrete([2, 5]),
           "multibinary": gym.spaces.MultiBinary(4), "box": gym.spaces.Box(-1, 1, (2,), np.float32)}


@pytest.mark.parametrize("obs_key", SPACES)
@pytest.mark.parametrize("act_key", ACTIONS)
def test_forward_and_sample_shapes(obs_key, act_key):
    obs_space, act_space = SPACES[obs_key], ACTIONS[act_key]
    obs_space.seed(0)
    m = RLModule(obs_space, act_space, {"fcnet_hiddens": [8]})
    obs = to_torch(nested.stack([obs_space.sample() for _ in range(6)]))
    out = m.forward_train(obs)
    assert out["vf_preds"].shape == (6,)
    dist = m.action_dist(out["action_dist_inputs"])
    a = dist.sample().numpy()
    env_a = m.dist_spec.to_env(a)
    assert all(act_space.contains(x) for x in env_a) or act_key == "box"
    assert dist.logp(torch.as_tensor(a)).shape == (6,)


def test_inference_only_module_has_no_value_head_and_loads_full_weights():
    full = RLModule(SPACES["box"], ACTIONS["discrete"])
    inf = RLModule(SPACES["box"], ACTIONS["discrete"], inference_only=True)
    assert not any(k.startswith("vf_") for k in inf.state_dict())
    inf.set_state(full.get_state())
    obs = torch.randn(3, 5)
    torch.testing.assert_close(inf.forward_inference(obs)["action_dist_inputs"],
                               full.forward_inference(obs)["action_dist_inputs"])
    with pytest.raises(RuntimeError, match="inference-only"):
        inf.forward_train(obs)


def test_categorical_matches_torch():
    logits = torch.randn(10, 4)
    ours, ref = Categorical(logits), torch.distributions.Categorical(logits=logits)
    a = torch.randint(0, 4, (10,))
    torch.testing.assert_close(ours.logp(a), ref.log_prob(a))
    torch.testing.assert_close(ours.entropy(), ref.entropy())
    other = torch.randn(10, 4)
    torch.testing.assert_close(ours.kl(Categorical(other)),
                               torch.distributions.kl_divergence(ref, torch.distributions.Categorical(logits=other)))
    torch.manual_seed(0)
    samples = torch.stack([ours.sample() for _ in range(4000)])
    freq = torch.stack([(samples[:, 0] == k).float().mean() for k in range(4)])
    torch.testing.assert_close(freq, ref.probs[0], atol=0.03, rtol=0)


def test_gaussian_matches_torch():
    inputs = torch.randn(7, 6)
    ours = DiagGaussian(inputs)
    ref = torch.distributions.Independent(torch.distributions.Normal(inputs[:, :3], inputs[:, 3:].exp()), 1)
    a = torch.randn(7, 3)
    torch.testing.assert_close(ours.logp(a), ref.log_prob(a))
    torch.testing.assert_close(ours.entropy(), ref.entropy())


def test_multicategorical_sums_components():
    inputs = torch.randn(5, 5)
    d = MultiCategorical(inputs, [2, 3])
    a = torch.stack([torch.randint(0, 2, (5,)), torch.randint(0, 3, (5,))], -1)
    expected = Categorical(inputs[:, :2]).logp(a[:, 0]) + Categorical(inputs[:, 2:]).logp(a[:, 1])
    torch.testing.assert_close(d.logp(a), expected)


def test_read_only_arrays_become_tensors_without_a_copy_or_a_warning():
    """Decoded frames are read-only; ``to_torch`` shares their memory, and torch's warning about writing through
    such a tensor (given once per process) was drawn silently when the module was imported, not filtered per
    call (a per-call filter swaps the process's filter list, which threads may not share safely)."""
    import subprocess
    import sys
    code = ("import numpy as np\n"
            "from actors.modules import to_torch\n"
            "a = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), np.float32)\n"
            "t = to_torch({'x': a})['x']\n"
            "assert not a.flags.writeable and t.data_ptr() == a.ctypes.data, 'copied'\n"
            "assert t.tolist() == [0.0, 1.0, 2.0, 3.0]\n")
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
