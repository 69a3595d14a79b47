"""The CUDA backend's host side on a CPU (``fake_cuda``: host memory for the device, launches
recorded): which launches a plan gets, with which grids, whether the merge runs, what the
plan buffer holds, and how often a layer's inputs are validated.  The GPU tests check the
results of the same paths against float64."""
from __future__ import annotations

import numpy as np
import pytest

from fake_cuda import PROPS, FakeArray, fake_backend
from pat_core import PrefixAttentionWrapper
from pat_core import cuda_compile as cc
from pat_core.launch import forward_launches, launch_grid, merge_needed
from pat_core.plan import Plan
from pat_core.workloads import build_tree_batch

SMS = PROPS["multiProcessorCount"]


def _inputs(batch, hq, hk, d, pages, page=16, seed=0):
    rng = np.random.default_rng(seed)
    q = FakeArray.of(rng.standard_normal((batch, hq, d)).astype(np.float16))
    k = FakeArray.of(np.zeros((pages, page, hk, d), np.float16))
    v = FakeArray.of(np.zeros((pages, page, hk, d), np.float16))
    return q, k, v


@pytest.fixture
def cuda(monkeypatch):
    """The fake device (its recorded launches); wrappers made in the test use it."""
    return fake_backend(monkeypatch)[1]


@pytest.mark.parametrize("spec,heads,d", [
    ("1,12_33,17", (8, 2), 64), ("1,4,16_128,256,1024", (32, 8), 128),
    ("8_4096", (32, 8), 128), ("1,16_16384,16", (32, 8), 128), ("64,512_512,64", (32, 8), 128),
    ("1,3,48_1024,6144,4096", (32, 32), 128), ("1_512", (32, 8), 128), ("3_50", (16, 4), 64),
    ("2000_40", (32, 8), 128), ("1000_300", (32, 8), 128)])
def test_launches_follow_the_plan(cuda, spec, heads, d):
    """One forward launch per tile with CTAs, tallest first, each of the grid the launch
    policy gives (resident blocks, at most one per item), then the merge exactly where
    :func:`pat_core.launch.merge_needed` (the simulator's rule) says."""
    fake = cuda
    hq, hk = heads
    b = build_tree_batch(spec, page_size=16, seed=1)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    be = w._gpu_backend
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, 16)
    q, k, v = _inputs(b.batch_size, hq, hk, d, b.num_pages)
    fake.launches.clear()
    w.run(q, (k, v))
    per_sm = [be._blocks_per_sm(cc.FwdVariant.make(int(m), int(n), d, "float16", arch=be.arch))
              for m, n in plan.tile_configs]
    want = []
    for kk, (m, n), ctas in forward_launches(plan):
        key = cc.FwdVariant.make(m, n, d, "float16", arch=be.arch).key
        want.append((key, launch_grid(len(ctas) * hk, per_sm[kk], SMS)))
    got = [(key, grid[0]) for key, grid, *_ in fake.launches]
    merges = [g for g in got if g[0].startswith("pat_merge")]
    assert [g for g in got if not g[0].startswith("pat_merge")] == want
    assert len(merges) == int(merge_needed(plan, per_sm, SMS))
    if merges:
        assert got[-1] == merges[0]                     # the merge comes last


def test_the_plan_buffer_holds_the_packed_plan(cuda):
    """plan() copies the packed plan into the state's device buffer (one copy)."""
    b = build_tree_batch("1,4,16_128,256,1024", page_size=16, seed=2)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    plan = w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    st = w._gpu_backend.state_for(plan)
    assert st.plan is plan
    packed = st.layout.pack(plan)
    assert np.array_equal(st.buf.a[:packed.shape[0]], packed)


