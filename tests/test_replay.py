"""Replay: ring storage (observations once, FIFO wrap), n-step returns, PER, sum tree, rate limiter, state."""
import io
import json
import re
import threading

import numpy as np
import pytest

from actors.replay import RateLimiter, RateLimiterTimeout, ReplayBuffer, ReplaySettings, SumTree
from protocols import EpisodeChunk

GAMMA = 0.9


def _chunk(eid, index, ep, t0, rewards, end=None):
    """Steps t0.. of episode ``ep``: obs = [ep, t], action = 1000 * ep + t (checkable after sampling)."""
    t = np.arange(t0, t0 + len(rewards) + 1)
    return EpisodeChunk(eid, index, obs=np.stack([np.full(len(t), ep), t], 1).astype(np.float32),
                        actions=(1000 * ep + t[:-1]).astype(np.int64), rewards=np.asarray(rewards, np.float32),
                        terminated=end == "terminated", truncated=end == "truncated")


def simulate(seed, num_envs=4, rounds=50, p_end=0.1):
    """Interleaved chunks of several envs' episodes, cut at random points, and the per-episode truth."""
    rng = np.random.default_rng(seed)
    episodes, envs, chunks = {}, [], []
    for _ in range(num_envs):
        episodes[len(episodes)] = {"rewards": [], "end": None}
        envs.append([len(episodes) - 1, 0])  # episode number, chunk index
    for _ in range(rounds):
        for e in rng.permutation(num_envs):
            ep, index = envs[e]
            rec, rewards, end = episodes[ep], [], None
            for _ in range(rng.integers(1, 7)):
                rewards.append(float(np.float32(rng.normal())))
                u = rng.random()
                end = "terminated" if u < p_end / 2 else "truncated" if u < p_end else None
                if end:
                    break
            chunks.append(_chunk(f"ep{ep}", index, ep, len(rec["rewards"]), rewards, end))
            rec["rewards"] += rewards
            rec["end"] = end
            if end:
                episodes[len(episodes)] = {"rewards": [], "end": None}
                envs[e] = [len(episodes) - 1, 0]
            else:
                envs[e][1] += 1
    return chunks, episodes


def check_batch(buf, batch, episodes, n_lo, n_hi, gamma=GAMMA):
    """Every sampled row against a literal per-step reference built from the episodes' rewards."""
    assert buf.storage.cols["has_action"][batch["indices"]].all()
    for i in range(len(batch["indices"])):
        ep, t = (int(x) for x in batch["obs"][i])
        rec = episodes[ep]
        length, n = len(rec["rewards"]), int(batch["n_steps"][i])
        assert batch["actions"][i] == 1000 * ep + t
        assert 1 <= n <= n_hi and t + n <= length
        if n_lo == n_hi:  # fewer steps than asked only where the stored episode data ends
            assert n == min(n_hi, length - t)
        else:
            assert n >= n_lo or t + n == length
        ret = sum(gamma**k * rec["rewards"][t + k] for k in range(n))
        assert batch["rewards"][i] == pytest.approx(ret, rel=1e-5, abs=1e-5)
        assert list(batch["next_obs"][i]) == [ep, t + n]  # the same episode: never straddles two
        terminated = t + n == length and rec["end"] == "terminated"
        assert batch["terminateds"][i] == terminated
        assert batch["discounts"][i] == pytest.approx(0.0 if terminated else gamma**n)


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("n_step", [1, 3, (2, 5)])
@pytest.mark.parametrize("capacity", [5000, 97])
def test_n_step_returns_match_reference(capacity, n_step, prioritized):
    chunks, episodes = simulate(seed=capacity + 7)
    buf = ReplayBuffer(ReplaySettings(capacity=capacity, n_step=n_step, gamma=GAMMA, prioritized=prioritized, seed=1))
    for i in range(0, len(chunks), 5):
        buf.add(chunks[i : i + 5])
    lo, hi = (n_step, n_step) if isinstance(n_step, int) else n_step
    seen = set()
    for _ in range(8):
        batch = buf.sample(256)
        check_batch(buf, batch, episodes, lo, hi)
        seen |= set(batch["n_steps"].tolist())
        if prioritized:
            buf.update_priorities(batch["indices"], buf.rng.random(256) * 5)
        else:
            assert (batch["weights"] == 1).all()
    assert set(range(lo, hi + 1)) <= seen
    assert len(buf) <= capacity and len(buf.storage.open) <= 4


