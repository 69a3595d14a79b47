"""Phases and their gaps on the one launch path: the forward launches of an sm_90 GPU are one
chained phase, the merge opens one gap after it; on a GPU without programmatic dependent launch
each forward launch waits for the one before it.  No launch forks, so the measured join cost
(``graph_join_ns``) prices nothing (CPU only)."""
from __future__ import annotations

import numpy as np
import pytest

from sim.constants import default_constants, load_constants
from sim.methods import load_batch, make_plan
from sim.model import predict, prepare, run_timeline
from sim.timeline import run_engine

DEEP = "1,2,4,8,16,32_32,32,32,32,32,32"     # node: several forward launches; query: one


def _plan(method, gpu="h100"):
    return make_plan(load_batch(DEEP, 16), method, 32, 8, 128, gpu=gpu)


def test_chained_forward_then_one_gap_before_the_merge():
    many, one = prepare(_plan("node")), prepare(_plan("query"))
    fwd = [ln for ln in many.launches if ln.kind == "forward"]
    assert len(fwd) >= 2 and {ln.phase for ln in fwd} == {0}
    assert sum(ln.kind == "forward" for ln in one.launches) == 1
    c = load_constants("h100").with_values(graph_join_ns=0.0)
    cj = c.with_values(graph_join_ns=3000.0)
    for wl in (many, one):
        assert predict(wl, cj) == predict(wl, c)
        assert predict(wl, cj, "eager") == predict(wl, c, "eager")
    tl = run_timeline(many, c)
    assert tl.phase_start[1] - tl.phase_end[0] == pytest.approx(c.graph_gap_ns)


def test_without_dependent_launch_the_forward_launches_run_one_after_another():
    wl = prepare(_plan("node", "a100"))
    fwd = [ln for ln in wl.launches if ln.kind == "forward"]
    assert len(fwd) >= 2
    assert [ln.phase for ln in fwd] == list(range(len(fwd))) and all(ln.gate == -1 for ln in fwd)
    tl = run_timeline(wl, load_constants("a100"))
    for a, b in zip(fwd, fwd[1:]):
        assert tl.block_start[b.begin:b.end].min() >= tl.block_end[a.begin:a.end].max()


def test_files_without_a_join_predict_as_before():
    assert default_constants("h100").graph_join_ns == 0.0


def test_engine_takes_one_gap_per_phase():
    # one block per phase, 1000 ns of latency each, no bytes: phase p starts gap[p] after p - 1
    cap = np.array([1 << 20, 1 << 16, 2048, 32])
    need = np.array([[0, 32, 32, 1]])
    args = (1, cap, need, np.zeros(3, np.int32), np.full(3, 1000.0), np.zeros(3), np.zeros(3),
            np.arange(4), np.zeros(3), np.arange(3, dtype=np.int32), 3)
    *_, ps, pe = run_engine(*args, np.array([0.0, 200.0, 500.0]), 10.0, 10.0)
    assert list(ps) == pytest.approx([0.0, 1200.0, 2700.0]) and pe[-1] == pytest.approx(3700.0)
    *_, ps, pe = run_engine(*args, 100.0, 10.0, 10.0)
    assert list(ps) == pytest.approx([0.0, 1100.0, 2200.0])
    with pytest.raises(ValueError, match="gap_ns"):
        run_engine(*args, -1.0, 10.0, 10.0)
