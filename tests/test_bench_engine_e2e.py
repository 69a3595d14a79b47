"""bench/engine_e2e.py: the workloads' sharing, the token comparison and (with torch and
transformers, the ``.[transformers]`` extra CI does not install) the tiny CPU smoke run."""
import json
import types
import importlib.util

import pytest

from bench.engine_e2e import WORKLOADS, build_workload, compare_tokens

HAVE_HF = (importlib.util.find_spec("torch") is not None
           and importlib.util.find_spec("transformers") is not None)
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="torch and transformers not installed "
                              "(pip install -e '.[transformers]'); CI does not install them")


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("kind", WORKLOADS)
def test_workloads_share_what_they_say(kind):
    prompts, info = build_workload(kind, 24, 96, 1000, seed=3, suffix=(5, 9), samples=8,
                                   templates=2, turns=3)
    assert len(prompts) == info["requests"] == 24
    assert all(3 <= t < 1000 for p in prompts for t in p)
    assert info["prompt_tokens_total"] == sum(map(len, prompts))
    if kind == "sysprompt":
        assert all(p[:96] == prompts[0][:96] for p in prompts)
        assert all(101 <= len(p) <= 105 for p in prompts)
    elif kind == "none":
        # random prompts: no two share more than a couple of leading tokens
        assert max(common_prefix(a, b) for i, a in enumerate(prompts)
                   for b in prompts[i + 1:]) < 4
    elif kind == "sampling":
        assert info["shared_prompts"] == 3
        for g in range(3):
            assert all(p == prompts[8 * g] for p in prompts[8 * g:8 * g + 8])
        assert prompts[0] != prompts[8]
    else:
        assert info["sessions"] == 8 and info["history_tokens"] == 24
        for s in range(8):
            turns = prompts[3 * s:3 * s + 3]
            assert all(t[:96] == prompts[s % 2 * 3][:96] for t in turns)   # the template
            # turn t holds the first (t+1)/3 of the session's history
            assert common_prefix(turns[0], turns[2]) >= 96 + 8
            assert common_prefix(turns[1], turns[2]) >= 96 + 16
        assert prompts[0][:96] != prompts[3][:96]


def test_workload_argument_errors():
    with pytest.raises(ValueError, match="workload"):
        build_workload("chat", 4, 8, 100, 0)
    with pytest.raises(ValueError, match="requests"):
        build_workload("none", 0, 8, 100, 0)
    with pytest.raises(ValueError, match="suffix"):
        build_workload("none", 2, 8, 100, 0, suffix=(4, 2))
    with pytest.raises(ValueError, match="samples"):
        build_workload("sampling", 2, 8, 100, 0, samples=0)


def out(tokens, logprobs=()):
    return types.SimpleNamespace(generated_tokens=list(tokens), logprobs=list(logprobs))


def test_paired_ratios_pair_runs_of_one_round():
    """Round i of an implementation is divided by round i of the reference (not the medians),
    and implementations that were skipped get none."""
    from bench.engine_e2e import paired_ratios

    def run(tput, step):
        return {"decode_tokens_per_s": tput, "decode_step_ms_median": step}
    rows = {"ref": [run(100.0, 10.0), run(200.0, 5.0), run(150.0, 8.0)],
            "a": [run(90.0, 11.0), run(220.0, 4.0), run(150.0, 10.0)],
            "gone": {"status": "skipped"}}
    got = paired_ratios(rows, "ref")
    assert set(got) == {"a"}
    assert got["a"]["decode_tokens_per_s"] == pytest.approx([0.9, 1.1, 1.0])
    assert got["a"]["decode_tokens_per_s_median"] == pytest.approx(1.0)
    assert got["a"]["decode_step"] == pytest.approx([10 / 11, 1.25, 0.8])
    assert got["a"]["decode_step_median"] == pytest.approx(10 / 11)
    assert paired_ratios({"a": rows["a"]}, "ref") == {}


