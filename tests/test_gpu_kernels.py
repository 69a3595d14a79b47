"""GPU kernel tests: the CUDA backend against the float64 dense reference.

Every test here is ``@pytest.mark.gpu`` and is skipped without CuPy and a CUDA device (importing
this module needs neither).  Tolerance: the kernel's norm-wise relative error against
the float64 reference may be at most twice the error of a plain same-dtype implementation (torch
attention computed entirely in fp16/bf16) on the same inputs.

Covered: every compiled forward variant (the planner's ``tile=(m, n)`` override forces it), every
packer on Hypothesis-drawn prefix forests, fp16 and bf16, head_dim 64 and 128, page sizes 1, 16
and 32, NHD and HND caches, strided views, the caller's stream, CuPy inputs, outputs and partial
buffers poisoned with NaN before each run, and bit-identical repeated runs.
"""
from __future__ import annotations

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

    def run_once():
        o_part, l_part = backend._partials(plan.num_slots, hq, d)
        o_part.fill(float("nan"))
        l_part.fill(float("nan"))
        out = torch.full((B, hq, d), float("nan"), dtype=q.dtype, device=q.device)
        lse = torch.full((B, hq), float("nan"), dtype=torch.float32, device=q.device)
        backend.run(plan, q, k, v, kv_layout=layout, return_lse=True, out=out, lse=lse)
        torch.cuda.synchronize()
        return out, lse

    out, lse = run_once()
    assert not torch.isnan(out).any(), "output not fully written (NaN left)"
    assert not torch.isnan(lse).any(), "lse not fully written (NaN left)"

    ref, ref_lse = dense_attention(_np64(q), (_np64(k), _np64(v)), block_tables, seq_lens,
                                   page_size, kv_layout=layout, sm_scale=plan.sm_scale,
                                   return_lse=True)
    low, low_lse = plain_attention(q, k, v, bt, page_size, layout, plan.sm_scale)
    err = _rel(_np64(out), ref)
    err_plain = _rel(_np64(low), ref)
    assert err <= 2 * err_plain + 1e-6, (
        f"{plan.summary()}: kernel error {err:.3e} > 2 x plain {dtype} error {err_plain:.3e}")
    lerr = float(np.abs(_np64(lse) - ref_lse).max())
    lerr_plain = float(np.abs(_np64(low_lse) - ref_lse).max())
    assert lerr <= 2 * lerr_plain + 1e-5, f"lse error {lerr:.3e} vs plain {lerr_plain:.3e}"

    out2, lse2 = run_once()
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "repeated runs differ"
    return plan, err, err_plain


