"""Batch invariance on the CUDA backend: with ``plan(..., batch_invariant=True)`` one request's
output and LSE are the same bits whatever else is in its batch (fp16 and bf16, sharing
partners, long KV over several chunks), and right against the float64 reference.

Every test is ``@pytest.mark.gpu`` and skipped without CuPy, torch and a CUDA device (importing
this module needs neither).  The CPU executor's side is ``tests/test_batch_invariant.py``.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies import invariant_batches, invariant_table

pytestmark = pytest.mark.gpu


def _available() -> bool:
    try:
        from pat_core.cuda_backend import is_available
        import torch  # noqa: F401
        return is_available()
    except Exception:
        return False


@pytest.fixture(scope="module")
def backend():
    """One backend for the module (the kernels compile at first use)."""
    if not _available():
        pytest.skip("needs CuPy, torch and a CUDA device")
    from pat_core.cuda_backend import CudaBackend
    return CudaBackend()


def _cache(num_pages, ps, hk, d, dtype, seed):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    k = torch.randn((num_pages, ps, hk, d), generator=g, device="cuda").to(tdt)
    v = torch.randn((num_pages, ps, hk, d), generator=g, device="cuda").to(tdt)
    return k, v


def _run(backend, rows, q_target, pos, kv, ps, hq, hk, d, dtype, chunk, seed):
    """Plan ``rows`` batch-invariantly on the CUDA wrapper and run it (output and LSE
    buffers poisoned with NaN); ``(out row, lse row, out, lse, q, table, lens)``."""
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.planner import Tuning
    table, lens = invariant_table(rows)
    w = PrefixAttentionWrapper(backend="cuda")
    w._gpu_backend = backend          # share the module's compiled kernels
    w.planner.tuning = Tuning(invariant_chunk=chunk)
    plan = w.plan(table, lens, hq, hk, d, ps, kv_data_type=dtype, batch_invariant=True)
    assert plan.batch_invariant
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((len(rows), hq, d), generator=g, device="cuda").to(q_target.dtype)
    q[pos] = q_target
    out = torch.full((len(rows), hq, d), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((len(rows), hq), float("nan"), dtype=torch.float32, device="cuda")
    w.run(q, kv, out=out, lse=lse)
    torch.cuda.synchronize()
    return out[pos].clone(), lse[pos].clone(), out, lse, q, table, lens


def _check_dense(out, lse, q, kv, table, lens, ps):
    from pat_core.reference import dense_attention, relative_error
    f = [t.float().cpu().numpy() for t in (q, kv[0], kv[1])]
    ref, ref_lse = dense_attention(f[0], (f[1], f[2]), table, lens, ps, return_lse=True)
    assert relative_error(out.float().cpu().numpy(), ref) < 2e-2
    assert np.allclose(lse.cpu().numpy(), ref_lse, atol=1e-2, rtol=1e-3)


def _same_bits(a, b):
    import torch
    return torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.view(torch.int32),
                       b.view(torch.uint8) if b.dtype != torch.float32 else b.view(torch.int32))


@settings(max_examples=25, deadline=None)
@given(st.sampled_from([(32, 8, 128), (8, 8, 64), (64, 8, 128), (4, 1, 64)]),
       st.sampled_from(["float16", "bfloat16"]), st.sampled_from([None, 64, 256]),
       st.data())
def test_request_bits_do_not_depend_on_batch(backend, heads, dtype, chunk, data):
    """Random partners sharing parts of the target's prefix (forks at and inside pages,
    identical copies, unrelated requests), random batch sizes and positions; several chunks
    per request (chunk 64 / 256, or the default 1024 with targets up to 5000 tokens)."""
    hq, hk, d = heads
    max_len = 5000 if chunk is None else 4 * chunk
    ps, target, L, batches = data.draw(invariant_batches(page_sizes=(16, 3), max_len=max_len,
                                                         pool_pages=4096))
    seed = data.draw(st.integers(0, 2**31 - 1))
    kv = _cache(4096, ps, hk, d, dtype, seed % 1000)
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_t = torch.randn((hq, d), generator=g, device="cuda").to(kv[0].dtype)
    a_out, a_lse, *_ = _run(backend, [(target, L)], q_t, 0, kv, ps, hq, hk, d, dtype, chunk,
                            seed + 1)
    for i, (rows, pos) in enumerate(batches):
        o, l_, out, lse, q, table, lens = _run(backend, rows, q_t, pos, kv, ps, hq, hk, d, dtype,
                                               chunk, seed + 2 + i)
        assert _same_bits(o, a_out) and _same_bits(l_, a_lse)
        _check_dense(out, lse, q, kv, table, lens, ps)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_long_shared_prefix_in_large_batches(backend, dtype):
    """A target behind an 8192-token shared prefix (eight 1024-token chunks) plus 300 tokens
    of its own: alone, with 15 and with 255 partners on the same prefix (a fork mid-chunk,
    each with its own suffix).  The default plans of these batches differ in split, packing
    and merge layout (block per pair, heads per warp); the invariant plan's bits stay."""
    import torch
    hq, hk, d, ps = 32, 8, 128, 16
    prefix = list(range(512))                       # 8192 tokens
    own = 19                                        # 300 tokens: 19 pages
    kv = _cache(512 + own * 256, ps, hk, d, dtype, 7)
    g = torch.Generator(device="cuda").manual_seed(3)
    q_t = torch.randn((hq, d), generator=g, device="cuda").to(kv[0].dtype)

    def req(i):
        return (prefix + list(range(512 + i * own, 512 + (i + 1) * own)), 8192 + 300)

    got = []
    for partners in (0, 15, 255):
        rows = [req(i) for i in range(partners + 1)]
        pos = partners // 2
        rows.insert(pos, rows.pop(0))                # the target (req(0)) mid-batch
        o, l_, out, lse, q, table, lens = _run(backend, rows, q_t, pos, kv, ps, hq, hk, d, dtype,
                                               None, 11 + partners)
        got.append((o, l_))
        if partners == 15:
            _check_dense(out, lse, q, kv, table, lens, ps)
    for o, l_ in got[1:]:
        assert _same_bits(o, got[0][0]) and _same_bits(l_, got[0][1])


def test_graph_safe_wrapper_refuses():
    """``use_cuda_graph=True`` with ``batch_invariant=True`` is refused, naming both."""
    if not _available():
        pytest.skip("needs CuPy, torch and a CUDA device")
    from pat_core import PrefixAttentionWrapper
    w = PrefixAttentionWrapper(backend="cuda", use_cuda_graph=True, max_batch_size=4,
                               max_num_pages=64)
    with pytest.raises(ValueError, match="batch_invariant.*use_cuda_graph"):
        w.plan([[0, 1]], [20], 8, 2, 64, 16, batch_invariant=True)
