"""FP8 (float8_e4m3fn) KV caches: the decode table, the scales, the CPU executor and wrapper
against the float64 reference on the decoded values, pricing, and the refusals."""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pat_core.cuda_compile as cc
from pat_core import PrefixAttentionWrapper
from pat_core.executor import execute
from pat_core.fp8 import E4M3FN_TO_F32, as_scale, decode_e4m3fn
from pat_core.planner import Planner
from pat_core.reference import dense_attention, relative_error
from pat_core.tiles import estimate_resources
from pat_core.workloads import build_tree_batch, random_kv_cache
from strategies import head_configs, prefix_batches

FP8 = ml_dtypes.float8_e4m3fn
HQ, HK, D, PS = 8, 2, 64, 16


def fp8_cache(num_pages, page_size, hk, d, seed, layout="NHD"):
    """A random cache spread over most of e4m3fn's range (subnormals to ~100), as fp8."""
    k, v = random_kv_cache(num_pages, page_size, hk, d, seed=seed)
    rng = np.random.default_rng(seed + 7)
    mag = np.exp2(rng.integers(-8, 5, size=k.shape)).astype(np.float32)   # |x| < 448
    k, v = (x * mag for x in (k, v))
    if layout == "HND":
        k, v = (x.transpose(0, 2, 1, 3).copy() for x in (k, v))
    return k.astype(FP8), v.astype(FP8)


@pytest.fixture(scope="module")
def batch():
    return build_tree_batch("1,3,4_40,33,20", page_size=PS)


# ----------------------------------------------------------------------------- decode table
def test_decode_table_matches_ml_dtypes_on_every_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(FP8).astype(np.float32)
    assert np.array_equal(E4M3FN_TO_F32, want, equal_nan=True)
    # the bit patterns too (signed zeros), not only the values
    fin = ~np.isnan(want)
    assert np.array_equal(E4M3FN_TO_F32[fin].view(np.uint32), want[fin].view(np.uint32))


def test_decode_table_landmarks():
    t = E4M3FN_TO_F32
    assert t[0x7E] == 448.0 and t[0xFE] == -448.0          # largest finite
    assert np.isnan(t[0x7F]) and np.isnan(t[0xFF])          # the only NaNs, no infinities
    assert np.count_nonzero(np.isnan(t)) == 2 and not np.any(np.isinf(t))
    assert t[0x01] == 2.0 ** -9 and t[0x08] == 2.0 ** -6    # smallest subnormal, normal
    assert t[0x38] == 1.0 and t[0x80] == 0.0 and math.copysign(1, t[0x80]) == -1


def test_decode_of_arrays_and_codes():
    x = np.array([[0.5, -3.0], [448.0, 2.0 ** -9]], dtype=FP8)
    assert np.array_equal(decode_e4m3fn(x), x.astype(np.float32))
    assert np.array_equal(decode_e4m3fn(x.view(np.uint8)), x.astype(np.float32))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        decode_e4m3fn(np.zeros(3, np.float16))


# ----------------------------------------------------------------------------- scales
@pytest.mark.parametrize("value,want", [(None, 1.0), (2, 2.0), (0.5, 0.5),
                                        (np.float32(0.25), 0.25),
                                        (np.array(3.0), 3.0), (np.array([1.5], np.float16), 1.5)])
def test_scale_forms_accepted(value, want):
    assert as_scale(value, "k_scale") == want


@pytest.mark.parametrize("value,err,match", [
    (True, TypeError, "k_scale must be a number"), ("2", TypeError, "k_scale must be a float"),
    (np.ones(2), ValueError, "one-element"), (np.array(["a"]), TypeError, "real number"),
    (0.0, ValueError, "positive finite"), (-1.0, ValueError, "positive finite"),
    (float("nan"), ValueError, "positive finite"), (float("inf"), ValueError, "positive"),
    pytest.param(10**400, ValueError, "positive finite", id="int-past-float"),
    (1e39, ValueError, "float32")])
def test_scale_forms_refused(value, err, match):
    with pytest.raises(err, match=match):
        as_scale(value, "k_scale")


