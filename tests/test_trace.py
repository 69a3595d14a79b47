"""Trace replay (pat_core.trace) and its report (python -m sim trace) on small synthetic traces
in the Mooncake format."""
import json

import numpy as np
import pytest

from pat_core.trace import (ReplayConfig, ReplayStats, load_trace, replay, snapshot_steps)

BT, PS = 32, 8                     # tokens per hash block, tokens per page: 4 pages per block


def _synthetic(n=24, seed=0):
    """Requests with shared leading hash ids (a common system block, a few conversations that
    grow turn by turn), some ending inside a block, some exactly on a block boundary."""
    rng = np.random.default_rng(seed)
    lines, nxt_id = [], 1000
    convs = [[0, 1, 2], [0, 3], [0, 4, 5, 6], [7]]
    t = 0
    for i in range(n):
        c = convs[int(rng.integers(len(convs)))]
        full = int(rng.integers(1, len(c) + 1))
        ids = list(c[:full])
        extra = int(rng.integers(0, 3))
        ids += list(range(nxt_id, nxt_id + extra))
        nxt_id += extra
        tail = int(rng.integers(0, BT))              # 0: the prompt ends on a block boundary
        input_length = (len(ids) - (1 if tail else 0)) * BT + tail
        if tail == 0 and not ids:
            continue
        lines.append({"timestamp": t, "input_length": input_length,
                      "output_length": int(rng.integers(1, 40)), "hash_ids": ids})
        t += int(rng.integers(0, 60))
    return lines


def _write(path, objs):
    with open(path, "w") as fh:
        for o in objs:
            fh.write((o if isinstance(o, str) else json.dumps(o)) + "\n")
    return str(path)


@pytest.fixture
def trace_file(tmp_path):
    return _write(tmp_path / "t.jsonl", _synthetic())