def test_gc_timer_counts_each_generation_while_installed():
    """Collections run while the timer is installed are counted in their generation, with
    their time; none after remove()."""
    import gc
    from bench.engine_e2e import GcTimer
    t = GcTimer()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        t.remove()
    s = t.summary()
    gc.collect(2)
    assert t.summary() == s                         # removed: not counted
    assert s["gc_collections"][0] >= 1 and s["gc_collections"][2] >= 2
    assert all(ms >= 0 for ms in s["gc_ms"]) and s["gc_ms"][2] > 0


def test_compare_tokens_reports_the_first_divergence():
    ref = [out([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0]), out([5, 6, 7], [-1.0, -1.0, -1.0])]
    got = [out([1, 2, 3, 9], [-1.0, -2.5, -3.0, -4.1]), out([5, 6, 7], [-1.0, -1.0, -1.25])]
    c = compare_tokens(ref, got, check=4)
    assert c["requests"] == 2 and c["identical"] == 1 and c["check_tokens"] == 4
    assert c["divergences"] == [dict(request=0, index=3, ref_token=4, token=9,
                                     ref_logprob=-4.0, logprob=-4.1)]
    assert c["max_logprob_diff_before_divergence"] == 0.5
    # only the first `check` tokens count
    assert compare_tokens(ref, got, check=3)["identical"] == 2
    # without log-probabilities
    c = compare_tokens([out([1, 2])], [out([1, 3])], check=2)
    assert c["divergences"] == [dict(request=0, index=1, ref_token=2, token=3)]
    assert c["max_logprob_diff_before_divergence"] is None


