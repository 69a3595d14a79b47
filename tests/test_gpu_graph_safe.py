"""Graph-safe mode on the GPU: capture one CUDA graph, replay it over 50 changing decode steps.

A small paged KV cache with a free list and reference counts is driven like a serving loop:
requests join (fresh, or forked from a running request's full pages so prefixes are shared),
every running request appends one token per step (a new page when its last one is full), and
requests leave, freeing pages that later requests reuse with new contents.  Each step plans with
the graph-safe wrapper, copies its queries into the captured q buffer, replays the graph, and the
output must match the float64 reference within the usual tolerance (twice the error of plain
same-dtype attention); rows past the live batch must stay untouched.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_gpu_kernels import _available, _np64, _rel, plain_attention, plain_attention_mt

pytestmark = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not _available(), reason="needs CuPy, torch and a CUDA device")

PAGE = 16


def replay_step(graph, stream, run, out_buf, lse_buf, n):
    """One graph-safe serving step after plan(): at the first step (``graph`` None) ``run()``
    once outside the capture (compiles, builds the launches) and capture it on ``stream``;
    then NaN the ``n`` live rows of the outputs and replay.  Returns the graph."""
    import torch
    if graph is None:
        run()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
    out_buf[:n] = float("nan")
    lse_buf[:n] = float("nan")
    graph.replay()
    return graph


class PagedCache:
    """Host bookkeeping of a paged KV cache on the GPU (torch tensors, NHD)."""

    def __init__(self, num_pages, hk, d, dtype, rng, torch):
        self.torch = torch
        self.k = torch.zeros((num_pages, PAGE, hk, d), dtype=dtype, device="cuda")
        self.v = torch.zeros_like(self.k)
        self.free = list(range(num_pages))[::-1]
        self.refs = np.zeros(num_pages, dtype=np.int64)
        self.rng = rng
        self.reqs = []          # each: {"pages": [...], "len": int}
        self.reused = 0         # pages handed out again after being freed
        self.ever_used = np.zeros(num_pages, dtype=bool)

    def _alloc(self):
        p = self.free.pop()
        if self.ever_used[p]:
            self.reused += 1
        self.ever_used[p] = True
        self.refs[p] = 1
        return p

    def _fill(self, page, first, last):
        """New random K/V for token slots [first, last) of a page."""
        t = self.torch
        shape = (last - first,) + tuple(self.k.shape[2:])
        self.k[page, first:last] = t.randn(shape, device="cuda").to(self.k.dtype)
        self.v[page, first:last] = t.randn(shape, device="cuda").to(self.v.dtype)

    def join(self, length, parent=None):
        pages = []
        shared = 0
        if parent is not None:
            shared = parent["len"] // PAGE       # full pages only: a fork shares whole pages
            shared = int(self.rng.integers(1, shared + 1)) if shared else 0
            pages = list(parent["pages"][:shared])
            self.refs[pages] += 1
        tokens = shared * PAGE
        length = max(length, tokens + 1)
        while tokens < length:
            p = self._alloc()
            take = min(PAGE, length - tokens)
            self._fill(p, 0, take)
            pages.append(p)
            tokens += take
        req = {"pages": pages, "len": length}
        self.reqs.append(req)
        return req

    def leave(self, i):
        req = self.reqs.pop(i)
        for p in req["pages"]:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def grow(self):
        for req in self.reqs:
            slot = req["len"] % PAGE
            if slot == 0:
                p = self._alloc()
                req["pages"].append(p)
            self._fill(req["pages"][-1], slot, slot + 1)
            req["len"] += 1

    def table(self):
        B = len(self.reqs)
        width = max(len(r["pages"]) for r in self.reqs)
        bt = np.full((B, width), -7, dtype=np.int32)     # junk padding
        for i, r in enumerate(self.reqs):
            bt[i, :len(r["pages"])] = r["pages"]
        return bt, np.array([r["len"] for r in self.reqs], dtype=np.int32)


@requires_gpu
@pytest.mark.parametrize("packer,max_batch,fused,d", (
    ("pat", 24, "off", 128), ("cascade", 24, "off", 128), ("pat", 4, "off", 128),
    ("pat", 24, "on", 128), ("cascade", 24, "on", 128),
    ("pat", 24, "off", 256), ("pat", 4, "off", 256), ("pat", 24, "on", 256)))
def test_one_capture_fifty_changing_steps(packer, max_batch, fused, d):
    """max_batch 4 at group 4: every CTA fits one 16-row tile, so the wrapper plans with one
    KV tile width and its launch set is one forward launch (static_plan.graph_safe_tile_table).
    fused "on": the launch set's tiles run in one fused pull launch, planned without the tiles
    that would cut its blocks per SM; "off": one launch per tile (the default "auto" fuses
    buckets of at most 16 requests).  head_dim 256: the same, on its kernels (whose 64-token
    tiles hold one block per SM, so the fused set's exclusions differ from head_dim 128's)."""
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.inputs import as_block_table

    hq, hk, dtype = 32, 8, torch.float16
    num_pages = 1024
    rng = np.random.default_rng(11)
    torch.manual_seed(11)
    cache = PagedCache(num_pages, hk, d, dtype, rng, torch)
    root = cache.join(300)
    for _ in range(min(5, max_batch - 1)):
        cache.join(int(rng.integers(20, 200)), parent=root)
    w = PrefixAttentionWrapper(backend="cuda", packer=packer, use_cuda_graph=True,
                               max_batch_size=max_batch, max_num_pages=num_pages)
    w._gpu_backend.graph_fused = fused
    q_buf = torch.zeros((max_batch, hq, d), dtype=dtype, device="cuda")
    out_buf = torch.zeros_like(q_buf)
    lse_buf = torch.zeros((max_batch, hq), dtype=torch.float32, device="cuda")

    stream = torch.cuda.Stream()
    graph = None
    batches = []
    for step in range(50):
        # everything on one stream: cache writes, plan()'s copy, the replay
        with torch.cuda.stream(stream):
            if step:
                # requests leave, join (most forked from a running request), and grow
                for _ in range(int(rng.integers(0, 3))):
                    if len(cache.reqs) > 2:
                        cache.leave(int(rng.integers(0, len(cache.reqs))))
                for _ in range(int(rng.integers(0, 3))):
                    if len(cache.reqs) < max_batch and len(cache.free) > 64:
                        parent = cache.reqs[int(rng.integers(0, len(cache.reqs)))] \
                            if rng.random() < 0.6 else None
                        cache.join(int(rng.integers(1, 300)), parent=parent)
                cache.grow()
            bt, lens = cache.table()
            B = bt.shape[0]
            batches.append(B)
            plan = w.plan(bt, lens, hq, hk, d, PAGE, kv_data_type="float16")
            q = torch.randn((B, hq, d), device="cuda").to(dtype)
            q_buf[:B] = q
            out_buf[B:] = float("nan")
            lse_buf[B:] = float("nan")
            graph = replay_step(graph, stream, lambda: w.run(q_buf, (cache.k, cache.v),
                                                             out=out_buf, lse=lse_buf),
                                out_buf, lse_buf, B)
        stream.synchronize()

        assert not torch.isnan(out_buf[:B]).any(), f"step {step}: output rows not written"
        assert torch.isnan(out_buf[B:]).all() and torch.isnan(lse_buf[B:]).all(), \
            f"step {step}: rows past the batch were written"
        ref, ref_lse = dense_attention(_np64(q), (_np64(cache.k), _np64(cache.v)), bt, lens,
                                       PAGE, sm_scale=plan.sm_scale, return_lse=True)
        blk = as_block_table(bt, lens, PAGE)
        low, _ = plain_attention(q, cache.k, cache.v, blk, PAGE, "NHD", plan.sm_scale)
        err = _rel(_np64(out_buf[:B]), ref)
        err_plain = _rel(_np64(low), ref)
        assert err <= 2 * err_plain + 1e-6, \
            f"step {step} ({plan.summary()}): error {err:.3e} > 2 x plain {err_plain:.3e}"
        lerr = float(np.abs(_np64(lse_buf[:B]) - ref_lse).max())
        assert lerr < 1e-2, f"step {step}: lse error {lerr:.3e}"
    # the loop really changed the batch and reused freed pages
    assert len(set(batches)) >= min(4, max_batch - 1) and cache.reused > 0, \
        (batches, cache.reused)
    tiles = w._static.layout.tiles
    if max_batch * hq // hk <= 16:
        assert tiles == ((16, 64),), tiles
    elif fused != "on":                     # the GPU's KV tile table: several n per m
        assert len({n for m, n in tiles if m == 16}) > 1, tiles
    assert len(w._static.launch_variants) == (1 if fused == "on" else len(w._static.layout.tiles))
    # a fused launch set leaves out the tiles that would cut its blocks per SM (static_plan.
    # fused_pull_exclusions: (32, 64) at head_dim 128 on sm_90); a launch per tile keeps them
    excluded = set(w.planner.tuning.exclude_tiles or ())
    assert not excluded & set(w._static.layout.tiles)
    if fused == "on" and w.planner.gpu.name.startswith("H"):
        assert (32, 64) in excluded, w.planner.tuning.exclude_tiles
    if fused == "on" and d != 128:
        from pat_core.static_plan import FUSED_TILE_TABLE
        assert w.planner.tuning.kv_tile_table == FUSED_TILE_TABLE
        assert w._static.grids[0] >= w._static.num_sms, (w._static.grids, tiles)
    elif fused == "on":
        from pat_core.static_plan import FUSED_TILE_TABLE
        assert w.planner.tuning.kv_tile_table == FUSED_TILE_TABLE
        # one n per m (64), (32, 64)'s CTAs taking (32, 32) on Hopper
        assert all(len({n for mm, n in tiles if mm == m}) == 1 for m, _ in tiles), tiles
        assert {n for m, n in tiles if m != 32} == {64}, tiles
        if w.planner.gpu.name.startswith("H"):
            assert (32, 32) in tiles, tiles
        # tiles left out and rows capped until the fused block fits two per SM: the grid of the
        # compiled pull kernel (every block that can be resident at once) shows it
        from pat_core.static_plan import FUSED_MIN_BLOCKS_PER_SM
        assert w._static.grids[0] >= FUSED_MIN_BLOCKS_PER_SM * w._static.num_sms, \
            (w._static.grids, w._static.layout.tiles)
    if max_batch * hq // hk > 16 and not w._static.fused:
        # a launch per tile: the lean table at head_dim <= 128 (the 32-token width for 16-row
        # CTAs only), the GPU's tables above
        from pat_core.static_plan import LEAN_EXCLUDED_TILES, LEAN_TILE_TABLE
        if d <= 128:
            assert w.planner.tuning.kv_tile_table == LEAN_TILE_TABLE
            assert excluded == set(LEAN_EXCLUDED_TILES)
            assert {n for m, n in tiles if m > 16} == {64}, tiles
        else:
            assert not excluded


@requires_gpu
def test_limits_and_inputs_are_checked():
    import torch
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch

    b = build_tree_batch("1,4,16_128,40,33", page_size=PAGE)
    w = PrefixAttentionWrapper(backend="cuda", use_cuda_graph=True, max_batch_size=16,
                               max_num_pages=b.num_pages * 4)
    with pytest.raises(ValueError, match="max_batch_size"):
        big = build_tree_batch("1,4,20_128,40,33", page_size=PAGE)
        w.plan(big.block_tables, big.seq_lens, 32, 8, 128, PAGE)
    w.plan(b.block_tables, b.seq_lens, 32, 8, 128, PAGE)
    k = torch.zeros((b.num_pages, PAGE, 8, 128), dtype=torch.float16, device="cuda")
    q = torch.zeros((16, 32, 128), dtype=torch.float16, device="cuda")
    w.run(q, (k, k))
    with pytest.raises(ValueError, match="num_kv_heads"):
        w.plan(b.block_tables, b.seq_lens, 32, 4, 128, PAGE)
    # a plan reading a page past the cache the launches were built for is refused
    bt = b.block_tables.copy()
    bt[0, 0] = b.num_pages + 3
    with pytest.raises(ValueError, match="KV cache"):
        w.plan(bt, b.seq_lens, 32, 8, 128, PAGE)
    # the refused plan left nothing runnable
    with pytest.raises(RuntimeError, match="the last plan\\(\\) call failed"):
        w.run(q, (k, k))
    w.plan(b.block_tables, b.seq_lens, 32, 8, 128, PAGE)
    with pytest.raises(ValueError, match="rows"):
        w.run(q[:3], (k, k))


@requires_gpu
@pytest.mark.parametrize("fused", ("off", "on"))
def test_fp8_cache_under_one_capture(fused):
    """An fp8 cache (float8_e4m3fn) with scales in graph-safe mode: one capture replayed over
    changing steps, each against float64 on the decoded values times the scales."""
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.inputs import as_block_table

    hq, hk, d, qdt, k_scale, v_scale = 32, 8, 128, torch.bfloat16, 0.4, 3.0
    num_pages, max_batch = 512, 12
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    cache = PagedCache(num_pages, hk, d, torch.float8_e4m3fn, rng, torch)
    root = cache.join(200)
    for _ in range(4):
        cache.join(int(rng.integers(20, 150)), parent=root)
    w = PrefixAttentionWrapper(backend="cuda", use_cuda_graph=True, max_batch_size=max_batch,
                               max_num_pages=num_pages)
    w._gpu_backend.graph_fused = fused
    q_buf = torch.zeros((max_batch, hq, d), dtype=qdt, device="cuda")
    out_buf = torch.zeros_like(q_buf)
    lse_buf = torch.zeros((max_batch, hq), dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    graph = None
    for step in range(12):
        with torch.cuda.stream(stream):
            if step:
                if len(cache.reqs) < max_batch and rng.random() < 0.5:
                    cache.join(int(rng.integers(1, 200)), parent=root)
                cache.grow()
            bt, lens = cache.table()
            B = bt.shape[0]
            plan = w.plan(bt, lens, hq, hk, d, PAGE, kv_data_type=torch.float8_e4m3fn,
                          q_data_type=torch.bfloat16)
            q = (torch.randn((B, hq, d), device="cuda") / 4).to(qdt)
            q_buf[:B] = q
            graph = replay_step(graph, stream, lambda: w.run(
                q_buf, (cache.k, cache.v), out=out_buf, lse=lse_buf, k_scale=k_scale,
                v_scale=v_scale), out_buf, lse_buf, B)
        stream.synchronize()
        assert not torch.isnan(out_buf[:B]).any(), f"step {step}: output rows not written"
        ref, ref_lse = dense_attention(_np64(q), (_np64(cache.k), _np64(cache.v)), bt, lens,
                                       PAGE, sm_scale=plan.sm_scale, return_lse=True,
                                       k_scale=k_scale, v_scale=v_scale)
        blk = as_block_table(bt, lens, PAGE)
        low, _ = plain_attention(q, cache.k.to(qdt) * k_scale, cache.v.to(qdt) * v_scale, blk,
                                 PAGE, "NHD", plan.sm_scale)
        err, err_plain = _rel(_np64(out_buf[:B]), ref), _rel(_np64(low), ref)
        assert err <= 2 * err_plain + 1e-6, f"step {step}: error {err:.3e} > 2 x {err_plain:.3e}"
        lerr = float(np.abs(_np64(lse_buf[:B]) - ref_lse).max())
        assert lerr < 1e-2, f"step {step}: lse error {lerr:.3e}"
    assert all(v.kv_dtype == "float8_e4m3fn" for v in w._static.variants)


@requires_gpu
@pytest.mark.parametrize("max_batch,fused", ((12, "off"), (4, "on"), (12, "auto")))
def test_multitoken_steps_under_one_capture(max_batch, fused):
    """A graph-safe wrapper with max_num_qo_tokens: one capture replays steps of changing
    query-length mixes (all one token, fixed draft lengths, mixed 1..8), requests joining,
    leaving and growing by their tokens; each step against float64 with the causal rule, rows
    past the live tokens untouched.  Every replay runs the multi-token kernels."""
    import torch
    from pat_core import PrefixAttentionWrapper, dense_attention
    from pat_core.inputs import as_block_table

    hq, hk, d, dtype = 16, 4, 128, torch.float16
    num_pages, max_q = 768, 8
    max_tokens = max_batch * max_q
    rng = np.random.default_rng(5)
    torch.manual_seed(5)
    cache = PagedCache(num_pages, hk, d, dtype, rng, torch)
    root = cache.join(260)
    for _ in range(min(4, max_batch - 1)):
        cache.join(int(rng.integers(20, 150)), parent=root)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat", use_cuda_graph=True,
                               max_batch_size=max_batch, max_num_pages=num_pages,
                               max_num_qo_tokens=max_tokens)
    w._gpu_backend.graph_fused = fused
    q_buf = torch.zeros((max_tokens, hq, d), dtype=dtype, device="cuda")
    out_buf = torch.zeros_like(q_buf)
    lse_buf = torch.zeros((max_tokens, hq), dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    graph = None
    mixes = set()
    for step in range(24):
        with torch.cuda.stream(stream):
            if step:
                for _ in range(int(rng.integers(0, 2))):
                    if len(cache.reqs) > 2:
                        cache.leave(int(rng.integers(0, len(cache.reqs))))
                for _ in range(int(rng.integers(0, 2))):
                    if len(cache.reqs) < max_batch and len(cache.free) > 64:
                        parent = cache.reqs[int(rng.integers(0, len(cache.reqs)))] \
                            if rng.random() < 0.6 else None
                        cache.join(int(rng.integers(1, 200)), parent=parent)
            kind = step % 3
            B = len(cache.reqs)
            ql = (np.ones(B, dtype=np.int64) if kind == 0 else
                  np.full(B, int(rng.integers(2, max_q + 1))) if kind == 1 else
                  rng.integers(1, max_q + 1, size=B))
            for _ in range(int(ql.max())):      # the new tokens are in the cache (seq_lens)
                cache.grow()
            bt, lens = cache.table()
            ql = np.minimum(ql, lens)
            qo = np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
            N = int(qo[-1])
            mixes.add(tuple(sorted(set(ql.tolist()))))
            plan = w.plan(bt, lens, hq, hk, d, PAGE, kv_data_type="float16", qo_indptr=qo)
            q = torch.randn((N, hq, d), device="cuda").to(dtype)
            q_buf[:N] = q
            out_buf[N:] = float("nan")
            lse_buf[N:] = float("nan")
            graph = replay_step(graph, stream, lambda: w.run(q_buf, (cache.k, cache.v),
                                                             out=out_buf, lse=lse_buf),
                                out_buf, lse_buf, N)
        stream.synchronize()
        assert not torch.isnan(out_buf[:N]).any(), f"step {step}: output rows not written"
        assert torch.isnan(out_buf[N:]).all() and torch.isnan(lse_buf[N:]).all(), \
            f"step {step}: rows past the live tokens were written"
        ref, ref_lse = dense_attention(_np64(q), (_np64(cache.k), _np64(cache.v)), bt, lens,
                                       PAGE, sm_scale=plan.sm_scale, return_lse=True,
                                       qo_indptr=qo)
        blk = as_block_table(bt, lens, PAGE)
        low, _ = plain_attention_mt(q, cache.k, cache.v, blk, qo, PAGE, "NHD", plan.sm_scale)
        err, err_plain = _rel(_np64(out_buf[:N]), ref), _rel(_np64(low), ref)
        assert err <= 2 * err_plain + 1e-6, \
            f"step {step} ({plan.summary()}): error {err:.3e} > 2 x plain {err_plain:.3e}"
        lerr = float(np.abs(_np64(lse_buf[:N]) - ref_lse).max())
        assert lerr < 1e-2, f"step {step}: lse error {lerr:.3e}"
    assert len(mixes) >= 4, mixes
    assert all(v.causal for v in w._static.variants)
    assert w._static.layout.limits.max_tokens == max_tokens


@requires_gpu
def test_multitoken_plan_refused_without_max_num_qo_tokens():
    """A graph-safe wrapper sized for one token per request refuses a multi-token plan, naming
    max_num_qo_tokens, and leaves no runnable plan."""
    from pat_core import PrefixAttentionWrapper
    from pat_core.workloads import build_tree_batch

    b = build_tree_batch("1,4_128,40", page_size=PAGE)
    w = PrefixAttentionWrapper(backend="cuda", use_cuda_graph=True, max_batch_size=8,
                               max_num_pages=256)
    qo = np.arange(b.batch_size + 1, dtype=np.int32) * 2
    with pytest.raises(ValueError, match="max_num_qo_tokens"):
        w.plan(b.block_tables, b.seq_lens, 8, 2, 128, PAGE, qo_indptr=qo)
    with pytest.raises(RuntimeError, match="failed"):
        w.stats()
    w2 = PrefixAttentionWrapper(backend="cuda", use_cuda_graph=True, max_batch_size=8,
                                max_num_pages=256, max_num_qo_tokens=8)
    with pytest.raises(ValueError, match="max_num_qo_tokens=8"):
        w2.plan(b.block_tables, b.seq_lens, 8, 2, 128, PAGE,
                qo_indptr=np.arange(b.batch_size + 1, dtype=np.int32) * 3)