def _page_keys(req, j):
    """What page ``j`` of ``req`` holds: a shared prompt block (by hash-id prefix) or the
    request's own tokens."""
    nfull = req.input_length // BT
    if j < nfull * (BT // PS):
        b = j // (BT // PS)
        return ("shared", req.hash_ids[:b + 1], j % (BT // PS))
    return ("private", req.rid, j)


@pytest.mark.parametrize("kv_pages,max_batch", [(64, 3), (400, 8), (33, 16)])
def test_replay_invariants(trace_file, kv_pages, max_batch):
    reqs = load_trace(trace_file, block_tokens=BT)
    cfg = ReplayConfig(page_size=PS, block_tokens=BT, max_batch=max_batch, kv_pages=kv_pages,
                       step_ms=10.0)
    st = ReplayStats()
    seen_steps = {r.rid: [] for r in reqs}
    first_time = {}
    page_history = {}                     # page id -> set of contents over the whole replay
    order = []
    shared_seen = False
    for s in replay(reqs, cfg, stats=st):
        B = s.batch_size
        assert 1 <= B <= max_batch
        assert s.used_pages <= s.reserved_pages <= kv_pages
        tab = s.block_table
        assert tab.shape[0] == B and tab.dtype == np.int32
        contents = {}
        uniq = set()
        for i in range(B):
            req = reqs[int(s.request_ids[i])]
            k = int(s.decode_index[i])
            seen_steps[req.rid].append(k)
            assert int(s.seq_lens[i]) == req.input_length + k
            assert s.time_ms >= req.arrival_ms
            if req.rid not in first_time:
                first_time[req.rid] = s.time_ms
                order.append(req.rid)
            npages = -(-int(s.seq_lens[i]) // PS)
            assert np.all(tab[i, npages:] == -1) and np.all(tab[i, :npages] >= 0)
            assert np.all(tab[i, :npages] < kv_pages)
            for j in range(npages):
                page = int(tab[i, j])
                key = _page_keys(req, j)
                # a page holds one content at a time: shared only when hash ids match
                assert contents.setdefault(page, key) == key, (page, key, contents[page])
                page_history.setdefault(page, set()).add(key)
                ntok = min(PS, int(s.seq_lens[i]) - j * PS)
                uniq.update((page, t) for t in range(ntok))
        # some page appears in more than one row (a shared prompt block)
        shared_seen |= len(contents) < sum(-(-int(x) // PS) for x in s.seq_lens)
        # every resident page is in the table; the counters agree with a brute-force count
        assert len(contents) == s.used_pages
        assert s.unique_tokens == len(uniq)
        assert s.read_tokens == int(s.seq_lens.sum())
    fits = [r for r in reqs
            if (r.input_length // BT) * (BT // PS)
            + -(-(r.input_length + r.output_length - (r.input_length // BT) * BT) // PS)
            <= kv_pages]
    assert len(st.rejected) == len(reqs) - len(fits)
    for r in fits:                         # exactly output_length steps, 1, 2, ..., in order
        assert seen_steps[r.rid] == list(range(1, r.output_length + 1)), r.rid
    for rid in st.rejected:
        assert seen_steps[rid] == []
    assert order == sorted(order)          # first come, first served
    assert st.finished == st.admitted == len(fits)
    assert any(len(v) > 1 for v in page_history.values()), "freed pages are reused"
    assert shared_seen, "some step shares prompt pages"


def test_shared_prefix_pages_and_reuse(tmp_path):
    objs = [
        {"timestamp": 0, "input_length": 2 * BT + 5, "output_length": 3, "hash_ids": [1, 2, 9]},
        {"timestamp": 0, "input_length": 2 * BT, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 2 * BT + 1, "output_length": 2, "hash_ids": [1, 3, 4]},
        {"timestamp": 0, "input_length": BT, "output_length": 1, "hash_ids": [2]},
        {"timestamp": 500, "input_length": 5, "output_length": 1, "hash_ids": [8]},
    ]
    reqs = load_trace(_write(tmp_path / "s.jsonl", objs), block_tokens=BT)
    cfg = ReplayConfig(page_size=PS, block_tokens=BT, kv_pages=100, step_ms=10.0)
    steps = list(replay(reqs, cfg))
    s0 = steps[0]
    t = s0.block_table
    ppb = BT // PS
    assert np.array_equal(t[0, :2 * ppb], t[1, :2 * ppb])        # hash ids 1, 2 shared
    assert np.array_equal(t[0, :ppb], t[2, :ppb])                # only hash id 1 shared
    assert not set(t[2, ppb:2 * ppb]) & set(t[0, ppb:2 * ppb])   # 3 != 2: not shared
    assert not set(t[3, :ppb]) & set(t[0, :2 * ppb])             # id 2 at position 0 != 1, 2
    # 4 distinct blocks (1, 1>2, 1>3, 2) + privates; unique tokens count shared blocks once
    assert s0.unique_tokens == s0.read_tokens - 2 * BT - BT
    # the request arriving at 500 ms runs alone, after the others left and freed their pages
    last = steps[-1]
    assert last.batch_size == 1 and reqs[int(last.request_ids[0])].arrival_ms == 500
    assert last.time_ms == 500 and last.used_pages == 1
    assert int(last.block_table[0, 0]) in set(t[t >= 0].tolist())  # a freed page reused


def test_admission_waits_for_capacity(tmp_path):
    objs = [{"timestamp": 0, "input_length": 4 * PS, "output_length": 4 * PS,
             "hash_ids": [i]} for i in range(3)]
    reqs = load_trace(_write(tmp_path / "c.jsonl", objs), block_tokens=BT)
    cfg = ReplayConfig(page_size=PS, block_tokens=BT, kv_pages=17, step_ms=1.0)
    batches = [s.batch_size for s in replay(reqs, cfg)]
    assert max(batches) == 2 and len(batches) == 2 * 4 * PS   # two fit (8 pages each), then one
    tiny = ReplayConfig(page_size=PS, block_tokens=BT, kv_pages=7, step_ms=1.0)
    st = ReplayStats()
    assert list(replay(reqs, tiny, stats=st)) == [] and len(st.rejected) == 3


def test_load_trace_errors_name_the_line(tmp_path):
    good = {"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1, 2]}
    cases = [
        ("{not json", "line 2: not valid JSON"),
        ({"timestamp": 1, "input_length": 40, "hash_ids": [1, 2]}, "line 2: missing field"),
        (dict(good, hash_ids=[1]), "line 2: input_length 40 needs 2 hash_ids"),
        (dict(good, output_length=0), "line 2: output_length must be an integer >= 1"),
        (dict(good, timestamp=-5), "line 2: timestamp must be a number >= 0"),
        (dict(good, hash_ids=["a", "b"]), "line 2: hash_ids must be a list of integers"),
        ([1, 2], "line 2: expected a JSON object"),
    ]
    for bad, msg in cases:
        path = _write(tmp_path / "bad.jsonl", [good, bad, good])
        with pytest.raises(ValueError, match=msg):
            load_trace(path, block_tokens=BT)
    with pytest.raises(ValueError, match="sample must lie in"):
        load_trace(_write(tmp_path / "ok.jsonl", [good]), sample=0, block_tokens=BT)
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        ReplayConfig(page_size=24, block_tokens=BT)


def test_window_sample_and_snapshots(trace_file):
    everything = load_trace(trace_file, block_tokens=BT)
    win = load_trace(trace_file, start_ms=100, end_ms=400, block_tokens=BT)
    assert win and all(100 <= r.arrival_ms < 400 for r in win)
    assert len(win) == sum(100 <= r.arrival_ms < 400 for r in everything)
    half = load_trace(trace_file, sample=0.5, seed=1, block_tokens=BT)
    assert 0 < len(half) < len(everything)
    assert half == load_trace(trace_file, sample=0.5, seed=1, block_tokens=BT)
    cfg = ReplayConfig(page_size=PS, block_tokens=BT, max_batch=4, kv_pages=200)
    full = list(replay(everything, cfg))
    snaps = snapshot_steps(everything, 5, cfg)
    assert [s.step for s in snaps][0] == 0 and snaps[-1].step == len(full) - 1
    assert len(snaps) == 5
    for s in snaps:
        ref = full[s.step]
        assert np.array_equal(s.block_table, ref.block_table)
        assert np.array_equal(s.seq_lens, ref.seq_lens)
    assert len(list(replay(everything, cfg, max_steps=7))) == 7


def test_sim_trace_cli(tmp_path):
    from sim.cli import main
    # heavy sharing: 12 requests on one long prompt
    objs = [{"timestamp": 10 * i, "input_length": 8 * BT + 3, "output_length": 20,
             "hash_ids": list(range(8)) + [100 + i]} for i in range(12)]
    path = _write(tmp_path / "shared.jsonl", objs)
    out = str(tmp_path / "res")
    rc = main(["trace", "--trace", path, "--out", out, "--block-tokens", str(BT),
               "--page-size", str(PS), "--every", "3", "--kv-pages", "1000", "--step-ms", "5",
               "--methods", "pat,query", "--no-progress"])
    assert rc == 0
    res = json.load(open(out + ".json"))
    rp = res["replay"]
    assert rp["finished"] == 12 and rp["rejected"] == 0
    assert rp["evaluated_steps"] == -(-rp["steps"] // 3) == len(res["series"]["step"])
    assert all(s % 3 == 0 for s in res["series"]["step"])
    for m in ("pat", "query"):
        assert len(res["series"]["predicted_us"][m]) == rp["evaluated_steps"]
        assert len(res["series"]["plan_ms"][m]) == rp["evaluated_steps"]
        assert sum(res["summary"][m]["plan_paths"].values()) == rp["evaluated_steps"]
    q = np.asarray(res["series"]["predicted_us"]["query"])
    p = np.asarray(res["series"]["predicted_us"]["pat"])
    assert res["summary"]["pat"]["speedup_vs_query"]["geomean"] == pytest.approx(
        float(np.exp(np.log(q / p).mean())), rel=1e-6)
    assert res["summary"]["pat"]["total_ms_estimated"] == pytest.approx(
        p.mean() * rp["steps"] / 1e3, rel=1e-6)
    assert min(res["series"]["unique_tokens"][i] / res["series"]["read_tokens"][i]
               for i in range(rp["evaluated_steps"])) < 0.5
    assert (tmp_path / "res.png").stat().st_size > 0
    # a malformed line: named error, exit code 2
    _write(tmp_path / "bad.jsonl", [objs[0], "{oops"])
    assert main(["trace", "--trace", str(tmp_path / "bad.jsonl"), "--out", out,
                 "--block-tokens", str(BT), "--page-size", str(PS), "--no-progress"]) == 2


def test_gpu_trace_replay_prepare_and_summary(trace_file, tmp_path):
    """bench/trace_replay.py's CPU stage stores the sampled steps the replay makes, and its
    summary computes the speed-ups it reports (the GPU stage is run on a device)."""
    from bench import trace_replay
    out = tmp_path / "steps.npz"
    assert trace_replay.main(["prepare", "--trace", trace_file, "--steps", "5", "--out",
                              str(out), "--page-size", str(PS), "--block-tokens", str(BT),
                              "--max-batch", "8", "--kv-pages", "512"]) == 0
    meta, steps = trace_replay.load_steps(out)
    want = snapshot_steps(load_trace(trace_file, block_tokens=BT), 5,
                          ReplayConfig(page_size=PS, block_tokens=BT, max_batch=8, kv_pages=512))
    assert [m["step"] for m, _, _ in steps] == [s.step for s in want]
    for (m, table, lens), s in zip(steps, want):
        assert np.array_equal(table, s.block_table) and np.array_equal(lens, s.seq_lens)
        assert m["unique_tokens"] == s.unique_tokens and m["batch"] == s.batch_size
    rows = [dict(step=0, heads="32:8", method="pat", graph_us=10.0, shares=True),
            dict(step=0, heads="32:8", method="fi-decode", graph_us=20.0, shares=True),
            dict(step=0, heads="32:8", method="query", graph_us=15.0, shares=True),
            dict(step=1, heads="32:8", method="pat", graph_us=10.0, shares=False),
            dict(step=1, heads="32:8", method="fi-decode", graph_us=9.0, shares=False)]
    s = trace_replay.summarise(rows)["32:8"]
    assert s["sharing_speedup_geomean"] == 2.0 and s["no_sharing_speedup_min"] == 0.9
    assert s["pat_total_us"] == 20.0 and s["vs_query_geomean"] == 1.5
    with pytest.raises(SystemExit):
        trace_replay.main(["time", "--steps-file", str(out), "--out", str(tmp_path),
                           "--heads", "32:5"])
