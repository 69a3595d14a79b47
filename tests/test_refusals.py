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
                                      ((128, 256), ValueError), (64, TypeError)])
def test_forced_tiles_are_kernel_tiles(tile, err):
    w = PrefixAttentionWrapper("cpu")
    with pytest.raises(err, match="tile"):
        w.plan(np.array([[0, 1]]), [20], 4, 4, 128, 16, tile=tile)


def test_a_kernel_tile_is_accepted():
    w = PrefixAttentionWrapper("cpu")
    plan = w.plan(np.array([[0, 1]]), [20], 4, 4, 128, 16, tile=(16, 64))
    assert plan.stats()["tiles"] == {"16x64": 1}


def test_outputs_that_overlap_are_refused():
    w, q, k, v = _wrapper_with_a_plan()
    buf = np.zeros((1, 4, 64), np.float32)
    with pytest.raises(ValueError, match="out overlaps lse"):
        w.run(q, (k, v), out=buf, lse=buf[:, :, 0])
    with pytest.raises(ValueError, match="out overlaps q"):
        w.run(q, (k, v), out=q)
    with pytest.raises(ValueError, match="lse overlaps k_cache"):
        w.run(q, (k, v), lse=k[0, 0:1, :, 0])
    out, lse = w.run(q, (k, v), out=buf, lse=np.zeros((1, 4), np.float32))   # separate: fine
    assert out is buf and np.isfinite(lse).all()


def test_a_plan_made_on_another_thread_is_named():
    import threading
    w, q, k, v = _wrapper_with_a_plan()
    made = {}
    t = threading.Thread(target=lambda: made.setdefault(
        "plan", w.plan(np.array([[0, 2]]), [30], 4, 4, 64, 16, kv_data_type="float32")))
    t.start()
    t.join()
    with pytest.raises(RuntimeError, match="made by another thread"):
        w.run(q, (k, v))
    out = w.run(q, (k, v), plan=made["plan"])          # said explicitly: runs that plan
    ref = dense_attention(q, (k, v), np.array([[0, 2]]), np.array([30]), 16)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    other = w.planner.plan(np.array([[0, 1]]), [20], 4, 4, 64, 16, kv_data_type="float32")
    with pytest.raises(ValueError, match="not this wrapper's current plan"):
        w.run(q, (k, v), plan=other)


def test_two_threads_on_one_wrapper_never_get_the_other_batch():
    """Each thread plans its own batch and runs it, 60 times, on one shared wrapper: every call
    either computes the thread's own attention or raises RuntimeError (before the threading
    contract, hundreds of runs returned the other thread's batch)."""
    import threading
    import time
    w = PrefixAttentionWrapper("cpu")
    k, v = random_kv_cache(3, 16, 4, 64, dtype=np.float32, seed=2)
    q = np.random.default_rng(3).standard_normal((1, 4, 64)).astype(np.float32)
    batches = {0: (np.array([[0, 1]]), [20]), 1: (np.array([[2, 1]]), [31])}
    refs = {i: dense_attention(q, (k, v), t, np.array(s), 16) for i, (t, s) in batches.items()}
    tally = {"right": 0, "refused": 0, "wrong": 0}
    lock = threading.Lock()
    w.plan(*batches[0], 4, 4, 64, 16, kv_data_type="float32")   # compile once, outside
    w.run(q, (k, v))

    def worker(i):
        for _ in range(60):
            try:
                w.plan(*batches[i], 4, 4, 64, 16, kv_data_type="float32")
                time.sleep(0.0005)     # as a serving thread does other work between the two
                out = w.run(q, (k, v))
            except RuntimeError:
                with lock:
                    tally["refused"] += 1
                continue
            ok = np.allclose(out, refs[i], rtol=1e-4, atol=1e-5)
            with lock:
                tally["right" if ok else "wrong"] += 1

    ts = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert tally["wrong"] == 0, tally
    assert tally["right"] + tally["refused"] == 120 and tally["right"] > 0, tally