def test_a_layers_inputs_are_validated_once_across_batch_sizes(cuda, monkeypatch):
    """An engine's loop: rows of one query buffer, one cache per layer, batches of changing
    size.  Each layer's inputs are validated (and its launches built) once per device state,
    not once per batch size; q rows that differ from the plan's batch are refused."""
    fake = cuda
    from pat_core.cuda_state import StaticState
    calls = []
    real = Plan.check_inputs
    monkeypatch.setattr(Plan, "check_inputs",
                        lambda self, *a, **kw: (calls.append(1), real(self, *a, **kw))[1])
    prepared = []
    real_prep = StaticState.prepare
    monkeypatch.setattr(StaticState, "prepare",
                        lambda self, *a, **kw: (prepared.append(1), real_prep(self, *a, **kw))[1])
    specs = ("1,12_33,17", "1,4_40,20", "3_50", "1,4_40,20", "2,6_16,30")
    batches = [build_tree_batch(s, page_size=16, seed=i) for i, s in enumerate(specs)]
    rows = max(b.batch_size for b in batches)
    pages = max(b.num_pages for b in batches)
    qbuf, k0, v0 = _inputs(rows, 8, 2, 64, pages)
    _, k1, v1 = _inputs(rows, 8, 2, 64, pages)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    states = []
    for b in batches:
        plan = w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
        st = w._gpu_backend.state_for(plan)
        assert st.plan is plan
        if not any(s is st for s in states):
            states.append(st)
        q = qbuf[:b.batch_size]                      # a view of the same rows
        for kv in ((k0, v0), (k1, v1)):
            n = len(fake.launches)
            w.run(q, kv)
            assert len(fake.launches) > n
    assert len(states) < len(specs)
    assert len(prepared) == len(calls) == 2 * len(states)
    for _ in range(2):                          # refused again, not noted as checked
        with pytest.raises(ValueError, match=r"plan has \d+ requests but q has"):
            w.run(qbuf[:batches[-1].batch_size - 1], (k0, v0))


def test_graph_safe_layers_are_prepared_once_and_plans_fit_every_prepared_set(cuda, monkeypatch):
    """Graph-safe mode under an engine that captures its layers (one cache each) for several
    graphs: each layer's inputs are prepared once across plans, not again whenever another
    layer ran in between; and a plan must fit the q rows of every input set prepared, since
    a graph captured with any of them may be replayed (with the fewest rows last prepared
    for another set, a plan of more requests was accepted and would write past them)."""
    from pat_core.cuda_state import StaticState
    prepared = []
    real_prep = StaticState.prepare
    monkeypatch.setattr(StaticState, "prepare",
                        lambda self, *a, **kw: (prepared.append(1), real_prep(self, *a, **kw))[1])
    batches = [build_tree_batch(s, page_size=16, seed=0)
               for s in ("1,12_33,17", "1,4_40,20", "3_50")]
    pages = max(b.num_pages for b in batches)
    w = PrefixAttentionWrapper(backend="cuda", use_cuda_graph=True, max_batch_size=16,
                               max_num_pages=pages)
    qbuf, k0, v0 = _inputs(16, 8, 2, 64, pages)
    _, k1, v1 = _inputs(16, 8, 2, 64, pages)
    for b in batches:
        w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
        for kv in ((k0, v0), (k1, v1)):
            w.run(qbuf, kv)
    assert len(prepared) == 2
    w.run(qbuf[:3], (k0, v0))                   # a 3-row query buffer: prepared for it
    w.run(qbuf, (k1, v1))                       # the 16-row set again: kept
    assert len(prepared) == 3
    _, k2, v2 = _inputs(16, 8, 2, 64, pages)
    w.run(qbuf, (k2, v2))                       # a new layer's 16-row set
    assert len(prepared) == 4
    big = batches[0]
    with pytest.raises(ValueError, match="the plan has 12 requests but the q buffer the "
                                         "launches were built for has 3 rows"):
        w.plan(big.block_tables, big.seq_lens, 8, 2, 64, 16)


