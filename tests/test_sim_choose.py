"""sim.choose: a packer picked by the simulator's predicted latency, and the bench check that
judges that rule on measured calibration files."""
import json
import math

import pytest

from pat_core import Planner
from pat_core.workloads import build_tree_batch
import sim
from sim.choose import DEFAULT_MARGIN, choose_packer

DEEP = "1,2,4,8,16,32_32,32,32,32,32,32"      # six levels of 32-token nodes
SHARED = "1,4,64_256,1024,64"                 # development set: a long shared level


def _choose(spec, heads=(32, 8), **kw):
    b = build_tree_batch(spec, page_size=16)
    return b, choose_packer(b.block_tables, b.seq_lens, heads[0], heads[1], 128, 16, **kw)


def test_picks_query_where_predicted_faster_beyond_the_margin():
    b, c = _choose(DEEP)
    assert set(c.predicted_us) == {"pat", "query"}
    assert c.predicted_us["query"] < c.predicted_us["pat"] * (1 - DEFAULT_MARGIN)
    assert c.packer == "query" and c.plan is c.plans["query"]
    # the predictions are the simulator's on the plans the planner makes for those packers
    p = Planner("query", "h100").plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert c.plan.num_ctas == p.num_ctas
    assert c.predicted_us["query"] == pytest.approx(sim.simulate(p).latency_us)


def test_keeps_pat_where_sharing_pays():
    _, c = _choose(SHARED)
    assert c.packer == "pat" and c.predicted_us["pat"] < c.predicted_us["query"]


def test_margin_keeps_the_default_on_near_ties():
    _, c0 = _choose(DEEP, margin=0.0)
    gain = 1 - c0.predicted_us["query"] / c0.predicted_us["pat"]
    assert c0.packer == "query" and 0 < gain < 0.9
    _, c1 = _choose(DEEP, margin=min(0.99, gain + 0.01))
    assert c1.packer == "pat"
    # another default: kept unless beaten by the margin
    _, c2 = _choose(DEEP, default="query", margin=0.0)
    assert c2.packer == "query"
    _, c3 = _choose(SHARED, default="query", margin=0.99)
    assert c3.packer == "query"


def test_more_candidates_pick_the_fastest_predicted():
    _, c = _choose(SHARED, candidates=("pat", "query", "node", "cascade"), margin=0.0)
    assert set(c.predicted_us) == {"pat", "query", "node", "cascade"}
    best = min(c.predicted_us.values())
    assert c.predicted_us[c.packer] == best


@pytest.mark.parametrize("kw, word", [
    (dict(candidates=("pat", "bogus")), "candidates"),
    (dict(candidates=()), "candidates"),
    (dict(default="node"), "default"),
    (dict(margin=-0.1), "margin"),
    (dict(margin=1.0), "margin"),
    (dict(margin=math.nan), "margin"),
    (dict(margin=True), "margin"),
    (dict(constants="no/such/constants.json"), "constants"),
])
def test_bad_arguments_name_themselves(kw, word):
    with pytest.raises(ValueError, match=word):
        _choose(SHARED, **kw)


def _calibration_file(tmp_path, rows):
    recs = [dict(workload=w, method=m, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                 page_size=16, measured_graph_us=us) for w, m, us in rows]
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"gpu": "h100", "records": recs,
                                "split": {"fit": [SHARED], "validation": [DEEP]}}))
    return str(path)


def test_sim_choice_check_scores_the_rule(tmp_path, capsys):
    """bench/lab/sim_choice_check.py: the chosen plan's measured time over pat's, per set."""
    from bench.lab import sim_choice_check as scc
    # the model picks query on DEEP and pat on SHARED (tests above); measured, query is 20%
    # faster on DEEP, so the validation row gains 0.8x, and the fit row is unchanged
    path = _calibration_file(tmp_path, [(DEEP, "pat", 20.0), (DEEP, "query", 16.0),
                                        (SHARED, "pat", 25.0), (SHARED, "query", 50.0)])
    rows = scc.check(path, [0.02])
    by = {r["set"]: r for r in rows}
    assert by["validation"]["geomean"] == pytest.approx(0.8)
    assert by["validation"]["changed"] == 1 and by["validation"]["n"] == 1
    assert by["fit"]["geomean"] == pytest.approx(1.0) and by["fit"]["changed"] == 0
    # measured the other way round: the rule's pick is slower, and the check says so
    path = _calibration_file(tmp_path, [(DEEP, "pat", 16.0), (DEEP, "query", 20.0)])
    (row,) = scc.check(path, [0.02])
    assert row["worst"] == pytest.approx(1.25)
    out = tmp_path / "rows.json"
    assert scc.main([path, "--margins", "0", "0.5", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())) == 2
    with pytest.raises(SystemExit):
        scc.main([path, "--margins", "1.5"])


def test_pick_rule_and_the_compare_command(capsys):
    from sim.choose import pick
    assert pick({"pat": 10.0, "query": 9.9}, "pat", 0.02) == "pat"        # within the margin
    assert pick({"pat": 10.0, "query": 9.7}, "pat", 0.02) == "query"
    assert pick({"pat": 10.0, "query": 10.0}, "query", 0.0) == "query"    # ties: the default
    assert pick({"pat": 10.0, "query": 10.0, "node": 8.0}, "pat", 0.1) == "node"
    from sim.cli import main
    assert main(["compare", "--tree", DEEP, "--heads", "32:8"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(": query")
    assert main(["compare", "--tree", SHARED, "--heads", "32:8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pick"] == "pat"
    assert main(["compare", "--tree", SHARED, "--methods", "pat,node", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pick"] is None
