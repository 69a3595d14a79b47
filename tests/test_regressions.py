"""Named corner cases, each checked end to end against the float64 reference."""
import numpy as np
import pytest

from pat_core import PACKERS, PrefixAttentionWrapper
from pat_core.reference import dense_attention, relative_error
from pat_core.workloads import random_kv_cache


def run_all_packers(table, lens, ps, hq, hk, d=64, num_pages=None, layout="NHD", seed=0):
    num_pages = num_pages or int(max(max(r) for r in table)) + 1
    k, v = random_kv_cache(num_pages, ps, hk, d, np.float32, layout, seed=seed)
    q = np.random.default_rng(seed + 1).standard_normal((len(lens), hq, d)).astype(np.float32)
    ref = dense_attention(q, (k, v), table, lens, ps, kv_layout=layout)
    plans = {}
    for packer in PACKERS:
        w = PrefixAttentionWrapper("cpu", packer, kv_layout=layout)
        plan = w.plan(table, np.asarray(lens), hq, hk, d, ps, kv_data_type="float32")
        plan.validate()
        assert all(np.all(c == 1) for c in plan.coverage_counts()), packer
        err = relative_error(w.run(q, (k, v)), ref)
        assert err <= 1e-5, (packer, err)
        plans[packer] = plan
    return plans


def test_request_ending_at_internal_node():
    # request 2 is a prefix of requests 0 and 1 and ends exactly at their branch point
    plans = run_all_packers([[0, 1, 2], [0, 1, 3], [0, 1]], [40, 45, 32], 16, 4, 4)
    f = plans["pat"].extra["forest"]
    assert f.hi[f.req_node[2]] - f.lo[f.req_node[2]] == 3


def test_identical_requests():
    plans = run_all_packers([[5, 6, 7]] * 4, [40] * 4, 16, 2, 1)
    assert plans["pat"].stats()["kv_tokens"] == 40          # read once for all four
    assert plans["query"].stats()["kv_tokens"] == 160


def test_forked_request_covering_part_of_shared_page():
    # both list page 9 as their last page; request 1 covers 3 of its tokens, request 0 covers 7
    plans = run_all_packers([[4, 9], [4, 9], [4, 8]], [15, 11, 14], 8, 4, 2)
    f = plans["pat"].extra["forest"]
    assert f.unique_tokens() == 15 + 6


def test_page_size_one():
    table = [[0, 1, 2, 3, 4], [0, 1, 2, 5, 6], [0, 1, 7], [8]]
    run_all_packers(table, [5, 5, 3, 1], 1, 8, 2)


def test_single_request_of_100k_tokens():
    ps = 64
    n = 100_000
    table = [list(range(-(-n // ps)))]
    hq = hk = 1
    d = 64
    k, v = random_kv_cache(len(table[0]), ps, hk, d, np.float32, seed=5)
    q = np.random.default_rng(6).standard_normal((1, hq, d)).astype(np.float32)
    ref = dense_attention(q, (k, v), table, [n], ps)
    w = PrefixAttentionWrapper("cpu", "pat")
    plan = w.plan(table, [n], hq, hk, d, ps, kv_data_type="float32")
    plan.validate()
    assert plan.num_ctas > 1                      # split so the GPU is not left idle
    assert np.all(plan.cta_kv_len <= -(-n // plan.num_ctas) + 16)
    assert relative_error(w.run(q, (k, v)), ref) <= 1e-5


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
def test_gqa_ratios(group):
    hk = 2
    table = [[0, 1, 2], [0, 1, 3], [0, 1, 4], [0, 5], [6]]
    plans = run_all_packers(table, [40, 33, 47, 20, 9], 16, group * hk, hk, seed=group)
    for p in plans.values():
        assert np.all(p.cta_rows() <= p.cta_mn()[:, 0])


def test_hnd_layout_and_many_requests_chunked():
    # 40 requests x group 8 = 320 rows: more than one CTA's worth; the shared root is chunked
    table = [[0, 1, 100 + i] for i in range(40)]
    plans = run_all_packers(table, [40] * 40, 16, 16, 2, layout="HND", num_pages=140)
    assert plans["node"].cta_rows().max() <= plans["node"].cta_mn()[:, 0].max()
    assert plans["node"].stats()["kv_tokens"] > 32 + 40 * 8     # root re-read per chunk


def test_torch_cpu_tensors_bf16_and_fp16():
    torch = pytest.importorskip("torch")
    table = [[0, 1, 2], [0, 1, 3], [0, 4, -1]]
    lens = [40, 37, 20]
    k, v = random_kv_cache(5, 16, 2, 64, np.float32, seed=3)
    q = np.random.default_rng(4).standard_normal((3, 8, 64)).astype(np.float32)
    for dt, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16")):
        qt, kt, vt = (torch.from_numpy(x).to(dt) for x in (q, k, v))
        ref = dense_attention(qt, (kt, vt), table, lens, 16)
        w = PrefixAttentionWrapper("cpu", "pat")
        w.plan(torch.tensor(table, dtype=torch.int32), torch.tensor(lens), 8, 2, 64, 16,
               kv_data_type=name)
        out, lse = w.run(qt, (kt, vt), return_lse=True)
        assert isinstance(out, torch.Tensor) and out.dtype == dt and lse.dtype == torch.float32
        # bf16 keeps 8 significant bits: its outputs round at 2^-8 relative
        assert relative_error(out.float().numpy(), ref) <= (2.0 ** -8 if name == "bfloat16"
                                                              else 2.0 ** -10)


def _to_bf16_values(x):
    """float32 array rounded to the nearest bfloat16 value (round half to even), as float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def test_bf16_path_without_torch():
    from pat_core.executor import execute
    table = [[0, 1, 2], [0, 1, 3], [0, 4, -1]]
    lens = [40, 37, 20]
    k, v = (_to_bf16_values(x) for x in random_kv_cache(5, 16, 2, 64, np.float32, seed=8))
    q = _to_bf16_values(np.random.default_rng(9).standard_normal((3, 8, 64)))
    plan = PrefixAttentionWrapper("cpu", "pat").plan(table, lens, 8, 2, 64, 16,
                                                      kv_data_type="bfloat16")
    ref = dense_attention(q, (k, v), table, lens, 16)
    out32 = execute(plan, q, k, v, input_dtype="float32")
    outbf = execute(plan, q, k, v, input_dtype="bfloat16")
    assert relative_error(out32, ref) <= 1e-5
    err = relative_error(outbf, ref)
    # P rounded to 8 significant bits before P.V: visible, and bounded by bf16's unit
    assert 1e-6 < err <= 2.0 ** -8