def test_a_caller_out_buffer_is_checked_whenever_it_changes(cuda):
    """The last out buffer that passed the checks is not checked again; another one is, and a
    bad one (wrong shape, or overlapping q) is refused by name."""
    b = build_tree_batch("1,12_33,17", page_size=16, seed=0)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    q, k, v = _inputs(b.batch_size, 8, 2, 64, b.num_pages)
    out = FakeArray((b.batch_size, 8, 64), np.float16)
    assert w.run(q, (k, v), out=out) is out
    assert w.run(q, (k, v), out=out) is out
    with pytest.raises(ValueError, match="out must be"):
        w.run(q, (k, v), out=FakeArray((b.batch_size + 1, 8, 64), np.float16))
    big = FakeArray((b.batch_size + 1, 8, 64), np.float16)
    assert w.run(q, (k, v), out=big[:b.batch_size]) is not None
    with pytest.raises(ValueError, match="out must be"):
        w.run(q, (k, v), out=big)                # the same pointer, one row too many
    with pytest.raises(ValueError, match="out overlaps q"):
        w.run(q, (k, v), out=q)
    n = b.batch_size                             # one buffer: q's last row is out's first
    buf = FakeArray((2 * n - 1, 8, 64), np.float16)
    buf[:n].a[:] = q.a
    with pytest.raises(ValueError, match="out overlaps q"):
        w.run(buf[:n], (k, v), out=buf[n - 1:])
    with pytest.raises(ValueError, match="out overlaps q"):     # out's last row is q's first
        w.run(buf[n - 1:], (k, v), out=buf[:n])
    assert w.run(q, (k, v), out=out) is out


def test_cached_launches_equal_freshly_built_ones(cuda):
    """A serving loop's calls (changing batches, two layers, the caller's out buffer) enqueue
    the same launches, grids and parameter bytes when the backend reuses its prepared inputs,
    its plan's launch list and its checked out buffer as when it builds them again."""
    fake = cuda
    specs = ("1,12_33,17", "2,6_16,30", "1,4_40,20", "3_50", "1,2_200,30", "1,12_33,17",
             "1,3_300,40", "1,2_200,30", "1,8_300,20", "1,3_300,40")
    batches = [build_tree_batch(s, page_size=16, seed=i) for i, s in enumerate(specs)]
    rows = max(b.batch_size for b in batches)
    pages = max(b.num_pages for b in batches)
    qbuf, k0, v0 = _inputs(rows, 8, 2, 64, pages)
    _, k1, v1 = _inputs(rows, 8, 2, 64, pages)
    outs = [FakeArray((rows, 8, 64), np.float16) for _ in range(2)]
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    compared, states, grids, merge_grids = 0, [], set(), set()
    for i, b in enumerate(batches):
        plan = w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
        st = w._gpu_backend.state_for(plan)
        states += [] if any(s is st for s in states) else [st]
        n = b.batch_size
        for j, kv in enumerate(((k0, v0), (k1, v1))):
            w.run(qbuf[:n], kv, out=outs[(i + j + 1) % 2][:n])
            out = outs[(i + j) % 2][:n]          # the out buffer changes from call to call
            got = []
            for fresh in (False, True):
                kept = st.prepared
                if fresh:                        # built again, the caches left as they were
                    st.prepared = {}
                start = len(fake.launches)
                w.run(qbuf[:n], kv, out=out)
                got.append(fake.launches[start:])
                st.prepared = kept
            assert got[0] == got[1] and got[0]
            compared += len(got[0])
            grids |= {g for _, g, *_ in got[0]}
            merge_grids |= {(id(st), g) for key, g, *_ in got[0] if key.startswith("pat_merge")}
    # the loop exercised plans of other grids on one state, merges among them
    assert len(states) < len(specs) and len(grids) >= 3 and compared >= 2 * len(specs)
    assert any(len({g for s, g in merge_grids if s == sid}) >= 2 for sid, _ in merge_grids)


