"""Both command lines under random and hostile arguments: exit status 0 or 2, one ``error:`` line,
never a traceback, never a silent substitute, bounded time; then one test per known failure.

The CLIs run in-process (``main(argv)``, ``SystemExit`` caught) so that a few hundred calls take
seconds; two subprocess runs check the real entry points.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from pat_core import PrefixAttentionWrapper
from pat_core.__main__ import main as demo_cli
from pat_core.workloads import (DEEP_WORKLOADS, DESIGN_WORKLOADS, build_tree_batch,
                                tree_size)
from sim.cli import main as sim_cli
from sim.constants import load_constants, save_constants

CALL_LIMIT_S = 10.0
SMALL_TREES = ("1,2_20,20", "1,3_16,5", "2_7", "1,2,4_8,8,8")
HOSTILE = ("", "-1", "0", "nan", "inf", "-inf", "1e999", "1.5", "x", ":", "32:0", "0:0",
           "99999999999999999999", "-99999999999999999999", "1_2147483647",
           "1,1000000000_16,16", "1_99999999999999999999", "1,2_20", "_", ",", "1,,2_3,,4",
           "\x00", "é", "--", "-", "/")


def run(cli, argv):
    """``(exit status, stderr)`` of one in-process call; fails on any exception but
    ``SystemExit`` (pytest reports the traceback) and on a call past CALL_LIMIT_S."""
    t0 = time.perf_counter()
    try:
        rc = cli(argv)
    except SystemExit as e:
        rc = e.code
    dt = time.perf_counter() - t0
    assert dt < CALL_LIMIT_S, f"{argv} took {dt:.1f} s"
    return rc


def check(cli, argv, capsys, want=None):
    """Run, then: status 0 or 2 (``want`` if given), no traceback, a failure's last stderr line
    an ``error:`` line, a success's stderr free of ``error:``."""
    rc = run(cli, argv)
    cap = capsys.readouterr()
    assert rc in (0, 2), (argv, rc, cap.err)
    assert "Traceback" not in cap.err and "Traceback" not in cap.out, argv
    if rc == 2:
        lines = cap.err.strip().splitlines()
        assert lines and "error:" in lines[-1], (argv, cap.err)
    if want is not None:
        assert rc == want, (argv, rc, cap.err)
    return cap.err.strip().splitlines()[-1] if rc == 2 else cap.out


@pytest.fixture
def files(tmp_path):
    """Paths a hostile argument may name: missing, a folder, an empty object, garbage, a
    tiny trace, a file where a folder is expected."""
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "garbage.json").write_text("\x89not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 600,
                                         "output_length": 3, "hash_ids": [i % 2, i]}) + "\n"
                             for i in range(4)))
    (tmp_path / "dir").mkdir()
    return {"missing": str(tmp_path / "nope.json"), "dir": str(tmp_path / "dir"),
            "dir/": str(tmp_path / "dir") + "/", "empty": str(tmp_path / "empty.json"),
            "garbage": str(tmp_path / "garbage.json"), "list": str(tmp_path / "list.json"),
            "trace": str(trace), "under_file": str(trace) + "/x",
            "out": str(tmp_path / "out" / "o")}


def _value(rng, files, good):
    """A good value (from ``good``), a hostile string, or a path."""
    pick = rng.random()
    if pick < 0.5:
        return rng.choice(good)
    if pick < 0.8:
        return rng.choice(HOSTILE)
    return rng.choice(list(files.values()))


SIM_OPTIONS = {
    "--tree": SMALL_TREES, "--heads": ("4:2", "8:8", "32:8"), "--gpu": ("h100", "a100", "b200"),
    "--page-size": ("4", "16"), "--head-dim": ("64", "128"), "--dtype": ("float16", "float32"),
    "--constants": (), "--seed": ("0", "3"), "--timing": ("graph", "eager"),
    "--methods": ("pat,query", "node"), "--method": ("pat", "query"), "--max-sms": ("4",),
    "--knob": ("batch", "depth", "gqa", "prefix"), "--values": ("2,4", "1"),
    "--batch": ("2", "4"), "--prefix": ("16", "64"), "--suffix": ("8",), "--depth": ("1", "2"),
    "--trace": (), "--start-s": ("0", "0.01"), "--duration-s": ("1", "0.02"),
    "--sample": ("1", "0.5"), "--max-requests": ("2",), "--max-steps": ("3",),
    "--every": ("1", "2"), "--max-batch": ("2", "8"), "--kv-pages": ("64", "4096"),
    "--step-ms": ("25",), "--block-tokens": ("512",), "--measurements": (),
    "--fit-workloads": ("1,2_20,20",), "--validation": ("x",), "--max-evals": ("1",),
    "--measured": ("copy_bandwidth_gbps=1",),
}
SIM_COMMANDS = ("compare", "timeline", "sweep", "trace", "fit", "calibration-report")
DEMO_OPTIONS = {
    "--tree": SMALL_TREES, "--heads": ("4:2", "2:2"), "--head-dim": ("64",),
    "--page-size": ("4", "16"), "--dtype": ("float32", "float16"), "--backend": ("cpu",),
    "--gpu": ("h100", "a100", "b200"), "--seed": ("0", "1"),
}