# ----------------------------------------------------------------------------- against float64
def _check(out, lse, ref, rlse, tol):
    assert relative_error(out, ref) < tol
    assert np.max(np.abs(np.asarray(lse, np.float64) - rlse)) < tol * (1 + np.max(np.abs(rlse)))


@settings(max_examples=25, deadline=None)
@given(b=prefix_batches(max_requests=10), heads=head_configs(), d=st.sampled_from([8, 16, 64]),
       k_scale=st.floats(-5, 5).map(lambda e: 2.0 ** e),
       v_scale=st.floats(-5, 5).map(lambda e: 2.0 ** e),
       layout=st.sampled_from(["NHD", "HND"]), five_d=st.booleans())
def test_wrapper_cpu_fp8_matches_dense(b, heads, d, k_scale, v_scale, layout, five_d):
    """The CPU wrapper on an fp8 cache with random scales: the float64 reference on the same
    decoded values, to fp16 accuracy (P and the output are fp16)."""
    hq, hk = heads
    k, v = fp8_cache(b.num_pages, b.page_size, hk, d, seed=3, layout=layout)
    # scores of order one: the scale brings q . (k_scale k) back to unit size
    q = (np.random.default_rng(4).standard_normal((b.batch_size, hq, d)) / (8 * k_scale)
         ).astype(np.float16)
    w = PrefixAttentionWrapper("cpu", kv_layout=layout)
    p = w.plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size,
               kv_data_type="float8_e4m3fn", q_data_type="float16")
    p.validate()
    cache = np.stack([k, v], axis=1) if five_d else (k, v)
    out, lse = w.run(q, cache, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref, rlse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size,
                                kv_layout=layout, return_lse=True, k_scale=k_scale,
                                v_scale=v_scale)
    _check(out, lse, ref, rlse, 4e-3)


@settings(max_examples=15, deadline=None)
@given(b=prefix_batches(max_requests=8), heads=head_configs(),
       k_scale=st.floats(0.01, 10), v_scale=st.floats(0.01, 10))
def test_executor_fp8_bf16_queries_match_dense(b, heads, k_scale, v_scale):
    """bfloat16 queries (ml_dtypes arrays, which the executor takes directly): P rounded to
    bf16 as the kernels' MMAs take it; the reference on the same decoded values."""
    hq, hk = heads
    d = 16
    k, v = fp8_cache(b.num_pages, b.page_size, hk, d, seed=5)
    q = (np.random.default_rng(6).standard_normal((b.batch_size, hq, d)) / (8 * k_scale)
         ).astype(ml_dtypes.bfloat16)
    p = Planner().plan(b.block_tables, b.seq_lens, hq, hk, d, b.page_size,
                       kv_data_type="float8_e4m3fn", q_data_type="bfloat16")
    assert (p.kv_dtype, p.q_dtype) == ("float8_e4m3fn", "bfloat16")
    out, lse = execute(p, q, k, v, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    ref, rlse = dense_attention(q, (k, v), b.block_tables, b.seq_lens, b.page_size,
                                return_lse=True, k_scale=k_scale, v_scale=v_scale)
    _check(out, lse, ref, rlse, 2e-2)


def test_scales_are_applied_not_ignored(batch):
    """v_scale scales the output, k_scale sharpens the softmax (LSE moves, output changes)."""
    k, v = fp8_cache(batch.num_pages, PS, HK, D, seed=1)
    q = (np.random.default_rng(2).standard_normal((batch.batch_size, HQ, D)) / 8
         ).astype(np.float16)
    w = PrefixAttentionWrapper("cpu")
    w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, kv_data_type="float8_e4m3fn")
    o1, l1 = w.run(q, (k, v), return_lse=True)
    o2, l2 = w.run(q, (k, v), return_lse=True, v_scale=4.0)
    assert np.allclose(o2.astype(np.float32), 4 * o1.astype(np.float32), rtol=2e-3, atol=1e-3)
    assert np.array_equal(l1, l2)
    o3, l3 = w.run(q, (k, v), return_lse=True, k_scale=3.0)
    assert relative_error(o3, o1) > 1e-2 and not np.allclose(l3, l1)
    ref = dense_attention(q, (k, v), batch.block_tables, batch.seq_lens, PS, k_scale=3.0)
    assert relative_error(o3, ref) < 4e-3