def test_the_wrappers_checks_run_when_an_input_set_is_new(cuda):
    """A decode call with every option at its default goes straight to the backend, which runs
    the wrapper's checks when it validates a new input set: a cache pair of unequal shapes,
    a q of another dtype than the plan's and caches of another dtype are refused by name, each
    time they are passed (a refused set is never cached), and a good call still runs."""
    b = build_tree_batch("1,4_40,20", page_size=16, seed=0)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    q, k, v = _inputs(b.batch_size, 8, 2, 64, b.num_pages + 1)
    bad = [((q, (k, v[:-1])), ValueError, "4-D with equal shapes"),
           ((FakeArray.of(q.a.astype(np.float32)), (k, v)), TypeError, "q is float32"),
           ((q, (FakeArray.of(k.a.astype(np.float32)), FakeArray.of(v.a.astype(np.float32)))),
            TypeError, "float32")]
    for args, err, match in bad:
        for _ in range(2):
            n = len(cuda.launches)
            with pytest.raises(err, match=match):
                w.run(*args)
            assert len(cuda.launches) == n
    assert w.run(q, (k, v)) is not None
    with pytest.raises(ValueError, match="4-D with equal shapes"):
        w.run(q, (k, v[:-1]))

    class Bare:                     # the same memory, but no array attributes to check
        def __init__(self, a):
            self.__cuda_array_interface__ = a.__cuda_array_interface__
    for _ in range(2):              # refused every time, though its pointers were validated
        with pytest.raises(TypeError, match="q must be an array"):
            w.run(Bare(q), (k, v))
        with pytest.raises(TypeError, match="paged_kv_cache must hold arrays"):
            w.run(q, (Bare(k), v))
        with pytest.raises(TypeError, match="paged_kv_cache must hold arrays"):
            w.run(q, (k.a.tolist(), v))


def test_a_plan_the_kernels_cannot_run_is_refused_before_any_copy(cuda):
    """A plan changed in place after planning (its version bumped) is checked again when it is
    written: a negative page id and a CTA with more query rows than its tile are refused by
    name, and nothing is launched."""
    b = build_tree_batch("1,12_2000,17", page_size=16, seed=0)   # a 48-row root CTA
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    plan = w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    q, k, v = _inputs(b.batch_size, 8, 2, 64, b.num_pages)
    w.run(q, (k, v))
    n = len(cuda.launches)
    pages = plan.cta_pages.copy()
    plan.cta_pages[-1] = -1                     # not the first entry, where the range starts
    plan.version += 1
    with pytest.raises(ValueError, match="page ids must be >= 0"):
        w.run(q, (k, v))
    plan.cta_pages[:] = pages
    plan.cta_pages[-1] = b.num_pages            # past the cache: checked per plan version
    plan.version += 1
    with pytest.raises(ValueError, match=rf"holds {b.num_pages} pages but the plan reads "
                                         rf"page {b.num_pages}"):
        w.run(q, (k, v))
    plan.cta_pages[:] = pages
    rows = np.diff(plan.cta_req_indptr) * plan.group_size
    m = plan.tile_configs[:, 0]
    big = int(np.argmax(rows))
    small = int(np.argmin(m))
    assert rows[big] > m[small]                 # the plan has a CTA a smaller tile cannot hold
    plan.cta_tile[big] = small
    plan.version += 1
    with pytest.raises(ValueError, match=rf"CTA {big} has {rows[big]} query rows but its tile "
                                         rf"has m={m[small]}"):
        w.run(q, (k, v))
    assert len(cuda.launches) == n


def test_planning_never_waits_for_the_device(cuda):
    """A serving loop whose batches outgrow the plain device state, with the GPU "busy" (no
    event completes): no plan() synchronises the device.  A replaced state is kept, with an
    event on the stream its copies and launches went to, until that work has finished, and
    is dropped by the first plan after it has.  Each write waits only for the copy of two
    writes before (two pinned staging buffers in turn), so a plan never waits for the last
    one's copy, which is queued behind the GPU's work."""
    fake = cuda
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    be = w._gpu_backend
    fake.busy = True
    states, same = [], 0
    for i, spec in enumerate(("2_64", "8_300", "40_300", "40_300", "160_700", "160_700")):
        b = build_tree_batch(spec, page_size=16, seed=i)
        plan = w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
        st = be.state_for(plan)
        q, k, v = _inputs(b.batch_size, 8, 2, 64, b.num_pages)
        w.run(q, (k, v))
        if not any(s is st for s in states):
            states.append(st)
        # this write packed into one staging buffer after waiting on its last copy's event;
        # the other buffer still holds the plan before (same state), untouched
        h = 1 - st._half
        assert fake.event_waits[-1] is st._copied[h]
        packed = st.layout.pack(plan)
        assert np.array_equal(st._staging[h][:packed.shape[0]], packed)
        if i and prev_state is st:
            assert np.array_equal(st._staging[1 - h][:prev.shape[0]], prev)
            same += 1
        prev, prev_state = packed, st
    assert len(states) >= 3 and same >= 2       # the state grew, and was written twice in a row
    assert fake.device_syncs == 0
    retired = [s for s, _ in be._retired]
    assert retired == states[:-1]               # kept while their work may run
    for _, events in be._retired:
        assert [ev.stream for ev in events] == [0]   # CuPy's current stream: plan and run's
    fake.busy = False                           # the work finished: the next plan drops them
    w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    assert be._retired == [] and fake.device_syncs == 0