# ----------------------------------------------------------------------------- every variant
def _variant_case(m):
    """A two-level tree whose root CTA has about m rows with group 4 (hq=8, hk=2)."""
    n_req = max(1, m // 4)
    return f"1,{n_req}_{2 * 37 + 5 + m},{19 + m // 16}"


@requires_gpu
@pytest.mark.parametrize("variant", cc.all_fwd_variants(pulls=(False,)), ids=lambda v: v.key)
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


# ----------------------------------------------------------------------------- random forests
from strategies import head_configs, prefix_batches  # noqa: E402  (tests/strategies.py)


@requires_gpu
@settings(deadline=None, max_examples=int(os.environ.get("PAT_GPU_EXAMPLES", 40)))
@given(batch=prefix_batches(max_requests=16, page_sizes=(1, 16, 32)), heads=head_configs(),
       d=st.sampled_from((64, 128)), dtype=st.sampled_from(("float16", "bfloat16")),
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


@requires_gpu
@pytest.mark.parametrize("launch_mode", ("auto", "streams", "fused"))
def test_input_sets_share_one_launch_set(backend, launch_mode):
    """A model's layers: several input sets (q and caches at other addresses, one strided) on
    one plan share the launch set built once for the plan, each with its own addresses.  Every
    layer's output is close to float64; after another plan has grown the shared partial
    buffers and merge counters, the launch set is rebuilt and reruns are bit-identical."""
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.workloads import build_tree_batch
    saved = backend.launch_mode
    backend.launch_mode = launch_mode
    try:
        b = build_tree_batch("1,4,16_64,40,21", page_size=16, seed=1)
        w = PrefixAttentionWrapper(backend="cuda", packer="pat")
        w._gpu_backend = backend
        plan = w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
        layers = [make_inputs(b.num_pages, 16, b.batch_size, 32, 8, 128, "float16", "NHD", s,
                              strided=s == 2) for s in range(3)]
        outs = [w.run(q, (k, v)) for q, k, v in layers]
        rec = backend._uploads[id(plan)]
        assert len(rec["layouts"]) == 1 and len(rec["prepared"]) == 3
        for (q, k, v), o in zip(layers, outs):
            ref = dense_attention(_np64(q), (_np64(k), _np64(v)), b.block_tables, b.seq_lens, 16)
            assert _rel(_np64(o), ref) < 2e-3
        dev = torch.cuda.current_device()
        backend._counters(1)                      # make sure both buffers exist
        gen = backend._buffer_generation(dev)
        # what a larger plan's launch set does: both shared buffers grow (and move)
        backend._partials(backend._buffers[dev][0] // (32 * 128) + 1, 32, 128)
        backend._counters(backend._counter_bufs[dev].size + 1)
        new_gen = backend._buffer_generation(dev)
        assert new_gen[0] != gen[0] and new_gen[1] != gen[1]
        for (q, k, v), o in zip(layers, outs):
            assert torch.equal(w.run(q, (k, v)), o)
    finally:
        backend.launch_mode = saved


@requires_gpu
def test_prepared_launches_follow_backend_settings(backend):
    """A setting changed between calls on the same inputs (KV heads' order in the grid, the
    launch path) gets launches prepared for it, not the ones cached for the old value; every
    variant of the run gives the same output."""
    import torch
    from pat_core.workloads import build_tree_batch
    from pat_core import PrefixAttentionWrapper
    saved = backend.head_minor, backend.fast_launch
    try:
        b = build_tree_batch("1,4,16_64,40,21", page_size=16, seed=1)
        w = PrefixAttentionWrapper(backend="cuda", packer="pat")
        w._gpu_backend = backend
        plan = w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
        q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 32, 8, 128, "float16", "NHD", 4)
        first = w.run(q, (k, v))
        prepared = backend._uploads[id(plan)]["prepared"]
        n0 = len(prepared)
        for minor, fast in ((False, True), (True, False), (False, False)):
            backend.head_minor, backend.fast_launch = minor, fast
            assert torch.equal(w.run(q, (k, v)), first), (minor, fast)
        assert len(prepared) == n0 + 3
    finally:
        backend.head_minor, backend.fast_launch = saved


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
@requires_gpu
@pytest.mark.parametrize("launch_mode", ("streams", "fused", "auto"))
@pytest.mark.parametrize("merge_mode", ("forward", "kernel"))
def test_launch_and_merge_modes(backend, launch_mode, merge_mode):
    """Every launch mode x merge mode against float64, reruns bit-identical (the in-kernel
    merge's counters must be back at zero after each run), on a multi-group tree and on a batch
    whose requests have a single partial slot each."""
    from pat_core.workloads import build_tree_batch
    saved = (backend.launch_mode, backend.merge_mode)
    backend.launch_mode, backend.merge_mode = launch_mode, merge_mode
    try:
        for spec, heads in (("1,4,16_200,37,61", (32, 8)), ("1,3,24_96,64,33", (16, 16)),
                            ("12_300", (32, 8))):
            b = build_tree_batch(spec, page_size=16, seed=5)
            plan, _, _ = check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16,
                                    heads[0], heads[1], 128, "float16", seed=3)
    finally:
        backend.launch_mode, backend.merge_mode = saved


@requires_gpu
@pytest.mark.parametrize("spec", ("1,16_16384,16", "1,3,12_16,64,128", "8_64",
                                  "1,4,16_100,37,61"))
def test_merge_block_and_warp_modes(backend, spec):
    """The merge with one block per (request, head) pair and with one warp per 1, 2 or 4 heads
    of a request, each forced on the same plan: all within tolerance of float64 and
    bit-identical on a rerun (check_case), with outputs poisoned before each run."""
    from pat_core.workloads import build_tree_batch
    saved = backend.merge_per_pair, backend.merge_heads_per_warp
    b = build_tree_batch(spec, page_size=16, seed=5)
    try:
        for mode, nh in (("block", None), ("warp", 1), ("warp", 2), ("warp", 4)):
            backend.merge_per_pair, backend.merge_heads_per_warp = mode, nh
            for d in (128, 64):
                check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16, 32, 8,
                           d, "float16", seed=3)
        backend.merge_per_pair, backend.merge_heads_per_warp = "warp", 3
        with pytest.raises(ValueError, match="merge_heads_per_warp"):
            check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16, 32, 8, 128,
                       "float16", seed=3)
    finally:
        backend.merge_per_pair, backend.merge_heads_per_warp = saved


