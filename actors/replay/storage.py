"""Ring storage of transitions in preallocated arrays, each observation stored once.

One row holds one observation. A row is a *step* (``has_action``) when it also holds the action
taken there, its reward and done flags, and ``next_row`` points at the row of the observation that
followed. An episode of ``N`` steps occupies ``N + 1`` rows however many chunks it came in: a
chunk that continues an episode whose closing row is still stored fills in that row's action
instead of writing its first observation again.

Rows are written at the head of the ring in order, so eviction is FIFO by write order. A step's
next observation is always written after the step's own row (in the same chunk, or by the later
chunk that continued the episode), hence evicted after it: a step row that is still present
always has its next row present, and following ``next_row`` from any stored step never reaches
an overwritten row. The sampleable rows are exactly those with ``has_action``.

Arrays are allocated on the first add, when the chunk shows the observation/action structure,
shapes and dtypes, and are sized ``capacity``: memory never grows after that.

With ``look_back`` L > 0 (a view such as frame stacking, rebuilt where batches are drawn) each row also
keeps ``prev_row``, the row of the observation before it in its episode (itself at the episode's start,
where a view repeats the first observation), and ``serial``, its write count. ``stack_rows`` follows L
links back from a row to give the rows its view is built from; still one frame stored per step. A chunk
written anew that does not start an episode (its episode's closing row is gone) brings its own
``look_back`` rows, which are written before its first observation as rows without a step. Eviction can
take a stored step's look-back rows before the step itself; a link into a slot written after the row
that points to it (``serial`` not older) shows that, and ``stack_rows`` reports such rows as not valid,
for the sampler to draw again.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from protocols import nested

COLUMNS = {"rewards": np.float32, "terminated": np.bool_, "truncated": np.bool_, "has_action": np.bool_,
           "next_row": np.int64, "episode": np.int64}
_EMPTY = {"rewards": 0.0, "terminated": False, "truncated": False, "has_action": False, "next_row": -1, "episode": -1}
LOOK_BACK_COLUMNS = {"prev_row": np.int64, "serial": np.int64}
"""Columns kept only with ``look_back`` > 0 (set on every write, so they need no empty value)."""


def skeleton(name: str, struct: Any) -> Any:
    """JSON-able shape of a nested structure: dicts stay dicts, tuples become lists, leaves None."""
    if isinstance(struct, dict):
        bad = [k for k in struct if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{name} dict keys must be str (they become state keys), got {bad!r}")
        return {k: skeleton(f"{name}[{k!r}]", struct[k]) for k in sorted(struct)}
    if isinstance(struct, (tuple, list)):
        return [skeleton(f"{name}[{i}]", v) for i, v in enumerate(struct)]
    return None


def leaf_names(name: str, skel: Any) -> list[str]:
    """Readable leaf paths in ``nested.flatten`` order, for error messages."""
    if isinstance(skel, dict):
        return [p for k in sorted(skel) for p in leaf_names(f"{name}[{k!r}]", skel[k])]
    if isinstance(skel, list):
        return [p for i, v in enumerate(skel) for p in leaf_names(f"{name}[{i}]", v)]
    return [name]


def unflatten(skel: Any, leaves: list[Any]) -> Any:
    it = iter(leaves)

    def build(s: Any) -> Any:
        if isinstance(s, dict):
            return {k: build(s[k]) for k in sorted(s)}
        if isinstance(s, list):
            return tuple(build(v) for v in s)
        return next(it)

    return build(skel)


def leaf_specs(struct: Any) -> list[list]:
    """``[shape without time, dtype str]`` per leaf."""
    return [[list(leaf.shape[1:]), leaf.dtype.str] for leaf in nested.flatten(struct)]


class RingStorage:
    def __init__(self, capacity: int, look_back: int = 0) -> None:
        """``look_back``: rows of earlier observations a view needs beside each row's own (0: no view)."""
        self.capacity = int(capacity)
        self.look_back = int(look_back)
        if self.look_back < 0 or self.capacity < 4 * (self.look_back + 1):
            raise ValueError(f"capacity={capacity} rows is too small for a view that looks back {look_back} rows: "
                             f"give the replay buffer a capacity of at least {4 * (self.look_back + 1)}")
        self.columns = {**COLUMNS, **(LOOK_BACK_COLUMNS if self.look_back else {})}
        self.spec: dict[str, Any] | None = None  # {"obs": {"skeleton", "leaves"}, "actions": ...}
        self.obs: list[np.ndarray] = []  # one ring array per leaf, nested.flatten order
        self.actions: list[np.ndarray] = []
        self.cols: dict[str, np.ndarray] = {}
        self.head = 0
        self.num_written = 0  # rows ever written
        self.num_steps = 0  # rows with has_action now
        self.next_key = 0
        # episode_id -> (episode key, row of its latest closing observation, next chunk_index), for
        # episodes not done yet, in the write order of those rows (see _prune).
        self.open: OrderedDict[str, tuple[int, int, int]] = OrderedDict()

    @property
    def filled(self) -> int:
        return min(self.num_written, self.capacity)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.obs + self.actions + list(self.cols.values()))

    # --- structure ----------------------------------------------------------------------------
    @staticmethod
    def spec_of(chunk: Any) -> dict[str, Any]:
        """JSON-able structure, per-step shapes and dtypes of a chunk's observations and actions."""
        spec = {}
        for name in ("obs", "actions"):
            struct = getattr(chunk, name)
            skel, leaves = skeleton(name, struct), leaf_specs(struct)
            for path, (_, dtype) in zip(leaf_names(name, skel), leaves):
                if np.dtype(dtype).hasobject:
                    raise ValueError(f"{path} has dtype object; replay stores numeric arrays only: convert it")
            spec[name] = {"skeleton": skel, "leaves": leaves}
        return spec

    @staticmethod
    def check(chunk: Any, spec: dict[str, Any]) -> None:
        """ValueError naming the first difference between a chunk and ``spec`` (the first chunk's)."""
        for name in ("obs", "actions"):
            struct, want_spec = getattr(chunk, name), spec[name]
            skel = skeleton(name, struct)
            if skel != want_spec["skeleton"]:
                raise ValueError(f"{name} structure {skel} differs from the first chunk's {want_spec['skeleton']} "
                                 "(None marks an array): every chunk added to one buffer needs the same structure")
            for path, got, want in zip(leaf_names(name, skel), leaf_specs(struct), want_spec["leaves"]):
                if got != want:
                    raise ValueError(f"{path} has per-step shape {tuple(got[0])} and dtype {np.dtype(got[1])}; "
                                     f"the first chunk had shape {tuple(want[0])} and dtype {np.dtype(want[1])}: "
                                     "convert it to match (one ring array per leaf is preallocated)")

    def _allocate(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        n = self.capacity
        self.obs = [np.zeros((n, *shape), dtype) for shape, dtype in spec["obs"]["leaves"]]
        self.actions = [np.zeros((n, *shape), dtype) for shape, dtype in spec["actions"]["leaves"]]
        self.cols = {k: np.full(n, _EMPTY.get(k, -1), dtype) for k, dtype in self.columns.items()}

    # --- writing ------------------------------------------------------------------------------
    def add(self, chunk: Any) -> np.ndarray:
        """Write one chunk; returns the rows it touched (whose step status may have changed)."""
        if self.spec is None:
            self._allocate(self.spec_of(chunk))
        steps = len(chunk)
        if steps == 0:
            return np.zeros(0, np.int64)  # an observation without a step adds no transition
        cap, cols, L = self.capacity, self.cols, self.look_back
        key, row0 = self._continued_row(chunk)
        if row0 < 0 and steps + 1 + L > cap:
            # Rows would overwrite rows of the same chunk: keep its newest steps that fit.
            chunk = chunk.slice(steps - (cap - 1 - L), steps)
            steps = cap - 1 - L
        back = self.rows_before(chunk) if L and row0 < 0 else None
        extra = 0 if back is None else len(back)
        new = (self.head + np.arange(extra + (steps if row0 >= 0 else steps + 1))) % cap
        self.num_steps -= int(cols["has_action"][new].sum())
        for name, value in _EMPTY.items():  # the overwritten rows' old contents are gone
            cols[name][new] = value
        obs_rows = np.concatenate([[row0], new]) if row0 >= 0 else new[extra:]
        src = 1 if row0 >= 0 else 0  # a continuation's first observation is already stored
        for ring, leaf in zip(self.obs, nested.flatten(chunk.obs)):
            ring[new[extra:]] = leaf[src:]
            if extra:
                ring[new[:extra]] = back
        step_rows, closing = obs_rows[:-1], obs_rows[-1]
        for ring, leaf in zip(self.actions, nested.flatten(chunk.actions)):
            ring[step_rows] = leaf
            ring[closing] = 0
        cols["rewards"][step_rows] = chunk.rewards
        cols["has_action"][step_rows] = True
        cols["next_row"][step_rows] = obs_rows[1:]
        cols["terminated"][step_rows[-1]] = chunk.terminated
        cols["truncated"][step_rows[-1]] = chunk.truncated
        cols["episode"][new] = key
        if L:  # each new row links to the row before it; an episode's first row (or oldest look-back row) to itself
            cols["prev_row"][new] = np.concatenate([[row0 if row0 >= 0 else new[0]], new[:-1]])
            cols["serial"][new] = self.num_written + np.arange(len(new))
        self.head = int((self.head + len(new)) % cap)
        self.num_written += len(new)
        self.num_steps += steps
        self.open.pop(chunk.episode_id, None)
        if not chunk.is_done:
            self.open[chunk.episode_id] = (key, int(closing), int(chunk.chunk_index) + 1)
        self._prune()
        return obs_rows if not extra else np.concatenate([new[:extra], obs_rows])  # look-back rows were overwritten too

    def rows_before(self, chunk: Any) -> np.ndarray | None:
        """The rows to write before a chunk written anew: its last ``look_back`` look-back rows, or None where
        they all repeat its first observation (an episode's start: the first row then links to itself).
        ValueError when the chunk has fewer than ``look_back`` rows or nested observations."""
        lb, obs = chunk.look_back, chunk.obs
        if not isinstance(obs, np.ndarray):
            raise ValueError("a view that looks back (frame stacking) needs observations that are one array; "
                             f"chunk {chunk.chunk_index} of episode {chunk.episode_id} has nested ones")
        if lb is None or len(lb) < self.look_back:
            raise ValueError(f"chunk {chunk.chunk_index} of episode {chunk.episode_id} carries "
                             f"{0 if lb is None else len(lb)} look-back rows; the view this replay buffer rebuilds "
                             f"needs {self.look_back} (runners send them when their env_to_module_connector has "
                             f"the view)")
        lb = lb[len(lb) - self.look_back:]
        return None if np.array_equal(lb, np.broadcast_to(obs[:1], lb.shape)) else lb

    def stack_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each row, the ``look_back + 1`` rows its view is built from, oldest first (``[n, L + 1]``), and
        whether all of them are still stored (False: eviction took one; such a row cannot be drawn)."""
        c, L = self.cols, self.look_back
        idx = np.empty((len(rows), L + 1), np.int64)
        idx[:, L] = rows
        valid = np.ones(len(rows), bool)
        for j in range(L - 1, -1, -1):
            cur = idx[:, j + 1]
            prev = idx[:, j] = c["prev_row"].take(cur)
            valid &= (prev == cur) | ((c["serial"].take(prev) < c["serial"].take(cur))
                                      & (c["episode"].take(prev) == c["episode"].take(cur)))
        return idx, valid

    def _continued_row(self, chunk: Any) -> tuple[int, int]:
        """(episode key, row of the chunk's first observation), or (new key, -1) to write it anew."""
        entry = self.open.get(chunk.episode_id)
        if entry is not None and chunk.chunk_index > 0:
            key, row, next_chunk = entry
            cols = self.cols
            intact = cols["episode"][row] == key and not cols["has_action"][row]
            # The new rows start at the head: a closing row among them would be overwritten by
            # this very chunk, so it counts as gone.
            if intact and next_chunk == chunk.chunk_index and (row - self.head) % self.capacity >= len(chunk):
                return key, row
        self.next_key += 1
        return self.next_key - 1, -1

    def _prune(self) -> None:
        # Entries are ordered by when their closing row was written and eviction is FIFO, so
        # overwritten entries are always at the front; the rest each own a live row, which bounds
        # the map by capacity however many runners die mid-episode.
        while self.open:
            key, row, _ = next(iter(self.open.values()))
            if self.cols["episode"][row] == key and not self.cols["has_action"][row]:
                break
            self.open.popitem(last=False)

    # --- reading ------------------------------------------------------------------------------
    def gather(self, name: str, rows: np.ndarray) -> Any:
        rings = self.obs if name == "obs" else self.actions
        # take() is several times faster than fancy indexing on arrays of more than one dimension.
        return unflatten(self.spec[name]["skeleton"], [r.take(rows, axis=0) for r in rings])

    def n_step(self, rows: np.ndarray, n: np.ndarray | int, gamma: float) -> tuple[np.ndarray, ...]:
        """Discounted returns over at most ``n`` steps from each step row, never past an episode end
        or the newest stored step. Returns ``(returns, bootstrap rows, steps used, terminated)``."""
        c = self.cols
        ret = c["rewards"].take(rows).astype(np.float64)
        term = c["terminated"].take(rows)
        boot = c["next_row"].take(rows)  # rows is all steps, so every next row is stored
        used = np.ones(len(rows), np.int64)
        n_max = int(np.max(n))
        if n_max == 1:
            return ret, boot, used, term
        # Continue from a step to the next only when the episode did not end there and the next
        # row is a step itself (not the newest observation of an open episode). A done episode's
        # closing row never becomes a step, so that test alone would already stop at episode ends;
        # the flags are checked as well so no sample can straddle two episodes however rows got there.
        active = ~(term | c["truncated"].take(rows)) & c["has_action"].take(boot) & (n > 1)
        for k in range(1, n_max):
            live = np.flatnonzero(active)  # only the rows still counting: most stop early
            if not len(live):
                break
            cur = boot[live]
            ret[live] += gamma**k * c["rewards"].take(cur)
            used[live] += 1
            t = c["terminated"].take(cur)
            term[live] = t
            boot[live] = nxt = c["next_row"].take(cur)
            more = ~(t | c["truncated"].take(cur)) & c["has_action"].take(nxt)
            active[live] = more & (np.take(n, live) > k + 1 if np.ndim(n) else k + 1 < n)
        return ret, boot, used, term

    # --- state --------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """Plain data and numpy arrays only. Ring arrays of nested leaves sit under their index in
        ``nested.flatten`` order (``{"obs": {"0": ..., "1": ...}}``); ``spec`` rebuilds the structure."""
        ids = list(self.open)
        entries = np.array(list(self.open.values()), np.int64).reshape(-1, 3)
        return {
            "capacity": self.capacity, "look_back": self.look_back, "spec": self.spec, "head": self.head, "num_written": self.num_written,
            "num_steps": self.num_steps, "next_key": self.next_key,
            "obs": {str(i): a.copy() for i, a in enumerate(self.obs)},
            "actions": {str(i): a.copy() for i, a in enumerate(self.actions)},
            "columns": {k: v.copy() for k, v in self.cols.items()},
            "open_ids": ids, "open_entries": entries,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if int(state["capacity"]) != self.capacity:
            raise ValueError(f"replay state was saved with capacity {state['capacity']}, this buffer has "
                             f"{self.capacity}: build the buffer with capacity={state['capacity']} to restore it")
        if int(state.get("look_back", 0)) != self.look_back:
            raise ValueError(f"replay state was saved by a buffer whose view looks back {state.get('look_back', 0)} "
                             f"rows, this buffer's looks back {self.look_back}: restore it with the "
                             "env_to_module_connector it was saved with")
        self.spec, self.obs, self.actions, self.cols = None, [], [], {}
        if state["spec"] is not None:
            self._allocate(state["spec"])
            for name, rings in (("obs", self.obs), ("actions", self.actions)):
                for i, ring in enumerate(rings):
                    ring[:] = state[name][str(i)]
            for k, v in self.cols.items():
                v[:] = state["columns"][k]
        self.head, self.num_written = int(state["head"]), int(state["num_written"])
        self.num_steps, self.next_key = int(state["num_steps"]), int(state["next_key"])
        entries = np.asarray(state["open_entries"], np.int64).reshape(-1, 3)
        self.open = OrderedDict((eid, tuple(int(x) for x in e)) for eid, e in zip(state["open_ids"], entries))
