"""GPU kernel tests: the CUDA backend against the float64 dense reference.

Every test here is ``@pytest.mark.gpu`` and is skipped without CuPy and a CUDA device (importing
this module needs neither).  Tolerance: the kernel's norm-wise relative error against
the float64 reference may be at most twice the error of a plain same-dtype implementation (torch
attention computed entirely in fp16/bf16) on the same inputs.

Covered: every compiled forward variant (the planner's ``tile=(m, n)`` override forces it), every
packer on Hypothesis-drawn prefix forests, fp16 and bf16, head_dim 64, 128 and 256 (every
head_dim-256 variant also on a split shared root), page sizes 1, 16 and 32, NHD and HND caches,
strided views, the caller's stream, CuPy inputs, fp8 (e4m3fn) caches with scales (every fp8
variant, random forests, CuPy uint8 bytes), outputs and partial
buffers poisoned with NaN before each run, and bit-identical repeated runs.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import cuda_compile as cc

pytestmark = pytest.mark.gpu

PACKERS = ("pat", "query", "node", "compute", "cascade")


def _available() -> bool:
    try:
        from pat_core.cuda_backend import is_available
        import torch  # noqa: F401
        return is_available()
    except Exception:
        return False


requires_gpu = pytest.mark.skipif(not _available(), reason="needs CuPy, torch and a CUDA device")


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def backend():
    """One backend for the session, with every kernel variant compiled up front."""
    if not _available():
        pytest.skip("needs CuPy, torch and a CUDA device")
    from pat_core.cuda_backend import CudaBackend
    be = CudaBackend()
    be.warmup(jobs=int(os.environ.get("PAT_COMPILE_JOBS", os.cpu_count() or 1)))
    return be


def _torch_dtype(name):
    import torch
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def make_inputs(num_pages, page_size, batch, hq, hk, d, dtype, layout, seed, strided=False):
    """Random q, k_cache, v_cache as torch CUDA tensors (optionally strided views)."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = _torch_dtype(dtype)
    shape = ((num_pages, page_size, hk, d) if layout == "NHD" else (num_pages, hk, page_size, d))
    if strided:
        # a view whose page and head strides are not the dense ones (head_dim still contiguous)
        big = (shape[0], shape[1], shape[2] + 1, shape[3] * 2)
        k = torch.randn(big, generator=g, device="cuda", dtype=torch.float32).to(tdt)
        v = torch.randn(big, generator=g, device="cuda", dtype=torch.float32).to(tdt)
        k, v = k[:, :, 1:, 8:8 + d], v[:, :, :-1, d:]
    else:
        k = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(tdt)
        v = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32).to(tdt)
    q = torch.randn((batch, hq, d), generator=g, device="cuda", dtype=torch.float32).to(tdt)
    return q, k, v


def plain_attention(q, k, v, bt, page_size, layout, scale):
    """Same-dtype torch attention (scores, softmax and P·V all in q's dtype) + fp32 LSE."""
    import torch
    B, hq, d = q.shape
    hk = k.shape[2] if layout == "NHD" else k.shape[1]
    g = hq // hk
    out = torch.empty_like(q)
    lse = torch.empty((B, hq), dtype=torch.float32, device=q.device)
    for r in range(B):
        pages = torch.as_tensor(bt.pages_of(r).astype(np.int64), device=q.device)
        L = int(bt.seq_lens[r])
        kb, vb = k[pages], v[pages]
        if layout == "HND":
            kb, vb = kb.transpose(1, 2), vb.transpose(1, 2)
        kb = kb.reshape(-1, hk, d)[:L].permute(1, 0, 2)     # [hk, L, d]
        vb = vb.reshape(-1, hk, d)[:L].permute(1, 0, 2)
        qg = q[r].view(hk, g, d)
        s = torch.matmul(qg, kb.transpose(1, 2)) * scale    # [hk, g, L] in q's dtype
        p = torch.softmax(s, dim=-1)
        out[r] = torch.matmul(p, vb).reshape(hq, d)
        lse[r] = torch.logsumexp(s.float(), dim=-1).reshape(hq)
    return out, lse


def _np64(t):
    return t.detach().float().cpu().numpy().astype(np.float64)