@requires_gpu
@pytest.mark.parametrize("spec,page_size", (("1,256_64,16", 16), ("1,8,64_128,64,32", 16),
                                            ("2,200_64,16", 5), ("1,4,64_256,1024,64", 16),
                                            ("1,6,30_70,45,29", 7), ("3,24_40,30", 1)))
def test_one_tile_launches(backend, spec, page_size):
    """The one-tile CTAs of 16-row groups in a launch of their own ("split": the one-tile layout;
    "piped": the piped kernel, a producer warp feeding consumer warps; "piped-all": whole
    groups to the piped kernel, so CTAs of several tiles take its fallback path) at head_dim 128
    and 64, GQA groups 1 and 4, both dtypes, both cache layouts, KV heads major and minor in item
    order, with the separate and the in-kernel merge: within tolerance of float64 and
    bit-identical on a rerun (check_case; the piped kernel's work counters must be back at zero
    after every run), and the split-off launch really runs."""
    from pat_core import Tuning
    from pat_core import cuda_compile as cc
    from pat_core.launch import one_tile_split
    from pat_core.workloads import build_tree_batch
    saved = backend.one_tile, backend.launch_mode, backend.head_minor, backend.merge_mode
    b = build_tree_batch(spec, page_size=page_size, seed=5)
    cases = [("split", 128, (32, 8), "float16", "NHD", True, "kernel"),
             ("piped", 128, (32, 8), "float16", "NHD", True, "kernel"),
             ("piped-all", 128, (32, 32), "float16", "NHD", True, "kernel"),
             ("piped-all", 64, (16, 4), "bfloat16", "HND", False, "kernel"),
             ("piped", 128, (32, 32), "bfloat16", "HND", False, "forward"),
             ("split", 64, (32, 32), "float16", "NHD", False, "forward")]
    try:
        backend.launch_mode = "streams"
        for mode, d, (hq, hk), dtype, layout, minor, merge in cases:
            backend.one_tile, backend.head_minor, backend.merge_mode = mode, minor, merge
            # finisher plans (no merge) never split a group: keep the merge on every plan
            plan, _, _ = check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages,
                                    page_size, hq, hk, d, dtype, layout=layout, seed=3,
                                    tuning=Tuning(finish_share=None))
            # which groups must split, from the plan itself
            tails = [(m, n) for _, (m, n), g0, g1 in plan.groups()
                     if m == 16 and (plan.cta_kv_len[g0:g1] <= n).any()]
            variants = backend.variants_for(plan)
            if mode == "split":
                # the one-tile layout may equal the group's own (16x32 since round 8), so the
                # split shows in the launch list, not in the variants; the split-off launch
                # running is what check_case's comparison with float64 shows
                want = any((m, n) in cc.ONE_TILE_LAYOUTS for m, n in tails)
                got = any(one_tile_split(plan, g0, g1, backend._num_sms(), mode)[0] < g1
                          for _, _, g0, g1 in plan.groups())
                keys = {v.key for v in variants}
                assert all(cc.FwdVariant.make(m, n, d, dtype, arch=backend.arch,
                                              one_tile=True).key in keys
                           for m, n in tails if (m, n) in cc.ONE_TILE_LAYOUTS)
            else:
                want = any(n in cc.PIPED_LAYOUTS for _, n in tails) or (
                    mode == "piped-all" and any(m == 16 and n in cc.PIPED_LAYOUTS
                                                for _, (m, n), _, _ in plan.groups()))
                got = any(isinstance(v, cc.PipedVariant) for v in variants)
            assert got == want, (mode, plan.summary(), [v.key for v in variants])
        backend.one_tile = "sometimes"
        with pytest.raises(ValueError, match="one_tile"):
            check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, page_size, 32,
                       8, 128, "float16", seed=3, tuning=Tuning(finish_share=None))
    finally:
        backend.one_tile, backend.launch_mode, backend.head_minor, backend.merge_mode = saved