@needs_hf
@pytest.mark.parametrize("workload", ["sysprompt", "agent"])
def test_tiny_smoke_run(tmp_path, workload):
    """The CPU smoke path end to end: pat and paged|sdpa run, float32 tokens match for every
    request, pat planned once per decode step and read the shared pages once."""
    from bench.engine_e2e import main
    path = tmp_path / "e2e.json"
    # the CPU path on any machine (pat's kernels refuse the tiny model's head_dim 16)
    res = main(["--model", "tiny", "--device", "cpu", "--requests", "8", "--prompt-tokens", "64",
                "--new-tokens", "16", "--dtype", "float32", "--num-blocks", "128",
                "--max-batch-tokens", "256", "--repeats", "2", "--probe",
                "--workload", workload, "--out", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(res))
    assert res["benchmark"] == "engine_e2e" and res["git_sha"]
    assert res["device"]["kind"] == "cpu"
    assert set(res["versions"]) >= {"torch", "transformers", "pat", "python"}
    assert res["config"]["workload"] == workload and res["config"]["allow_block_sharing"]
    rows = {r["impl"]: r for r in res["impls"]}
    assert set(rows) == {"paged|sdpa", "paged|pat"}
    for r in rows.values():
        assert r["status"] == "ok"
        assert r["output_tokens"] == 8 * 16
        assert 0 < r["ttft_s_max"] <= r["run_s"] <= r["wall_s"]
        assert 64 <= r["decode_tokens"] < 8 * 16 and r["decode_tokens_per_s"] > 0
        assert r["tpot_ms_median"] > 0
        assert r["repeats"] == 2 and r["decode_tokens_per_s"] == min(
            r["repeat_decode_tokens_per_s"])          # the lower middle of two
        assert r["steps"] >= 16 and r["decode_steps"] >= 15
        assert 0 < r["profile"]["attention_share"] < 1
        assert 0 < r["engine_prepare_next_batch_ms_median"] < r["decode_step_ms_median"]
        assert 0 < r["engine_update_batch_ms_median"] < r["decode_step_ms_median"]
        assert 0 < r["engine_compute_batch_ms_median"] < r["decode_step_ms_median"]
        assert r["engine_retrieve_device_outputs_ms_median"] >= 0
        # every engine call in order; no graphs on the CPU, so no capture
        calls = r["engine_calls"]
        assert [m for m, _ in calls[:4]] == ["prepare_next_batch", "compute_batch",
                                             "retrieve_device_outputs", "update_batch"]
        assert sum(m == "compute_batch" for m, _ in calls) == r["steps"]
        assert all(t >= 0 for _, t in calls) and r["engine_capture_graph_ms_median"] is None
        # the engine thread's resources: its CPU time within the step's wall time, and the
        # process's at least the thread's
        assert 0 < r["step_cpu_ms_median"] <= r["decode_step_ms_median"] * 1.05
        assert r["step_process_cpu_ms_median"] >= r["step_cpu_ms_median"]
        assert 0 < r["engine_prepare_next_batch_cpu_ms_median"] <= \
            r["engine_prepare_next_batch_ms_median"] * 1.05
        assert r["step_minflt_median"] >= 0 and r["step_nvcsw_median"] >= 0
        assert r["cuda_allocator"] == {"num_device_alloc": 0, "num_device_free": 0,
                                       "num_alloc_retries": 0}      # a CPU run
        p = r["probe"]                  # no device to wait for on the CPU: no backlog key
        assert p["gpu_backlog_ms_median"] is None and p["decode_step_ms_median"] > 0
    s = rows["paged|pat"]["seam_stats"]
    assert s["plans"] == s["pat_steps"] >= 15
    assert s["plan_kv_tokens"] < s["request_kv_tokens"]
    r = rows["paged|pat"]
    assert 0 < r["host_plan_share"] < 1
    assert 0 < r["host_copy_ms_median"] < r["host_step_ms_median"] <= r["host_step_ms_max"]
    assert r["host_step_ms_median"] < r["attn_host_ms_median"]    # planning + the layers
    assert len(r["repeat_attn_host_ms_median"]) == 2
    assert 0 < r["attn_cpu_ms_median"] <= r["attn_host_ms_median"] * 1.05
    pr = r["paired_vs_reference"]
    sdpa = rows["paged|sdpa"]["repeat_decode_tokens_per_s"]
    assert pr["reference"] == "paged|sdpa" and len(pr["decode_tokens_per_s"]) == 2
    assert pr["decode_tokens_per_s"] == pytest.approx(
        [a / b for a, b in zip(r["repeat_decode_tokens_per_s"], sdpa)])
    assert len(pr["decode_step"]) == 2 and pr["decode_step_median"] > 0
    assert "paired_vs_reference" not in rows["paged|sdpa"]
    c = res["correctness"]["paged|pat"]
    assert c["requests"] == 8 and c["check_tokens"] == 16
    assert c["identical"] == 8 and c["divergences"] == []
    assert c["max_logprob_diff_before_divergence"] < 1e-4


@needs_hf
def test_unknown_implementation_is_skipped_with_its_reason():
    from bench.engine_e2e import main
    res = main(["--model", "tiny", "--device", "cpu", "--requests", "2", "--prompt-tokens", "16",
                "--new-tokens", "2", "--dtype", "float32", "--num-blocks", "16",
                "--max-batch-tokens", "64",
                "--warmup-tokens", "0", "--profile-tokens", "0",
                "--impls", "paged|sdpa paged|no_such_impl"])
    rows = {r["impl"]: r for r in res["impls"]}
    assert rows["paged|sdpa"]["status"] == "ok" and "profile" not in rows["paged|sdpa"]
    assert rows["paged|no_such_impl"]["status"] == "skipped"
    assert "no_such_impl" in rows["paged|no_such_impl"]["reason"]
    assert res["correctness"] == {}


def test_graph_suffix_names_the_registered_implementation():
    from bench.engine_e2e import base_impl
    assert base_impl("paged|sdpa+graph") == ("paged|sdpa", True)
    assert base_impl("paged|pat") == ("paged|pat", False)


@needs_hf
def test_graph_runs_skip_the_profile():
    """A ``+graph`` implementation runs (on the CPU the engine turns its graphs off) and is not
    profiled (a graph replay calls no forward hook), with profiling on for the others."""
    from bench.engine_e2e import main
    res = main(["--model", "tiny", "--device", "cpu", "--requests", "2", "--prompt-tokens", "16",
                "--new-tokens", "4", "--dtype", "float32", "--num-blocks", "32",
                "--max-batch-tokens", "64", "--repeats", "1", "--profile-tokens", "2",
                "--impls", "paged|sdpa paged|sdpa+graph"])
    rows = {r["impl"]: r for r in res["impls"]}
    assert rows["paged|sdpa+graph"]["status"] == "ok" and "profile" not in rows["paged|sdpa+graph"]
    assert "profile" in rows["paged|sdpa"]
