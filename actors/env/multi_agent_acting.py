"""ModuleActing: one batched forward pass per module (or per fused group of modules) for a multi-agent sampler.

What both multi-agent samplers share: ``MultiAgentSampler`` (any multi-agent env, episodes recorded per
agent) and ``LockstepSampler`` (``make_multi_agent`` copies, recorded time-major). Given the observations
waiting in one step, grouped by module, it runs one forward pass per module -- or one for a group of modules
of the same small architecture (``FusedActors``), in numpy when that group can -- one exploration call on the
batch and one action conversion (``EnvActions``), and returns the actions, their env form and the extras'
columns (``action_logp``, ``action_dist_inputs``, ``vf_preds`` when the module's pass gives them).

Observations are checked against their module's observation space a batch at a time before a module acts
on them (``check_observations``); an error names the env and the agent.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from actors.env.actions import EnvActions
from actors.env.exploration import Exploration, StochasticSampling
from actors.env.multi_agent_checks import MultiAgentEnvError
from actors.env.numpy_acting import categorical_draw
from actors.env.space_values import BatchProblemFinder, batch_problem_finder
from actors.modules import RLModule
from actors.modules.fused import FusedActors, fusion_key, pad_rows
from protocols import nested
from protocols.agent_record import STATE_COLUMN

Who = list[tuple[int, Any]]
"""The rows of a batch: (env index, agent id) each."""
Waiting = dict[str, tuple]
"""Module id -> the rows waiting for it and their observations, in the same order: ``(who, obs)``, or
``(who, obs, rows)`` with the observations' rows in an array of them all (see ``batch_rows``)."""
Group = tuple[tuple[str, ...], FusedActors | None]
"""Module ids acting in one pass (a ``FusedActors``), or one module acting alone (None)."""


