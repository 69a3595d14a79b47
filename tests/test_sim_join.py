"""The join of concurrent launches (``graph_join_ns``): the kernel that waits for two or more
forked launch groups (the merge) starts that much later in graph timing; a plan of one forward
launch, chained forward launches (one stream, no fork), and eager timing, do not pay it (CPU
only)."""
from __future__ import annotations

import numpy as np
import pytest

from sim.constants import default_constants, load_constants
from sim.methods import load_batch, make_plan
from sim.model import predict, prepare, run_timeline
from sim.timeline import run_engine

DEEP = "1,2,4,8,16,32_32,32,32,32,32,32"     # node: several forward groups; query: one


def _wl(method, fwd_chain="fork"):
    return prepare(make_plan(load_batch(DEEP, 16), method, 32, 8, 128), fwd_chain=fwd_chain)


def test_merge_after_forked_groups_waits_for_the_join():
    many, one, chained = _wl("node"), _wl("query"), _wl("node", "pdl")
    assert sum(ln.kind == "forward" for ln in many.launches) >= 3
    assert sum(ln.kind == "forward" for ln in one.launches) == 1
    c = load_constants("h100").with_values(graph_join_ns=0.0)
    j = 3000.0
    cj = c.with_values(graph_join_ns=j)
    assert predict(many, cj) == pytest.approx(predict(many, c) + j)
    tl0, tl1 = run_timeline(many, c), run_timeline(many, cj)
    assert tl1.phase_start[1] - tl1.phase_end[0] == pytest.approx(
        tl0.phase_start[1] - tl0.phase_end[0] + j)
    assert predict(one, cj) == predict(one, c)
    assert predict(chained, cj) == predict(chained, c)
    assert predict(many, cj, "eager") == predict(many, c, "eager")
    assert cj.join_cost("eager") == 0.0 and cj.join_cost("graph") == j


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
