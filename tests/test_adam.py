"""runnel's Adam (``actors.learner.adam``) is ``torch.optim.Adam`` to the bit, minus the ``torch._dynamo``
import: the same weights and state after the same steps (default and fused kernels), state dicts that
load into either, and a learner's whole life (build, train, save, restore) in a fresh process that
never imports ``torch._dynamo``."""
from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from actors.learner.adam import Adam


def trained(optimizer_cls, fused, steps=25, seed=0):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    kwargs = {} if fused is None else {"fused": fused}
    optimizer = optimizer_cls(net.parameters(), lr=1e-2, eps=1e-5, weight_decay=1e-3, **kwargs)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        (net(torch.randn(8, 4)) ** 2).sum().backward()
        optimizer.step()
    return net, optimizer


def assert_same_state(a, b):
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, entry in a["state"].items():
        assert entry.keys() == b["state"][i].keys()
        for key, value in entry.items():
            torch.testing.assert_close(value, b["state"][i][key], rtol=0, atol=0)


@pytest.mark.parametrize("fused", [None, False, True], ids=["default", "foreach-off", "fused"])
def test_steps_state_and_state_dicts_match_torch_adam_bit_for_bit(fused):
    ours, ours_opt = trained(Adam, fused)
    theirs, theirs_opt = trained(torch.optim.Adam, fused)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert_same_state(ours_opt.state_dict(), theirs_opt.state_dict())
    # a checkpoint of either loads into the other, and both go on alike
    ours_opt.load_state_dict(copy.deepcopy(theirs_opt.state_dict()))
    theirs_opt.load_state_dict(copy.deepcopy(ours_opt.state_dict()))
    for optimizer, net in ((ours_opt, ours), (theirs_opt, theirs)):
        torch.manual_seed(1)
        optimizer.zero_grad()
        (net(torch.randn(8, 4)) ** 2).sum().backward()
        optimizer.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("maximize", [False, True])
def test_fused_step_is_torchs_fused_step_to_the_bit(maximize):
    """``fused_step`` (straight to the fused kernel) against torch's fused Adam: the same weights and state after
    steps at changing learning rates, with weight decay, with a step skipped through ``found_inf`` and with
    gradients set to None in between (torch's path then builds nothing new: the state exists)."""
    nets, optimizers = [], []
    for cls in (Adam, torch.optim.Adam):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        nets.append(net)
        optimizers.append(cls(net.parameters(), lr=1e-2, eps=1e-5, weight_decay=1e-3, fused=True, maximize=maximize))
    ours, theirs = optimizers
    for step in range(30):
        skip = step in (7, 8)
        for net, optimizer in zip(nets, optimizers):
            torch.manual_seed(step)
            optimizer.param_groups[0]["lr"] = 1e-2 / (1 + step)
            optimizer.zero_grad(set_to_none=step % 3 == 0)
            (net(torch.randn(8, 4)) ** 2).sum().backward()
            optimizer.found_inf = torch.tensor(1.0 if skip else 0.0)
        ours.fused_step()
        theirs.step()
        for p, q in zip(*(n.parameters() for n in nets)):
            torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert ours._plan_fused() is not None  # the fast path ran (after the first step built the state)
    assert_same_state(ours.state_dict(), theirs.state_dict())
    assert all(int(s["step"]) == 28 for s in ours.state_dict()["state"].values())


def test_fused_step_takes_torchs_path_where_it_must():
    """Hooks run, a parameter without a gradient is left alone (no state for it), and an unfused Adam steps."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = Adam(net.parameters(), lr=1e-2, fused=True)
    calls = []
    handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    for _ in range(2):
        optimizer.zero_grad()
        (net(torch.randn(8, 4)) ** 2).sum().backward()
        optimizer.fused_step()
    assert calls == ["post", "post"]
    handle.remove()
    before = net[2].weight.detach().clone()
    net[2].weight.grad = None  # a loss that left it out: torch's path steps the others only
    net[0].weight.grad = torch.ones_like(net[0].weight)
    optimizer.fused_step()
    assert torch.equal(net[2].weight, before)
    unfused = Adam(net.parameters(), lr=1e-2)
    (net(torch.randn(8, 4)) ** 2).sum().backward()
    unfused.fused_step()
    assert all(int(s["step"]) == 1 for s in unfused.state_dict()["state"].values())


def test_it_is_a_torch_adam_with_working_hooks_and_closures():
    net, optimizer = trained(Adam, None, steps=1)
    assert isinstance(optimizer, torch.optim.Adam)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))

    def closure():
        optimizer.zero_grad()
        loss = (net(torch.ones(2, 4)) ** 2).sum()
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    assert calls == ["pre", "post"]  # once each, not once per wrapper
    assert float(loss.detach()) > 0


@pytest.mark.slow
def test_a_learner_builds_trains_saves_and_restores_without_importing_dynamo(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from pipeline import Algorithm, PPOConfig, SACConfig
        for name, config in (("ppo", PPOConfig().environment("CartPole-v1")
                                     .training(train_batch_size_per_learner=256, minibatch_size=64, num_epochs=2)),
                             ("sac", SACConfig().environment("Pendulum-v1")
                                     .training(num_steps_sampled_before_learning_starts=64))):
            algo = config.env_runners(num_env_runners=0).debugging(seed=0).build(logdir=None)
            algo.train()
            path = algo.save({str(tmp_path)!r} + "/" + name)
            algo.stop()
            restored = Algorithm.from_checkpoint(path, logdir=None)
            updates = sum(restored.train()["num_learner_updates"] for _ in range(5))
            assert updates > 0, (name, updates)
            restored.stop()
        print("dynamo imported:", "torch._dynamo" in sys.modules)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dynamo imported: False" in run.stdout, run.stdout + run.stderr[-2000:]