class ModuleActing:
    """The modules, their explorations and action conversions (dicts keyed by module id, the same ids), and
    how a batch of one module's (or one fused group's) observations becomes actions.

    ``module_of(env_index, agent_id)`` names the module an agent acts with (for error messages); ``rng``
    draws the actions of modules that act in numpy."""

    def __init__(self, modules: Mapping[str, RLModule], explorations: Mapping[str, Exploration],
                 env_actions: Mapping[str, EnvActions], rng: np.random.Generator,
                 module_of: Callable[[int, Any], str], check_observations: bool = False) -> None:
        if not modules:
            raise ValueError("a multi-agent sampler needs at least one module, got none")
        for name, pieces in (("explorations", explorations), ("env_actions", env_actions)):
            if set(pieces) != set(modules):
                raise ValueError(f"{name} are given for modules {sorted(pieces)}, the modules are {sorted(modules)}: "
                                 f"give one per module id")
        self.modules, self.explorations, self.env_actions = dict(modules), dict(explorations), dict(env_actions)
        self.rng = rng
        self.module_of = module_of
        self.check_observations = check_observations
        """Check each batch of observations against its module's observation space before acting on it."""
        self.fast_path = True
        """Pad a fused group's rows as a list before the one stack (False: pad the array after it)."""
        self._batch_checks: dict[str, tuple[RLModule, BatchProblemFinder]] = {}
        self._dtypes: dict[str, tuple[RLModule, Any]] = {}
        """Module id -> (the module, its observation space's dtypes), computed once per module object."""
        self._groups: tuple[tuple, list[Group]] | None = None
        self.states: dict[tuple[int, Any], np.ndarray] = {}
        """A recurrent module's state per running agent ``(env index, agent id)``, after its last action (absent:
        the agent has not acted yet in this episode, so it starts from zeros)."""

    def forget_states(self, env_index: int) -> None:
        """A new episode starts in env ``env_index``: its agents' states start afresh."""
        for key in [k for k in self.states if k[0] == env_index]:
            del self.states[key]

    def share(self, modules: Mapping[str, RLModule], explorations: Mapping[str, Exploration],
              env_actions: Mapping[str, EnvActions]) -> None:
        """The runner's modules changed (one added or removed): act with these from the next step on."""
        self.modules, self.explorations, self.env_actions = dict(modules), dict(explorations), dict(env_actions)

    def groups(self) -> list[Group]:
        """The modules that act in one pass (``FusedActors``: same architecture, plain sampling; a lone such
        module too, for its numpy pass) and the ones that act alone, each group in module order; built when
        the modules change, restacked (new weights) at every call -- once per run."""
        members = tuple((mid, id(m), id(self.explorations[mid])) for mid, m in self.modules.items())
        if self._groups is None or self._groups[0] != members:
            by_key: dict[Any, list[str]] = {}
            for mid, module in self.modules.items():
                expl = self.explorations[mid]
                key = fusion_key(module)
                plain = type(expl) is StochasticSampling
                by_key.setdefault(mid if key is None or not plain else (key, expl.random_timesteps), []).append(mid)
            groups = [(tuple(mids), FusedActors({m: self.modules[m] for m in mids}) if isinstance(key, tuple) else None)
                      for key, mids in by_key.items()]
            self._groups = (members, groups)
        else:
            for _, fused in self._groups[1]:
                if fused is not None:
                    fused.refresh()
        return self._groups[1]

    def forwards(self, explore: bool) -> dict[str, Callable[[Any], dict]]:
        """Each module's acting pass: ``forward_exploration`` when exploring, ``forward_inference`` otherwise."""
        return {mid: m.forward_exploration if explore else m.forward_inference for mid, m in self.modules.items()}

    def act_group(self, group: Group, waiting: Waiting, forwards: Mapping[str, Callable[[Any], dict]], explore: bool,
                  timestep: int, stacked: np.ndarray | None = None, rows: np.ndarray | None = None
                  ) -> tuple[list[str], Who, Any, list[Any], dict[str, np.ndarray]] | None:
        """One group's pass over the rows waiting for its modules: (the modules that had rows, the rows in the
        order acted on -- grouped by module in the group's order --, actions, env actions, extras' columns);
        None when none of its modules has a row. ``stacked``: every observation stacked already (a flat array
        observation) and ``rows`` the group's batch in it (``batch_rows``): gathered, not stacked again."""
        mids, fused = group
        present = [m for m in mids if m in waiting]
        if not present:
            return None
        gathered = None if stacked is None else stacked.take(rows, axis=0)
        if fused is None:
            who, obs = waiting[present[0]][:2]
            acts, env_acts, columns = self._act(present[0], who, obs, forwards[present[0]], explore, timestep, gathered)
        else:  # one pass for every module of the group, rows grouped by module in the group's order
            who = [w for m in present for w in waiting[m][0]]
            obs = [o for m in present for o in waiting[m][1]]
            counts = [len(waiting[m][0]) if m in waiting else 0 for m in mids]
            acts, env_acts, columns = self._act_fused(fused, mids, counts, who, obs, explore, timestep, gathered)
        return present, who, acts, env_acts, columns

    def batch_rows(self, group: Group, waiting: Waiting) -> np.ndarray | None:
        """Where ``act_group``'s batch for ``group`` lies in an array of every observation, given each waiting
        observation's row in it (``waiting``'s third items): the rows in the order the group acts on them,
        padded as its fused pass lays them out. None when none of the group's modules has a row."""
        mids, fused = group
        present = [m for m in mids if m in waiting]
        if not present:
            return None
        rows = [r for m in present for r in waiting[m][2]]
        if fused is not None and self.fast_path:
            rows = pad_rows(rows, [len(waiting[m][0]) if m in waiting else 0 for m in mids])
        return np.array(rows, np.intp)

    def _act_fused(self, fused: FusedActors, mids: tuple[str, ...], counts: list[int], who: Who, obs: list[Any],
                   explore: bool, timestep: int, gathered: np.ndarray | None = None
                   ) -> tuple[Any, list[Any], dict[str, np.ndarray]]:
        """Several modules' rows (grouped by module, ``counts`` each) in one pass; as ``_act``."""
        if fused.numpy_ready and fused.dist_spec.kind == "categorical":  # no torch from observations to actions
            batch = self._stacked(mids[0], who, pad_rows(obs, counts) if self.fast_path else obs, obs, gathered)
            if type(batch) is np.ndarray:
                logits = fused.dist_inputs_numpy(batch, counts, padded=self.fast_path)
                uniform = timestep < self.explorations[mids[0]].random_timesteps
                acts, logp = categorical_draw(logits, explore, uniform, self.rng)
                env_acts = self.env_actions[mids[0]](acts)
                return acts, env_acts.tolist(), {"action_logp": logp, "action_dist_inputs": logits}
        if self.fast_path:  # padded as a list, stacked once: the modules' rows side by side for one matmul a layer
            tensors = self._tensors(mids[0], who, pad_rows(obs, counts), obs, gathered)
            dist_inputs = fused.dist_inputs(tensors, counts, padded=True)
        else:
            dist_inputs = fused.dist_inputs(self._tensors(mids[0], who, obs, None, gathered), counts)
        return self._choose(mids[0], dist_inputs, {}, explore, timestep)

    def _tensors(self, mid: str, who: Who, obs: list[Any], values: list[Any] | None = None,
                 gathered: np.ndarray | None = None) -> Any:
        """The observations as one batch of tensors, cast to the module's observation space's dtypes.
        ``values``: the agents' own observations when ``obs`` repeats some of them (``pad_rows``);
        ``gathered``: ``obs`` stacked already."""
        batch = self._stacked(mid, who, obs, values, gathered)
        return torch.from_numpy(batch) if type(batch) is np.ndarray else nested.map_structure(torch.from_numpy, batch)

    def _stacked(self, mid: str, who: Who, obs: list[Any], values: list[Any] | None = None,
                 gathered: np.ndarray | None = None) -> Any:
        """The observations as one numpy batch (nested for Dict/Tuple spaces), checked when observations are
        checked and cast to the module's observation space's dtypes; ``values``, ``gathered`` as for ``_tensors``."""
        module = self.modules[mid]
        dtypes = self._dtypes.get(mid)
        if dtypes is None or dtypes[0] is not module:
            dtypes = self._dtypes[mid] = (module, _space_dtypes(getattr(module, "observation_space", None)))
        dtypes = dtypes[1]
        flat = type(obs[0]) is np.ndarray and not isinstance(dtypes, (dict, tuple))
        batch = None
        if flat and gathered is not None:
            batch = gathered
        elif flat:
            try:
                batch = nested.stack_leaves(obs)  # the common case, flat arrays: one stack and at most one cast
            except ValueError:  # ragged: the check below names the agent, or the message below the shapes
                flat = False
        if self.check_observations:
            self._check_batch(mid, batch, who, obs if values is None else values)
        try:
            if flat:
                return _cast(batch, dtypes)
            batch = nested.stack(obs)
            if dtypes is not None:
                batch = nested.map_structure(_cast, batch, dtypes)
            return batch
        except (KeyError, ValueError, TypeError) as err:
            raise ValueError(f"observations of agents {sorted({str(a) for _, a in who})} (module {mid!r}) do not "
                             f"fit the module's observation space {module.observation_space}: {err}. Map these "
                             "agents to a module built for their observation space") from None

    def _check_batch(self, mid: str, batch: Any, who: Who, obs: list[Any]) -> None:
        """Every observation about to be acted on lies in its module's observation space, or an error names
        the first agent whose does not."""
        module = self.modules[mid]
        check = self._batch_checks.get(mid)
        if check is None or check[0] is not module:
            check = self._batch_checks[mid] = (module, batch_problem_finder(module.observation_space))
        bad = check[1](batch, obs)
        if bad is not None:
            row, why = bad
            i, aid = who[row]
            raise MultiAgentEnvError(f"env {i}: the observation of agent {aid!r} {why}; it must lie in the observation "
                                     f"space of module {self.module_of(i, aid)!r} that acts for it, "
                                     f"{module.observation_space} (fix the env's observation, or the space it declares "
                                     f"for {aid!r})", aid)

    def _act(self, mid: str, who: Who, obs: list[Any], forward: Callable[[Any], dict], explore: bool,
             timestep: int, gathered: np.ndarray | None = None) -> tuple[Any, list[Any], dict[str, np.ndarray]]:
        """One module's batch: its actions, the env's form of them, and the extras' columns."""
        module = self.modules[mid]
        if not getattr(module, "is_recurrent", False):
            out = forward(self._tensors(mid, who, obs, None, gathered))
            return self._choose(mid, out["action_dist_inputs"], out, explore, timestep)
        fresh = module.initial_state(1)[0]
        states = np.stack([self.states.get(w, fresh) for w in who])
        out = forward(self._tensors(mid, who, obs, None, gathered), torch.from_numpy(states))
        after = out["state_out"].numpy()
        for w, state in zip(who, after):
            self.states[w] = state
        acts, env_acts, columns = self._choose(mid, out["action_dist_inputs"], out, explore, timestep)
        columns[STATE_COLUMN] = states  # each row's chunk starts from the state its first action saw
        return acts, env_acts, columns

    def _choose(self, mid: str, dist_inputs: torch.Tensor, out: dict[str, torch.Tensor], explore: bool,
                timestep: int) -> tuple[Any, list[Any], dict[str, np.ndarray]]:
        """Actions from distribution inputs with ``mid``'s exploration, their env form and the extras' columns."""
        dist = self.modules[mid].dist_spec.build(dist_inputs)
        chosen = self.explorations[mid].actions(dist, explore, timestep)
        acts = chosen.numpy()
        columns = {"action_logp": dist.logp(chosen).numpy(), "action_dist_inputs": dist_inputs.numpy()}
        if "vf_preds" in out:
            columns["vf_preds"] = out["vf_preds"].numpy()
        env_acts = self.env_actions[mid](acts)
        # Discrete actions as Python ints: every env accepts them, and gymnasium checks them fastest
        return acts, env_acts.tolist() if env_acts.ndim == 1 else list(env_acts), columns


def _space_dtypes(space: gym.Space | None) -> Any:
    """The dtypes of a space's leaves, shaped like its observations (None: nothing to cast to)."""
    if isinstance(space, gym.spaces.Dict):
        return {k: _space_dtypes(s) for k, s in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(_space_dtypes(s) for s in space.spaces)
    return getattr(space, "dtype", None)


def _cast(leaf: np.ndarray, dtype: Any) -> np.ndarray:
    # an env that gives Python floats or float64 for a float32 space still feeds the module what it was built for
    return leaf if dtype is None or leaf.dtype == dtype else leaf.astype(dtype)
