"""The PolicyClient's inference: actions asked of the server (remote) or computed here with numpy (local).

Apart from ``protocols.client`` because turning an observation into an action is its own job:
the act messages and how their replies read back, the numpy copy of the policy with the weights
it pulls, and the mapping between the policy's actions and the env's. The client keeps the
episodes and decides which way to act (the welcome's ``inference_mode``).
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from protocols import external as wire
from protocols import nested
from protocols.client_connection import Connection
from protocols.codec import Limits, decode, encode
from protocols.errors import ProtocolError
from protocols.external import ServerError

log = logging.getLogger("runnel.client")

REPLY_LIMITS = Limits(max_frame_bytes=256 << 20, max_decoded_bytes=512 << 20)
"""Bounds for what a client decodes from a server (weights of large policies included)."""
INLINE_ELEMENTS = 4096
"""Observations with at most this many numbers go in the act header as plain msgpack; bigger ones in a frame."""

Acted = tuple[Any, Any, dict, int]
"""What acting gives: the env's action, the policy's (module) action, its extras, the weights version."""


class Inference:
    """Actions for observations, remote or local, and the weights version they came from."""

    def __init__(self, conn: Connection, rng: np.random.Generator) -> None:
        self._conn = conn
        self._rng = rng
        self._policy: Any = None
        self.weights_version = -1
        """The version of the weights this client acts with (local) or last saw (remote)."""
        self._last_pull = 0.0
        self._welcome: dict[str, Any] | None = None
        self._action_dtype: np.dtype | None = None

    def welcomed(self, welcome: dict[str, Any]) -> None:
        """A server's welcome: its action mapping and inference mode apply from now on."""
        self._welcome = welcome
        self._action_dtype = np.dtype(welcome["action_mapping"]["dtype"])

    # --- remote -------------------------------------------------------------------------------
    def act_remote(self, eid: str, obs: Any, given: Any, record: bool = True) -> Acted:
        """``record``: the step goes into a chunk, so keep the module action and extras too."""
        request, body = self.act_request(eid, obs, given)
        reply, _ = self._conn.request(request, body, retry_unknown_episode=eid)
        return self.read_action(reply, record)

    def act_request(self, eid: str, obs: Any, given: Any) -> tuple[dict, bytes | None]:
        request: dict[str, Any] = {"op": wire.ACT, "episode_id": eid}
        body = None
        dense = type(obs) is np.ndarray
        if (obs.size if dense else _size(obs)) <= INLINE_ELEMENTS:
            request["obs"] = obs.tolist() if dense else plain_value(obs)  # small: plain msgpack in the header
            if given is not None:
                request["action"] = plain_value(given)
        else:
            body = encode({"obs": obs} if given is None else {"obs": obs, "action": given}, compress=False)
        return request, body

    def read_action(self, reply: dict, record: bool) -> Acted:
        version = reply.get("weights_version", 0)
        if version > self.weights_version:
            self.weights_version = int(version)
        action = self._from_plain_action(reply["action"])  # a new array, built from the reply's plain values
        env_action = action[()] if action.ndim == 0 else action
        if not record:  # acting only: nothing keeps the module action or the extras
            return env_action, None, {}, version
        module_action = np.asarray(reply["module_action"], np.float32) if "module_action" in reply else action
        extra = {"action_logp": np.float32(reply["logp"]), "action_dist_inputs": np.asarray(reply["dist"], np.float32)}
        return (env_action if action.ndim == 0 else action.copy()), module_action, extra, version

    def act_remote_batch(self, eids: list[str], obs: list[Any]) -> list[Acted]:
        """Actions for many episodes, in requests of at most the server's ``max_batch`` episodes."""
        limit = (self._welcome or {}).get("limits", {}).get("max_batch")
        if type(limit) is int and 0 < limit < len(eids):
            return [row for i in range(0, len(eids), limit)
                    for row in self._act_remote_batch(eids[i:i + limit], obs[i:i + limit])]
        return self._act_remote_batch(eids, obs)

    def _act_remote_batch(self, eids: list[str], obs: list[Any]) -> list[Acted]:
        reply, _ = self._conn.request({"op": wire.ACT, "episode_ids": eids, "obs": [plain_value(o) for o in obs]},
                                      retry_unknown_episode=eids)
        version = int(reply.get("weights_version", 0))
        self.weights_version = max(self.weights_version, version)
        raws = reply.get("module_action")
        rows = []
        for i, (action, logp, dist) in enumerate(zip(reply["action"], reply["logp"], reply["dist"])):
            action = self._from_plain_action(action)
            module_action = np.asarray(raws[i], np.float32) if raws is not None else action
            rows.append((_env_value(action), module_action,
                         {"action_logp": np.float32(logp), "action_dist_inputs": np.asarray(dist, np.float32)}, version))
        return rows

    def _from_plain_action(self, value: Any) -> np.ndarray:
        return np.asarray(value, dtype=self._action_dtype)

    # --- local --------------------------------------------------------------------------------
    def act_local_batch(self, obs: list[Any], states: list[np.ndarray | None] | None = None
                        ) -> tuple[list[Acted], list[np.ndarray | None]]:
        """Actions for a batch of observations, and (a recurrent policy) each row's next state; ``states``: the
        rows' states (None for an episode's first step)."""
        if self._policy is None:
            self.pull_weights()
        policy, version = self._policy, self.weights_version
        explore = self._welcome.get("explore", True)
        if policy.recurrent:
            actions, extra, after = policy.act_recurrent(nested.stack(obs), self._states(states or [None] * len(obs)),
                                                         explore=explore, rng=self._rng)
            next_states: list[np.ndarray | None] = list(after)
        else:
            actions, extra = policy.act(nested.stack(obs), explore=explore, rng=self._rng)
            next_states = [None] * len(obs)
        return [(_env_value(self._to_env(actions[i])), actions[i], {k: v[i] for k, v in extra.items()}, version)
                for i in range(len(obs))], next_states

    def act_local(self, obs: Any, given: Any, state: np.ndarray | None = None) -> tuple[Acted, np.ndarray | None]:
        """The action for one observation, and (a recurrent policy) the state after it; ``state``: the one it acts
        from (None: an episode's first step)."""
        if self._policy is None:
            self.pull_weights()
        policy, version = self._policy, self.weights_version
        batch = nested.map_structure(lambda a: a[None], obs)
        explore = self._welcome.get("explore", True)
        after = None
        if policy.recurrent:
            if given is None:
                actions, extra, after = policy.act_recurrent(batch, self._states([state]), explore=explore,
                                                             rng=self._rng)
            else:
                actions = self._to_module(np.asarray(given))[None]
                extra, after = policy.extras_recurrent(batch, self._states([state]), actions)
        elif given is None:
            actions, extra = policy.act(batch, explore=explore, rng=self._rng)
        else:
            actions = self._to_module(np.asarray(given))[None]
            extra = policy.extras(batch, actions)
        module_action = actions[0]
        extra = {k: v[0] for k, v in extra.items()}
        return (_env_value(self._to_env(module_action)), module_action, extra, version), \
            (None if after is None else after[0])

    def start_state(self, state: np.ndarray | None) -> np.ndarray | None:
        """The state a step acts from, for a chunk's ``state_in``: ``state``, or a new episode's (zeros) when it is
        None or does not fit the policy; None for a policy that is not recurrent."""
        policy = self._policy
        if policy is None or not policy.recurrent:
            return None
        return self._states([state])[0]

    def _states(self, states: list[np.ndarray | None]) -> np.ndarray:
        """The rows' states as one ``[B, 2, cell]`` batch; a missing one (or one from another policy's cell) zeros."""
        fresh = self._policy.initial_state(len(states))
        for i, st in enumerate(states):
            if st is not None and st.shape == fresh.shape[1:]:
                fresh[i] = st
        return fresh

    def _to_module(self, action: np.ndarray) -> np.ndarray:
        """An env action the client chose (``log_action``) -> the policy's raw action."""
        m = self._welcome["action_mapping"]
        if m["kind"] != "box" or not m["normalize"]:
            return action
        low, high = np.asarray(m["low"], np.float64), np.asarray(m["high"], np.float64)
        return (2.0 * (action - low) / (high - low) - 1.0).astype(np.float32)

    def _to_env(self, action: np.ndarray) -> np.ndarray:
        m = self._welcome["action_mapping"]
        if m["kind"] == "box":
            low, high = np.asarray(m["low"], np.float64), np.asarray(m["high"], np.float64)
            if m["normalize"]:
                action = low + (np.clip(action, -1.0, 1.0) + 1.0) * 0.5 * (high - low)
            elif m["clip"]:
                action = np.clip(action, low, high)
        return np.asarray(action).astype(m["dtype"], copy=False)

    # --- weights (local inference) ------------------------------------------------------------
    def pull_weights(self) -> None:
        from protocols.numpy_policy import NumpyPolicy

        header, parts = self._conn.request({"op": wire.WEIGHTS, "have": self.weights_version})
        self._last_pull = time.monotonic()
        if header.get("changed"):
            desc = _decode_body(parts, "policy")
            self._policy = NumpyPolicy(desc)
            self.weights_version = int(header["weights_version"])

    def maintain(self, now: float, update_interval: float) -> None:
        """Pull weights when ``update_interval`` seconds have passed (local inference, once acting)."""
        if (self._welcome and self._welcome["inference_mode"] == "local" and self._policy is not None
                and now - self._last_pull > update_interval):
            try:
                self.pull_weights()
            except (TimeoutError, ServerError, ProtocolError) as err:  # keep acting with the weights we have (9.1)
                self._last_pull = now
                log.warning("could not pull new weights: %s", err)


def plain_value(value: Any) -> Any:
    """Arrays -> nested lists (msgpack natives); dicts stay maps, tuples become arrays."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: plain_value(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [plain_value(v) for v in value]
    return value


def _size(value: Any) -> int:
    return sum(np.size(leaf) for leaf in nested.flatten(value))


def _decode_body(parts: list, what: str) -> Any:
    if not parts:
        raise ProtocolError(f"the server's {what!r} reply has no body")
    return decode(parts[0], limits=REPLY_LIMITS)


def _env_value(action: Any) -> Any:
    """Read-only decoded arrays -> values an env may keep (0-d arrays as numpy scalars)."""
    a = np.array(action)
    return a[()] if a.ndim == 0 else a