def test_observations_stored_once_and_memory_fixed():
    rewards = np.arange(50, dtype=np.float32)
    whole = _chunk("a", 0, 0, 0, rewards, "terminated")
    buf = ReplayBuffer(ReplaySettings(capacity=500, seed=0))
    buf.add(whole.split(7)[:3])
    buf.add(whole.split(7)[3:])
    assert buf.storage.num_written == 51 and len(buf) == 50 and not buf.storage.open
    nbytes = buf.storage.nbytes()
    arrays = buf.storage.obs + buf.storage.actions + list(buf.storage.cols.values())
    assert all(len(a) == 500 for a in arrays)
    assert nbytes == 500 * (2 * 4 + 8 + 4 + 3 + 8 + 8)  # obs (2,) f4, action i8, reward, 3 flags, next_row, episode
    for i in range(1, 40):  # wrap the ring several times
        buf.add(_chunk(f"e{i}", 0, i, 0, rewards, "truncated").split(9))
    assert buf.storage.nbytes() == nbytes and buf.storage.num_written == 51 * 40


def test_ring_wrap_evicts_fifo_and_keeps_samples_valid():
    chunks, episodes = simulate(seed=3, num_envs=1, rounds=200)
    buf = ReplayBuffer(ReplaySettings(capacity=50, n_step=4, gamma=GAMMA, seed=0))
    written = []
    for c in chunks:
        written += list(map(tuple, c.obs[1:] if c.chunk_index else c.obs))  # one env: continuations intact
        buf.add([c])
    stored = np.roll(buf.storage.obs[0], -buf.storage.head, axis=0)
    assert list(map(tuple, stored)) == written[-50:]
    check_batch(buf, buf.sample(512), episodes, 4, 4)


def test_open_episode_map_is_bounded_and_lost_predecessors_start_fresh():
    buf = ReplayBuffer(ReplaySettings(capacity=64, gamma=GAMMA, seed=0))
    for ep in range(1000):  # runners that die mid-episode: never continued
        buf.add([_chunk(f"ep{ep}", 0, ep, 0, [1.0, 2.0, 3.0])])
    assert len(buf.storage.open) <= 64 // 4 + 1
    before = buf.storage.num_written
    buf.add([_chunk("ep0", 1, 0, 3, [4.0, 5.0], "terminated")])  # its predecessor is long overwritten
    assert buf.storage.num_written == before + 3
    buf.add([_chunk("ep999", 1, 999, 3, [4.0, 5.0])])  # predecessor intact: only the new observations
    assert buf.storage.num_written == before + 5
    episodes = {ep: {"rewards": [1.0, 2.0, 3.0], "end": None} for ep in range(1000)}
    episodes[0] = {"rewards": [1.0, 2.0, 3.0, 4.0, 5.0], "end": "terminated"}
    episodes[999]["rewards"] += [4.0, 5.0]
    check_batch(buf, buf.sample(300), episodes, 1, 1)


def test_sum_tree_matches_cumsum_reference():
    rng = np.random.default_rng(0)
    tree, ref = SumTree(100), np.zeros(100)
    assert tree.size == 128
    for _ in range(20):
        idx = rng.integers(0, 100, 30)
        vals = rng.integers(0, 5, 30).astype(float)  # integers: sums exact, zeros included
        tree.update(idx, vals)
        for i, v in zip(idx, vals):  # last value wins
            ref[i] = v
        assert tree.total() == ref.sum() and (tree.get(np.arange(100)) == ref).all()
        c = np.cumsum(ref)
        u = np.concatenate([rng.random(200) * c[-1], c[c < c[-1]]])  # random and boundary values
        assert (tree.sample(u) == np.searchsorted(c, u, side="right")).all()
        assert (ref[tree.sample(u)] > 0).all()
    # Rounding can put a query a hair past the total: it still lands on a positive leaf.
    assert tree.sample([tree.total()])[0] == np.flatnonzero(ref)[-1]


