"""Variant layout rules, the measured variant-speed table and the fused-launch variant (CPU
only)."""

from pat_core import cuda_compile as cc
from pat_core.tiles import TileSelector


def test_layouts_come_from_the_measured_table():
    table = cc.variant_speed()
    assert table, "pat_core/data/variant_speed_h100.json is missing"
    for (m, n), rec in table.items():
        v = cc.FwdVariant.make(m, n, 128, "float16")
        assert (v.warps, v.stages, v.rows_per_warp) == (rec["warps"], rec["stages"],
                                                        rec["rows_per_warp"])
        assert f"_m{m}_n{n}_w{v.warps}_s{v.stages}_r{v.rows_per_warp}" in v.key
        # the warpgroup layout is sm_90 only: other GPUs run the fastest mma.sync layout
        if rec["rows_per_warp"] == cc.WG_ROWS:
            assert v.warpgroup and cc.variant_archs(v) == ("sm_90",)
            v80 = cc.FwdVariant.make(m, n, 128, "float16", arch="sm_80")
            assert not v80.warpgroup and set(cc.variant_archs(v80)) == {"sm_80", "sm_90"}
            sync = rec["sync"]
            assert (v80.warps, v80.stages, v80.rows_per_warp) == (
                sync["warps"], sync["stages"], sync["rows_per_warp"])
    assert any(r["rows_per_warp"] == cc.WG_ROWS for r in table.values())
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
    assert f.name_expression.startswith(f"pat_fwd_fused_pull_kernel<128, __half, {f.threads}, ")
    assert f.name_expression.count("pat::FwdTraits<") == 2
    assert f.key != cc.FusedVariant(128, "float16", (b, a)).key   # order is the live table's