def _rel(x, ref):
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def poisoned_runner(backend, plan, q, call):
    """A function running ``call(out, lse)`` with the plan's partials and fresh ``out`` /
    ``lse`` (q's rows and heads) all NaN first, so a slot no kernel writes shows; it returns
    ``(out, lse)`` after a device sync."""
    import torch

    def run_once():
        st = backend.state_for(plan)     # the plan's device state (written by plan())
        st.o_part.fill(float("nan"))
        st.l_part.fill(float("nan"))
        out = torch.full(tuple(q.shape), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full(tuple(q.shape[:2]), float("nan"), dtype=torch.float32, device=q.device)
        call(out, lse)
        torch.cuda.synchronize()
        return out, lse
    return run_once


def assert_like_reference(plan, run_once, out, lse, ref, ref_lse, low, low_lse, what):
    """``out`` / ``lse`` within twice the error of the plain same-dtype result ``low`` /
    ``low_lse`` against the float64 ``ref`` / ``ref_lse``, and a rerun bit-identical (a moving
    result is a race).  Returns ``(err, err_plain)``."""
    import torch
    err, err_plain = _rel(_np64(out), ref), _rel(_np64(low), ref)
    assert err <= 2 * err_plain + 1e-6, (
        f"{plan.summary()}: {what} error {err:.3e} > 2 x plain error {err_plain:.3e}")
    lerr = float(np.abs(_np64(lse) - ref_lse).max())
    lerr_plain = float(np.abs(_np64(low_lse) - ref_lse).max())
    assert lerr <= 2 * lerr_plain + 1e-5, f"lse error {lerr:.3e} vs plain {lerr_plain:.3e}"
    out2, lse2 = run_once()
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "repeated runs differ"
    return err, err_plain


def check_case(backend, packer, block_tables, seq_lens, num_pages, page_size, hq, hk, d, dtype,
               layout="NHD", seed=0, tile=None, strided=False, tuning=None):
    """Plan (with the planner's ``tuning``, default its own), run (outputs and partials
    poisoned), compare with the references, rerun."""
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.inputs import as_block_table

    w = PrefixAttentionWrapper(backend="cuda", packer=packer, kv_layout=layout)
    w._gpu_backend = backend   # share the session's compiled kernels and buffers
    if tuning is not None:
        w.planner.tuning = tuning
    plan = w.plan(block_tables, seq_lens, hq, hk, d, page_size, kv_data_type=dtype, tile=tile)
    plan.validate()
    bt = as_block_table(block_tables, seq_lens, page_size)
    B = bt.batch_size
    q, k, v = make_inputs(num_pages, page_size, B, hq, hk, d, dtype, layout, seed, strided)

    run_once = poisoned_runner(backend, plan, q, lambda out, lse: backend.run(
        plan, q, k, v, kv_layout=layout, return_lse=True, out=out, lse=lse))
    out, lse = run_once()
    assert not torch.isnan(out).any(), "output not fully written (NaN left)"
    assert not torch.isnan(lse).any(), "lse not fully written (NaN left)"

    ref, ref_lse = dense_attention(_np64(q), (_np64(k), _np64(v)), block_tables, seq_lens,
                                   page_size, kv_layout=layout, sm_scale=plan.sm_scale,
                                   return_lse=True)
    low, low_lse = plain_attention(q, k, v, bt, page_size, layout, plan.sm_scale)
    err, err_plain = assert_like_reference(plan, run_once, out, lse, ref, ref_lse, low, low_lse,
                                           f"{dtype} kernel")
    return plan, err, err_plain


# ----------------------------------------------------------------------------- every variant
def _variant_case(m):
    """A two-level tree whose root CTA has about m rows with group 4 (hq=8, hk=2)."""
    n_req = max(1, m // 4)
    return f"1,{n_req}_{2 * 37 + 5 + m},{19 + m // 16}"


@requires_gpu
@pytest.mark.parametrize("variant", cc.all_fwd_variants(), ids=lambda v: v.key)
def test_every_variant(backend, variant):
    from pat_core.workloads import build_tree_batch
    ps = 16
    b = build_tree_batch(_variant_case(variant.m), page_size=ps, seed=variant.n)
    plan, err, plain = check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, ps,
                                  8, 2, variant.head_dim, variant.dtype, seed=variant.m,
                                  tile=(variant.m, variant.n))
    assert set(plan.stats()["tiles"]) == {f"{variant.m}x{variant.n}"}


@requires_gpu
@pytest.mark.parametrize("m", (64, 128))
@pytest.mark.parametrize("root", (15, 64, 100, 129, 200))
@pytest.mark.parametrize("ps", (1, 16))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_warpgroup_tile_counts(backend, m, root, ps, dtype):
    """Two-stage warpgroup tiles (n = 64) over shared roots of one to four KV tiles, full and
    ragged: the prologue, the steady state and the last step of the warpgroup KV walk, each
    against float64."""
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch(f"1,{m // 4}_{root},3", page_size=ps, seed=root)
    plan, err, plain = check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, ps,
                                  8, 2, 128, dtype, seed=root, tile=(m, 64))
    assert set(plan.stats()["tiles"]) == {f"{m}x64"}


@requires_gpu
@pytest.mark.parametrize("n,stages", ((32, 3), (64, 2), (64, 3), (128, 2)))
@pytest.mark.parametrize("root,dtype", ((15, "float16"), (40, "bfloat16"), (129, "float16"),
                                        (200, "bfloat16")))
@pytest.mark.parametrize("ps", (1, 16))
def test_warpgroup_two_slices(backend, n, stages, root, ps, dtype):
    """64-row warpgroup tiles on two token slices (8 warps, two warpgroups over the same rows,
    each walking half of every tile's tokens, states combined at the end) over shared roots of
    one to seven KV tiles: ragged last tiles, including ones whose second slice holds no token
    (root 15 at every n, 40 at n = 32, 129 at n = 64 and 128), against float64."""
    import torch
    from pat_core.workloads import build_tree_batch
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("warpgroup tiles need sm_90")
    b = build_tree_batch(f"1,16_{root},3", page_size=ps, seed=root)
    cc.VARIANT_OVERRIDES[(64, n)] = (8, stages, cc.WG_ROWS)
    try:
        plan, err, plain = check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages,
                                      ps, 8, 2, 128, dtype, seed=root, tile=(64, n))
        assert set(plan.stats()["tiles"]) == {f"64x{n}"}
        assert {v.warps for v in backend.variants_for(plan) if getattr(v, "m", 0) == 64} == {8}
    finally:
        cc.VARIANT_OVERRIDES.pop((64, n), None)


@requires_gpu
@pytest.mark.parametrize("variant", cc.all_fwd_variants(head_dims=(256,)), ids=lambda v: v.key)
@pytest.mark.parametrize("ps", (1, 16))
def test_head_dim_256_sharing_and_split(backend, variant, ps):
    """Every head_dim-256 variant (16-row warps re-reading Q from shared memory) on a shared
    2100-token root that the long-KV split cuts into 256-token parts, with ragged private
    leaves: several partial slots per request, merged by the head_dim-256 merge kernel."""
    from pat_core.tuning import Tuning
    from pat_core.workloads import build_tree_batch
    m, n = variant.m, variant.n
    reqs = max(1, m // 4)                # GQA group 4: the root CTA holds about m rows
    b = build_tree_batch(f"1,{reqs}_2100,{37 + m}", page_size=ps, seed=m + n)
    tuning = Tuning(split_share=64.0, min_part=256, merge_min_part=256, narrow_share=0.0,
                    request_share=0.0)
    plan, err, plain = check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, ps,
                                  8, 2, 256, variant.dtype, seed=n, tile=(m, n), tuning=tuning)
    assert set(plan.stats()["tiles"]) == {f"{m}x{n}"}
    assert plan.num_slots > b.batch_size, "no request has several partials: nothing merged"
    assert variant in backend.variants_for(plan)


@requires_gpu
@pytest.mark.parametrize("heads,nh", (((16, 4), 1), ((32, 4), 2), ((64, 8), 4)))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_head_dim_256_merge_heads_per_warp(backend, heads, nh, dtype):
    """The head_dim-256 merge in warp mode with 1, 2 and 4 heads per warp (fewer slots per
    round than at head_dim 128: pat_merge.cuh, kMergeRoundSlots): 272 requests under one
    shared root, two partials each, enough (request, head) pairs for each layout."""
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,272_128,17", page_size=16, seed=1)
    plan, err, plain = check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16,
                                  heads[0], heads[1], 256, dtype, seed=nh)
    merge = backend.variants_for(plan)[-1]
    assert isinstance(merge, cc.MergeVariant) and merge.head_dim == 256 and merge.heads == nh


