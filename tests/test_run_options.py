"""Run options of PrefixAttentionWrapper: caller buffers, dtypes fixed at plan(), FlashInfer
options that pat does not implement, backend limits (CPU)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core import PrefixAttentionWrapper
from pat_core.workloads import build_tree_batch, random_kv_cache

HQ, HK, D, PS = 4, 2, 64, 16


@pytest.fixture(scope="module")
def batch():
    return build_tree_batch("1,3_40,21", page_size=PS, seed=2)


def _inputs(b, dtype, seed=0):
    k, v = random_kv_cache(b.num_pages, PS, HK, D, dtype=dtype, seed=seed)
    q = np.random.default_rng(seed).standard_normal((b.batch_size, HQ, D)).astype(dtype)
    return q, k, v


def _wrapper(b, dtype="float32", **kw):
    w = PrefixAttentionWrapper("cpu")
    w.plan(b.block_tables, b.seq_lens, HQ, HK, D, PS, kv_data_type=dtype, **kw)
    return w


# ----------------------------------------------------------------------------- out= / lse=
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_out_and_lse_written_in_place(batch, dtype):
    name = np.dtype(dtype).name
    q, k, v = _inputs(batch, dtype)
    w = _wrapper(batch, name)
    want, want_lse = w.run(q, (k, v), return_lse=True)
    out = np.full((batch.batch_size, HQ, D), np.nan, dtype=dtype)
    lse = np.full((batch.batch_size, HQ), np.nan, dtype=np.float32)
    got, got_lse = w.run(q, (k, v), return_lse=True, out=out, lse=lse)
    assert got is out and got_lse is lse
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    # lse= alone implies return_lse
    lse2 = np.zeros_like(lse)
    res = w.run(q, (k, v), lse=lse2)
    assert isinstance(res, tuple) and res[1] is lse2
    np.testing.assert_array_equal(lse2, want_lse)
    # out= alone returns the buffer only
    out2 = np.zeros_like(out)
    assert w.run(q, (k, v), out=out2) is out2
    np.testing.assert_array_equal(out2, want)


def test_out_strided_view(batch):
    q, k, v = _inputs(batch, np.float32)
    w = _wrapper(batch)
    want = w.run(q, (k, v))
    big = np.zeros((batch.batch_size, HQ, 2 * D), np.float32)
    view = big[:, :, ::2]                      # every other element: non-contiguous
    w.run(q, (k, v), out=view)
    np.testing.assert_array_equal(big[:, :, ::2], want)
    assert not big[:, :, 1::2].any()           # nothing written outside the view


def test_bad_out_and_lse_buffers(batch):
    q, k, v = _inputs(batch, np.float32)
    w = _wrapper(batch)
    B = batch.batch_size
    with pytest.raises(ValueError, match=r"out has shape \(1, 4, 64\)"):
        w.run(q, (k, v), out=np.zeros((1, HQ, D), np.float32))
    with pytest.raises(TypeError, match="out is float16, expected float32"):
        w.run(q, (k, v), out=np.zeros((B, HQ, D), np.float16))
    ro = np.zeros((B, HQ, D), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        w.run(q, (k, v), out=ro)
    with pytest.raises(TypeError, match="out must be a NumPy array or CPU tensor"):
        w.run(q, (k, v), out=[[0.0]])
    with pytest.raises(TypeError, match="lse: unsupported dtype|lse is float16, expected"):
        w.run(q, (k, v), lse=np.zeros((B, HQ), np.float16))
    with pytest.raises(ValueError, match=r"lse has shape \(\d+, 4, 1\), expected"):
        w.run(q, (k, v), lse=np.zeros((B, HQ, 1), np.float32))
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        w.run(q, (k, v), return_lse=np.array([1, 0]))
    # a writable view whose elements share memory (a zero stride, or rows overlapping)
    base = np.zeros(B * HQ * D, np.float32)
    for strides in ((0, D * 4, 4), (HQ * D * 4, 4, 4)):
        view = np.lib.stride_tricks.as_strided(base, (B, HQ, D), strides, writeable=True)
        with pytest.raises(ValueError, match="out has strides .* share memory"):
            w.run(q, (k, v), out=view)
    # transposed and sliced views do not overlap: accepted
    t = np.zeros((D, HQ, B), np.float32).transpose(2, 1, 0)
    w.run(q, (k, v), out=t)
    np.testing.assert_array_equal(t, w.run(q, (k, v)))


def test_out_with_cpu_torch():
    torch = pytest.importorskip("torch")
    b = build_tree_batch("1,3_40,21", page_size=PS, seed=2)
    q, k, v = _inputs(b, np.float32)
    w = _wrapper(b)
    want = w.run(q, (k, v))
    out = torch.empty(b.batch_size, HQ, D, dtype=torch.float32)
    assert w.run(torch.from_numpy(q), (torch.from_numpy(k), torch.from_numpy(v)), out=out) is out
    np.testing.assert_array_equal(out.numpy(), want)


# ----------------------------------------------------------------------------- dtypes
def test_dtype_fixed_at_plan_prices_stats(batch):
    w16 = _wrapper(batch, "float16")
    w32 = _wrapper(batch, "float32")
    s16, s32 = w16.stats(), w32.stats()
    assert s32["kv_tokens"] == s16["kv_tokens"]
    assert s32["kv_bytes"] == s32["kv_tokens"] * HK * 2 * D * 4
    assert s16["kv_bytes"] == s16["kv_tokens"] * HK * 2 * D * 2
    assert s32["q_bytes"] == 2 * s16["q_bytes"] and s32["out_bytes"] == 2 * s16["out_bytes"]


def test_run_rejects_other_dtypes(batch):
    q, k, v = _inputs(batch, np.float32)
    w = PrefixAttentionWrapper("cpu")
    w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS)        # default: float16
    assert w.current_plan.kv_dtype == "float16"
    with pytest.raises(TypeError, match=r"q is float32 but plan\(\) fixed q_data_type="):
        w.run(q, (k, v))
    w = _wrapper(batch, "float32")
    with pytest.raises(TypeError, match=r"paged_kv_cache is float16 but plan\(\) fixed "
                                        r"kv_data_type='float32'"):
        w.run(q, (k.astype(np.float16), v.astype(np.float16)))


def test_dtype_arguments(batch):
    def plan(**kw):
        return PrefixAttentionWrapper("cpu").plan(batch.block_tables, batch.seq_lens, HQ, HK, D,
                                                  PS, **kw)
    p = plan(q_data_type="float32")                  # FlashInfer style: kv follows q
    assert (p.kv_dtype, p.q_dtype) == ("float32", "float32")
    p = plan(kv_data_type=np.float32)                # q follows kv
    assert (p.kv_dtype, p.q_dtype) == ("float32", "float32")
    assert plan(data_type="float32").kv_dtype == "float32"     # FlashInfer's older name
    with pytest.raises(ValueError, match="data_type='float32'.*disagrees with kv_data_type"):
        plan(data_type="float32", kv_data_type="float16")
    with pytest.raises(ValueError, match="mixed-precision attention is not supported"):
        plan(q_data_type="float32", kv_data_type="float16")
    with pytest.raises(TypeError, match="q_data_type: unsupported dtype"):
        plan(q_data_type="int8")
    assert plan(kv_data_type="float32", o_data_type="float32").kv_dtype == "float32"
    with pytest.raises(ValueError, match="o_data_type='float32' is not supported"):
        plan(kv_data_type="float16", o_data_type="float32")


# ----------------------------------------------------------------------------- FlashInfer options
@pytest.mark.parametrize("name,value", [
    ("pos_encoding_mode", "ROPE_LLAMA"), ("pos_encoding_mode", "ALIBI"),
    ("window_left", 128), ("logits_soft_cap", 30.0), ("rope_scale", 1.0),
    ("rope_theta", 1e4), ("fixed_split_size", 256), ("q_len_per_req", 2)])
def test_unimplemented_plan_options_named(batch, name, value):
    w = PrefixAttentionWrapper("cpu")
    with pytest.raises(ValueError, match=f"plan\\(\\): {name}=.* is not supported"):
        w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, **{name: value})


def test_plan_options_at_their_defaults_are_accepted(batch):
    w = PrefixAttentionWrapper("cpu")
    base = w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, kv_data_type="float32",
                  split=False).stats()
    p = w.plan(batch.block_tables, batch.seq_lens, HQ, HK, D, PS, kv_data_type="float32",
               pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=0.0, rope_scale=None,
               rope_theta=None, non_blocking=False, disable_split_kv=True,
               fixed_split_size=None, q_len_per_req=1)
    assert p.stats() == base                     # disable_split_kv=True is split=False
    long = build_tree_batch("1,2_2000,16", page_size=PS)
    args = (long.block_tables, long.seq_lens, HQ, HK, D, PS)
    n_split = PrefixAttentionWrapper("cpu").plan(*args).num_ctas
    n_whole = PrefixAttentionWrapper("cpu").plan(*args, disable_split_kv=True).num_ctas
    assert n_whole < n_split
    q, k, v = _inputs(batch, np.float32)
    w.run(q, (k, v), q_scale=None, k_scale=1.0, v_scale=1, window_left=-1, enable_pdl=False,
          sinks=None)


@pytest.mark.parametrize("name,value", [
    ("q_scale", 0.5), ("k_scale", 2.0), ("v_scale", 0.25), ("window_left", 64),
    ("enable_pdl", True), ("sinks", np.zeros(4, np.float32))])
def test_unimplemented_run_options_named(batch, name, value):
    q, k, v = _inputs(batch, np.float32)
    w = _wrapper(batch)
    with pytest.raises(ValueError, match=f"run\\(\\): {name}=.* is not supported"):
        w.run(q, (k, v), **{name: value})


def test_cuda_backend_limits_checked_at_plan():
    w = PrefixAttentionWrapper("cpu")
    w._check_backend_limits(96, "float32")           # the CPU executor takes any head_dim/dtype
    w.backend = "cuda"                               # the check alone, no device needed
    with pytest.raises(ValueError, match="head_dim=96 is not supported by the CUDA backend"):
        w._check_backend_limits(96, "float16")
    with pytest.raises(ValueError, match="kv_data_type='float32' is not supported by the CUDA"):
        w._check_backend_limits(128, "float32")
    w._check_backend_limits(128, "bfloat16")


# ------------------------------------------------------------------ 32-bit gather offsets
class _FakeDeviceArray:
    """Metadata of a device array (no memory behind it): what the CUDA backend's input checks
    read, so they can be tested without a GPU."""

    def __init__(self, shape, strides):
        self.__cuda_array_interface__ = {
            "data": (1 << 20, False), "shape": tuple(shape), "typestr": "<f2",
            "strides": tuple(2 * s for s in strides), "version": 3}


def _contiguous_strides(shape):
    st, acc = [], 1
    for s in reversed(shape):
        st.append(acc)
        acc *= s
    return tuple(reversed(st))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_backend_rejects_caches_past_32bit_offsets(layout):
    from pat_core.cuda_views import _Dev, _check_cache
    pages, ps, hk, d = 8, 16, 2, 128
    shape = (pages, ps, hk, d) if layout == "NHD" else (pages, hk, ps, d)
    q = _Dev(_FakeDeviceArray((3, 4, d), _contiguous_strides((3, 4, d))), "q")
    ok = _Dev(_FakeDeviceArray(shape, _contiguous_strides(shape)), "k_cache")
    assert _check_cache(q, ok, ok, layout, ps, hk, d)[0] == pages
    # a page stride past int32 (e.g. a view into a huge buffer): rejected, naming the argument
    st = list(_contiguous_strides(shape))
    st[0] = 2**31 + 8
    big = _Dev(_FakeDeviceArray(shape, st), "v_cache")
    with pytest.raises(ValueError, match="v_cache: element strides"):
        _check_cache(q, ok, big, layout, ps, hk, d)
    # the span inside one page past int32
    st = list(_contiguous_strides(shape))
    st[1] = 2**31 - 8
    with pytest.raises(ValueError, match="k_cache: element strides"):
        _check_cache(q, _Dev(_FakeDeviceArray(shape, st), "k_cache"), ok, layout, ps, hk, d)
    # q's row stride past int32
    qbig = _Dev(_FakeDeviceArray((3, 4, d), (2**31 + 8, d, 1)), "q")
    with pytest.raises(ValueError, match="q: element strides"):
        _check_cache(qbig, ok, ok, layout, ps, hk, d)


# ------------------------------------------------------- checks delegated to the GPU backend
class _CachingBackend:
    """Stands in for CudaBackend's input-set cache: runs the wrapper's ``check`` only for an
    input set (by shapes and dtypes here) it has not seen, as the real backend does per
    (pointers, shapes, strides, dtypes)."""

    def __init__(self):
        self.seen, self.checks = set(), 0

    def run(self, plan, q, k, v, kv_layout="NHD", return_lse=False, out=None, lse=None,
            check=None):
        key = (id(plan), q.shape, str(q.dtype), k.shape, str(k.dtype), kv_layout)
        if key not in self.seen:
            self.checks += 1
            check()
            self.seen.add(key)
        return "ran"


def test_gpu_path_checks_once_per_input_set(batch):
    """On the GPU path the wrapper's own checks (dtypes fixed at plan(), shapes and pages against
    the plan) go to the backend as ``check``, run once per new input set instead of per call."""
    q, k, v = _inputs(batch, np.float16)
    w = _wrapper(batch, "float16")
    w._gpu_backend = fake = _CachingBackend()
    assert w.run(q, (k, v)) == "ran" and fake.checks == 1
    for _ in range(3):
        w.run(q, (k, v))
    assert fake.checks == 1
    with pytest.raises(TypeError, match=r"q is float32 but plan\(\) fixed q_data_type="):
        w.run(q.astype(np.float32), (k, v))
    with pytest.raises(ValueError, match="q has shape"):
        w.run(q[:, :2], (k, v))
    with pytest.raises(ValueError, match="paged_kv_cache holds only"):
        w.run(q, (k[:1], v[:1]))
    assert fake.checks == 4


def test_cuda_backend_without_a_gpu_points_at_the_cpu_backend():
    from pat_core.cuda_backend import is_available
    if is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(RuntimeError, match="backend='cpu'"):
        PrefixAttentionWrapper()


def test_launch_options_are_checked_and_frozen():
    import dataclasses

    from pat_core.cuda_backend import LaunchOptions
    opt = LaunchOptions()
    assert opt.fast and opt.graph_fused == "auto"
    assert LaunchOptions(fast=False) != opt and hash(LaunchOptions()) == hash(opt)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.fast = False
    with pytest.raises(ValueError, match="graph_fused"):
        LaunchOptions(graph_fused="sometimes")
    with pytest.raises(TypeError, match="fast"):
        LaunchOptions(fast="yes")


@settings(max_examples=200, deadline=None)
@given(dims=st.lists(st.tuples(st.integers(1, 4), st.integers(-9, 9)), min_size=1, max_size=3))
def test_self_overlap_rule_never_accepts_a_collision(dims):
    """The out/lse buffer rule is sound: whatever shape and strides it accepts map every index
    to its own element (brute force over all indices), and a contiguous layout is accepted."""
    from pat_core.inputs import refuse_self_overlap
    shape = tuple(n for n, _ in dims)
    strides = tuple(s for _, s in dims)
    offsets = [sum(i * s for i, s in zip(idx, strides)) for idx in np.ndindex(*shape)]
    try:
        refuse_self_overlap("out", shape, strides)
    except ValueError:
        pass
    else:
        assert len(set(offsets)) == len(offsets)
    contiguous = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    refuse_self_overlap("out", shape, contiguous)       # never refused
