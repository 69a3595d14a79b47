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


def test_a_head_dim_table_drives_its_layouts_and_widths(tmp_path, monkeypatch):
    """A measured table for head_dim 256 (none is packaged yet) takes over that head_dim's
    kernel layouts and the selector's choice of n, and leaves head_dim 128 alone; a table
    holding another head_dim is refused."""
    import json

    import pytest
    real = cc.variant_speed_path
    table = {"head_dim": 256, "tiles": {
        "16x32": {"m": 16, "n": 32, "warps": 2, "stages": 2, "rows_per_warp": 16,
                  "frac_copy": 0.95},
        "16x64": {"m": 16, "n": 64, "warps": 4, "stages": 2, "rows_per_warp": 16,
                  "frac_copy": 0.85},
        "16x16": {"m": 16, "n": 16, "warps": 1, "stages": 3, "rows_per_warp": 16,
                  "frac_copy": 0.80}}}
    path = tmp_path / "variant_speed_d256.json"

    def reset():
        cc.variant_speed.cache_clear()
        cc._SUPPORTED.clear()

    before = TileSelector(256, "float16", "h100").pick_n(16, 1 << 20)
    v128 = cc.FwdVariant.make(16, 64, 128, "float16")
    try:
        path.write_text(json.dumps(table))
        monkeypatch.setattr(cc, "variant_speed_path",
                            lambda head_dim=128: path if head_dim == 256 else real(head_dim))
        reset()
        assert before == 64 and TileSelector(256, "float16", "h100").pick_n(16, 1 << 20) == 32
        v = cc.FwdVariant.make(16, 32, 256, "float16")
        assert (v.warps, v.stages, v.rows_per_warp) == (2, 2, 16)
        assert cc.FwdVariant.make(16, 64, 128, "float16") == v128
        table["head_dim"] = 128
        path.write_text(json.dumps(table))
        reset()
        with pytest.raises(ValueError, match="holds head_dim 128"):
            cc.variant_speed(256)
    finally:
        monkeypatch.undo()
        reset()
    assert TileSelector(256, "float16", "h100").pick_n(16, 1 << 20) == before