# ----------------------------------------------------------------------------- random forests
from strategies import head_configs, prefix_batches, qo_indptrs  # noqa: E402  (tests/strategies.py)


@requires_gpu
@settings(deadline=None, max_examples=int(os.environ.get("PAT_GPU_EXAMPLES", 40)))
@given(batch=prefix_batches(max_requests=16, page_sizes=(1, 16, 32)), heads=head_configs(),
       d=st.sampled_from(cc.HEAD_DIMS), dtype=st.sampled_from(("float16", "bfloat16")),
       packer=st.sampled_from(PACKERS), layout=st.sampled_from(("NHD", "HND")),
       seed=st.integers(0, 2**16))
def test_random_forests(backend, batch, heads, d, dtype, packer, layout, seed):
    hq, hk = heads
    check_case(backend, packer, batch.block_tables, batch.seq_lens, batch.num_pages,
               batch.page_size, hq, hk, d, dtype, layout=layout, seed=seed)


@requires_gpu
@pytest.mark.parametrize("packer", PACKERS)
@pytest.mark.parametrize("page_size", (1, 16, 32))
def test_packers_tree(backend, packer, page_size):
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4,16_100,37,61", page_size=page_size, seed=page_size)
    for hq, hk in ((32, 8), (12, 2), (7, 7), (40, 8)):
        check_case(backend, packer, b.block_tables, b.seq_lens, b.num_pages, page_size, hq, hk,
                   128, "float16", seed=hq)


@requires_gpu
@pytest.mark.parametrize("layout", ("NHD", "HND"))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_strided_cache_views(backend, layout, dtype):
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,3,9_70,20,33", page_size=16, seed=1)
    check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16, 8, 2, 64, dtype,
               layout=layout, strided=True)


# ----------------------------------------------------------------------------- streams, CuPy
@requires_gpu
def test_runs_on_callers_stream(backend):
    """On a side stream, with the default stream busy, results match a default-stream run."""
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4,32_512,128,64", page_size=16, seed=3)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    w._gpu_backend = backend
    w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 32, 8, 128, "float16", "NHD", 5)
    ref = w.run(q, (k, v))
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q2 = q.clone()          # produced on s: the kernels must wait for it
        out = w.run(q2, (k, v))
    s.synchronize()
    assert torch.equal(out, ref)


@requires_gpu
def test_a_replaced_state_is_kept_while_its_work_runs(backend):
    """plan() replaces a device state too small for a batch without waiting for the GPU: with
    the stream held up by a long sleep, batches that each outgrow the last are planned and run
    (every state but the last replaced while its kernels are still queued, so none of them may
    be freed yet); once the GPU is done, every output equals the same batch's run on an idle
    GPU, and the replaced states are dropped."""
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.cuda_backend import CudaBackend
    from pat_core.workloads import build_tree_batch
    batches = [build_tree_batch(s, page_size=16, seed=i)
               for i, s in enumerate(("2_64", "1,40_300,40", "1,160_700,60"))]
    inputs = [make_inputs(b.num_pages, 16, b.batch_size, 32, 8, 128, "float16", "NHD", i)
              for i, b in enumerate(batches)]

    def run_all(busy):
        be = CudaBackend()            # a fresh one: its first state is the smallest batch's
        w = PrefixAttentionWrapper(backend="cuda", packer="pat")
        w._gpu_backend = be
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(400_000_000)        # ~0.2 s of GPU time ahead of everything
        outs = []
        for b, (q, k, v) in zip(batches, inputs):
            w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
            outs.append(w.run(q, (k, v)))
            if not busy:
                torch.cuda.synchronize()
        return be, outs

    _, want = run_all(False)
    be, got = run_all(True)
    assert len(be._retired) == len(batches) - 1       # no plan() waited for the sleep
    torch.cuda.synchronize()
    for g, r in zip(got, want):
        assert torch.equal(g, r)
    be._reap()
    assert be._retired == []


@requires_gpu
def test_steps_planned_on_another_thread_while_the_last_runs(backend):
    """A pipelined decode loop on one wrapper: each next step is planned on a worker thread
    while the steps before it are still queued on the GPU (held up by a sleep), and run on the
    main thread with ``run(plan=...)``; every step's output equals the same step's run on an
    idle GPU, and the second plan is made while the GPU is still busy (nothing waited)."""
    import threading
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import ServingLoop
    loop = ServingLoop(24, 2, 256, (8, 64), 16, seed=5)
    steps = [tuple(np.array(a) for a in loop.step()) for _ in range(6)]
    pages = max(int(t.max()) for t, _ in steps) + 1
    q, k, v = make_inputs(pages, 16, 24, 32, 8, 128, "float16", "NHD", 7)

    def run_all(busy):
        w = PrefixAttentionWrapper(backend="cuda", packer="pat")
        made, outs, busy_after_second_plan = {}, [], None

        def plan(i):        # the worker thread's current stream is the default one, as here
            made[i] = w.plan(*steps[i], 32, 8, 128, 16)
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(300_000_000)            # ~0.15 s of GPU time ahead of it all
        for i in range(len(steps)):
            t = threading.Thread(target=plan, args=(i,))
            t.start()
            t.join()
            if i == 1:
                busy_after_second_plan = not torch.cuda.current_stream().query()
            outs.append(w.run(q, (k, v), plan=made[i]))
        torch.cuda.synchronize()
        return outs, busy_after_second_plan

    want, _ = run_all(False)
    got, still_busy = run_all(True)
    assert still_busy, "the second plan waited for the GPU"
    for i, (g, r) in enumerate(zip(got, want)):
        assert torch.equal(g, r), f"step {i}"


@requires_gpu
def test_a_new_state_on_a_side_stream_is_zeroed_on_that_stream(backend):
    """A device state's first plan and run on a non-blocking side stream while the default
    stream is held up by a long sleep: the state's buffers (plan, work and chain counters) are
    zeroed on the side stream before its copy, so the output equals an idle GPU's.  (Zeroed on
    CuPy's current stream, the default one, the fill would wait behind the sleep and the
    kernels would read counters left in reused memory: here -1, put there first.)"""
    import cupy as cp
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.cuda_backend import CudaBackend
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,40_300,40", page_size=16, seed=2)
    q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 32, 8, 128, "float16", "NHD", 3)

    def run(busy):
        w = PrefixAttentionWrapper(backend="cuda", packer="pat")
        w._gpu_backend = CudaBackend()          # a fresh state, made by this plan
        junk = cp.full(1 << 22, -1, dtype=cp.int32)
        del junk                                # its memory back in CuPy's pool, not zero
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        if busy:
            torch.cuda._sleep(400_000_000)      # the default stream held up (~0.2 s)
        with torch.cuda.stream(side):
            w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
            out = w.run(q, (k, v))
        torch.cuda.synchronize()
        return out

    assert torch.equal(run(True), run(False))