def _per_buffer(alpha=0.7, beta=0.5):
    buf = ReplayBuffer(ReplaySettings(capacity=64, prioritized=True, alpha=alpha, beta=beta, seed=3))
    buf.add([_chunk("a", 0, 0, 0, np.ones(16))])  # rows 0..15 are steps, row 16 its closing observation
    return buf


def test_per_frequencies_proportional_to_priority_alpha():
    buf, pri = _per_buffer(), np.arange(1.0, 17.0)
    buf.update_priorities(np.arange(16), pri)
    counts = np.zeros(64)
    for _ in range(40):
        np.add.at(counts, buf.sample(500)["indices"], 1)
    expected = (pri + 1e-6) ** 0.7 / ((pri + 1e-6) ** 0.7).sum() * 20_000
    chi2 = (((counts[:16] - expected) ** 2) / expected).sum()
    assert chi2 < 37.697  # chi-square critical value, 15 degrees of freedom, p = 0.001
    assert counts[16:].sum() == 0


def test_per_weights_and_priority_updates():
    buf = _per_buffer()
    pri = np.arange(1.0, 17.0)
    buf.update_priorities(np.arange(16), pri)
    batch = buf.sample(64)
    p = (pri + 1e-6) ** 0.7
    w = (16 * p[batch["indices"]] / p.sum()) ** -0.5
    assert np.allclose(batch["weights"], w / w.max(), rtol=1e-5)
    buf.update_priorities([3, 16], [1e5, 1e5])  # row 16 is no step: stays at 0
    assert buf.tree.get([16])[0] == 0 and np.mean(buf.sample(1000)["indices"] == 3) > 0.9
    top = (1e5 + 1e-6) ** 0.7
    buf.add([_chunk("b", 0, 1, 0, [1.0, 1.0])])  # new steps get the max priority, closing row 0
    assert np.allclose(buf.tree.get([17, 18, 19]), [top, top, 0.0])
    buf.add([_chunk("b", 1, 1, 2, [1.0])])  # the closing row becomes a step: max priority now
    assert np.allclose(buf.tree.get([19, 20]), [top, 0.0])


def test_rate_limiter_construction_errors():
    with pytest.raises(ValueError, match=r"samples_per_insert must be a number > 0 or None .* got 0"):
        RateLimiter(0, 1)
    with pytest.raises(ValueError, match=r"min_size_to_sample must be an int >= 1, got 0"):
        RateLimiter(1.0, 0)
    with pytest.raises(ValueError, match=r"= 6, less than 2 \* max\(1, samples_per_insert\) = 8: this could "
                                         r"block samples and/or inserts completely; use an error_buffer of at least 4"):
        RateLimiter(4.0, 10, error_buffer=3.0)
    with pytest.raises(ValueError, match=r"min_diff = 20 is above samples_per_insert \* min_size_to_sample = 10: "
                                         r"sampling would deadlock .* lower min_diff to at most 10"):
        RateLimiter(1.0, 10, error_buffer=(20.0, 100.0))