def test_fp8_nan_code_propagates(batch):
    """A NaN byte (0x7F) in a key makes NaN output for exactly the requests that read it."""
    k, v = fp8_cache(batch.num_pages, PS, HK, D, seed=1)
    q = np.random.default_rng(2).standard_normal((batch.batch_size, HQ, D)).astype(np.float16)
    page = int(batch.block_tables[0, 0])
    k.view(np.uint8)[page, 0, 0, 0] = 0x7F
    w = PrefixAttentionWrapper("cpu")
    w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, kv_data_type="float8_e4m3fn")
    out = w.run(q, (k, v)).astype(np.float32)
    ref = dense_attention(q, (k, v), batch.block_tables, batch.seq_lens, PS)
    assert np.array_equal(np.isnan(out), np.isnan(ref)) and np.isnan(out).any()


# ----------------------------------------------------------------------------- pricing
def test_stats_price_one_byte_per_kv_element(batch):
    def stats(**kw):
        w = PrefixAttentionWrapper("cpu")
        w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, split=False, **kw)
        return w.current_plan, w.stats()
    p16, s16 = stats(kv_data_type="float16")
    p8, s8 = stats(kv_data_type="float8_e4m3fn", q_data_type="bfloat16")
    assert s8["kv_bytes"] == s8["kv_tokens"] * HK * 2 * D * 1
    assert s8["q_bytes"] == s8["num_slots"] * HQ * D * 2
    assert s8["out_bytes"] == batch.batch_size * HQ * D * 2
    assert p8.io_dtype == "bfloat16" and p16.io_dtype == "float16"


def test_fp8_tiles_shared_memory():
    """fp8 variants take mma.sync layouts only (the tile's fastest one where the 16-bit
    variant takes the warpgroup layout), with byte tiles: half the 16-bit ring."""
    wg16 = 0
    for m, n in ((16, 64), (64, 128), (128, 64), (32, 32), (64, 64)):
        r8 = estimate_resources(m, n, 128, "float8_e4m3fn")
        v = cc.FwdVariant.make(m, n, 128, "float8_e4m3fn")
        assert (v.dtype, v.kv_dtype) == ("float16", "float8_e4m3fn")
        assert not v.warpgroup
        v16 = cc.FwdVariant.make(m, n, 128, "float16")
        if v16.warpgroup:
            wg16 += 1
            rec = cc.variant_speed(128)[(m, n)]["sync"]
            assert (v.warps, v.stages, v.rows_per_warp) == (
                rec["warps"], rec["stages"], rec["rows_per_warp"])
        else:
            assert (v.warps, v.stages, v.rows_per_warp) == (v16.warps, v16.stages,
                                                            v16.rows_per_warp)
        st_, rw = v.stages, v.rows_per_warp
        assert r8.smem == v.smem_bytes == cc.fwd_smem_bytes(m, n, 128, st_, rw) - st_ * 2 * n * 128
        assert r8.stages == st_ and r8.threads == v.threads
    assert wg16 > 0
    # a forced warpgroup layout over an fp8 cache is not a variant the kernel builds
    cc.VARIANT_OVERRIDES[(64, 64)] = (4, 2, cc.WG_ROWS)
    try:
        assert not cc.fwd_variant_feasible(cc.FwdVariant.make(64, 64, 128, "float8_e4m3fn"))
    finally:
        cc.VARIANT_OVERRIDES.clear()


def test_simulator_prices_fp8_kv_bytes(batch):
    from sim.traffic import forward_work
    p16 = Planner().plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, split=False)
    p8 = Planner().plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, split=False,
                        kv_data_type="float8_e4m3fn")
    w16, w8 = forward_work(p16), forward_work(p8)
    if np.array_equal(p16.cta_kv_len, p8.cta_kv_len):
        assert np.allclose(2 * w8.kv_bytes, w16.kv_bytes)
        assert np.allclose(w8.q_bytes, w16.q_bytes)
    assert np.allclose(w8.kv_bytes, p8.cta_kv_len * 2 * D * 1)


