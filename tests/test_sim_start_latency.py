"""The fixed start latency of a step (``start_ns`` eager, ``graph_start_ns`` graph) is paid once
per step, not once per launch (CPU only)."""
from __future__ import annotations

import pytest

import sim.model
from sim.constants import default_constants, load_constants
from sim.methods import load_batch, make_plan
from sim.model import predict, prepare

# A deep tree of 32-token nodes: the node packer gives it four forward launches (128, 64,
# 32 and 16 rows at heads 32:8), the query packer one.
DEEP = "1,2,4,8,16,32_32,32,32,32,32,32"


def _wl(method):
    return prepare(make_plan(load_batch(DEEP, 16), method, 32, 8, 128))


def _launches(wl):
    return sum(ln.kind == "forward" for ln in wl.launches)


def test_start_latency_shifts_every_plan_by_itself_once():
    one, many = _wl("query"), _wl("node")
    assert _launches(one) == 1 and _launches(many) >= 3
    c = load_constants("h100").with_values(graph_start_ns=0.0, graph_launch_ns=1500.0)
    s = 9000.0
    for wl in (one, many):
        base = predict(wl, c)
        # the timeline is shift invariant: the whole step moves by the start latency
        assert predict(wl, c.with_values(graph_start_ns=s)) == pytest.approx(base + s)
        tl = sim.model.run_timeline(wl, c.with_values(graph_start_ns=s))
        assert len(tl.launches) >= 2 or wl is one
        for k, ln in enumerate(tl.launches):
            assert ln.issue_ns == pytest.approx(s + 1500.0 * (k + 1))


def test_start_latency_is_not_a_per_launch_cost():
    """Folding the start latency into the launch interval (the model before the start constants)
    charges it once per launch: a plan of four small launches then pays three more times
    than a plan of one."""
    one, many = _wl("query"), _wl("node")
    s, step = 9000.0, 1500.0
    apart = load_constants("h100").with_values(graph_start_ns=s, graph_launch_ns=step)
    folded = apart.with_values(graph_start_ns=0.0, graph_launch_ns=step + s)
    extra_one = predict(one, folded) - predict(one, apart)
    extra_many = predict(many, folded) - predict(many, apart)
    assert extra_one < 0.5 * s
    assert extra_many > extra_one + 2 * s


def test_each_timing_mode_reads_its_own_start():
    wl = _wl("node")
    c = load_constants("h100").with_values(start_ns=0.0, graph_start_ns=0.0)
    eager, graph = predict(wl, c, "eager"), predict(wl, c, "graph")
    assert predict(wl, c.with_values(start_ns=50_000.0), "graph") == graph
    assert predict(wl, c.with_values(graph_start_ns=50_000.0), "eager") == eager
    assert predict(wl, c.with_values(start_ns=4000.0), "eager") == pytest.approx(eager + 4000.0)
    assert c.start_cost("eager") == 0.0 and c.with_values(graph_start_ns=7.0).start_cost() == 7.0


def test_files_without_start_constants_predict_as_before():
    # 0 by default: a constants file written before the start constants keeps its predictions
    d = default_constants("h100")
    assert d.start_ns == 0.0 and d.graph_start_ns == 0.0
