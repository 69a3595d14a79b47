"""The command lines on a base install: ``python -m pat_core demo`` and ``python -m sim``.

* the demo's table is the plans' own numbers, and its default batches include one where the
  packers decide differently;
* bad arguments end in one line on stderr (``error: ...`` or argparse's usage + error) and exit
  status 2, never a traceback, in both command lines;
* matplotlib is imported only where a plot is drawn: with it unimportable, the demo and
  ``sim compare`` still work and a plotting subcommand says what is missing.
"""
from __future__ import annotations

import sys

import pytest

import pat_core
from pat_core.__main__ import DEFAULT_TREES, demo_main
from pat_core.__main__ import main as demo_cli
from pat_core.workloads import build_tree_batch
from sim.cli import main as sim_cli

PACKERS = ("query", "pat", "node", "compute", "cascade")


def _table(text: str) -> dict:
    """packer -> (CTAs, groups, slots, KV MB, ok, tiles) from one demo table."""
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in PACKERS and len(parts) >= 12:
            rows[parts[0]] = (int(parts[1]), int(parts[2]), int(parts[3]), float(parts[4]),
                              parts[10], " ".join(parts[11:]))
    return rows


def test_demo_table_is_the_plans(capsys):
    spec, hq, hk, d = "1,3,12_16,64,40", 8, 2, 64
    assert demo_cli(["demo", "--tree", spec, "--heads", f"{hq}:{hk}", "--head-dim", str(d),
                     "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "first-call cost before timing" in out
    rows = _table(out)
    assert set(rows) == set(PACKERS)
    b = build_tree_batch(spec, 16)
    for packer, (ctas, groups, slots, kv_mb, ok, tiles) in rows.items():
        plan = pat_core.Planner(packer, "h100").plan(b.block_tables, b.seq_lens, hq, hk, d, 16,
                                                     kv_data_type="float32")
        st = plan.stats()
        assert (ctas, groups, slots) == (st["num_ctas"], plan.num_groups, st["num_slots"])
        assert kv_mb == pytest.approx(st["kv_bytes"] / 1e6, abs=0.006)
        assert tiles == " ".join(f"{k}:{v}" for k, v in st["tiles"].items())
        assert ok == "yes"


def test_a_default_batch_shows_the_packers_differ():
    """The demo's defaults include a batch where pat, node and compute pack differently."""
    def packing(plan):
        st = plan.stats()
        return st["num_ctas"], st["num_slots"], st["kv_bytes"], tuple(st["tiles"].items())

    distinct = []
    for spec in DEFAULT_TREES:
        b = build_tree_batch(spec, 16)
        packs = {p: packing(pat_core.Planner(p, "h100").plan(b.block_tables, b.seq_lens, 32, 8,
                                                             128, 16))
                 for p in ("pat", "node", "compute")}
        distinct.append(len(set(packs.values())))
    assert max(distinct) == 3, distinct


@pytest.mark.parametrize("argv", [
    ["--tree", "1,4_128"], ["--tree", "foo"], ["--gpu", "b200"], ["--heads", "32"],
    ["--heads", "30:8"], ["--head-dim", "0"], ["--page-size", "-1"], ["--backend", "tpu"],
    ["--backend", "cuda", "--dtype", "float32"],
])
def test_demo_bad_arguments_one_line(argv, capsys):
    try:
        rc = demo_cli(["demo"] + argv)
    except SystemExit as e:             # argparse: usage line + one error line
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "error:" in last, err


def test_demo_without_a_gpu_says_so(capsys):
    from pat_core.cuda_backend import is_available
    if is_available():
        pytest.skip("a GPU is present: --backend cuda works here")
    assert demo_cli(["demo", "--backend", "cuda", "--tree", "1,2_20,20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "CUDA" in err[0]


@pytest.mark.parametrize("argv", [
    ["compare", "--tree", "1,4_128"], ["compare", "--gpu", "b200"],
    ["compare", "--page-size", "0"], ["compare", "--heads", "32:5"],
    ["sweep", "--knob", "prefix", "--values", "x", "--out", "never"],
    ["timeline", "--tree", "1,2_20,20", "--out", "/nonexistent-dir/x.png"],
])
def test_sim_bad_arguments_one_line(argv, capsys):
    try:
        rc = sim_cli(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "error:" in err.strip().splitlines()[-1], err


def test_pat_demo_entry_point_is_the_demo(capsys):
    assert demo_main(["--tree", "1,2_20,20", "--heads", "4:2", "--head-dim", "64",
                      "--dtype", "float32"]) == 0
    assert set(_table(capsys.readouterr().out)) == set(PACKERS)


def test_no_matplotlib_needed_without_plots(monkeypatch, tmp_path, capsys):
    """With matplotlib unimportable: the demo and ``sim compare`` run; ``sim timeline`` ends in
    a one-line error naming matplotlib."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "sim.plots", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # import matplotlib -> ImportError
    assert demo_cli(["demo", "--tree", "1,2_20,20", "--heads", "4:2", "--head-dim", "64",
                     "--dtype", "float32"]) == 0
    assert sim_cli(["compare", "--tree", "1,2_20,20", "--methods", "pat,query"]) == 0
    capsys.readouterr()
    assert sim_cli(["timeline", "--tree", "1,2_20,20", "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "matplotlib" in err[0]
    assert not (tmp_path / "t.png").exists()