# ----------------------------------------------------------------------------- refusals
def test_fp8_dtype_arguments(batch):
    def plan(**kw):
        return PrefixAttentionWrapper("cpu").plan(batch.block_tables, batch.seq_lens, HQ, HK, D,
                                                  PS, **kw)
    p = plan(kv_data_type="float8_e4m3fn")               # q defaults to float16
    assert (p.kv_dtype, p.q_dtype) == ("float8_e4m3fn", "float16")
    assert plan(kv_data_type=np.dtype(FP8), q_data_type="bfloat16").q_dtype == "bfloat16"
    with pytest.raises(TypeError, match="q_data_type='float8_e4m3fn' is a KV-cache-only"):
        plan(kv_data_type="float8_e4m3fn", q_data_type="float8_e4m3fn")
    with pytest.raises(TypeError, match="q_data_type='float8_e4m3fn' is a KV-cache-only"):
        plan(q_data_type="float8_e4m3fn")
    with pytest.raises(TypeError, match="q_data_type='float32': an fp8 KV cache"):
        plan(kv_data_type="float8_e4m3fn", q_data_type="float32")
    with pytest.raises(ValueError, match="mixed-precision attention is not supported"):
        plan(kv_data_type="float16", q_data_type="bfloat16")
    with pytest.raises(TypeError, match="kv_data_type: unsupported dtype"):
        plan(kv_data_type="float8_e5m2")


def test_fp8_run_refusals(batch):
    k, v = fp8_cache(batch.num_pages, PS, HK, D, seed=1)
    q = np.zeros((batch.batch_size, HQ, D), np.float16)
    w = PrefixAttentionWrapper("cpu")
    w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, kv_data_type="float8_e4m3fn")
    with pytest.raises(TypeError, match="q is float32 but plan"):
        w.run(q.astype(np.float32), (k, v))
    with pytest.raises(TypeError, match="paged_kv_cache: unsupported dtype"):
        w.run(q, (k.view(np.uint8), v.view(np.uint8)))     # raw bytes: which format?
    with pytest.raises(TypeError, match="paged_kv_cache is float16 but plan"):
        w.run(q, (k.astype(np.float16), v.astype(np.float16)))
    with pytest.raises(ValueError, match="v_scale must be a positive finite number"):
        w.run(q, (k, v), v_scale=0.0)
    with pytest.raises(TypeError, match="k_scale must be a float or a one-element"):
        w.run(q, (k, v), k_scale=[2.0])
    with pytest.raises(ValueError, match=r"run\(\): q_scale=2.0 is not supported"):
        w.run(q, (k, v), q_scale=2.0)
    # the executor checks the dtypes itself: fp8 queries are refused
    with pytest.raises(TypeError, match="q is float8_e4m3fn, a KV-cache-only dtype"):
        execute(w.current_plan, q.astype(FP8), k, v)
    # a 16-bit cache takes no scales
    w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, kv_data_type="float16")
    with pytest.raises(ValueError, match=r"run\(\): k_scale=0.5 is not supported"):
        w.run(q, (k.astype(np.float16), v.astype(np.float16)), k_scale=0.5)


# ----------------------------------------------------------------------------- CUDA variants
def test_fp8_variant_keys_and_names():
    """fp8 variants add a KV type; the 16-bit keys and kernel names stay as they were."""
    v16 = cc.FwdVariant.make(16, 64, 128, "float16")
    w, s, r = v16.warps, v16.stages, v16.rows_per_warp
    assert v16.key == f"pat_fwd_d128_f16_m16_n64_w{w}_s{s}_r{r}"
    assert v16.name_expression == f"pat_fwd_kernel<128, __half, 16, 64, {w}, {s}, {r}>"
    v8 = cc.FwdVariant.make(16, 64, 128, "bfloat16", kv_dtype="float8_e4m3fn")
    assert v8.key == f"pat_fwd_d128_bf16_m16_n64_w{w}_s{s}_r{r}_kv8"
    assert v8.name_expression.endswith(", pat::fp8_e4m3>")
    assert v8.smem_bytes == v16.smem_bytes - 2 * 2 * 64 * 128   # byte tiles: half the ring
    assert cc.FwdVariant.make(16, 64, 128, "float16", kv_dtype="float16") == v16
    from pat_core.cuda_modules import _variant_from
    assert _variant_from(v8.key) == v8
    all8 = cc.all_fwd_variants(kv_dtype="float8_e4m3fn")
    assert all(v.key.endswith("_kv8") for v in all8)
    # one fp8 variant per 16-bit (head_dim, dtype, m, n)
    tiles = {(v.head_dim, v.dtype, v.m, v.n) for v in cc.all_fwd_variants()}
    assert {(v.head_dim, v.dtype, v.m, v.n) for v in all8} == tiles
    assert all(cc.fwd_variant_feasible(v) for v in cc.all_fwd_variants(kv_dtype="float8_e4m3fn"))