def _sim_argv(rng, files):
    """A random ``python -m sim`` argument list: a subcommand, then a few options with good,
    hostile or path values; ``--out`` goes to a scratch file unless drawn hostile.  Commands
    that read measurements always get an explicit (small) file, never the repository's."""
    cmd = rng.choice(SIM_COMMANDS)
    argv = [cmd]
    if cmd in ("timeline", "sweep", "trace", "fit"):
        argv += ["--out", files["out"] if rng.random() < 0.7 else _value(rng, files, ("o",))]
    if cmd == "sweep":
        argv += ["--knob", rng.choice(SIM_OPTIONS["--knob"])]
    if cmd == "trace":
        argv += ["--trace", files["trace"] if rng.random() < 0.7 else
                 _value(rng, files, (files["trace"],)), "--no-progress"] + (["--no-plot"] * (rng.random() < .8))
    if cmd in ("fit", "calibration-report"):
        argv += ["--measurements", rng.choice([files["empty"], files["garbage"], files["list"],
                                               files["missing"], files["trace"]])]
    for opt in rng.sample(sorted(SIM_OPTIONS), rng.randint(0, 4)):
        good = SIM_OPTIONS[opt] or (files["trace"],)
        argv += [opt, _value(rng, files, good)]
    if rng.random() < 0.1:
        argv.insert(rng.randint(0, len(argv)), rng.choice(HOSTILE))
    return argv


def _demo_argv(rng, files):
    """A random ``python -m pat_core demo`` argument list, small trees unless drawn hostile."""
    argv = ["demo", "--tree", rng.choice(SMALL_TREES), "--heads", "4:2", "--head-dim", "64",
            "--dtype", "float32"]
    for opt in rng.sample(sorted(DEMO_OPTIONS), rng.randint(1, 3)):
        argv += [opt, _value(rng, files, DEMO_OPTIONS[opt])]
    return argv


@pytest.mark.parametrize("seed", range(4))
def test_fuzz_sim(seed, files, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)              # a hostile relative --out lands in tmp_path
    rng = random.Random(seed)
    for _ in range(40):
        check(sim_cli, _sim_argv(rng, files), capsys)


@pytest.mark.parametrize("seed", range(2))
def test_fuzz_demo(seed, files, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = random.Random(100 + seed)
    for _ in range(25):
        check(demo_cli, _demo_argv(rng, files), capsys)


def test_fuzz_random_tokens(files, capsys, tmp_path, monkeypatch):
    """Argument lists of random tokens: options in random order, values anywhere."""
    monkeypatch.chdir(tmp_path)
    rng = random.Random(7)
    words = list(SIM_COMMANDS) + ["demo"] + list(SIM_OPTIONS) + list(HOSTILE) + ["--json"]
    for _ in range(60):
        argv = [rng.choice(words) for _ in range(rng.randint(0, 6))]
        check(sim_cli, argv, capsys)
        check(demo_cli, argv, capsys)


@pytest.mark.parametrize("argv", [
    ["-m", "sim", "compare", "--tree", "1,1000000000_16,16"],
    ["-m", "pat_core", "demo", "--tree", "1,100000_16,16"],
])
def test_real_entry_points_refuse_huge_trees(argv):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable] + argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].count("error:") == 1
    assert "65536" in p.stderr and time.perf_counter() - t0 < 30