@requires_gpu
def test_cupy_inputs(backend):
    import cupy
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,8_300,45", page_size=16, seed=4)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    w._gpu_backend = backend
    w.plan(b.block_tables, b.seq_lens, 16, 4, 128, 16)
    q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 16, 4, 128, "float16", "NHD", 6)
    qc, kc, vc = (cupy.asarray(t) for t in (q, k, v))
    out, lse = w.run(qc, (kc, vc), return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16
    assert isinstance(lse, cupy.ndarray) and lse.dtype == cupy.float32
    ref = dense_attention(_np64(q), (_np64(k), _np64(v)), b.block_tables, b.seq_lens, 16)
    assert _rel(cupy.asnumpy(out).astype(np.float64), ref) < 5e-3
    out_t = w.run(q, (k, v))
    assert np.array_equal(cupy.asnumpy(out), out_t.cpu().numpy())
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- validation
@requires_gpu
def test_bad_inputs(backend):
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4_40,20", page_size=16, seed=0)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    w._gpu_backend = backend
    plan = w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 8, 2, 64, "float16", "NHD", 0)
    wide = torch.zeros(b.num_pages, 16, 2, 128, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match="k_cache"):
        backend.run(plan, q, wide[..., ::2], v)
    with pytest.raises(TypeError):
        backend.run(plan, q, k.to(torch.bfloat16), v.to(torch.bfloat16))
    with pytest.raises(TypeError):
        backend.run(plan, q, k.float(), v)
    with pytest.raises(ValueError, match="pages"):
        backend.run(plan, q, k[:1], v[:1])
    with pytest.raises(ValueError, match="q"):
        backend.run(plan, q[:, :4], k, v)


# ----------------------------------------------------------------------------- multi-token queries
def plain_attention_mt(q, k, v, bt, qo, page_size, layout, scale):
    """:func:`plain_attention` with query tokens (``qo``: int ``[batch + 1]``): token ``j`` of
    a request of ``n`` tokens attends to its first ``seq_len - n + 1 + j`` positions (scores,
    softmax and P·V in q's dtype) + fp32 LSE; ``q``, out and LSE have ``qo[-1]`` rows."""
    import torch
    N, hq, d = q.shape
    hk = k.shape[2] if layout == "NHD" else k.shape[1]
    g = hq // hk
    out = torch.empty_like(q)
    lse = torch.empty((N, hq), dtype=torch.float32, device=q.device)
    for r in range(bt.batch_size):
        pages = torch.as_tensor(bt.pages_of(r).astype(np.int64), device=q.device)
        L = int(bt.seq_lens[r])
        n = int(qo[r + 1] - qo[r])
        kb, vb = k[pages], v[pages]
        if layout == "HND":
            kb, vb = kb.transpose(1, 2), vb.transpose(1, 2)
        kb = kb.reshape(-1, hk, d)[:L].permute(1, 0, 2)     # [hk, L, d]
        vb = vb.reshape(-1, hk, d)[:L].permute(1, 0, 2)
        for j in range(n):
            row = int(qo[r]) + j
            lim = L - n + 1 + j
            qg = q[row].view(hk, g, d)
            s = torch.matmul(qg, kb[:, :lim].transpose(1, 2)) * scale
            p = torch.softmax(s, dim=-1)
            out[row] = torch.matmul(p, vb[:, :lim]).reshape(hq, d)
            lse[row] = torch.logsumexp(s.float(), dim=-1).reshape(hq)
    return out, lse


def check_multitok_case(backend, block_tables, seq_lens, num_pages, page_size, qo, hq, hk, d,
                        dtype, layout="NHD", seed=0, tile=None, packer="pat", split=True,
                        fp8=False, k_scale=1.0, v_scale=1.0):
    """A multi-token plan (``qo`` int ``[batch + 1]``) through the wrapper's CUDA path (outputs
    and partials poisoned) against float64 dense attention with the causal rule, within twice
    the error of plain same-dtype attention (``fp8``: an e4m3fn cache with the scales, q in
    ``dtype``); then a bit-identical rerun.  Returns the plan."""
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.inputs import as_block_table

    w = PrefixAttentionWrapper(backend="cuda", packer=packer, kv_layout=layout)
    w._gpu_backend = backend
    kw = (dict(kv_data_type=torch.float8_e4m3fn, q_data_type=dtype) if fp8
          else dict(kv_data_type=dtype))
    plan = w.plan(block_tables, seq_lens, hq, hk, d, page_size, tile=tile, split=split,
                  qo_indptr=qo, **kw)
    plan.validate()
    bt = as_block_table(block_tables, seq_lens, page_size)
    N = int(qo[-1])
    tdt = _torch_dtype(dtype)
    if fp8:
        k, v = make_fp8_cache(num_pages, page_size, hk, d, layout, seed)
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        q = (torch.randn((N, hq, d), generator=g, device="cuda") / (4 * k_scale)).to(tdt)
        run_kw = dict(k_scale=k_scale, v_scale=v_scale)
        kp_, vp_ = k.to(tdt) * k_scale, v.to(tdt) * v_scale
    else:
        q, k, v = make_inputs(num_pages, page_size, N, hq, hk, d, dtype, layout, seed)
        run_kw = {}
        kp_, vp_ = k, v

    run_once = poisoned_runner(backend, plan, q,
                               lambda out, lse: w.run(q, (k, v), out=out, lse=lse, **run_kw))
    out, lse = run_once()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "output not fully written"
    ref, ref_lse = dense_attention(_np64(q), (_np64(k), _np64(v)), block_tables, seq_lens,
                                   page_size, kv_layout=layout, sm_scale=plan.sm_scale,
                                   return_lse=True, qo_indptr=qo,
                                   **({"k_scale": k_scale, "v_scale": v_scale} if fp8 else {}))
    low, low_lse = plain_attention_mt(q, kp_, vp_, bt, qo, page_size, layout, plan.sm_scale)
    assert_like_reference(plan, run_once, out, lse, ref, ref_lse, low, low_lse,
                          f"multi-token {dtype}")
    return plan