def test_fp8_resources_are_the_compiled_fp8_variants():
    """The resource file lists the fp8 variants themselves (their registers differ from the
    16-bit twins'), in their own layouts: mma.sync where the 16-bit tile is a warpgroup one."""
    import json
    from pat_core.gpus import get_gpu
    from pat_core.tiles import kernel_resources
    data = json.loads(cc.resources_path().read_text())["variants"]
    gpu = get_gpu("h100")
    for m, n in ((16, 64), (64, 64), (128, 32)):
        v8 = cc.FwdVariant.make(m, n, 128, "float8_e4m3fn")
        rec = data[v8.key]["sm_90"]
        r8 = kernel_resources(m, n, 128, "float8_e4m3fn", gpu)
        assert r8.source == "nvcc" and r8.registers == rec["registers"]
        assert r8.smem == rec["smem_static"] + v8.smem_bytes and r8.stages == v8.stages
        assert r8.threads == v8.threads


def test_fp8_plans_for_the_cuda_kernels(batch):
    """An fp8 plan's launch variants are fp8 ones in the query dtype, and fit."""
    p = Planner().plan(batch.block_tables, batch.seq_lens, 32, 8, 128, PS,
                       kv_data_type="float8_e4m3fn", q_data_type="bfloat16")
    vs = cc.plan_fwd_variants(p)
    assert vs and all((v.dtype, v.kv_dtype) == ("bfloat16", "float8_e4m3fn") for v in vs)
    assert all(cc.fwd_variant_supported(v.m, v.n, 128, "float8_e4m3fn") for v in vs)


def test_fp8_queries_and_matrix_scales_refused():
    """An fp8 q gets told fp8 is a cache-only dtype (not to plan again with it), and a scale
    must be a number or a 0-d / [1] array."""
    from pat_core.fp8 import as_scale
    w = PrefixAttentionWrapper(backend="cpu")
    w.plan([[0]], [3], 1, 1, 64, 4, kv_data_type="float8_e4m3fn")
    k = np.zeros((1, 4, 1, 64), ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match="KV-cache-only"):
        w.run(np.zeros((1, 1, 64), ml_dtypes.float8_e4m3fn), (k, k))
    with pytest.raises(ValueError, match="k_scale"):
        as_scale(np.array([[2.0]]), "k_scale")
    assert as_scale(np.array([2.0]), "k_scale") == as_scale(np.array(2.0), "k_scale") == 2.0


def test_scale_product_past_float32_refused():
    """Each scale in range, but k_scale times sm_scale past float32 (the kernels fold them into
    one float32 softmax scale): refused naming k_scale, not a NaN output."""
    k, v = fp8_cache(2, 16, 2, 16, seed=1)
    q = np.ones((1, 4, 16), np.float16)
    w = PrefixAttentionWrapper("cpu")
    w.plan(np.array([[0, 1]]), np.array([20]), 4, 2, 16, 16, sm_scale=1e20,
           kv_data_type="float8_e4m3fn", q_data_type="float16")
    with pytest.raises(ValueError, match="k_scale"):
        w.run(q, (k, v), k_scale=1e20)
    out = w.run(q, (k, v), k_scale=1e-20)          # the product in range: runs
    assert np.isfinite(out.astype(np.float32)).all()
