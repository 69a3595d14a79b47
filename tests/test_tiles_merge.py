"""Tile solver and selector; log-sum-exp merge."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pat_core import GPUS, merge_state
from pat_core.merge import merge_partials
from pat_core.tiles import TileSelector, check_tile, feasible_tiles


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_feasible_set_respects_constraints(gpu, d, dtype):
    tiles = feasible_tiles(d, dtype, gpu)
    assert tiles
    spec = GPUS[gpu]
    for m, n in tiles:
        chk = check_tile(m, n, d, dtype, gpu)
        assert chk.feasible
        assert m >= 16 and n >= 16 and m & (m - 1) == 0 and n & (n - 1) == 0
        assert chk.resources.smem <= spec.smem_per_block
        assert chk.resources.registers <= spec.regs_per_thread
        assert n >= chk.n_min and chk.ctas_per_sm >= 1


def test_bandwidth_constraint_bites():
    # with a long memory latency, the bytes the resident CTAs keep in flight at a small n no
    # longer cover it: the bandwidth constraint rejects the tile, and only that constraint
    import dataclasses
    slow = dataclasses.replace(GPUS["h100"], mem_latency_ns=GPUS["h100"].mem_latency_ns * 64)
    chk = check_tile(128, 16, 128, "float16", slow)
    assert not chk.feasible and chk.violated == ("bandwidth",)
    assert chk.n_min > 16
    assert check_tile(128, 16, 128, "float16", "h100").n_min < chk.n_min


@given(st.integers(1, 64), st.integers(1, 200_000))
def test_selector_rounds_m_up(rows, kv):
    sel = TileSelector(128, "float16", "h100")
    (m, n), = sel.select(np.array([rows]), np.array([kv]))
    assert m >= rows
    assert (m, n) in sel.feasible
    smaller = [mm for mm in sel.m_values if rows <= mm < m]
    assert not smaller


def test_selector_prefers_bigger_n_for_longer_kv():
    sel = TileSelector(128, "float16", "h100")
    ns = sel.select(np.full(4, 16), np.array([32, 200, 1000, 100_000]))[:, 1]
    assert list(ns) == sorted(ns)


def test_fixed_tile():
    sel = TileSelector(128, "float16", "h100", fixed=(64, 128))
    assert sel.max_rows == 64
    assert set(map(tuple, sel.select(np.array([1, 40]), np.array([10, 5000])))) == {(64, 128)}


@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_merge_is_order_independent_and_matches_dense(sizes, rnd):
    rng = np.random.default_rng(rnd.randint(0, 10**6))
    d = 8
    s = rng.standard_normal(sum(sizes)) * 3
    v = rng.standard_normal((sum(sizes), d))
    dense_lse = np.log(np.exp(s).sum())
    dense_o = (np.exp(s - dense_lse)[:, None] * v).sum(0)
    parts = np.split(np.arange(sum(sizes)), np.cumsum(sizes)[:-1])
    states = [((np.exp(s[p] - s[p].max())[:, None] * v[p]).sum(0) / np.exp(s[p] - s[p].max()).sum(),
               np.log(np.exp(s[p]).sum())) for p in parts]
    states.append((np.zeros(d), -np.inf))           # an empty partial is the identity
    for perm in (range(len(states)), reversed(range(len(states)))):
        o, lse = np.zeros(d), -np.inf
        for i in perm:
            o, lse = merge_state(o, lse, *states[i])
        np.testing.assert_allclose(o, dense_o, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, dense_lse, rtol=1e-12)


def test_merge_partials_empty_states_no_nan():
    o = np.ones((3, 2, 4), np.float32)
    lse = np.array([[-np.inf, 0.0], [-np.inf, -np.inf], [-np.inf, 1.0]], np.float32)
    out, l = merge_partials(o, lse, np.array([0, 2, 3], np.int32))
    assert np.isfinite(out).all()
    assert np.all(out[0, 0] == 0) and np.isneginf(l[0, 0])
    np.testing.assert_allclose(out[0, 1], 1.0)
    np.testing.assert_allclose(l[1, 1], 1.0)