def test_launch_paths_agree(backend, monkeypatch):
    """Packed cuLaunchKernel launches and CuPy's generic launches give identical results.

    The launch path is fixed when a plan's launches are prepared (``CudaBackend.fast_launch`` at
    that moment), and the prepared launches are cached per plan object; so each path gets its
    own Plan object (two Planner instances: no plan cache in common), and a spy on the launch
    object records which path every launch of each run really took.
    """
    import torch
    from pat_core import Planner
    from pat_core import cuda_backend as cb
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch("1,4,16_200,37,61", page_size=16, seed=7)
    q, k, v = make_inputs(b.num_pages, 16, b.batch_size, 32, 8, 128, "float16", "NHD", 8)

    taken = []
    real_call = cb._Launch.__call__

    def spy(self, stream_ptr, dependent=False):
        taken.append(bool(self.fast))
        return real_call(self, stream_ptr, dependent=dependent)

    monkeypatch.setattr(cb._Launch, "__call__", spy)
    outs, paths, plans = [], [], []
    for fast in (True, False):
        plan = Planner("pat", backend.gpu_name).plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
        plans.append(plan)
        backend.fast_launch = fast
        try:
            taken.clear()
            outs.append(backend.run(plan, q, k, v, return_lse=True))
            torch.cuda.synchronize()
            paths.append(list(taken))
        finally:
            backend.fast_launch = True
    assert plans[0] is not plans[1]
    assert plans[0].num_groups > 1, "the batch should need several launch groups"
    # every launch of the first run took the packed path, every launch of the second the
    # generic one (at least one launch each time; with the in-kernel merge and a fused step
    # there is exactly one)
    assert len(paths[0]) >= 1 and all(paths[0]), paths[0]
    assert len(paths[1]) == len(paths[0]) and not any(paths[1]), paths[1]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


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


@requires_gpu
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
@pytest.mark.parametrize("d", (64, 128))
def test_finisher_phase(backend, dtype, d):
    """Plans with a finisher phase (pat_core.fold: each request's own CTA runs last, folds in
    its other slots and writes the output; no merge launch) against float64, reruns
    bit-identical: finisher tiles of 16 and 32 rows, one and several token slices, one to five
    other slots per request, no first phase at all, split leaves, both cache layouts, and the
    backend's merge_mode "forward" (ignored by such plans)."""
    from pat_core import Tuning
    from pat_core.workloads import build_tree_batch
    always = Tuning(finish_share=1.0)
    cases = [("1,4,16_64,48,300", (32, 8), "NHD"), ("1,8,32_40,64,700", (64, 8), "HND"),
             ("1,3,12_96,64,33", (16, 16), "NHD"), ("200_100", (32, 8), "NHD"),
             ("1,2,4,8,16_16,16,16,16,200", (32, 4), "HND"), ("2,6_100,900", (32, 32), "NHD"),
             ("1,6_64,500", (32, 1), "NHD"), ("3,12_200,3000", (16, 8), "NHD")]
    saved = backend.merge_mode, backend.finish_launch
    try:
        for i, (spec, heads, layout) in enumerate(cases):
            backend.merge_mode = "forward" if i % 3 == 2 else "kernel"
            b = build_tree_batch(spec, page_size=16, seed=7)
            # both phases in one ordered launch (where they share a tile), the finishers as
            # programmatic dependents of the first phase, and after it
            for mode in ("ordered", "pdl", "serial"):
                backend.finish_launch = mode
                plan, _, _ = check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages,
                                        16, heads[0], heads[1], d, dtype, layout, seed=i,
                                        tuning=always)
                assert plan.finish_from >= 0, spec
    finally:
        backend.merge_mode, backend.finish_launch = saved


