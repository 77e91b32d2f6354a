"""Multi-agent sampling with per-module connector pipelines: what a MeanStdFilter, PrevActionsPrevRewards and a
module-to-env piece cost.

Two CartPole copies (``make_multi_agent``), one module each, 8 envs, one in-process runner, one torch thread.
Seven runners, rounds interleaved, agent steps per CPU-second of this process (medians of ``--rounds`` rounds of
``--seconds``): ``plain`` (no connectors, the lockstep sampler), ``filter`` (a ``MeanStdFilter`` per module, the
lockstep sampler), ``filter_general`` (the same through the general ``MultiAgentSampler``), ``plain_general``
(no connectors, the general sampler), ``to_env`` and ``to_env_general`` (a module-to-env piece per module that
passes the actions through, in either sampler) and ``prev_actions`` (``PrevActionsPrevRewards`` per module, its
memory per agent, the lockstep sampler) and ``stack4`` (``FrameStackingEnvToModule(num_frames=4)`` per module: each
agent's stack built from its episode's rows, the general sampler; its ratio is to ``plain_general``, with the
bytes of observations stored per agent step beside one frame's). Prints one JSON line.

    python tests/benchmarks/multi_agent_connectors.py [--rounds 5] [--seconds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from actors.connectors import (FlattenObservations, FrameStackingEnvToModule, ModuleToEnvConnector,  # noqa: E402
                               PrevActionsPrevRewards)
from actors.connectors.multi_agent import ModuleConnectors  # noqa: E402
from actors.env.multi_agent_env import make_multi_agent  # noqa: E402
from actors.env.multi_agent_runner import MultiAgentEnvRunner  # noqa: E402
from actors.env.settings import EnvRunnerSettings  # noqa: E402
from actors.modules import ModuleSpec  # noqa: E402
from pipeline.connectors import mean_std_filter  # noqa: E402

CARTPOLES = make_multi_agent("CartPole-v1")


def two_cartpoles(ctx):
    return CARTPOLES({"num_agents": 2})


def by_agent(agent_id, episode, **kwargs):
    return f"p{agent_id}"


class PassThrough(ModuleToEnvConnector):
    """A module-to-env piece that changes nothing: the cost of the pipeline itself."""

    def __call__(self, batch, *, observations=None, explore=True):
        return batch


def prev_actions(env):
    return [PrevActionsPrevRewards(n_prev_actions=1, n_prev_rewards=1), FlattenObservations()]


def stack4(env):
    return FrameStackingEnvToModule(num_frames=4)


def runner(filtered: bool, lockstep: bool = True, to_env: bool = False, factory=mean_std_filter) -> MultiAgentEnvRunner:
    env = two_cartpoles({})
    spaces = {by_agent(a, None): (env.get_observation_space(a), env.get_action_space(a)) for a in env.possible_agents}
    extra = {}
    if filtered:
        connectors = ModuleConnectors.build(factory, spaces)
        specs = {m: ModuleSpec(connectors.observation_space(m), act, {}) for m, (_, act) in spaces.items()}
        extra = {"connector_spaces": spaces}
    else:
        specs = {m: ModuleSpec(obs, act, {}) for m, (obs, act) in spaces.items()}
    settings = EnvRunnerSettings(env_creator=two_cartpoles, num_envs=8, rollout_fragment_length=64, seed=0,
                                 env_to_module=factory if filtered else None,
                                 module_to_env=(lambda env: PassThrough()) if to_env else None)
    return MultiAgentEnvRunner(settings, specs, by_agent, worker_index=1, lockstep=lockstep, **extra)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    cases = {"plain": runner(False), "filter": runner(True), "filter_general": runner(True, lockstep=False),
             "plain_general": runner(False, lockstep=False), "to_env": runner(False, to_env=True),
             "to_env_general": runner(False, lockstep=False, to_env=True),
             "prev_actions": runner(True, factory=prev_actions), "stack4": runner(True, factory=stack4)}
    stored = cases["stack4"].sample(num_timesteps=512)
    bytes_per_step = sum(c.obs.nbytes - c.obs[:1].nbytes for c in stored) / sum(len(c) for c in stored)
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, r in cases.items():
            before, t0 = r.num_agent_steps_sampled_lifetime, time.process_time()
            while time.process_time() - t0 < args.seconds:
                r.sample(num_timesteps=512)
            rates[name].append((r.num_agent_steps_sampled_lifetime - before) / (time.process_time() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({"bench": "multi_agent_connectors", **{k: round(v) for k, v in med.items()},
                      "filter_over_plain": round(med["filter"] / med["plain"], 3),
                      "general_over_plain": round(med["filter_general"] / med["plain"], 3),
                      "to_env_over_plain": round(med["to_env"] / med["plain"], 3),
                      "to_env_general_over_plain_general": round(med["to_env_general"] / med["plain_general"], 3),
                      "prev_actions_over_plain": round(med["prev_actions"] / med["plain"], 3),
                      "stack4_over_plain_general": round(med["stack4"] / med["plain_general"], 3),
                      "stack4_stored_bytes_per_step": bytes_per_step,
                      "one_frame_bytes": int(stored[0].obs[0].nbytes),
                      "stack4_module_input_bytes": module_input_bytes(cases["stack4"])}))


def module_input_bytes(r: MultiAgentEnvRunner) -> int:
    space = r.module.members["p0"].observation_space
    return int(np.prod(space.shape)) * space.dtype.itemsize


if __name__ == "__main__":
    main()
