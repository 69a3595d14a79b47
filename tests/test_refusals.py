"""What a wrapper refuses, and what it leaves behind when it does: a failed ``plan()`` leaves
no runnable plan, and a forced ``tile=`` must be a kernel's tile (CPU only)."""
import numpy as np
import pytest

from pat_core import PrefixAttentionWrapper
from pat_core.reference import dense_attention
from pat_core.workloads import random_kv_cache


def _wrapper_with_a_plan():
    w = PrefixAttentionWrapper("cpu")
    w.plan(np.array([[0, 1]]), [20], 4, 4, 64, 16, kv_data_type="float32")
    k, v = random_kv_cache(3, 16, 4, 64, dtype=np.float32, seed=1)
    q = np.random.default_rng(0).standard_normal((1, 4, 64)).astype(np.float32)
    return w, q, k, v


@pytest.mark.parametrize("how", ["plan", "plan_csr"])
def test_a_failed_plan_leaves_nothing_runnable(how):
    w, q, k, v = _wrapper_with_a_plan()
    w.run(q, (k, v))
    with pytest.raises(ValueError):
        if how == "plan":   # 40 tokens need three pages; the table lists two
            w.plan(np.array([[0, 2]]), [40], 4, 4, 64, 16, kv_data_type="float32")
        else:               # indptr and indices disagree
            w.plan_csr(np.array([0, 3]), np.array([0, 2]), np.array([8]), 4, 4, 64, 16,
                       kv_data_type="float32")
    for call in (lambda: w.run(q, (k, v)), w.stats):
        with pytest.raises(RuntimeError, match="the last plan\\(\\) call failed .*ValueError"):
            call()
    # a later plan runs again, and computes its own batch
    w.plan(np.array([[0, 2]]), [30], 4, 4, 64, 16, kv_data_type="float32")
    out = w.run(q, (k, v))
    ref = dense_attention(q, (k, v), np.array([[0, 2]]), np.array([30]), 16)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tile,err", [((3, 5), ValueError), ((0, 16), ValueError),
                                      ((16, 0), ValueError), ((17, 48), ValueError),
                                      ((-16, 64), ValueError), ((True, 64), TypeError),
                                      ((16, 64, 1), (TypeError, ValueError)),
                                      ((128, 256), ValueError)])
def test_forced_tiles_are_kernel_tiles(tile, err):
    w = PrefixAttentionWrapper("cpu")
    with pytest.raises(err, match="tile"):
        w.plan(np.array([[0, 1]]), [20], 4, 4, 128, 16, tile=tile)


def test_a_kernel_tile_is_accepted():
    w = PrefixAttentionWrapper("cpu")
    plan = w.plan(np.array([[0, 1]]), [20], 4, 4, 128, 16, tile=(16, 64))
    assert plan.stats()["tiles"] == {"16x64": 1}