def _graph_replays_eager(w, plan, b, hq, hk, d, ps):
    """Capture ``w.run`` (planned with ``plan``) in a CUDA graph; its replays must equal the
    eager run bit for bit, for two different inputs through the same buffers, both close to
    float64.  Returns the eager run's prepared launches."""
    import torch
    from pat_core import dense_attention
    q, k, v = make_inputs(b.num_pages, ps, b.batch_size, hq, hk, d, "float16", "NHD", 5)
    eager = w.run(q, (k, v))
    torch.cuda.synchronize()
    prep = next(iter(w._gpu_backend._uploads[id(plan)]["prepared"].values()))
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
@pytest.mark.parametrize("mode", ("ordered", "pdl"))
def test_finisher_launch_modes_in_graph(backend, mode):
    """A finisher-phase plan whose two phases are one tile group each, of one tile: "ordered" runs
    it as one launch (finishers wait on counters), "pdl" as two, the finishers a programmatic
    dependent launch (sm_90+).  The launch path is taken, and CUDA graph replays (counters and
    ticket reset by the kernel between runs) equal the eager result."""
    from pat_core import PrefixAttentionWrapper, Tuning
    from pat_core.workloads import build_tree_batch
    hq, hk, d, ps = 32, 8, 128, 16
    b = build_tree_batch("1,8,32_64,64,700", page_size=ps, seed=3)
    saved = backend.finish_launch
    backend.finish_launch = mode
    try:
        w = PrefixAttentionWrapper(backend="cuda", packer="pat")
        w._gpu_backend = backend
        w.planner.tuning = Tuning(finish_share=1.0)
        plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, ps, kv_data_type="float16")
        assert plan.finish_from >= 0
        prep = _graph_replays_eager(w, plan, b, hq, hk, d, ps)
        if mode == "ordered":
            assert len(prep["launches"]) == 1 and prep["phase_b"] is None
        else:
            pdl = backend._finish_pdl(prep["launches"], prep["phase_b"])
            assert pdl == (int(backend.arch[3:]) >= 90), (backend.arch, len(prep["launches"]))
    finally:
        backend.finish_launch = saved


@requires_gpu
@pytest.mark.parametrize("spec,heads", [("1,8,64,512_128,512,64,32", (32, 8)),
                                        ("1,4,64_256,1024,64", (32, 32)),
                                        ("3,24,96_1024,64,512", (32, 8)),
                                        ("1,4,16_128,256,1024", (64, 8)),
                                        # two trees: two finisher groups (16x64, 16x32)
                                        ("1,4_512,1000+1,8_256,40", (32, 8)),
                                        ("1,4,16_512,64,300+1,8_1024,24", (32, 8))])
def test_finisher_chain(backend, spec, heads):
    """A finisher phase behind several launches (pat_core.launch.finisher_chain): the first
    phase chained (longest first, or in plan order) and each finisher launch a programmatic
    dependent of the launch before it, against the forked first phase with the finishers
    after it: float64 references and bit-identical reruns with partials poisoned (a finisher
    that folded a slot before the launch writing it had finished would show it), graph replays
    equal to the eager run; on sm_90+ the chain is the path taken."""
    from types import SimpleNamespace
    from pat_core import PrefixAttentionWrapper, Tuning
    from pat_core.launch import finisher_chain
    from pat_core.workloads import build_tree_batch
    parts = [build_tree_batch(s_, page_size=16, seed=5) for s_ in spec.split("+")]
    width = max(p.block_tables.shape[1] for p in parts)
    tables, base = [], 0
    for p in parts:     # the trees side by side in one cache: page ids offset per tree
        tables.append(np.pad(p.block_tables, ((0, 0), (0, width - p.block_tables.shape[1])))
                      + base)
        base += p.num_pages
    bt = np.concatenate(tables).astype(np.int32)
    sl = np.concatenate([p.seq_lens for p in parts]).astype(np.int32)
    b = SimpleNamespace(block_tables=bt, seq_lens=sl, num_pages=base, batch_size=len(sl))
    always = Tuning(finish_share=1.0)
    saved = backend.fwd_chain
    try:
        for chain in ("fork", "pdl", "pdl-plan"):
            backend.fwd_chain = chain
            plan, _, _ = check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16,
                                    heads[0], heads[1], 128, "float16", "NHD", seed=3,
                                    tuning=always)
            assert plan.finish_from >= 1 and finisher_chain(plan, plan.gpu), plan.summary()
            w = PrefixAttentionWrapper(backend="cuda", packer="pat")
            w._gpu_backend = backend
            w.planner.tuning = always
            plan = w.plan(b.block_tables, b.seq_lens, heads[0], heads[1], 128, 16,
                          kv_data_type="float16")
            prep = _graph_replays_eager(w, plan, b, heads[0], heads[1], 128, 16)
            assert prep["chain"] == (chain != "fork" and int(backend.arch[3:]) >= 90)
            k = prep["phase_b"]
            assert k is not None and k < len(prep["launches"])
            if prep["chain"] and chain == "pdl" and k > 1:
                spans = [int(plan.cta_kv_len[ln.params.cta_offset:ln.params.cta_offset
                                             + ln.params.n_ctas].max())
                         for ln in prep["launches"][:k]]
                assert spans == sorted(spans, reverse=True), spans
    finally:
        backend.fwd_chain = saved