# ---------------------------------------------------------------------------- item 5: constants
def test_constants_file_must_exist_parse_and_be_complete(files, tmp_path, capsys):
    for path in (files["missing"], files["empty"], files["dir"], files["garbage"],
                 files["list"]):
        err = check(sim_cli, ["compare", "--tree", "1,2_20,20", "--constants", path], capsys,
                    want=2)
        assert path in err
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"constants": {"hbm_bandwidth": 3000.0}}))
    err = check(sim_cli, ["compare", "--constants", str(partial)], capsys, want=2)
    assert "missing constants" in err and "sm_bandwidth" in err
    bad = tmp_path / "nan.json"
    full = load_constants("h100").as_dict()
    bad.write_text(json.dumps({"constants": dict(full, tile_ns="fast")}))
    assert "tile_ns" in check(sim_cli, ["compare", "--constants", str(bad)], capsys, want=2)
    good = save_constants(load_constants("h100"), "h100", str(tmp_path / "good.json"))
    out = check(sim_cli, ["compare", "--tree", "1,2_20,20", "--constants", good, "--json"],
                capsys, want=0)
    assert json.loads(out)["constants_source"] == load_constants("h100").source
    # the packaged files (some older than the newest constants) still load without a path
    for gpu in ("a100", "h100", "h200"):
        load_constants(gpu)


# ---------------------------------------------------------------------------- JSON trees
@pytest.mark.parametrize("data, what", [
    ({"block_tables": [[0, 1]], "seq_lens": [20], "page_size": 16.5}, "page_size"),
    ({"block_tables": [[0, 1]], "seq_lens": [20], "page_size": 16.0}, "page_size"),
    ({"block_tables": [[0, 1]], "seq_lens": [20.7], "page_size": 16}, "seq_lens"),
    ({"block_tables": [[0, 1.0]], "seq_lens": [20], "page_size": 16}, "block_tables"),
    ({"block_tables": [[0, 1]], "seq_lens": [True], "page_size": 16}, "seq_lens"),
])
def test_json_tree_refuses_non_integers(data, what, tmp_path, capsys):
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(data))
    err = check(sim_cli, ["compare", "--tree", str(path), "--heads", "8:8"], capsys, want=2)
    assert what in err and "integer" in err


# ---------------------------------------------------------------------------- trace arguments
@pytest.mark.parametrize("opt, value", [
    ("--start-s", "nan"), ("--start-s", "inf"), ("--duration-s", "nan"), ("--step-ms", "inf"),
    ("--max-requests", "-1"), ("--max-steps", "-1"), ("--every", "0"), ("--kv-pages", "-5"),
    ("--sample", "nan"),
])
def test_trace_refuses_nan_and_negative_counts(opt, value, files, capsys):
    err = check(sim_cli, ["trace", "--trace", files["trace"], "--out", files["out"],
                          "--no-plot", "--no-progress", opt, value], capsys, want=2)
    assert opt in err


def test_trace_out_naming_a_directory_is_refused(files, capsys, tmp_path):
    for out in (files["dir/"], files["dir"]):
        err = check(sim_cli, ["trace", "--trace", files["trace"], "--out", out, "--no-plot",
                              "--no-progress"], capsys, want=2)
        assert "directory" in err
    assert not list((tmp_path / "dir").iterdir())          # no hidden dir/.json
    err = check(sim_cli, ["sweep", "--knob", "batch", "--values", "2", "--out", files["dir/"]],
                capsys, want=2)
    assert "directory" in err
    err = check(sim_cli, ["trace", "--trace", files["trace"], "--out", files["under_file"],
                          "--no-plot", "--no-progress"], capsys, want=2)
    assert "a file is in the way" in err
    check(sim_cli, ["trace", "--trace", files["trace"], "--out", files["out"], "--no-plot",
                    "--no-progress"], capsys, want=0)          # a new folder is created
    assert (tmp_path / "out" / "o.json").exists()


# ---------------------------------------------------------------------------- tracebacks
def test_numbers_past_int64_in_a_tree(tmp_path, capsys):
    check(sim_cli, ["compare", "--tree", "1_99999999999999999999"], capsys, want=2)
    check(sim_cli, ["compare", "--tree", "99999999999999999999_16"], capsys, want=2)
    path = tmp_path / "tree.json"
    for data in ({"block_tables": [[0, 2**70]], "seq_lens": [20], "page_size": 16},
                 {"block_tables": [[0, 1]], "seq_lens": [2**40], "page_size": 16},
                 {"block_tables": [[0, 1]], "seq_lens": [20], "page_size": 2**70}):
        path.write_text(json.dumps(data))
        check(sim_cli, ["compare", "--tree", str(path)], capsys, want=2)


