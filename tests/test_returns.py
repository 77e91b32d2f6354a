"""GAE and V-trace against plain per-step reference loops, on random flat batches of chunks."""
import numpy as np
import pytest

from pipeline.algorithms.returns import gae, vtrace


def random_batch(rng, num_chunks):
    lengths = rng.integers(1, 12, size=num_chunks)
    n = int(lengths.sum())
    return dict(
        lengths=lengths,
        rewards=rng.normal(size=n).astype(np.float32),
        values=rng.normal(size=n + num_chunks).astype(np.float32),
        terminated=rng.random(num_chunks) < 0.5,
        behaviour_logp=rng.normal(-1.0, 0.5, size=n).astype(np.float32),
        target_logp=rng.normal(-1.0, 0.5, size=n).astype(np.float32),
    )


def chunks_of(b):
    """Yield per chunk: (rewards, values with bootstrap row, terminated, step slice)."""
    s, v = 0, 0
    for length, term in zip(b["lengths"], b["terminated"]):
        yield b["rewards"][s : s + length], b["values"][v : v + length + 1], term, slice(s, s + length)
        s += length
        v += length + 1


def reference_gae(b, gamma, lam):
    adv = np.zeros(len(b["rewards"]), np.float64)
    for r, v, term, sl in chunks_of(b):
        last = 0.0
        for t in reversed(range(len(r))):
            next_v = 0.0 if (term and t == len(r) - 1) else v[t + 1]
            delta = r[t] + gamma * next_v - v[t]
            last = delta + gamma * lam * last
            adv[sl.start + t] = last
    values = np.concatenate([v[:-1] for _, v, _, _ in chunks_of(b)])
    return adv, adv + values


def reference_vtrace(b, gamma, rho_bar, pg_rho_bar, c_bar):
    """Espeholt et al. (2018), eq. 1, written literally: v_s = V(x_s) + sum_t gamma^(t-s) (prod c_i) delta_t V."""
    n = len(b["rewards"])
    vs, pg = np.zeros(n), np.zeros(n)
    rho_all = np.exp(b["target_logp"] - b["behaviour_logp"]).astype(np.float64)
    for r, v, term, sl in chunks_of(b):
        rho = rho_all[sl]
        T = len(r)
        disc = np.full(T, gamma)
        if term:
            disc[-1] = 0.0
        deltas = np.minimum(rho_bar, rho) * (r + disc * v[1:] - v[:-1])
        for s in range(T):
            total, coef = 0.0, 1.0
            for t in range(s, T):
                total += coef * deltas[t]
                coef *= disc[t] * min(c_bar, rho[t])
            vs[sl.start + s] = v[s] + total
        for s in range(T):
            v_next = vs[sl.start + s + 1] if s + 1 < T else v[T]
            pg[sl.start + s] = min(pg_rho_bar, rho[s]) * (r[s] + disc[s] * v_next - v[s])
    return vs, pg


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 1.0), (1.0, 0.0)])
def test_gae_matches_reference(seed, gamma, lam):
    b = random_batch(np.random.default_rng(seed), num_chunks=7)
    adv, targets = gae(b["rewards"], b["values"], b["lengths"], b["terminated"], gamma, lam)
    ref_adv, ref_targets = reference_gae(b, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(targets, ref_targets, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("rho_bar,pg_rho_bar,c_bar", [(1.0, 1.0, 1.0), (2.0, 0.5, 0.9), (10.0, 10.0, 10.0)])
def test_vtrace_matches_reference(seed, rho_bar, pg_rho_bar, c_bar):
    b = random_batch(np.random.default_rng(100 + seed), num_chunks=6)
    vs, pg = vtrace(b["behaviour_logp"], b["target_logp"], b["rewards"], b["values"], b["lengths"],
                    b["terminated"], 0.95, rho_bar, pg_rho_bar, c_bar)
    ref_vs, ref_pg = reference_vtrace(b, 0.95, rho_bar, pg_rho_bar, c_bar)
    np.testing.assert_allclose(vs, ref_vs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pg, ref_pg, rtol=1e-4, atol=1e-4)


def test_vtrace_on_policy_equals_n_step_returns():
    """With identical policies and untruncated traces, v_s is the discounted return bootstrapped at the end."""
    b = random_batch(np.random.default_rng(7), num_chunks=4)
    b["target_logp"] = b["behaviour_logp"].copy()
    vs, _ = vtrace(b["behaviour_logp"], b["target_logp"], b["rewards"], b["values"], b["lengths"],
                   b["terminated"], 0.9)
    adv, targets = gae(b["rewards"], b["values"], b["lengths"], b["terminated"], 0.9, 1.0)
    np.testing.assert_allclose(vs, targets, rtol=1e-4, atol=1e-4)


def test_single_step_chunks_and_terminal_at_end():
    b = dict(lengths=np.array([1, 1]), rewards=np.array([1.0, 2.0], np.float32),
             values=np.array([0.5, 10.0, 0.5, 10.0], np.float32), terminated=np.array([True, False]))
    adv, targets = gae(b["rewards"], b["values"], b["lengths"], b["terminated"], 0.5, 1.0)
    np.testing.assert_allclose(targets, [1.0, 2.0 + 0.5 * 10.0])
