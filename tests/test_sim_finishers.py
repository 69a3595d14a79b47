"""How the simulator launches a finisher phase (pat_core.fold) behind a first phase, as the CUDA
backend does: one launch dependent on the first phase's one launch (placed once every
first-phase block has been, each ending no earlier than the first phase) on sm_90 GPUs when each
phase is one tile group; with more launches, behind the chained first phase, each launch gated
on the one before it; with forked launches, after the first phase has ended.  And the engine's launch gate
that the dependent launch uses (CPU only)."""
from __future__ import annotations

import numpy as np
import pytest

from pat_core import Planner, Tuning
from pat_core.launch import (chain_order, finisher_chain, finisher_launch_dependent,
                             group_spans)
from pat_core.workloads import build_tree_batch
from sim.model import prepare, run_timeline
from sim.constants import load_constants
from sim.timeline import run_engine

FOLD = Tuning(finish_share=1.0)


def _plan(spec, hq, hk, gpu="h100", tuning=FOLD):
    b = build_tree_batch(spec, page_size=16, seed=0)
    return Planner("pat", gpu, tuning=tuning).plan(b.block_tables, b.seq_lens, hq, hk, 128, 16)


def test_engine_gate_holds_a_launch_until_its_gate_is_placed():
    # one SM with room for one block at a time; launch 0: two blocks of 1000 ns, launch 1: one
    # block of 10 ns that arrives first.  Ungated it runs first; gated on launch 0 it waits
    # until launch 0's second block has been placed.
    cap = np.array([1 << 20, 1 << 16, 2048, 1])
    need = np.array([[0, 32, 32, 1]])
    lat = np.array([1000.0, 1000.0, 10.0])
    args = (1, cap, need, np.zeros(3, np.int32), lat, np.zeros(3), np.zeros(3),
            np.array([0, 2, 3]), np.array([5.0, 0.0]), np.zeros(2, np.int32), 1, 0.0, 10.0, 10.0)
    _, _, start, end, _, pe = run_engine(*args)
    assert start[2] == 0.0 and start[0] == pytest.approx(10.0)
    _, _, start, end, _, pe = run_engine(*args, stream_gate=np.array([-1, 0]))
    assert start[0] == pytest.approx(5.0) and start[1] == pytest.approx(1005.0)
    assert start[2] == pytest.approx(2005.0) and pe[0] == pytest.approx(2015.0)
    for bad in (np.array([-1, 1]), np.array([1, -1]), np.array([0]), np.array([-1, -2])):
        with pytest.raises(ValueError, match="stream_gate"):
            run_engine(*args, stream_gate=bad)


def test_engine_gated_blocks_end_with_their_gate_holding_their_slot():
    # one SM with two slots; launch 0: one block of 1000 ns; launch 1, gated on it: two blocks
    # of 10 ns.  The first gated block is done at 10 ns but waits, holding its slot, until
    # launch 0 ends at 1000 ns, so the second one starts only then.
    cap = np.array([1 << 20, 1 << 16, 2048, 2])
    need = np.array([[0, 32, 32, 1]])
    args = (1, cap, need, np.zeros(3, np.int32), np.array([1000.0, 10.0, 10.0]), np.zeros(3),
            np.zeros(3), np.array([0, 1, 3]), np.zeros(2), np.zeros(2, np.int32), 1, 0.0, 10.0,
            10.0)
    _, _, start, end, _, pe = run_engine(*args)
    assert list(end) == pytest.approx([1000.0, 10.0, 20.0])
    _, _, start, end, _, pe = run_engine(*args, stream_gate=np.array([-1, 0]))
    assert list(start) == pytest.approx([0.0, 0.0, 1000.0])
    assert list(end) == pytest.approx([1000.0, 1000.0, 1010.0]) and pe[0] == pytest.approx(1010.0)


def test_dependent_finisher_launch_is_gated_on_the_first_phase():
    plan = _plan("1,1024_1024,16", 32, 8)
    assert plan.finish_from == 1 and plan.num_groups == 2
    assert finisher_launch_dependent(plan, plan.gpu)
    wl = prepare(plan)
    fwd = [ln for ln in wl.launches if ln.kind == "forward"]
    assert [ln.phase for ln in fwd] == [0, 0] and [ln.gate for ln in fwd] == [-1, 0]
    tl = run_timeline(wl, load_constants("h100"))
    first = tl.block_launch == 0
    fin = tl.block_launch == 1
    assert np.nanmin(tl.block_start[fin]) >= np.nanmax(tl.block_start[first]) - 1e-6
    assert np.nanmin(tl.block_end[fin]) >= np.nanmax(tl.block_end[first]) - 1e-6
    # one stream (the gated launch follows its gate): the fold's merge pass pays no join
    c = load_constants("h100")
    gap = c.launch_costs("graph")[1]
    assert tl.phase_start[1] - tl.phase_end[0] == pytest.approx(gap, abs=1.0)