@requires_gpu
@pytest.mark.parametrize("spec,heads", [("1,32,256_64,64,1024", (32, 8)),
                                        ("1,4,16_128,256,1024", (64, 8)),
                                        ("3,24,96_1024,64,512", (32, 8)),
                                        ("128_300", (32, 32))])
def test_merge_dependent_launch(backend, spec, heads):
    """The merge launched as a programmatic dependent of the forward launches (merge_launch
    "pdl"; partials poisoned before each run, so a merge that read them early would show it):
    against float64 and reruns bit-identical; then CUDA graph replays of the plan and of its
    serial form (every launch on one stream, the merge after the last)."""
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch(spec, page_size=16, seed=1)
    saved = backend.merge_launch
    try:
        backend.merge_launch = "serial"   # the ablation, against the same references
        check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16, heads[0],
                   heads[1], 128, "float16", "NHD", seed=2)
        backend.merge_launch = "pdl"
        check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16, heads[0],
                   heads[1], 128, "float16", "NHD", seed=2)
        w = PrefixAttentionWrapper(backend="cuda", packer="pat")
        w._gpu_backend = backend
        for serial in (False, True):   # serial: the merge after the last of several launches
            plan = w.plan(b.block_tables, b.seq_lens, heads[0], heads[1], 128, 16,
                          kv_data_type="float16", serial=serial)
            _graph_replays_eager(w, plan, b, heads[0], heads[1], 128, 16)
    finally:
        backend.merge_launch = saved


@requires_gpu
@pytest.mark.parametrize("spec,heads", [("1,4,64_256,1024,64", (32, 8)),
                                        ("1,2,8,128_512,128,256,32", (32, 32)),
                                        ("3,24,96_1024,64,512", (16, 8)),
                                        ("1,8,64,512_128,512,64,32", (32, 8))])
def test_forward_chain(backend, spec, heads):
    """A plan's forward launches chained on one stream (fwd_chain "pdl", longest first, and
    "pdl-plan"), against the forked launches ("fork"): float64 references and bit-identical
    reruns with partials poisoned (a merge that read a slot before the launch writing it had
    finished would show it), with the separate merge and with the merge in the forward kernels;
    graph replays equal the eager run; on sm_90+ the chain is the path taken, longest launch
    first."""
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch
    b = build_tree_batch(spec, page_size=16, seed=4)
    saved = backend.fwd_chain, backend.merge_mode
    try:
        for chain in ("fork", "pdl", "pdl-plan"):
            backend.fwd_chain = chain
            for merge_mode in ("kernel", "forward"):
                backend.merge_mode = merge_mode
                check_case(backend, "pat", b.block_tables, b.seq_lens, b.num_pages, 16,
                           heads[0], heads[1], 128, "float16", "NHD", seed=2)
            backend.merge_mode = "kernel"
            w = PrefixAttentionWrapper(backend="cuda", packer="pat")
            w._gpu_backend = backend
            plan = w.plan(b.block_tables, b.seq_lens, heads[0], heads[1], 128, 16,
                          kv_data_type="float16")
            prep = _graph_replays_eager(w, plan, b, heads[0], heads[1], 128, 16)
            n = len(prep["launches"])
            assert n >= 2 or chain == "fork", plan.summary()
            assert prep["chain"] == (chain != "fork" and n >= 2
                                     and int(backend.arch[3:]) >= 90)
            if prep["chain"] and chain == "pdl":
                spans = [int(plan.cta_kv_len[ln.params.cta_offset:ln.params.cta_offset
                                             + ln.params.n_ctas].max())
                         for ln in prep["launches"]]
                assert spans == sorted(spans, reverse=True), spans
    finally:
        backend.fwd_chain, backend.merge_mode = saved


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
@pytest.mark.parametrize("merge_mode", ("forward", "kernel", "kernel-block", "kernel-h2",
                                        "kernel-h4", "fold"))