@requires_gpu
@pytest.mark.parametrize("q_len", (1, 2, 4, 8, 16))
def test_multitoken_qo_indptr(backend, q_len):
    """``qo_indptr``: one token per request runs exactly as ``qo_indptr=None`` (same plan,
    same one-token kernels, bit-identical output); more tokens run the multi-token kernels
    against float64 with the causal rule, some CTA masking."""
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4,16_100,37,61", page_size=16, seed=0)
    qo = np.arange(b.batch_size + 1, dtype=np.int32) * q_len
    if q_len > 1:
        plan = check_multitok_case(backend, b.block_tables, b.seq_lens, b.num_pages, 16, qo,
                                   32, 8, 128, "float16")
        assert plan.multi_token and plan.token_view().cta_causal.any()
        assert all(v.causal for v in backend.variants_for(plan) if isinstance(v, cc.FwdVariant))
        return
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    w._gpu_backend = backend
    q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 32, 8, 128, "float16", "NHD", 0)
    w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, qo_indptr=qo)
    out, lse = w.run(q, (k, v), return_lse=True)
    w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    out0, lse0 = w.run(q, (k, v), return_lse=True)
    torch.cuda.synchronize()
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


@requires_gpu
def test_one_token_plan_after_multitoken_state(backend):
    """A one-token plan on a device state made for a multi-token plan runs the one-token
    kernels and gives the bits of a fresh backend's state (the multi-token state's extra
    arrays change nothing for it)."""
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.cuda_backend import CudaBackend
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4,8_300,37,61", page_size=16, seed=3)
    qo = np.concatenate([[0], np.cumsum(np.arange(b.batch_size) % 5 + 1)]).astype(np.int32)
    q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 16, 4, 64, "bfloat16", "NHD", 3)
    outs = []
    for be, multi_first in ((CudaBackend(), True), (CudaBackend(), False)):
        w = PrefixAttentionWrapper(backend="cuda", packer="pat")
        w._gpu_backend = be
        if multi_first:
            qm = torch.randn((int(qo[-1]), 16, 64), device="cuda").to(torch.bfloat16)
            w.plan(b.block_tables, b.seq_lens, 16, 4, 64, 16, kv_data_type="bfloat16",
                   qo_indptr=qo)
            w.run(qm, (k, v))
        plan = w.plan(b.block_tables, b.seq_lens, 16, 4, 64, 16, kv_data_type="bfloat16")
        st = be.state_for(plan)
        assert st.layout.limits.multi_token == multi_first and not st.causal
        outs.append(w.run(q, (k, v), return_lse=True))
    torch.cuda.synchronize()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@requires_gpu
@settings(deadline=None, max_examples=int(os.environ.get("PAT_GPU_EXAMPLES", 40)))
@given(batch=prefix_batches(max_requests=12, page_sizes=(1, 16, 32)), heads=head_configs(),
       d=st.sampled_from((64, 128)), dtype=st.sampled_from(("float16", "bfloat16")),
       packer=st.sampled_from(PACKERS), layout=st.sampled_from(("NHD", "HND")),
       split=st.booleans(), seed=st.integers(0, 2**16), data=st.data())