def test_a_directory_where_a_file_is_expected(files, capsys):
    check(sim_cli, ["compare", "--constants", files["dir"]], capsys, want=2)
    check(sim_cli, ["compare", "--tree", files["dir"]], capsys, want=2)
    err = check(sim_cli, ["trace", "--trace", files["dir"], "--out", files["out"], "--no-plot",
                          "--no-progress"], capsys, want=2)
    assert "Is a directory" in err and "Errno" not in err


def test_trace_nothing_can_be_scheduled(files, tmp_path, capsys):
    err = check(sim_cli, ["trace", "--trace", files["trace"], "--out", files["out"],
                          "--kv-pages", "1", "--no-plot", "--no-progress"], capsys, want=2)
    assert "no request can ever be scheduled" in err
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"timestamp": 0, "input_length": 600,
                                "output_length": 10**9, "hash_ids": [0, 1]}) + "\n")
    err = check(sim_cli, ["trace", "--trace", str(long), "--out", files["out"], "--no-plot",
                          "--no-progress"], capsys, want=2)
    assert "no request can ever be scheduled" in err


# ---------------------------------------------------------------------------- size limits
@pytest.mark.parametrize("tree, numbers", [
    ("1,1000000000_16,16", ("1000000000", "65536")),
    ("1_2147483647", ("134217728", "16777216")),
    ("1," * 70 + "1_" + "1," * 70 + "1", ("71", "64")),
])
def test_huge_trees_refused_up_front(tree, numbers, capsys):
    t0 = time.perf_counter()
    err = check(sim_cli, ["compare", "--tree", tree], capsys, want=2)
    assert time.perf_counter() - t0 < 2 and all(n in err for n in numbers), err


def test_huge_sweeps_refused_up_front(capsys, tmp_path):
    for knob, value in (("depth", "1000000000"), ("batch", "1000000000")):
        err = check(sim_cli, ["sweep", "--knob", knob, "--values", value,
                              "--out", str(tmp_path / "s")], capsys, want=2)
        assert "limit" in err


def test_demo_refuses_what_does_not_fit_its_memory_limit(capsys):
    err = check(demo_cli, ["demo", "--tree", "1,100000_16,16"], capsys, want=2)
    assert "100000" in err and "65536" in err
    # within the tree limits, past the demo's 1 GiB of KV cache, queries and reference
    err = check(demo_cli, ["demo", "--tree", "1,10000_16,16"], capsys, want=2)
    assert "MiB" in err and "1024" in err
    err = check(demo_cli, ["demo", "--tree", "1,2_20,20", "--head-dim", "100000000"], capsys,
                want=2)
    assert "MiB" in err


def test_tree_size_is_what_build_tree_batch_builds():
    for spec in DESIGN_WORKLOADS + DEEP_WORKLOADS + SMALL_TREES:
        for ps in (1, 16, 64):
            b = build_tree_batch(spec, ps)
            size = tree_size(spec, ps)
            assert size["pages"] == b.num_pages and size["table_entries"] == b.block_tables.size
            assert size["requests"] == b.batch_size


# ---------------------------------------------------------------------------- CSR messages
@pytest.mark.parametrize("indptr, indices, last, name", [
    ([0, 2], [0, -3], [5], "indices[1]"),
    ([0, 2], [0, 2**40], [5], "indices[1]"),
    ([0], [], [], "indptr"),
])
def test_plan_csr_errors_name_the_csr_arguments(indptr, indices, last, name):
    w = PrefixAttentionWrapper("cpu")
    with pytest.raises(ValueError) as e:
        w.plan_csr(np.asarray(indptr, np.int64), np.asarray(indices, np.int64),
                   np.asarray(last, np.int64), 8, 2, 64, 16)
    assert name in str(e.value) and "block_tables" not in str(e.value)


def test_fit_bad_measured_value_is_an_error_line(files, capsys):
    err = check(sim_cli, ["fit", "--measurements", files["empty"], "--out", files["out"],
                          "--measured", "copy_bandwidth_gbps"], capsys, want=2)
    assert "KEY=NUMBER" in err


def test_timeline_max_sms_must_be_positive(files, capsys):
    err = check(sim_cli, ["timeline", "--tree", "1,4_64,16", "--out", files["out"],
                          "--max-sms", "-3"], capsys, want=2)
    assert "--max-sms" in err