def test_finishers_behind_a_forked_first_phase_start_after_it():
    plan = _plan("1,8,64,512_128,512,64,32", 32, 8)
    assert plan.finish_from >= 2            # a first phase of two tile groups
    assert not finisher_launch_dependent(plan, plan.gpu, "fork")
    assert finisher_launch_dependent(plan, plan.gpu)    # chained by default (next test)
    wl = prepare(plan, fwd_chain="fork")
    fwd = [(i, ln) for i, ln in enumerate(wl.launches) if ln.kind == "forward"]
    for g, (i, ln) in enumerate(fwd):
        assert ln.phase == (1 if g >= plan.finish_from else 0) and ln.gate == -1
    assert all(ln.phase == 2 for ln in wl.launches if ln.kind == "merge")
    tl = run_timeline(wl, load_constants("h100"))
    first = np.isin(tl.block_launch, [i for i, ln in fwd[:plan.finish_from]])
    fin = np.isin(tl.block_launch, [i for i, ln in fwd[plan.finish_from:]])
    assert np.nanmin(tl.block_start[fin]) > np.nanmax(tl.block_end[first])


def test_finishers_behind_a_chained_first_phase():
    """Several first-phase groups (pat_core.launch.finisher_chain): the first phase chained
    longest first, without holding; each finisher launch gated on the launch before it and
    holding, so no finisher block starts before the last first-phase block has been placed or
    ends before every first-phase block has ended; one phase, then the fold's pass."""
    plan = _plan("1,8,64,512_128,512,64,32", 32, 8)
    ff = plan.finish_from
    assert ff >= 2 and finisher_chain(plan, plan.gpu) and not finisher_chain(plan, plan.gpu,
                                                                              "fork")
    wl = prepare(plan)
    fwd = [(i, ln) for i, ln in enumerate(wl.launches) if ln.kind == "forward"]
    groups = list(plan.groups())
    want = [groups[i][1] for i in chain_order(group_spans(plan)[:ff])] + [g[1] for g in groups[ff:]]
    assert [tuple(int(x) for x in ln.name.split()[1].split("x")) for _, ln in fwd] == want
    assert [ln.gate for _, ln in fwd] == [-1] + list(range(len(fwd) - 1))
    assert [ln.hold for _, ln in fwd] == [False] * ff + [True] * (len(fwd) - ff)
    assert all(ln.phase == 0 for _, ln in fwd)
    assert all(ln.phase == 1 for ln in wl.launches if ln.kind == "merge")
    tl = run_timeline(wl, load_constants("h100"))
    first = np.isin(tl.block_launch, [i for i, _ in fwd[:ff]])
    last_first = tl.block_launch == fwd[ff - 1][0]
    fin = np.isin(tl.block_launch, [i for i, _ in fwd[ff:]])
    assert np.nanmin(tl.block_start[fin]) >= np.nanmax(tl.block_start[last_first]) - 1e-6
    assert np.nanmin(tl.block_end[fin]) >= np.nanmax(tl.block_end[first]) - 1e-6
    # the finishers' KV walks overlap the first phase: the step beats the forked layout
    c = load_constants("h100")
    forked = run_timeline(prepare(plan, fwd_chain="fork"), c).makespan
    assert tl.makespan < forked


def test_no_dependent_launch_before_sm90():
    plan = _plan("1,1024_1024,16", 32, 8, gpu="a100")
    assert plan.finish_from == 1 and plan.num_groups == 2
    assert not finisher_launch_dependent(plan, plan.gpu)
    fwd = [ln for ln in prepare(plan).launches if ln.kind == "forward"]
    assert [ln.phase for ln in fwd] == [0, 1]


def test_plans_without_a_first_phase_keep_one_phase():
    plan = _plan("128_2048", 32, 8, tuning=Tuning(finish_share=0.0))
    assert plan.finish_from == 0
    wl = prepare(plan)
    assert all(ln.phase == 0 and ln.gate == -1 for ln in wl.launches)
