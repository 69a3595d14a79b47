"""Variant layout rules, the measured variant-speed table, the fused-launch variant and the
FastTree tree -> block-table mapping (CPU only)."""
import sys
from pathlib import Path

import numpy as np
import pytest

from pat_core import cuda_compile as cc
from pat_core.tiles import TileSelector
from pat_core.workloads import build_tree_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_layouts_come_from_the_measured_table():
    table = cc.variant_speed()
    assert table, "pat_core/data/variant_speed_h100.json is missing"
    for (m, n), rec in table.items():
        v = cc.FwdVariant.make(m, n, 128, "float16")
        assert (v.warps, v.stages, v.rows_per_warp) == (rec["warps"], rec["stages"],
                                                        rec["rows_per_warp"])
        assert f"_m{m}_n{n}_w{v.warps}_s{v.stages}_r{v.rows_per_warp}" in v.key
    # head_dim 64 was not measured: the rules apply
    v = cc.FwdVariant.make(128, 64, 64, "float16")
    assert (v.warps, v.stages) == (cc.rule_warps(128, 64), cc.rule_stages(128, 64, 64))


def test_selector_takes_the_fastest_measured_n():
    sel = TileSelector(128, "float16", "h100")
    table = cc.variant_speed()
    for m in sel.m_values:
        ns = [n for n in sel.n_by_m[int(m)] if n <= sel.gpu.preferred_n(1 << 20)]
        best = max(table[(int(m), n)]["frac_copy"] for n in ns)
        n = sel.pick_n(int(m), 1 << 20)
        assert table[(int(m), n)]["frac_copy"] >= best - 0.03
        # never above the KV-length bound
        assert sel.pick_n(int(m), 50) <= sel.gpu.preferred_n(50)


def test_fused_variant_takes_the_largest_member():
    a = cc.FwdVariant.make(128, 64, 128, "float16")
    b = cc.FwdVariant.make(16, 32, 128, "float16")
    f = cc.FusedVariant(128, "float16", (a, b))
    assert f.threads == max(a.threads, b.threads)
    assert f.smem_bytes == max(a.smem_bytes, b.smem_bytes)
    assert f.name_expression.startswith(f"pat_fwd_fused_kernel<128, __half, {f.threads}, ")
    assert f.name_expression.count("pat::FwdTraits<") == 2
    assert f.key != cc.FusedVariant(128, "float16", (b, a)).key   # order is the CTA index


class _Node:   # the attributes of FastTree's tree nodes that the mapping reads
    def __init__(self, parent, seqlen):
        self.parent, self.seqlen, self.num_children, self.requests = parent, seqlen, 0, []


def _tree(spec):
    """A tree built by the workload rule (level-i node j's parent is node j * n_{i-1} // n_i of
    level i-1), nodes numbered level by level, request ids given to leaves in node order."""
    levels, lens = spec.split("_")
    sizes, lengths = [int(x) for x in levels.split(",")], [int(x) for x in lens.split(",")]
    nodes, prev = [], []
    for size, ln in zip(sizes, lengths):
        cur = []
        for j in range(size):
            parent = prev[j * len(prev) // size] if prev else -1
            if parent >= 0:
                nodes[parent].num_children += 1
            nodes.append(_Node(parent, ln))
            cur.append(len(nodes) - 1)
        prev = cur
    ptrs, r = [0], 0
    for node in nodes:
        ptrs.append(ptrs[-1] + node.seqlen)
    for i, node in enumerate(nodes):
        if node.num_children == 0:
            x = i
            while x != -1:
                nodes[x].requests.append(r)
                x = nodes[x].parent
            r += 1
    return nodes, ptrs


@pytest.mark.parametrize("spec", ["1,4,16_128,256,1024", "1,2,8,128_512,128,256,32",
                                  "1,4,16,64,256_512,256,128,64,32"])
def test_fasttree_block_tables_match_the_workload(spec):
    from fasttree_compare import tree_block_tables
    nodes, ptrs = _tree(spec)
    table, lens = tree_block_tables(nodes, ptrs)
    ours = build_tree_batch(spec, page_size=16)
    np.testing.assert_array_equal(lens, ours.seq_lens)
    # same sharing structure: two requests share exactly as many leading pages in both
    for i in range(len(lens)):
        for j in range(i + 1, min(len(lens), i + 5)):
            def common(t, a, b, la, lb):
                pa, pb = t[a, : la // 16], t[b, : lb // 16]
                k = 0
                while k < min(len(pa), len(pb)) and pa[k] == pb[k]:
                    k += 1
                return k
            assert common(table, i, j, lens[i], lens[j]) == common(
                ours.block_tables, i, j, ours.seq_lens[i], ours.seq_lens[j])


def test_fasttree_block_tables_reject_partial_pages():
    from fasttree_compare import tree_block_tables
    nodes, ptrs = _tree("1,2_20,16")
    with pytest.raises(ValueError, match="whole pages"):
        tree_block_tables(nodes, ptrs)