def test_a_tile_without_a_kernel_is_refused_by_name(cuda):
    """A plan whose launch group names a tile no kernel exists for is refused when it is put on
    the device, naming the tile; a tile config no group with CTAs uses is not checked."""
    from pat_core.cuda_backend import _check_plan_tiles
    b = build_tree_batch("1,4,16_128,256,64", page_size=16, seed=1)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    plan = w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    _check_plan_tiles(plan)
    g = int(np.argmax(np.diff(plan.group_indptr)))          # a group with CTAs
    t = int(plan.group_tile[g])
    configs = plan.tile_configs.copy()
    plan.tile_configs = np.concatenate([configs, [[48, 48]]]).astype(configs.dtype)
    _check_plan_tiles(plan)                                  # listed, used by no group: fine
    plan.tile_configs = configs.copy()
    plan.tile_configs[t] = (configs[t, 0], 48)
    plan.version += 1
    with pytest.raises(ValueError, match=rf"no CUDA kernel for tile \(m={configs[t, 0]}, n=48\)"):
        w._gpu_backend.upload(plan)


def test_a_new_state_is_zeroed_on_the_stream_of_its_first_copy(cuda):
    """A new device state's plan buffer, work counters and chain counters are zeroed on the
    stream of its first plan copy, before the copy (not on CuPy's current stream, which the
    caller's stream need not follow); later writes only copy."""
    from pat_core.cuda_state import StaticState
    fake = cuda
    b = build_tree_batch("1,4,16_128,256,64", page_size=16, seed=1)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    be = w._gpu_backend
    plan = w.planner.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    st = be.state_for(plan)
    assert isinstance(st, StaticState) and st.plan is None
    fake.copies.clear()
    st.write(plan, 0x55)
    fills = {(ptr, n) for op, ptr, n, s in fake.copies if op == "memset" and s == 0x55}
    assert fills == {(int(a.data.ptr), a.nbytes) for a in (st.buf, st.counters, st.chain)}
    assert [op for op, *_ in fake.copies] == ["memset"] * 3 + ["memcpy"]
    assert all(s == 0x55 for *_, s in fake.copies)
    assert not st.counters.a.any() and not st.chain.a.any()
    fake.copies.clear()
    st.write(plan, 0x55)
    assert [op for op, *_ in fake.copies] == ["memcpy"]


def test_a_failed_write_waits_for_its_copy_and_keeps_the_buffers_in_turn(cuda, monkeypatch):
    """If write() fails after its copy was queued (the event cannot be recorded), it waits
    for the device before raising, so the staging buffer is free again, and the stream stays
    noted for the state's retirement."""
    from pat_core import cuda_state
    fake = cuda
    b = build_tree_batch("8_300", page_size=16, seed=0)
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    plan = w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    st = w._gpu_backend.state_for(plan)
    real = cuda_state._external_stream

    def broken(cp, handle, device):
        if handle == 0x77:
            raise RuntimeError("no such stream")
        return real(cp, handle, device)
    monkeypatch.setattr(cuda_state, "_external_stream", broken)
    half, syncs = st._half, fake.device_syncs
    with pytest.raises(RuntimeError, match="no such stream"):
        st.write(plan, 0x77)
    assert fake.device_syncs == syncs + 1 and st._half == half and 0x77 in st.streams
    assert fake.copies[-1][0] == "memcpy" and fake.copies[-1][3] == 0x77


