"""CPU checks of the FastTree baseline's pure parts: the batch -> FastTree tree mapping, the
configuration selection and options of bench/compare.py, the report with FastTree rows, and
bench/lab/gpu_compare.sh's wiring.  FastTree's own code is not needed (stand-ins are used)."""
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

from bench import compare
from bench.compare import fasttree_table, floor_ratios, headline, plot_all
from bench.fasttree_map import (Unsupported, batch_token_tree, fasttree_nodes, fasttree_reason,
                                same_shape)
from pat_core.workloads import (DEEP_HEAD_CONFIGS, DEEP_WORKLOADS, DESIGN_WORKLOADS,
                                HEAD_CONFIGS, LONG_PREFIX_WORKLOADS, WORKLOAD_SETS,
                                block_tables_from_paths, build_tree_batch, parse_tree_spec)

ROOT = os.path.join(os.path.dirname(__file__), "..")


def request_rows(b, r, ps):
    """Cache rows (page * ps + slot) request ``r`` reads, in order."""
    t = np.arange(int(b.seq_lens[r]))
    return b.block_tables[r, t // ps].astype(np.int64) * ps + t % ps


def check_tree(tree, block_tables, seq_lens, ps):
    """Every property FastTree relies on, against the block table."""
    B = len(seq_lens)
    n = tree.num_nodes
    assert tree.parent[0] == -1
    assert np.all(tree.parent[1:] >= 0) and np.all(tree.parent[1:] < np.arange(1, n))
    assert np.array_equal(tree.num_children,
                          np.bincount(tree.parent[1:], minlength=n)[:n])
    assert np.array_equal(tree.kv_ptrs, np.concatenate([[0], np.cumsum(tree.seqlen)]))
    assert tree.flat_src.shape[0] == tree.kv_ptrs[-1] and np.all(tree.seqlen >= 1)
    through = [[] for _ in range(n)]
    for r in range(B):
        chain = tree.chain(r)
        leaf = chain[-1]
        assert tree.num_children[leaf] == 0 and tree.requests[leaf] == [r]
        got = np.concatenate([tree.flat_src[tree.kv_ptrs[x]:tree.kv_ptrs[x + 1]]
                              for x in chain])
        t = np.arange(int(seq_lens[r]))
        want = block_tables[r, t // ps].astype(np.int64) * ps + t % ps
        assert np.array_equal(got, want), r       # the same tokens, in the same order
        for x in chain:
            through[x].append(r)
    assert [sorted(x) for x in tree.requests] == through
    assert np.all(tree.depth[1:] == tree.depth[tree.parent[1:]] + 1)


def spec_parents(spec):
    """Parents and token counts of a tree spec, numbered level by level the way FastTree's
    ``generate_tree`` does (child j of a level of size n below node j * prev // n)."""
    counts, lens = parse_tree_spec(spec)
    parent, seqlen, prev = [], [], []
    for lvl, (c, L) in enumerate(zip(counts, lens)):
        cur = []
        for j in range(c):
            parent.append(-1 if lvl == 0 else prev[j * len(prev) // c])
            seqlen.append(L)
            cur.append(len(parent) - 1)
        prev = cur
    return np.array(parent), np.array(seqlen)


ALL_SPECS = DESIGN_WORKLOADS + DEEP_WORKLOADS + LONG_PREFIX_WORKLOADS + ("1,3_20,9",
                                                                           "1,2,4_8,40,3")


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("ps", [16, 32])
def test_tree_of_every_workload(spec, ps):
    b = build_tree_batch(spec, ps, seed=3)
    counts, lens = parse_tree_spec(spec)
    try:
        tree = batch_token_tree(b.block_tables, b.seq_lens, ps)
    except Unsupported as e:
        # several roots: a multi-root spec, or a root node shorter than a page (copied per
        # child, so the children share no page)
        assert "roots" in str(e)
        assert counts[0] > 1 or lens[0] < ps, spec
        return
    assert counts[0] == 1 and lens[0] >= ps
    check_tree(tree, b.block_tables, b.seq_lens, ps)
    if all(x % ps == 0 for x in lens[:-1]):
        parent, seqlen = spec_parents(spec)       # no page straddles two nodes
        assert np.array_equal(tree.parent, parent)
        assert np.array_equal(tree.seqlen, seqlen)


def test_copied_page_goes_to_the_children():
    # root of 20 tokens at page 16: the root keeps one page, each child copies tokens 16..19
    b = build_tree_batch("1,3_20,9", 16, seed=None)
    tree = batch_token_tree(b.block_tables, b.seq_lens, 16)
    assert tree.seqlen.tolist() == [16, 13, 13, 13]
    check_tree(tree, b.block_tables, b.seq_lens, 16)


def test_unsupported_shapes():
    with pytest.raises(Unsupported, match="128 roots"):
        b = build_tree_batch("128_2048", 16)
        batch_token_tree(b.block_tables, b.seq_lens, 16)
    table = np.array([[0, 1, 2], [0, 1, 3]], dtype=np.int32)
    with pytest.raises(Unsupported, match="prefix of request 1"):
        batch_token_tree(table, np.array([32, 48], dtype=np.int32), 16)
    with pytest.raises(Unsupported, match="identical"):
        batch_token_tree(table[[0, 0]], np.array([40, 40], dtype=np.int32), 16)
    # the same page read to different lengths is two different slots: a branch, not a prefix
    tree = batch_token_tree(table[[0, 0]], np.array([40, 48], dtype=np.int32), 16)
    assert tree.seqlen.tolist() == [32, 8, 16]
    with pytest.raises(ValueError, match="page_size"):
        batch_token_tree(table, np.array([32, 48]), 0)
    with pytest.raises(TypeError, match="block_tables"):
        batch_token_tree(table.astype(np.float32), np.array([32, 48]), 16)
    with pytest.raises(ValueError, match="fewer columns"):
        batch_token_tree(table, np.array([32, 64]), 16)


def test_random_trees_keep_every_request():
    rng = np.random.default_rng(7)
    for _ in range(40):
        ps = int(rng.choice([1, 4, 16]))
        n_leaf = int(rng.integers(1, 12))
        depth = int(rng.integers(1, 4))
        node_lens, paths = [int(rng.integers(ps, 4 * ps))], []   # a root of >= one page
        for _ in range(n_leaf):
            p = [0]
            for _ in range(depth):
                if rng.random() < 0.5 and len(node_lens) > 1:
                    cand = [x for x in range(1, len(node_lens)) if x not in p]
                    if cand:
                        p.append(int(rng.choice(cand)))
                        continue
                node_lens.append(int(rng.integers(1, 3 * ps)))
                p.append(len(node_lens) - 1)
            paths.append(p)
        table, seq, _ = block_tables_from_paths(paths, np.array(node_lens), ps, rng=rng)
        try:
            tree = batch_token_tree(table, seq, ps)
        except Unsupported as e:       # random paths can repeat or nest; say so, never crash
            assert "identical" in str(e) or "prefix" in str(e) or "roots" in str(e)
            continue
        check_tree(tree, table, seq, ps)


class Node:
    """A stand-in for FastTree's KVTreeNode."""

    def __init__(self):
        self.parent, self.id, self.seqlen, self.num_children, self.requests = -1, -1, 0, 0, []


def test_fasttree_nodes_and_shape_check():
    b = build_tree_batch("1,2,4_64,32,16", 16)
    tree = batch_token_tree(b.block_tables, b.seq_lens, 16)
    nodes = fasttree_nodes(tree, Node)
    assert [x.parent for x in nodes] == [-1, 0, 0, 1, 1, 2, 2]
    assert [x.id for x in nodes] == list(range(7))
    assert [x.num_children for x in nodes] == [2, 2, 2, 0, 0, 0, 0]
    assert nodes[0].requests == [0, 1, 2, 3] and nodes[4].requests == [1]
    assert same_shape(tree, nodes)
    nodes[5].seqlen += 1
    assert not same_shape(tree, nodes)
    assert not same_shape(tree, nodes[:-1])


def test_fasttree_reason():
    b = build_tree_batch("1,4_64,16", 16)
    tree = batch_token_tree(b.block_tables, b.seq_lens, 16)
    assert fasttree_reason(tree, 32, 32, 128) is None
    assert fasttree_reason(tree, 32, 8, 128) is None
    assert "group 2" in fasttree_reason(tree, 16, 8, 128)
    assert "group 8" in fasttree_reason(tree, 64, 8, 128)
    assert "head_dim 96" in fasttree_reason(tree, 32, 8, 96)
    assert fasttree_reason("3 roots", 32, 8, 128) == "3 roots"
    with pytest.raises(ValueError, match="multiple"):
        fasttree_reason(tree, 30, 8, 128)


# ---------------------------------------------------------------------------- options
def test_default_configs_are_the_development_set():
    cfg = compare.select_configs()
    assert len(cfg) == len(set(cfg)) == (len(DESIGN_WORKLOADS) * len(HEAD_CONFIGS) +
                                         len(DEEP_WORKLOADS) * len(DEEP_HEAD_CONFIGS)) * 2
    deep = {c for c in cfg if c[0] in DEEP_WORKLOADS}
    assert {h for _, h, _ in deep} == {(32, 32), (32, 8)}
    assert {p for _, _, p in cfg} == {16, 32}
    for spec in DEEP_WORKLOADS:
        counts, lens = parse_tree_spec(spec)
        assert counts[0] == 1 and 5 <= len(counts) <= 7 and counts[-1] <= 1024
        assert lens[-1] == 32


def test_selected_workloads_build_valid_batches():
    from bench.common import unique_kv_tokens
    for spec, _, ps in {(w, None, p) for w, _, p in compare.select_configs(
            sets=list(WORKLOAD_SETS))}:
        b = build_tree_batch(spec, ps, seed=0)
        counts, lens = parse_tree_spec(spec)
        assert b.batch_size == counts[-1] and np.all(b.seq_lens == sum(lens))
        used = np.concatenate([b.block_tables[r, : -(-int(b.seq_lens[r]) // ps)]
                               for r in range(b.batch_size)])
        assert used.min() >= 0 and used.max() < b.num_pages
        assert np.unique(used).size == b.num_pages
        assert unique_kv_tokens(b.block_tables, b.seq_lens, ps) <= int(b.seq_lens.sum())


def test_select_configs_overrides():
    cfg = compare.select_configs(["deep"], heads=["32:8"], page_sizes=[16])
    assert cfg == [(w, (32, 8), 16) for w in DEEP_WORKLOADS]
    cfg = compare.select_configs(["deep"], workloads=["1,16_2048,128"], page_sizes=[16])
    assert cfg == [("1,16_2048,128", h, 16) for h in DEEP_HEAD_CONFIGS]
    with pytest.raises(ValueError, match="unknown"):
        compare.select_configs(["nope"])
    with pytest.raises(ValueError, match="tree spec"):
        compare.select_configs(workloads=["1,2_3"])
    with pytest.raises(ValueError, match="--heads"):
        compare.select_configs(heads=["32-8"])
    with pytest.raises(ValueError, match="multiple"):
        compare.select_configs(heads=["30:8"])
    with pytest.raises(ValueError, match="no workloads"):
        compare.select_configs([])


def test_parse_args(capsys):
    a = compare.parse_args(["--out", "o"])
    assert "fasttree" not in a.methods and a.configs == compare.select_configs()
    a = compare.parse_args(["--out", "o", "--fasttree", "ftdir", "--sets", "long",
                            "--page-sizes", "16", "--time-budget", "300"])
    assert a.methods[-1] == "fasttree" and a.fasttree == "ftdir" and a.time_budget == 300
    assert a.fasttree_tiles == "prepared"
    assert a.configs == [(w, h, 16) for w in LONG_PREFIX_WORKLOADS for h in DEEP_HEAD_CONFIGS]
    for bad, msg in ((["--methods", "fasttree"], "needs --fasttree"),
                     (["--methods", "flashtree"], "unknown"),
                     (["--workloads", "1_2_3"], "tree spec"),
                     (["--reps", "0"], "reps"),
                     (["--fasttree-tiles", "mine"], "invalid choice")):
        with pytest.raises(SystemExit):
            compare.parse_args(["--out", "o"] + bad)
        assert msg in capsys.readouterr().err


def test_load_fasttree_fails_clearly(tmp_path):
    with pytest.raises(SystemExit, match="no FastTree.py"):
        compare.load_fasttree(str(tmp_path))
    (tmp_path / "FastTree.py").write_text("import a_module_that_is_not_there\n")
    with pytest.raises(SystemExit, match="importing .* failed"):
        compare.load_fasttree(str(tmp_path))
    assert "FastTree" not in sys.modules
    (tmp_path / "FastTree.py").write_text("class FastTreeParams:\n    pass\n")
    with pytest.raises(SystemExit, match="lacks KVTreeNode"):
        compare.load_fasttree(str(tmp_path))
    sys.modules.pop("FastTree", None)


# ---------------------------------------------------------------------------- report
def synthetic_result():
    rows = []

    def add(wl, heads, m, lat=None, eager=None, **kw):
        r = dict(workload=wl, heads=list(heads), page_size=16, method=m, batch=16,
                 floor_bytes=8e6, floor_us=8.0, **kw)
        if lat is not None:
            r.update(latency_us=lat, latency_graph_us=lat, latency_eager_us=eager or lat + 5,
                     timing="graph", eff_bandwidth=8e6 / (lat * 1e-6), floor_ratio=lat / 8.0)
        rows.append(r)

    add("1,16_2048,128", (32, 8), "pat", 16.0, 20.0)
    add("1,16_2048,128", (32, 8), "fasttree", 32.0, 50.0)
    add("1,16_2048,128", (32, 8), "fi-decode", 40.0)
    add("1,4,16,64,256_512,256,128,64,32", (32, 32), "pat", 40.0, 60.0)
    add("1,4,16,64,256_512,256,128,64,32", (32, 32), "fasttree", 20.0, 30.0)
    add("1,4,16,64,256_512,256,128,64,32", (32, 32), "fi-decode", 80.0)
    add("1,16_2048,128", (16, 8), "pat", 10.0)
    add("1,16_2048,128", (16, 8), "fasttree",
        skipped="GQA group 2: FastTree's benchmark settings cover groups 1 and 4 only")
    add("3,24,96_1024,64,512", (32, 8), "pat", 24.0)
    add("3,24,96_1024,64,512", (32, 8), "fasttree",
        skipped="3 roots: FastTree runs single-root trees only")
    add("1,2,8,128_512,128,256,32", (32, 8), "pat", 12.0)
    add("1,2,8,128_512,128,256,32", (32, 8), "fasttree", correct=False, rel_err=50.0)
    add("256_4096", (32, 8), "pat", 10.0)
    add("256_4096", (32, 8), "fi-decode", 10.5)
    return dict(device="test device", copy_bandwidth=3e12, git_sha="0" * 40, dtype="float16",
                head_dim=128, reps=20, versions={}, command="compare.py --out x", rows=rows,
                not_run=[dict(workload="1,1024_1024,16", heads=[32, 8], page_size=16)])


def test_fasttree_numbers():
    res = synthetic_result()
    h = headline(res)
    assert h["fasttree_configs"] == 2 and h["pat_faster_than_fasttree"] == 1
    assert h["geomean_speedup_vs_fasttree"] == pytest.approx(1.0)          # 2x and 0.5x
    assert h["geomean_speedup_vs_fasttree_eager"] == pytest.approx(np.sqrt(2.5 * 0.5))
    assert h["min_speedup_vs_fasttree"] == pytest.approx(0.5)
    tab = {(x["workload"], tuple(x["heads"])): x for x in fasttree_table(res)}
    assert len(tab) == 5
    assert tab[("1,16_2048,128", (32, 8))]["speedup"] == pytest.approx(2.0)
    assert tab[("1,16_2048,128", (16, 8))]["speedup"] is None
    assert "GQA group 2" in tab[("1,16_2048,128", (16, 8))]["status"]
    assert "wrong" in tab[("1,2,8,128_512,128,256,32", (32, 8))]["status"]
    fr = floor_ratios(res, ["pat", "fasttree", "fi-decode"])
    # pat: 16/8, 40/8, 10/8, 24/8, 12/8 over sharing configs; on FastTree's set 2 and 5
    assert fr["pat"]["all"][1] == 5
    assert fr["pat"]["all"][0] == pytest.approx(np.exp(np.mean(np.log(
        [2.0, 5.0, 1.25, 3.0, 1.5]))))
    assert fr["pat"]["fasttree_set"] == (pytest.approx(np.sqrt(10.0)), 2)
    assert fr["fasttree"]["all"] == (pytest.approx(np.sqrt(10.0)), 2)
    assert fr["fi-decode"]["fasttree_set"] == (pytest.approx(np.sqrt(50.0)), 2)


def test_report_with_fasttree(tmp_path):
    lines = plot_all(synthetic_result(), str(tmp_path))
    md = (tmp_path / "summary.md").read_text()
    assert (tmp_path / "fasttree.png").stat().st_size > 1000
    assert "pat beats FastTree: 1 / 2" in md
    assert "| 1,16_2048,128 | 32:8 | 16 | 16.0 | 32.0 | 2.00 | 2.50 | graph |" in md
    assert "| 1,16_2048,128 | 16:8 | 16 | - | - | - | - | GQA group 2" in md
    assert "| fasttree | 3.16 | 2 | 3.16 | 2 |" in md
    assert "fasttree: 3 roots: FastTree runs single-root trees only (1 configs)" in md
    assert "1 configurations not run" in md and "command: `compare.py --out x`" in md
    # the latency table has a FastTree column, "*" for its wrong row
    assert "| 1,2,8,128_512,128,256,32 | 32:8 | 8.0 | 12.0 | - | * |" in md
    assert any("beats FastTree" in x for x in lines)


# ---------------------------------------------------------------------------- gpu_compare.sh
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("with_fasttree", [True, False])
def test_gpu_compare_script(tmp_path, with_fasttree):
    repo = tmp_path / "repo"
    (repo / "bench" / "lab").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "bench", "lab", "gpu_compare.sh"), repo / "bench" / "lab")
    (repo / ".whl").mkdir()
    (repo / ".whl" / "flashinfer_python-0.2.5-py3-none-any.whl").write_bytes(b"x")
    if with_fasttree:
        (repo / ".baselines" / "fasttree").mkdir(parents=True)
        (repo / ".baselines" / "fasttree" / "FastTree.py").write_text("")
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "calls.txt"
    (fake / "python3").write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n'
                                  'echo "PYTHONPATH=$PYTHONPATH NVCC=$NVCC_APPEND_FLAGS" '
                                  f'>> {log}\n')
    (fake / "python3").chmod(stat.S_IRWXU)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}",
               PAT_BENCH_SITE=str(tmp_path / "site"))
    env.pop("PAT_FASTTREE_DIR", None)
    p = subprocess.run(["bash", str(repo / "bench" / "lab" / "gpu_compare.sh"), "out1", "--sets",
                        "deep"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    calls = log.read_text().splitlines()
    pip = next(c for c in calls if "pip install" in c)
    assert "--no-index" in pip and f"--target {tmp_path / 'site'}" in pip
    assert ".whl/flashinfer_python-0.2.5-py3-none-any.whl" in pip
    run = next(c for c in calls if "bench/compare.py" in c)
    assert run.startswith("bench/compare.py --out out1")
    assert run.endswith("--sets deep")
    assert ("--fasttree .baselines/fasttree" in run) == with_fasttree
    env_line = calls[calls.index(run) + 1]
    assert str(tmp_path / "site") in env_line and "static-global-template-stub=false" in env_line
    assert (repo / "out1" / "compare.log").exists()
    p = subprocess.run(["bash", str(repo / "bench" / "lab" / "gpu_compare.sh")], cwd=tmp_path,
                       env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "usage" in p.stderr
