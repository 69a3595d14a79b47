"""``python -m sim`` in-process: JSON round trips, PNGs with the Agg backend (CPU only)."""
from __future__ import annotations

import json

import matplotlib
import pytest

from sim import simulate
from sim.cli import ALL_METHODS, main, tree_spec
from sim.methods import load_batch, make_plan, save_batch
from sim.plots import bytes_plot, gantt, sweep_plot

PNG = b"\x89PNG\r\n\x1a\n"
SPEC = "1,4,16_128,256,1024"


def test_compare_json_round_trips(capsys):
    assert main(["compare", "--tree", SPEC, "--heads", "32:8", "--gpu", "h100",
                 "--page-size", "16", "--head-dim", "128", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in res["rows"]] == list(ALL_METHODS)
    assert res["heads"] == [32, 8] and res["gpu"].startswith("H100")
    batch = load_batch(SPEC, 16)
    for row in res["rows"]:
        plan = make_plan(batch, row["method"], 32, 8, 128)
        st = plan.stats()
        r = simulate(plan)
        assert row["ctas"] == st["num_ctas"] and row["kv_bytes"] == st["kv_bytes"]
        assert row["total_bytes"] == st["total_bytes"]
        assert row["predicted_us"] == pytest.approx(r.latency_us, abs=1e-3)
        assert row["bubble_pct"] == pytest.approx(100 * r.bubble, abs=0.01)
        assert row["waste_pct"] == pytest.approx(100 * r.waste["total"], abs=0.01)
    # the table form prints the same methods
    assert main(["compare", "--tree", SPEC, "--methods", "pat,query"]) == 0
    text = capsys.readouterr().out
    assert "pat" in text and "query" in text and "pred us" in text


def test_compare_on_a_block_table_file(tmp_path, capsys):
    path = tmp_path / "trace.json"
    save_batch(load_batch("1,8_100,30", 4), str(path))
    assert main(["compare", "--tree", str(path), "--heads", "8:8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["page_size"] == 4 and res["batch_size"] == 8


def test_timeline_png(tmp_path, capsys):
    out = tmp_path / "t.png"
    assert main(["timeline", "--tree", SPEC, "--heads", "32:8", "--method", "pat",
                 "--out", str(out), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert out.read_bytes()[:8] == PNG and row["method"] == "pat" and row["occupancy"]


def test_sweep_png_and_json(tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(["sweep", "--knob", "gqa", "--values", "1,4", "--batch", "8", "--prefix", "256",
                 "--methods", "pat,query", "--out", str(out)]) == 0
    res = json.loads((tmp_path / "sw.json").read_text())
    assert (tmp_path / "sw.png").read_bytes()[:8] == PNG
    assert res["values"] == [1, 4] and res["heads"] == [[8, 8], [32, 8]]
    assert set(res["methods"]) == {"pat", "query"}
    assert all(len(v) == 2 and min(v) > 0 for v in res["methods"].values())
    capsys.readouterr()


@pytest.mark.parametrize("knob", ["batch", "prefix", "depth"])
def test_sweep_knobs(tmp_path, knob, capsys):
    vals = {"batch": "4,8", "prefix": "0,64", "depth": "1,3"}[knob]
    assert main(["sweep", "--knob", knob, "--values", vals, "--batch", "4", "--prefix", "64",
                 "--methods", "pat", "--out", str(tmp_path / knob)]) == 0
    res = json.loads((tmp_path / f"{knob}.json").read_text())
    values = [int(x) for x in vals.split(",")]
    want = [tree_spec(v if knob == "batch" else 4, v if knob == "prefix" else 64, 128,
                      v if knob == "depth" else 2) for v in values]
    assert res["specs"] == want
    for spec, us in zip(want, res["methods"]["pat"]):
        r = simulate(make_plan(load_batch(spec, 16), "pat", 32, 8, 128))
        assert us == pytest.approx(r.latency_us, abs=1e-3)
    assert (tmp_path / f"{knob}.png").read_bytes()[:8] == PNG
    capsys.readouterr()


def test_tree_spec():
    assert tree_spec(8, 0, 32, 3) == "8_32"
    assert tree_spec(8, 300, 32, 1) == "8_332"
    assert tree_spec(8, 300, 32, 2) == "1,8_300,32"
    assert tree_spec(8, 301, 32, 3) == "1,2,8_151,150,32"


def test_plots_render_with_agg(tmp_path):
    assert matplotlib.get_backend().lower() == "agg"
    batch = load_batch("1,2,8_64,100,37", 16)
    res = [simulate(make_plan(batch, m, 32, 8, 128)) for m in ("pat", "cascade")]
    for i, r in enumerate(res):
        assert open(gantt(r, str(tmp_path / f"g{i}.png")), "rb").read(8) == PNG
    rows = [dict(method=m, bytes=r.bytes) for m, r in zip(("pat", "cascade"), res)]
    assert open(bytes_plot(rows, str(tmp_path / "b.png")), "rb").read(8) == PNG
    sw = {"knob": "batch", "values": [1, 2], "methods": {"pat": [1.0, 2.0]}}
    assert open(sweep_plot(sw, str(tmp_path / "s.png")), "rb").read(8) == PNG


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--tree", SPEC, "--heads", "32:5"])
    with pytest.raises(SystemExit):
        main(["compare", "--tree", SPEC, "--methods", "nope"])
    assert main(["compare", "--tree", "1,2_3"]) == 2       # malformed spec: clear error
    assert "error" in capsys.readouterr().err


def test_plot_helpers_name_what_the_reader_sees(tmp_path):
    """Idle spans of the timeline are the gaps between blocks; coinciding sweep curves are named
    in the legend; long titles are wrapped."""
    import numpy as np
    import matplotlib.pyplot as plt
    from sim.plots import _idle_intervals, _title
    start = np.array([5.0, 6.0, 20.0])
    end = np.array([10.0, 8.0, 25.0])
    assert _idle_intervals(start, end, 0.0, 30.0) == [(0.0, 5.0), (10.0, 20.0), (25.0, 30.0)]
    assert _idle_intervals(start, end, 0.0, 25.0) == [(0.0, 5.0), (10.0, 20.0)]
    fig, ax = plt.subplots()
    _title(ax, "x" * 30 + " " + "y" * 30, 40)
    assert ax.get_title().count("\n") == 1
    plt.close(fig)
    sw = {"knob": "batch", "values": [1, 2],
          "methods": {"pat": [1.0, 2.0], "node": [1.0, 2.0], "query": [3.0, 4.0]}}
    captured = {}
    real_savefig = plt.Figure.savefig

    def grab(fig, path, **kw):
        captured["labels"] = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
        return real_savefig(fig, path, **kw)

    plt.Figure.savefig = grab
    try:
        sweep_plot(sw, str(tmp_path / "s.png"))
    finally:
        plt.Figure.savefig = real_savefig
    assert captured["labels"] == ["pat (= node)", "node (= pat)", "query"]


def test_sweep_takes_no_tree(capsys):
    """``sweep`` builds its batches from its knobs; a ``--tree`` it would ignore is refused."""
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--knob", "batch", "--tree", "1,2_64,16", "--out", "sw"])
    assert e.value.code == 2
    assert "--tree" in capsys.readouterr().err
