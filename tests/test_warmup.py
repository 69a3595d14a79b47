"""Warm-up before the first decode step: after ``PrefixAttentionWrapper.warmup`` a serving loop
loads no compiled code on the way (every Numba function it calls already has the signatures
it needs), the planner's own state is untouched, and on the CUDA backend's host side (the fake
device) the kernels of the configuration are compiled and nothing is put on the device."""
from __future__ import annotations

import importlib
import pkgutil

import numpy as np
import pytest

import pat_core
from pat_core import PrefixAttentionWrapper
from pat_core.inputs import BlockTable
from pat_core.planner import Planner
from pat_core.workloads import ServingLoop, build_tree_batch


def _dispatchers() -> dict:
    """Every Numba dispatcher defined in pat_core, by qualified name."""
    from numba.core.registry import CPUDispatcher
    out = {}
    for info in pkgutil.iter_modules(pat_core.__path__):
        try:
            mod = importlib.import_module(f"pat_core.{info.name}")
        except ImportError:       # an optional dependency (cupy, torch) missing
            continue
        for name, obj in vars(mod).items():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == mod.__name__:
                out[f"{mod.__name__}.{name}"] = obj
    return out


def _serve(w, dtype, csr: bool, steps: int = 60):
    """A serving loop's steps planned by ``w``, the table handed over as an engine's persistent
    buffer gives it: a view of the live rows and columns (not contiguous), of ``dtype``."""
    loop = ServingLoop(64, 3, 512, (16, 400), 16, seed=7, order="swap")
    for _ in range(steps):
        table, lens = loop.step()
        if np.dtype(dtype) != table.dtype:       # the same view of a buffer of this dtype
            buf = np.zeros((table.shape[0] + 3, table.shape[1] + 5), dtype=dtype)
            buf[:table.shape[0], :table.shape[1]] = table
            table = buf[:table.shape[0], :table.shape[1]]
        if csr:
            csr_arrays = BlockTable.from_padded(table, lens, 16).to_csr()
            w.plan_csr(*(a.astype(dtype) for a in csr_arrays), 32, 8, 128, 16)
        else:
            w.plan(table, lens, 32, 8, 128, 16)


def _fake_cuda(monkeypatch):
    import sys
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from fake_cuda import fake_backend
    return fake_backend(monkeypatch)[1]


@pytest.mark.parametrize("backend", ("cpu", "cuda"))
def test_a_serving_loop_after_warmup_loads_no_compiled_code(backend, monkeypatch):
    """Whatever the table's integer type and form (padded or CSR) and the rows' order, no
    planning step after warmup() needs a Numba signature it did not load (on the CUDA
    backend, the fake device: the plan's checks and pack for the device too)."""
    if backend == "cuda":
        _fake_cuda(monkeypatch)
    w = PrefixAttentionWrapper(backend=backend)
    w.warmup(32, 8, 128, 16, kernels=False)
    disp = _dispatchers()
    assert len(disp) > 10
    before = {k: len(d.signatures) for k, d in disp.items()}
    for dtype in (np.int32, np.int64):
        for csr in (False, True):
            _serve(w, dtype, csr)
    grew = {k: (before[k], len(d.signatures)) for k, d in disp.items()
            if len(d.signatures) != before[k]}
    assert grew == {}


def test_warmup_leaves_the_planners_state_alone():
    """A planner that has planned a step still takes the step's incremental path after a
    warmup (its own state is kept), and a fresh one plans the same arrays with or without it."""
    b = build_tree_batch("1,4,16_128,256,64", page_size=16, seed=3)
    p = Planner("pat", "h100")
    first = p.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    plans = p.warmup(32, 8, 128, 16)
    assert len(plans) == len(Planner.WARMUP_PATHS)     # the last plan of each path
    again = p.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert p.last_path == "reuse" and again is first
    fresh = Planner("pat", "h100").plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    for name in ("cta_req_indptr", "cta_req", "cta_kv_start", "cta_kv_len", "cta_pages",
                 "cta_tile", "tile_configs"):
        assert np.array_equal(getattr(fresh, name), getattr(first, name)), name


def test_cuda_warmup_compiles_the_configuration_and_uses_no_device(monkeypatch):
    """On the CUDA backend (fake device): the forward kernels of every tile the planner can
    pick for the configuration and the merges are compiled, no device state is made, nothing
    is launched or copied, and the next plan is the first one the backend sees."""
    from pat_core import cuda_compile as cc
    fake = _fake_cuda(monkeypatch)
    w = PrefixAttentionWrapper(backend="cuda")
    wb = w._gpu_backend
    w.warmup(32, 8, 128, 16, kernels=True)
    sel = w.planner.tile_selector(128, "float16")
    want = {cc.FwdVariant.make(m, n, 128, "float16", arch=wb.arch).key for m, n in sel.feasible}
    want |= {cc.MergeVariant(128, "float16", cc.MERGE_WARPS, nh).key for nh in cc.MERGE_HEADS}
    have = {k for (_, k, _) in type(wb)._functions}
    assert want <= have
    assert wb._states == {} and fake.launches == [] and fake.device_syncs == 0
    b = build_tree_batch("8_300", page_size=16, seed=0)
    w.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert w.planner.last_path == "full" and len(wb._states) == 1


def test_warmup_refuses_what_plan_refuses():
    w = PrefixAttentionWrapper(backend="cpu")
    with pytest.raises(ValueError, match="page_size"):
        w.warmup(32, 8, 128, 0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        w.warmup(32, 7, 128, 16)
    with pytest.raises(ValueError, match="mixed-precision"):
        w.warmup(32, 8, 128, 16, kv_data_type="float16", q_data_type="bfloat16")


@pytest.mark.parametrize("page_size", (1, 16, 64))
def test_warmup_takes_every_path_at_any_page_size(page_size):
    """The warm-up's serving loop reaches every planning path (it raises otherwise)."""
    plans = Planner("pat", "h100").warmup(8, 2, 64, page_size, table_dtypes=("int32",))
    assert len(plans) == len(Planner.WARMUP_PATHS)