def test_rate_limiter_keeps_the_band_under_random_speeds():
    lim = RateLimiter(2.0, 20, error_buffer=60.0)  # band [-20, 100] around offset 40
    errors = []

    def check():
        inserts, samples, _ = lim.snapshot()  # the limiter's own counters, read together
        diff = inserts * 2.0 - samples
        assert diff <= lim.max_diff and (samples == 0 or diff >= lim.min_diff), (inserts, samples)

    def run(kind, seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(400 if kind == "insert" else 10**9):
                np.sort(rng.random(rng.integers(1, 3000)))  # a random amount of work: random speeds
                n = int(rng.integers(1, 9 if kind == "insert" else 17))
                with lim.lock:  # wait and record as one step
                    getattr(lim, f"await_{kind}")(n, timeout_s=10)
                    getattr(lim, f"record_{kind}")(n)
                check()
        except RuntimeError as e:
            if "closed" not in str(e):
                errors.append(e)
        except AssertionError as e:
            errors.append(e)
        if kind == "insert":
            lim.close()

    threads = [threading.Thread(target=run, args=(k, s)) for k, s in (("insert", 1), ("sample", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and lim.inserts > 1000 and lim.samples > 1000
    assert abs(lim.samples / lim.inserts - 2.0) < 120 / lim.inserts


def test_rate_limiter_timeouts_name_the_counts():
    lim = RateLimiter(1.0, 5, error_buffer=10.0)
    lim.record_insert(2)
    with pytest.raises(RateLimiterTimeout, match=r"sample of 1 transitions .* inserts=2, samples=0, size=2.*"
                                                 r"min_size_to_sample=5"):
        lim.await_sample(1, timeout_s=0.01)
    assert lim.sample_blocked_s > 0.005  # the time spent waiting is tracked
    lim.record_insert(13)
    with pytest.raises(RateLimiterTimeout, match=r"insert of 1 transitions .* inserts=15, samples=0"):
        lim.await_insert(1, timeout_s=0.01)
    with pytest.raises(ValueError, match="can never proceed"):
        lim.await_sample(50)


def test_an_insert_that_crosses_the_fill_up_point_goes_in_whole():
    # the README's DQN example once stopped here: 997 of 1000 transitions stored, an add of 77 refused by the
    # band, and no sample allowed before 1000 -- each side waiting for the other
    lim = RateLimiter(16.0, 1000, error_buffer=1152.0)
    lim.record_insert(997)
    lim.await_insert(77, timeout_s=0.01)
    lim.record_insert(77)
    lim.await_sample(32, timeout_s=0.01)  # the table is full enough, and diff is above the band's floor
    with pytest.raises(RateLimiterTimeout, match="insert of 1 transitions"):
        lim.await_insert(1, timeout_s=0.01)  # above the band's top until samples bring diff down


def test_buffer_waits_on_the_limiter_and_reports_metrics():
    buf = ReplayBuffer(ReplaySettings(capacity=100, samples_per_insert=1.0, min_size_to_sample=10,
                                      error_buffer=20.0, timeout_s=0.01, seed=0))
    buf.add([_chunk("a", 0, 0, 0, np.ones(8))])
    assert not buf.can_sample(1)
    with pytest.raises(RateLimiterTimeout, match="min_size_to_sample=10"):
        buf.sample(1)
    buf.add([_chunk("a", 1, 0, 8, np.ones(4))])
    assert buf.sample(4)["obs"].shape == (4, 2)
    assert buf.can_add(22) and not buf.can_add(23)  # diff 12 - 4 = 8; max_diff 30
    with pytest.raises(RateLimiterTimeout, match="inserts=12, samples=4"):
        buf.add([_chunk("a", 2, 0, 12, np.ones(23))])
    assert len(buf) == 12
    m = buf.get_metrics()
    assert m["inserts"]["value"] == 12 and m["samples"]["value"] == 4
    assert m["size"]["values"] == [12] and m["samples_per_insert"]["values"] == [4 / 12]
    assert m["blocked_s"]["value"] > 0.005  # the failed sample's wait counts too


def _through_checkpoint(state):
    """np.savez for the arrays, JSON for the rest, np.load(allow_pickle=False): as checkpoints do."""
    arrays = {}

    def strip(x, path):
        if isinstance(x, np.ndarray):
            arrays[".".join(path)] = x
            return {"__array__": ".".join(path)}
        if isinstance(x, dict):
            assert all(isinstance(k, str) for k in x)
            return {k: strip(v, path + [k]) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [strip(v, path + [str(i)]) for i, v in enumerate(x)]
        return x

    text = json.dumps(strip(state, []))
    f = io.BytesIO()
    np.savez(f, **arrays)
    f.seek(0)
    loaded = np.load(f, allow_pickle=False)

    def put(x):
        if isinstance(x, dict):
            return loaded[x["__array__"]] if "__array__" in x else {k: put(v) for k, v in x.items()}
        return [put(v) for v in x] if isinstance(x, list) else x

    return put(json.loads(text))


@pytest.mark.parametrize("settings", [
    dict(prioritized=True, n_step=(1, 3)),
    dict(samples_per_insert=4.0, min_size_to_sample=20, n_step=2),
])
def test_state_round_trip_continues_exactly(settings):
    chunks, _ = simulate(seed=5)
    settings = ReplaySettings(capacity=150, seed=9, **settings)
    a, b = ReplayBuffer(settings), ReplayBuffer(settings)
    b.set_state(_through_checkpoint(a.get_state()))  # an empty buffer round-trips too
    a.add(chunks[:40])
    a.sample(32)
    b.set_state(_through_checkpoint(a.get_state()))
    for i in range(40, len(chunks), 20):
        out = []
        for buf in (a, b):
            buf.add(chunks[i : i + 20])
            batch = buf.sample(32)
            buf.update_priorities(batch["indices"], batch["rewards"])
            out.append(batch | {"next": buf.sample(16)})
        for key in out[0]:
            x, y = out[0][key], out[1][key]
            assert all(np.array_equal(x[k], y[k]) for k in x) if isinstance(x, dict) else np.array_equal(x, y)
    if a.tree is not None:
        assert np.array_equal(a.tree.tree, b.tree.tree) and a.max_priority == b.max_priority


def _nested(eid, index, t0, steps, img_dtype=np.uint8, extra_key=False):
    t = np.arange(t0, t0 + steps + 1)
    obs = {"pos": np.stack([t, -t], 1).astype(np.float32), "cam": (np.zeros((steps + 1, 2, 2), img_dtype), t)}
    if extra_key:
        obs["more"] = t
    return EpisodeChunk(eid, index, obs=obs, actions=(t[:-1], np.ones((steps, 2), np.float32)),
                        rewards=np.ones(steps, np.float32))


def test_nested_observations_and_actions():
    buf = ReplayBuffer(ReplaySettings(capacity=40, n_step=2, seed=0))
    buf.add([_nested("a", 0, 0, 5), _nested("a", 1, 5, 30)])
    state = _through_checkpoint(buf.get_state())
    restored = ReplayBuffer(ReplaySettings(capacity=40, n_step=2, seed=0))
    restored.set_state(state)
    for b in (buf, restored):
        batch = b.sample(64)
        assert batch["obs"]["cam"][0].shape == (64, 2, 2) and batch["actions"][1].shape == (64, 2)
        assert (batch["next_obs"]["pos"][:, 0] == batch["obs"]["pos"][:, 0] + batch["n_steps"]).all()
        assert (batch["obs"]["cam"][1] == batch["actions"][0]).all()


def test_bad_input_is_refused_with_a_clear_error():
    buf = ReplayBuffer(ReplaySettings(capacity=40, seed=0))
    with pytest.raises(RuntimeError, match=r"holds 0 transitions and min_size_to_sample=1; add more"):
        buf.sample(1)
    buf.add([_nested("a", 0, 0, 3)])
    with pytest.raises(ValueError, match="obs structure .* differs from the first chunk's"):
        buf.add([_nested("b", 0, 0, 3), _nested("c", 0, 0, 3, extra_key=True)])
    with pytest.raises(ValueError, match=r"obs\['cam'\]\[0\] has per-step shape \(2, 2\) and dtype float32"):
        buf.add([_nested("b", 0, 0, 3, img_dtype=np.float32)])
    with pytest.raises(ValueError, match="obs structure None differs"):
        buf.add([_chunk("x", 0, 0, 0, [1.0])])
    assert len(buf) == 3 and buf.storage.num_written == 4  # a refused call stores nothing
    with pytest.raises(ValueError, match="2 indices but 1 priorities"):
        buf.update_priorities([0, 1], [1.0])
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        buf.sample(0)


@pytest.mark.parametrize("fields, message", [
    (dict(capacity=1), "capacity must be an int >= 2"),
    (dict(capacity=10, min_size_to_sample=10), "capacity=10 rows hold at most 9 transitions"),
    (dict(alpha=-1.0), "alpha must be a number >= 0, got -1.0"),
    (dict(beta=1.5), r"beta must be a number in \[0, 1\], got 1.5"),
    (dict(n_step=(3, 2)), r"1 <= lo <= hi, got \(3, 2\)"),
    (dict(n_step=0), "n_step must be an int >= 1"),
    (dict(gamma=1.5), "gamma must be a number in"),
    (dict(samples_per_insert=0.0), "samples_per_insert must be a number > 0"),
    (dict(samples_per_insert=4.0, error_buffer=1.0), "could block samples and/or inserts completely"),
])
def test_settings_problems(fields, message):
    problems = ReplaySettings(**fields).problems()
    assert len(problems) == 1 and re.search(message, problems[0]), problems
    with pytest.raises(ValueError, match="invalid replay settings"):
        ReplayBuffer(ReplaySettings(**fields))
    assert ReplaySettings().problems() == []