def test_a_state_used_on_many_streams_is_retired_by_a_device_wait(cuda):
    """A state whose work went to more streams than the backend tracks (a caller making a new
    stream per step) is replaced after a device synchronize; CuPy's stream objects are kept by
    the state while it may be retired."""
    fake = cuda
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    be = w._gpu_backend
    b = build_tree_batch("2_64", page_size=16, seed=0)
    plan = w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    st = be.state_for(plan)
    assert st.streams[0] is not None               # CuPy's current stream, kept
    st.note_stream(0x1001)
    assert st.streams[0x1001] is None              # not CuPy's current stream (torch's)
    for h in range(2, st.MAX_STREAMS + 1):
        st.note_stream(0x1000 + h)
    assert st.streams_overflow and st.streams == {}    # nothing kept past the limit
    fake.busy = True
    b = build_tree_batch("1,160_700,60", page_size=16, seed=1)
    w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    assert be.state_for(w.current_plan) is not st
    assert fake.device_syncs == 1 and be._retired == []


def test_warmup_skips_tiles_past_the_gpus_shared_memory(cuda):
    """On a GPU with less shared memory per block than the tile table assumes, warmup()
    compiles only the kernels that fit (the others could never be launched there)."""
    from pat_core import cuda_compile as cc
    w = PrefixAttentionWrapper(backend="cuda", packer="pat")
    be = w._gpu_backend
    be.max_smem_optin = 99 * 1024
    keys = be.warmup_configuration(w.planner.tile_selector(128, "float16").feasible, 128,
                                   "float16", "float16")
    fwd = [k for k in keys if not k.startswith("pat_merge")]
    sizes = {v.key: v.smem_bytes for v in cc.all_fwd_variants(head_dims=(128,))}
    assert fwd and all(k in sizes and sizes[k] <= 99 * 1024 for k in fwd)
    assert len(fwd) < len(w.planner.tile_selector(128, "float16").feasible)


@pytest.mark.parametrize("max_batch,heads,mode", [
    (4, (32, 8), "auto"), (12, (32, 8), "auto"), (16, (64, 8), "auto"), (12, (32, 32), "off"),
    (40, (32, 8), "auto"), (40, (16, 4), "on"), (200, (32, 8), "auto")])
def test_a_graph_safe_wrappers_setup_is_static_plans(cuda, max_batch, heads, mode):
    """What a graph-safe wrapper decides before its first plan (planner tuning, launch set,
    fused or not) is what :func:`pat_core.static_plan.graph_safe_tuning` and
    :func:`~pat_core.static_plan.graph_safe_launch_set` say for its limits, so the simulator's
    tools price the wrapper a GPU would run."""
    import dataclasses
    from pat_core import Planner
    from pat_core.static_plan import graph_safe_launch_set, graph_safe_tuning
    hq, hk = heads
    b = build_tree_batch(f"1,{max_batch}_64,20", page_size=16)
    w = PrefixAttentionWrapper(backend="cuda", use_cuda_graph=True, max_batch_size=max_batch,
                               max_num_pages=4096)
    w._gpu_backend.graph_fused = mode
    plan = w.plan(b.block_tables, b.seq_lens, hq, hk, 128, 16)
    p = Planner("pat", w.planner.gpu)
    auto = graph_safe_tuning(p.gpu, p.tuning, w.static_limits, hq // hk, 128, "float16", mode)
    p.tuning = dataclasses.replace(p.tuning, **auto)
    assert w.planner.tuning == p.tuning
    tiles, fused = graph_safe_launch_set(p.gpu, p.tuning, w.static_limits, hq // hk, 128,
                                         "float16", mode)
    assert w._static.layout.tiles == tiles and w._static.fused == fused
    assert np.array_equal(plan.tile_configs, p.plan(b.block_tables, b.seq_lens, hq, hk, 128,
                                                    16).tile_configs)
