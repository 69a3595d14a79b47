"""The development set's pieces on the CPU: the agent trace generator (determinism, format,
the prefix-sharing model), the windowed step sampling of ``bench/trace_replay.py prepare`` and
the synthetic tree specs."""
import dataclasses
import json
from collections import defaultdict

import numpy as np
import pytest

from bench import agent_trace, devset
from bench.agent_trace import AgentTraceConfig, generate, generate_labelled
from bench.trace_replay import load_steps, prepare_steps
from pat_core.trace import ReplayConfig, load_trace, snapshot_steps
from pat_core.workloads import build_tree_batch, parse_tree_spec

BT = 512
# small: 40 sessions, short templates, every other turn after the first fans out
SMALL = AgentTraceConfig(sessions=40, seed=3, session_rate=5.0, template_tokens=(1536, 4096),
                         turns=(3, 8), branch_prob=0.5)


def _by_session(labelled):
    out = defaultdict(list)
    for s, turn, b, rec in labelled:
        out[s].append((turn, b, rec))
    return out


def _full(rec):
    """Ids of a request's full prompt blocks (the ones a replay shares)."""
    return rec["hash_ids"][:rec["input_length"] // BT]


def test_agent_trace_is_deterministic_and_well_formed():
    a, b = generate(SMALL), generate(SMALL)
    assert a == b
    other = generate(AgentTraceConfig(**{**SMALL.__dict__, "seed": 4}))
    assert other != a
    ts = [r["timestamp"] for r in a]
    assert ts == sorted(ts)
    for r in a:
        assert set(r) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert len(r["hash_ids"]) == -(-r["input_length"] // BT)
        assert SMALL.output_clip[0] <= r["output_length"] <= SMALL.output_clip[1]
        assert all(isinstance(h, int) for h in r["hash_ids"])
    assert len({len(x) for x in _by_session(generate_labelled(SMALL)).values()}) > 1


def test_agent_trace_sharing_model():
    lab = generate_labelled(SMALL)
    sessions = _by_session(lab)
    assert len(sessions) == SMALL.sessions
    n_sys = SMALL.system_tokens // BT
    tmpl_blocks = SMALL.template_tokens[0] // BT       # full blocks every template has
    owner = {}                                          # (position, id) -> sessions holding it
    lead = defaultdict(set)                             # leading template blocks -> sessions
    branched = 0
    for s, reqs in sessions.items():
        main = [(t, r) for t, b, r in reqs if b == 0]
        assert [t for t, _ in main] == list(range(len(main)))
        assert SMALL.turns[0] <= len(main) <= SMALL.turns[1]
        for (t0, r0), (t1, r1) in zip(main, main[1:]):
            # a later turn starts with the earlier turn's blocks, and its prompt holds the
            # earlier prompt, the earlier output and a new message
            assert _full(r1)[:len(_full(r0))] == _full(r0)
            assert r1["input_length"] >= r0["input_length"] + r0["output_length"] \
                + SMALL.message_clip[0]
            # ... and arrives after the earlier turn could have decoded
            assert r1["timestamp"] >= r0["timestamp"] + r0["output_length"] * SMALL.step_ms
        for t, b, r in reqs:
            if b:                               # a branch shares its turn's history
                branched += 1
                r0 = next(x for tt, bb, x in reqs if tt == t and bb == 0)
                assert r["timestamp"] == r0["timestamp"]
                prev = next(x for tt, bb, x in reqs if tt == t - 1 and bb == 0)
                hist = (prev["input_length"] + prev["output_length"]) // BT
                assert _full(r)[:hist] == _full(r0)[:hist]
            for k, h in enumerate(_full(r)):
                owner.setdefault((k, h), set()).add(s)
        lead[tuple(_full(main[0][1])[:tmpl_blocks])].add(s)
    assert branched > 0
    # every request starts with the common system blocks; the templates are few and shared
    # across sessions; blocks past the templates belong to one session each
    assert len({tuple(r["hash_ids"][:n_sys]) for *_, r in lab}) == 1
    assert 1 < len(lead) <= SMALL.templates
    assert max(len(v) for v in lead.values()) >= 2
    max_tmpl = SMALL.template_tokens[1] // BT
    assert all(len(v) == 1 for (k, _), v in owner.items() if k >= max_tmpl)
    # a partly filled last block is the request's own
    tails = [r["hash_ids"][-1] for *_, r in lab if r["input_length"] % BT]
    assert len(tails) == len(set(tails))


def test_agent_trace_replays_with_sharing(tmp_path):
    path = tmp_path / "agent.jsonl"
    assert agent_trace.main(["--out", str(path), "--sessions", "20", "--seed", "1",
                             "--template-tokens", "1536,3072", "--turns", "3,6"]) == 0
    reqs = load_trace(path, block_tokens=BT)
    assert len(reqs) == len(path.read_text().splitlines())
    steps = snapshot_steps(reqs, 4, ReplayConfig(kv_pages=16384))
    assert steps and any(s.unique_tokens < s.read_tokens for s in steps)
    with pytest.raises(SystemExit):
        agent_trace.main(["--out", str(path), "--turns", "5,2"])


def test_prepare_steps_sample_window(tmp_path):
    path = tmp_path / "agent.jsonl"
    agent_trace.write_jsonl(generate(SMALL), path)
    out = tmp_path / "steps.npz"
    cfg = dict(kv_pages=16384, max_batch=64)
    meta = prepare_steps(path, out, steps=5, sample_start_ms=4000.0, sample_end_ms=9000.0,
                         verbose=False, **cfg)
    got, steps = load_steps(out)
    assert got == json.loads(json.dumps(meta)) and len(steps) == 5
    assert all(4000.0 <= m["time_ms"] < 9000.0 for m, _, _ in steps)
    for m, table, lens in steps:
        assert table.dtype == np.int32 and lens.dtype == np.int32
        assert table.shape[0] == lens.shape[0] == m["batch"]
    # the default window picks what snapshot_steps picks
    prepare_steps(path, out, steps=3, verbose=False, **cfg)
    want = snapshot_steps(load_trace(path), 3, ReplayConfig(**cfg))
    assert [m["step"] for m, _, _ in load_steps(out)[1]] == [s.step for s in want]


def test_synthetic_specs_parse_and_span_batches():
    names = [n for n, _, _ in devset.SYNTHETIC]
    assert len(names) == len(set(names))
    specs = devset.synthetic_specs()
    batches = []
    for spec in specs:
        counts, lens = parse_tree_spec(spec)
        batches.append(counts[-1])
        b, unique, read = devset.spec_counts(spec)
        assert b == counts[-1] and 1 <= unique <= read
        # the steps file's cache stays small enough to time on one GPU
        assert -(-read // devset.PAGE_SIZE) < 200_000
    assert min(batches) == 1 and max(batches) == 512
    assert {1, 2, 4, 8, 16, 64, 128, 256, 512} <= set(batches)
    # the counts agree with the built batch for a sharing spec
    tb = build_tree_batch("1,4,16_128,256,1024")
    assert devset.spec_counts("1,4,16_128,256,1024")[2] == int(tb.seq_lens.sum())


def test_devset_prepare_synthetic_matches_list(tmp_path):
    done = devset.prepare(tmp_path, parts=["synthetic"], verbose=False)
    meta, steps = load_steps(done["synthetic"]["file"])
    assert [m["spec"] for m in meta["steps"]] == devset.synthetic_specs()
    for m, table, lens in steps:
        assert (m["batch"], m["unique_tokens"], m["read_tokens"]) == devset.spec_counts(m["spec"])
        assert table.shape[0] == lens.shape[0] == m["batch"]
    assert meta["config"]["kv_pages"] < 200_000
    rows = devset.workloads(tmp_path)            # no trace parts there: the specs only
    assert [r[0] for r in rows] == [n for n, _, _ in devset.SYNTHETIC]


@pytest.mark.parametrize("kv_dtype,q_len", [("float16", 1), ("float8_e4m3fn", 1),
                                            ("float16", 4)])
def test_sim_error_reports_the_simulators_error(tmp_path, kv_dtype, q_len):
    """``devset.py sim-error`` against measurements that are the simulator's own prediction
    scaled by 1.25 (graph) and 0.8 (eager): errors -0.2 and +0.25 on every step, when it plans
    each step as the measured run did (its KV dtype and query tokens per request)."""
    from bench.trace_replay import prepare_synthetic_steps

    from pat_core import Planner
    from sim import simulate
    specs = ["1,4,16_128,256,1024", "40_300"]      # a bucket of 40 requests: not fused
    prepare_synthetic_steps(specs, tmp_path / "synthetic.npz", page_size=16, verbose=False)
    rows = []
    for i, spec in enumerate(specs):
        b = build_tree_batch(spec, page_size=16)
        kw = dict(kv_data_type=kv_dtype)
        if q_len > 1:
            kw["qo_indptr"] = np.arange(b.batch_size + 1, dtype=np.int32) * q_len
        plan = Planner("pat", "h100").plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, **kw)
        rows.append(dict(part="synthetic", step=i, heads="32:8", method="pat",
                         graph_us=1.25 * simulate(plan, "h100").latency_us,
                         eager_us=0.8 * simulate(plan, "h100", timing="eager").latency_us))
        # a graph-safe run of both steps, one wrapper sized for the larger: its launch set
        # priced on top, the measurement again 1.25x the prediction
        if q_len == 1:
            from bench.trace_replay import graph_safe_buckets
            from pat_core.static_plan import StaticLimits
            steps = devset.load_steps(tmp_path / "synthetic.npz")[1]
            planner = Planner("pat", "h100")
            plans = [planner.plan(t, ln, 32, 8, 128, 16, kv_data_type=kv_dtype)
                     for _, t, ln in steps]
            lim = StaticLimits.make(*graph_safe_buckets(plans, steps, 16, False)[0])
            bp, ls = devset.graph_safe_bucket("h100", lim, 4, 128, kv_dtype)
            # the wrapper's tuning: the default's, with the coarse split parts kept and the
            # lean KV tile table of a bucket that is not fused
            from pat_core.static_plan import LEAN_EXCLUDED_TILES, LEAN_TILE_TABLE
            assert bp.tuning.merge_min_part == bp.tuning.min_part
            assert (bp.tuning.kv_tile_table, bp.tuning.exclude_tiles) == (
                LEAN_TILE_TABLE, LEAN_EXCLUDED_TILES)
            assert dataclasses.replace(bp.tuning, merge_min_part=None, kv_tile_table=None,
                                       exclude_tiles=None) == planner.tuning
            assert len(ls[0]) > 1 and not ls[1]
            gplan = bp.plan(b.block_tables, b.seq_lens, 32, 8, 128, 16, **kw)
            rows.append(dict(part="synthetic", step=i, heads="32:8", method="pat-graph",
                             graph_us=1.25 * simulate(gplan, "h100",
                                                      launch_set=ls).latency_us))
    res = tmp_path / "devset.json"
    methods = ["pat"] + (["pat-graph"] if q_len == 1 else [])
    res.write_text(json.dumps(dict(heads=["32:8"], head_dim=128, kv_dtype=kv_dtype, q_len=q_len,
                                   methods=methods, rows=rows)))
    out = devset.sim_error(tmp_path, res)
    g, e = out["synthetic 32:8 graph"], out["synthetic 32:8 eager"]
    assert g["steps"] == e["steps"] == 2
    assert g["median_abs"] == pytest.approx(0.2, abs=1e-3) and g["mean"] == pytest.approx(-0.2,
                                                                                        abs=1e-3)
    assert e["max_abs"] == pytest.approx(0.25, abs=1e-3)
    if q_len == 1:
        gs = out["synthetic 32:8 graph pat-graph"]
        assert gs["steps"] == 2
        assert gs["median_abs"] == pytest.approx(0.2, abs=1e-3)
        assert "synthetic 32:8 eager pat-graph" not in out        # no eager time measured
    else:
        assert not any(k.endswith("pat-graph") for k in out)


@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_devset_time_takes_every_kernel_head_dim(tmp_path, monkeypatch, head_dim):
    """``devset.py time --head-dim`` accepts each head_dim the CUDA kernels exist for (the
    timing itself needs a GPU: stood in for here) and refuses others by name."""
    got = {}
    monkeypatch.setattr(devset, "time_all", lambda *a, **kw: got.update(kw))
    assert devset.main(["time", "--out", str(tmp_path), "--head-dim", str(head_dim)]) == 0
    assert got["head_dim"] == head_dim
    with pytest.raises(SystemExit):
        devset.main(["time", "--out", str(tmp_path), "--head-dim", "96"])