@pytest.mark.parametrize("packer", PACKERS)
def test_nonfinite_input_propagates(backend, packer, merge_mode):
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
    saved = backend.merge_mode, backend.merge_per_pair, backend.merge_heads_per_warp
    backend.merge_mode = "kernel" if merge_mode == "fold" else merge_mode.split("-")[0]
    backend.merge_per_pair = "block" if merge_mode.endswith("block") else "warp"
    # the merge warp taking 2 or 4 heads of a request: a NaN must stay in its own head's rows
    backend.merge_heads_per_warp = int(merge_mode[-1]) if merge_mode[-2:-1] == "h" else None
    try:
        w = PrefixAttentionWrapper(backend="cuda", packer=packer)
        w._gpu_backend = backend
        from pat_core import Tuning
        # "fold": the finishers merge (pat_core.fold), where the packer allows; the other modes
        # keep the merge launch even where every request has one CTA
        w.planner.tuning = Tuning(finish_share=1.0 if merge_mode == "fold" else None)
        plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, ps, kv_data_type="float16")
        assert (plan.finish_from >= 0) == (merge_mode == "fold" and packer != "cascade")
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
    finally:
        backend.merge_mode, backend.merge_per_pair, backend.merge_heads_per_warp = saved


@requires_gpu
def test_block_clock_records(tmp_path):
    """``bench/block_timeline.py`` builds the kernels with ``PAT_BLOCK_CLOCK`` (its own process:
    the define must be set before anything compiles) and records every block of a chained
    two-group plan and of its merge once: one record per (CTA, KV head), each on a real SM,
    started no later than it was ready and ended, and its cycle count positive; the result
    was checked against float64 attention there."""
    import json
    import subprocess
    import sys
    from pat_core.workloads import build_tree_batch
    from pat_core.gpus import detect_gpu_name
    from sim.methods import make_plan
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = "1,4,64_256,1024,64"
    cases = [f"{spec}@32:8@pat", f"{spec}@8:2@query"]
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "block_timeline.py"),
                        "--out", str(tmp_path), "--reps", "2", *cases],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    import torch
    props = torch.cuda.get_device_properties(0)
    num_sms, gpu = props.multi_processor_count, detect_gpu_name(props.name)
    b = build_tree_batch(spec, page_size=16, seed=0)
    rows = json.load(open(tmp_path / "block_timeline_summary.json"))["rows"]
    assert [row["case"] for row in rows] == cases
    for case, row in zip(cases, rows):
        assert row["unmapped"] == [], row["unmapped"]
        hq, hk = row["heads"]
        plan = make_plan(b, row["method"], hq, hk, 128, gpu=gpu)
        fname = case.replace(",", "-").replace(":", "-").replace("@", "_") + ".json"
        data = json.load(open(tmp_path / fname))
        fwd = [(x["cta"], x["head"]) for x in data["blocks"] if x["kind"] == "forward"]
        assert sorted(fwd) == [(c, h) for c in range(plan.num_ctas) for h in range(hk)]
        assert row["measured"]["merge_blocks"] >= 1
        for x in data["blocks"]:
            assert 0 <= x["sm"] < num_sms
            assert x["start"] <= x["ready"] <= x["end"], x
            assert x["cycles"] > 0, x
        # the simulator's blocks of the same plan, keyed the same way
        sim_fwd = [(x["cta"], x["head"]) for x in data["sim_blocks"] if x["kind"] == "forward"]
        assert sorted(sim_fwd) == sorted(fwd)