def test_multitoken_random_forests(backend, batch, heads, d, dtype, packer, layout, split,
                                   seed, data):
    """Mixed 1..16 query tokens per request on random forests (shared prefixes, new tokens
    inside shared nodes, every packer, with and without the long-KV split)."""
    from pat_core.inputs import MAX_QO_LEN
    hq, hk = heads
    qo = data.draw(qo_indptrs(batch.seq_lens, max_len=min(MAX_QO_LEN, 128 // (hq // hk))))
    check_multitok_case(backend, batch.block_tables, batch.seq_lens, batch.num_pages,
                        batch.page_size, qo, hq, hk, d, dtype, layout=layout, seed=seed,
                        packer=packer, split=split)


@requires_gpu
@pytest.mark.parametrize("d", (64, 128))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_multitoken_long_kv_split(backend, d, dtype):
    """Long shared KV cut by the split, 16 / 1 / 7 / 3 query tokens: the masked positions lie
    in the last part of each request, the earlier parts run unmasked, the merge combines per
    token row."""
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4_6000,40", page_size=16, seed=5)
    qo = np.concatenate([[0], np.cumsum([16, 1, 7, 3])]).astype(np.int32)
    plan = check_multitok_case(backend, b.block_tables, b.seq_lens, b.num_pages, 16, qo, 32, 8,
                               d, dtype, seed=5)
    assert plan.num_slots > plan.num_ctas and plan.token_view().cta_causal.any()
    assert plan.num_ctas > 4, "the shared root was split"


@requires_gpu
@pytest.mark.parametrize("packer", ("pat", "node"))
@pytest.mark.parametrize("leaf", (1, 2, 20))
def test_multitoken_new_tokens_inside_shared_node(backend, leaf, packer):
    """Private leaves of 1, 2 or 20 tokens under a 336-token shared root, 8 query tokens each:
    with the short leaves the first tokens' causal limits fall inside the shared root's CTAs
    (masked there) and those tokens see none of their leaf's CTA (the empty partial
    (0, -inf), which the merge must skip); with 20 only the leaves' CTAs mask."""
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch(f"1,6_336,{leaf}", page_size=16, seed=leaf)
    qo = np.arange(b.batch_size + 1, dtype=np.int32) * 8
    plan = check_multitok_case(backend, b.block_tables, b.seq_lens, b.num_pages, 16, qo, 8, 2,
                               128, "float16", seed=leaf, packer=packer, split=False)
    tv = plan.token_view()
    root = plan.cta_kv_start == 0
    assert tv.cta_causal[~root].all()
    assert tv.cta_causal[root].all() == (leaf < 8)
    assert (tv.cta_kv_limit == 0).any() == (leaf < 8)


@requires_gpu
@settings(deadline=None, max_examples=int(os.environ.get("PAT_GPU_EXAMPLES", 40)) // 2)
@given(batch=prefix_batches(max_requests=10, page_sizes=(1, 16)), heads=head_configs(),
       d=st.sampled_from((64, 128)), q_dtype=st.sampled_from(("float16", "bfloat16")),
       k_scale=st.floats(0.05, 20), v_scale=st.floats(0.05, 20), seed=st.integers(0, 2**16),
       data=st.data())
def test_multitoken_fp8_cache(backend, batch, heads, d, q_dtype, k_scale, v_scale, seed, data):
    """Multi-token queries over an fp8 (e4m3fn) cache with scales."""
    from pat_core.inputs import MAX_QO_LEN
    hq, hk = heads
    qo = data.draw(qo_indptrs(batch.seq_lens, max_len=min(MAX_QO_LEN, 128 // (hq // hk))))
    check_multitok_case(backend, batch.block_tables, batch.seq_lens, batch.num_pages,
                        batch.page_size, qo, hq, hk, d, q_dtype, seed=seed, fp8=True,
                        k_scale=k_scale, v_scale=v_scale)


CAUSAL_VARIANTS = [dataclasses.replace(v, causal=True) for v in cc.all_fwd_variants()
                   if v.dtype == "float16"] + \
    [dataclasses.replace(v, causal=True)
     for v in cc.all_fwd_variants(kv_dtype="float8_e4m3fn") if v.dtype == "bfloat16"]


@pytest.fixture(scope="module")
def causal_backend(backend):
    """The session's backend with the multi-token variants below compiled up front."""
    backend.warmup(variants=CAUSAL_VARIANTS,
                   jobs=int(os.environ.get("PAT_COMPILE_JOBS", os.cpu_count() or 1)))
    return backend


@requires_gpu
@pytest.mark.parametrize("variant", CAUSAL_VARIANTS, ids=lambda v: v.key)
def test_every_causal_variant(causal_backend, variant):
    """Every multi-token forward variant (fp16 ones, and the bf16-over-fp8 ones), forced onto a
    tree whose 4-token queries reach into the shared root (masked inside the root's CTA, and
    one-token leaves that the first tokens do not see at all)."""
    from pat_core.workloads import build_tree_batch
    ps = 16
    n_req = max(1, variant.m // 16)          # 4 tokens x group 4 = 16 rows per request
    b = build_tree_batch(f"1,{n_req}_{2 * 37 + 5 + variant.m},1", page_size=ps,
                         seed=variant.n)
    qo = np.arange(b.batch_size + 1, dtype=np.int32) * 4
    plan = check_multitok_case(causal_backend, b.block_tables, b.seq_lens, b.num_pages, ps, qo,
                               8, 2, variant.head_dim, variant.dtype, seed=variant.m,
                               tile=(variant.m, variant.n), fp8=bool(variant.kv_dtype))
    assert set(plan.stats()["tiles"]) == {f"{variant.m}x{variant.n}"}
    assert plan.token_view().cta_causal.any()
    # (all_fwd_variants lists the sm_80 layouts too; the device's own layout of the tile runs)
    assert any(v.causal and (v.m, v.n, v.kv_dtype) == (variant.m, variant.n, variant.kv_dtype)
               for v in causal_backend.variants_for(plan) if isinstance(v, cc.FwdVariant))


@requires_gpu
def test_wrapper_checks_once_per_input_set(backend, monkeypatch):
    """The wrapper's checks run when the backend validates a new input set, not on calls that
    reuse its cached launch arguments; a new q (other pointer or dtype) is checked again, and a
    bad one still raises, naming the argument.  Outputs allocated by run() match out=."""
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.plan import Plan
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4_40,20", page_size=16, seed=0)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    w._gpu_backend = backend
    w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 8, 2, 64, "float16", "NHD", 0)
    calls = []
    real = Plan.check_inputs
    monkeypatch.setattr(Plan, "check_inputs",
                        lambda self, *a, **kw: (calls.append(1), real(self, *a, **kw))[1])
    first, lse = w.run(q, (k, v), return_lse=True)
    for _ in range(3):
        again = w.run(q, (k, v))
    assert len(calls) == 1
    assert torch.equal(first, again)
    out = torch.full_like(q, float("nan"))
    lse_buf = torch.full(lse.shape, float("nan"), dtype=torch.float32, device="cuda")
    w.run(q, (k, v), out=out, lse=lse_buf)
    assert torch.equal(out, first) and torch.equal(lse_buf, lse) and len(calls) == 1
    w.run(q.clone(), (k, v))
    assert len(calls) == 2
    with pytest.raises(TypeError, match=r"q is bfloat16 but plan\(\) fixed q_data_type="):
        w.run(q.to(torch.bfloat16), (k, v))
    with pytest.raises(ValueError, match="paged_kv_cache holds only"):
        w.run(q, (k[:1], v[:1]))


@requires_gpu
def test_one_query_buffer_across_batch_sizes(monkeypatch):
    """An engine's decode loop: the rows of one query buffer and one cache per layer, batches
    of changing size.  Each step matches the float64 reference; the inputs are validated once
    per layer (the row count is not part of a prepared input set, so a new batch size is
    checked, not prepared again), and a plan whose batch differs from q's rows is refused."""
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.inputs import as_block_table
    from pat_core.plan import Plan
    from pat_core.workloads import build_tree_batch
    specs = ("1,12_33,17", "1,4_40,20", "3_50", "1,4_40,20", "2,6_16,30")
    batches = [build_tree_batch(s, page_size=16, seed=i) for i, s in enumerate(specs)]
    pages = max(b.num_pages for b in batches)
    rows = max(b.batch_size for b in batches)
    hq, hk, d = 8, 2, 64
    layers = [make_inputs(pages, 16, rows, hq, hk, d, "float16", "NHD", s)[1:] for s in (1, 2)]
    qbuf = make_inputs(pages, 16, rows, hq, hk, d, "float16", "NHD", 3)[0]
    # its own backend (the compiled kernels are the process's): no state of earlier tests
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    backend = w._gpu_backend
    calls = []
    real = Plan.check_inputs
    monkeypatch.setattr(Plan, "check_inputs",
                        lambda self, *a, **kw: (calls.append(1), real(self, *a, **kw))[1])
    states, reused = [], 0                   # the device states the plans went to
    for spec, b in zip(specs, batches):
        plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, 16)
        st = backend.state_for(plan)
        if not any(s is st for s in states):
            states.append(st)
        else:
            reused += st is states[-1]
        q = qbuf[:b.batch_size]
        bt = as_block_table(b.block_tables, b.seq_lens, 16)
        for k, v in layers:
            out = w.run(q, (k, v))
            ref = dense_attention(_np64(q), (_np64(k), _np64(v)), b.block_tables, b.seq_lens,
                                  16, sm_scale=plan.sm_scale)
            low, _ = plain_attention(q, k, v, bt, 16, "NHD", plan.sm_scale)
            err, err_plain = _rel(_np64(out), ref), _rel(_np64(low), ref)
            assert err <= 2 * err_plain + 1e-6, f"{spec}: {err:.3e} vs plain {err_plain:.3e}"
    # one validation per layer and device state (a state grows when a plan outgrows it)
    assert reused >= 1 and len(calls) == len(layers) * len(states)
    for _ in range(2):                          # refused again, not noted as checked
        with pytest.raises(ValueError, match=r"plan has \d+ requests but q has"):
            w.run(qbuf[:batches[-1].batch_size - 1], layers[0])


# ----------------------------------------------------------------------------- non-finite input
def _gpu_reads(where, bt, page, slot, hq, hk):
    """bool ``[batch, hq]``: the rows that read the spoiled element (q row, or a K/V token of
    KV head 1)."""
    reads = np.zeros((bt.batch_size, hq), bool)
    if where == "q":
        reads[3, 5] = True
        return reads
    g = hq // hk
    for r in range(bt.batch_size):
        cols = np.flatnonzero(bt.pages_of(r) == page)
        if any(c * bt.page_size + slot < bt.seq_lens[r] for c in cols):
            reads[r, g:2 * g] = True
    return reads


def _graph_replays_eager(w, plan, b, hq, hk, d, ps):
    """Capture ``w.run`` (planned with ``plan``) in a CUDA graph; its replays must equal the
    eager run bit for bit, for two different inputs through the same buffers, both close to
    float64.  Returns the eager run's prepared launches."""
    import torch
    from pat_core import dense_attention
    q, k, v = make_inputs(b.num_pages, ps, b.batch_size, hq, hk, d, "float16", "NHD", 5)
    eager = w.run(q, (k, v))
    torch.cuda.synchronize()
    prep = next(iter(w._gpu_backend.state_for(plan).prepared.values()))
    out = torch.empty_like(eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        w.run(q, (k, v), out=out)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, (k, v), out=out)
    for i in range(2):
        if i:   # new inputs in the same buffers: the replay must follow them
            q2, k2, v2 = make_inputs(b.num_pages, ps, b.batch_size, hq, hk, d, "float16",
                                     "NHD", 6)
            q.copy_(q2), k.copy_(k2), v.copy_(v2)
            eager = w.run(q, (k, v))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "graph replay differs from the eager run"
        ref = dense_attention(_np64(q), (_np64(k), _np64(v)), b.block_tables, b.seq_lens,
                              ps, sm_scale=plan.sm_scale)
        assert _rel(_np64(out), ref) < 2e-3
    return prep


@requires_gpu
@pytest.mark.parametrize("spec,heads,d,dtype", [("1,32,256_64,64,1024", (64, 8), 128, "float16"),
                                                ("1,8_16,240", (8, 2), 64, "bfloat16"),
                                                ("1,256_128,1024", (16, 8), 128, "float16")])
def test_request_rule_plans(backend, spec, heads, d, dtype):
    """The pat packer's per-request plans (pat_core.packers.request_packing: one CTA per
    request writing its own output, no merge): against float64, reruns bit-identical, and a
    CUDA graph replay equal to the eager run."""
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch(spec, page_size=16, seed=1)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    w._gpu_backend = backend
    plan = w.plan(b.block_tables, b.seq_lens, heads[0], heads[1], d, 16, kv_data_type=dtype)
    assert plan.one_cta_per_request
    check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16, heads[0], heads[1],
               d, dtype, "NHD", seed=2)
    if dtype != "float16":   # the graph check runs float16 inputs
        plan = w.plan(b.block_tables, b.seq_lens, heads[0], heads[1], d, 16,
                      kv_data_type="float16")
        assert plan.one_cta_per_request
    _graph_replays_eager(w, plan, b, heads[0], heads[1], d, 16)


@requires_gpu
@pytest.mark.parametrize("packer", PACKERS)
def test_nonfinite_input_propagates(backend, packer):
    """A NaN in q, or a NaN / +inf in one key or value, reaches exactly the rows that read it
    with the float64 reference's NaN/inf pattern (not zeros and lse = -inf); every other row is
    bit-identical to the clean run (mirrors tests/test_nonfinite.py on the CPU backend)."""
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.inputs import as_block_table
    from pat_core.workloads import build_tree_batch
    hq, hk, d, ps = 8, 2, 64, 16
    b = build_tree_batch("1,2,6_40,24,30", page_size=ps, seed=0)
    bt = as_block_table(b.block_tables, b.seq_lens, ps)
    w = PrefixAttentionWrapper(backend="cuda", packer=packer)
    w._gpu_backend = backend
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, ps, kv_data_type="float16")
    q, k, v = make_inputs(b.num_pages, ps, b.batch_size, hq, hk, d, "float16", "NHD", 11)
    clean, clean_lse = w.run(q, (k, v), return_lse=True)
    torch.cuda.synchronize()
    clean, clean_lse = _np64(clean), _np64(clean_lse)
    assert np.all(np.isfinite(clean)) and np.all(np.isfinite(clean_lse))
    cases = [("q", float("nan")), ("k_shared", float("nan")), ("k_leaf", float("nan")),
             ("k_shared", float("inf")), ("k_leaf", float("inf")),
             ("v_shared", float("nan")), ("v_leaf", float("nan")), ("v_leaf", float("inf"))]
    for where, value in cases:
        qb, kb, vb = q.clone(), k.clone(), v.clone()
        page = slot = -1
        if where == "q":
            qb[3, 5, 7] = value
        else:
            r, t = (0, 3) if where.endswith("shared") else (4, int(bt.seq_lens[4]) - 1)
            page, slot = int(bt.pages_of(r)[t // ps]), t % ps
            (kb if where[0] == "k" else vb)[page, slot, 1, 6] = value
        out, lse = w.run(qb, (kb, vb), return_lse=True)
        torch.cuda.synchronize()
        out, lse = _np64(out), _np64(lse)
        with np.errstate(invalid="ignore"):
            ref, ref_lse = dense_attention(_np64(qb), (_np64(kb), _np64(vb)), b.block_tables,
                                           b.seq_lens, ps, sm_scale=plan.sm_scale,
                                           return_lse=True)
        reads = _gpu_reads(where, bt, page, slot, hq, hk)
        assert (~np.isfinite(ref)).any() and not (~np.isfinite(ref[~reads])).any()
        for f in (np.isnan, np.isposinf, np.isneginf):
            assert np.array_equal(f(out), f(ref)), (where, value, f.__name__)
            assert np.array_equal(f(lse), f(ref_lse)), (where, value, f.__name__)
        assert np.array_equal(out[~reads], clean[~reads]), (where, value)
        assert np.array_equal(lse[~reads], clean_lse[~reads]), (where, value)
        fin = np.isfinite(ref)
        np.testing.assert_allclose(out[fin], ref[fin], rtol=2e-2, atol=2e-2)



@requires_gpu
def test_changing_launch_options_prepares_the_launches_again():
    """A state keeps the launches it prepared under the backend's LaunchOptions; after the
    options change, the next run prepares them again with the new ones (same result)."""
    import torch
    import pat_core
    from pat_core.cuda_backend import LaunchOptions
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4_256,64", page_size=16)
    q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 32, 8, 128, "float16", "NHD", 0)
    w = pat_core.PrefixAttentionWrapper(backend="cuda")
    w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    ref = w.run(q, (k, v)).clone()
    be = w._gpu_backend
    st = next(s for s in be._states.values() if s.plan is w.current_plan)

    def fast_flags():             # the launches prepared under the current options
        return [ln.fast for key, prep in st.prepared.items() if be._options_key in key
                for ln in prep["launches"]]
    assert fast_flags() and all(fast_flags())
    be.options = LaunchOptions(fast=False)
    out = w.run(q, (k, v))
    assert fast_flags() and not any(fast_flags())
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------- fp8 KV caches
FP8_VARIANTS = cc.all_fwd_variants(kv_dtype="float8_e4m3fn")


def make_fp8_cache(num_pages, page_size, hk, d, layout, seed):
    """A random float8_e4m3fn cache (torch CUDA tensors) spread over e4m3fn's range."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = ((num_pages, page_size, hk, d) if layout == "NHD" else (num_pages, hk, page_size, d))
    out = []
    for _ in range(2):
        x = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
        mag = torch.exp2(torch.randint(-6, 5, shape, generator=g, device="cuda").float())
        out.append((x * mag).to(torch.float8_e4m3fn))
    return out


def check_fp8_case(backend, packer, block_tables, seq_lens, num_pages, page_size, hq, hk, d,
                   q_dtype, layout="NHD", seed=0, tile=None, k_scale=0.7, v_scale=1.9,
                   cupy_bytes=False):
    """An fp8 cache through the wrapper's CUDA path (outputs and partials poisoned) against
    float64 attention on the decoded values times the scales, within twice the error of a
    plain implementation in q's dtype on the same values; then a bit-identical rerun."""
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.inputs import as_block_table

    w = PrefixAttentionWrapper(backend="cuda", packer=packer, kv_layout=layout)
    w._gpu_backend = backend
    plan = w.plan(block_tables, seq_lens, hq, hk, d, page_size,
                  kv_data_type=torch.float8_e4m3fn, q_data_type=q_dtype, tile=tile)
    plan.validate()
    bt = as_block_table(block_tables, seq_lens, page_size)
    B = bt.batch_size
    tdt = _torch_dtype(q_dtype)
    k, v = make_fp8_cache(num_pages, page_size, hk, d, layout, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    q = (torch.randn((B, hq, d), generator=g, device="cuda") / (4 * k_scale)).to(tdt)
    if cupy_bytes:
        import cupy
        cache = tuple(cupy.asarray(t.view(torch.uint8)) for t in (k, v))
    else:
        cache = (k, v)

    run_once = poisoned_runner(backend, plan, q, lambda out, lse: w.run(
        q, cache, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale))
    out, lse = run_once()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "output not fully written"
    kd, vd = _np64(k), _np64(v)          # the exact decoded values
    ref, ref_lse = dense_attention(_np64(q), (kd, vd), block_tables, seq_lens, page_size,
                                   kv_layout=layout, sm_scale=plan.sm_scale, return_lse=True,
                                   k_scale=k_scale, v_scale=v_scale)
    low, low_lse = plain_attention(q, k.to(tdt) * k_scale, v.to(tdt) * v_scale, bt, page_size,
                                   layout, plan.sm_scale)
    assert_like_reference(plan, run_once, out, lse, ref, ref_lse, low, low_lse,
                          f"fp8 kernel, q {q_dtype}")
    return plan


@requires_gpu
@pytest.mark.parametrize("variant", FP8_VARIANTS, ids=lambda v: v.key)
def test_every_fp8_variant(backend, variant):
    """Every fp8 forward variant, forced onto a two-level tree, with q in the variant's dtype."""
    from pat_core.workloads import build_tree_batch
    ps = 16
    b = build_tree_batch(_variant_case(variant.m), page_size=ps, seed=variant.n)
    plan = check_fp8_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, ps, 8, 2,
                          variant.head_dim, variant.dtype, seed=variant.m,
                          tile=(variant.m, variant.n))
    assert set(plan.stats()["tiles"]) == {f"{variant.m}x{variant.n}"}
    assert all(v.kv_dtype == "float8_e4m3fn" for v in backend.variants_for(plan)
               if isinstance(v, cc.FwdVariant))


@requires_gpu
@settings(deadline=None, max_examples=int(os.environ.get("PAT_GPU_EXAMPLES", 40)) // 2)
@given(batch=prefix_batches(max_requests=16, page_sizes=(1, 16, 32)), heads=head_configs(),
       d=st.sampled_from((64, 128)), q_dtype=st.sampled_from(("float16", "bfloat16")),
       packer=st.sampled_from(PACKERS), layout=st.sampled_from(("NHD", "HND")),
       k_scale=st.floats(0.05, 20), v_scale=st.floats(0.05, 20), seed=st.integers(0, 2**16))
def test_fp8_random_forests(backend, batch, heads, d, q_dtype, packer, layout, k_scale,
                            v_scale, seed):
    hq, hk = heads
    check_fp8_case(backend, packer, batch.block_tables, batch.seq_lens, batch.num_pages,
                   batch.page_size, hq, hk, d, q_dtype, layout=layout, seed=seed,
                   k_scale=k_scale, v_scale=v_scale)


@requires_gpu
@pytest.mark.parametrize("q_dtype", ("float16", "bfloat16"))
def test_fp8_cupy_bytes_and_scale_changes(backend, q_dtype):
    """CuPy uint8 arrays as the fp8 cache's bytes; new scales on the same inputs take effect
    (they are part of the cached launch arguments)."""
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4,8_300,70,33", page_size=16, seed=3)
    for ks, vs, cp_ in ((1.0, 1.0, True), (0.3, 2.5, True), (0.3, 2.5, False)):
        check_fp8_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16, 32, 8, 128,
                       q_dtype, seed=5, k_scale=ks, v_scale=vs, cupy_bytes=cp_)
