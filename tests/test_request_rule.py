"""The ``pat`` packer's per-request rule (:func:`pat_core.packers.request_packing`): one CTA
per request, with no merge, where sharing short levels would cost more than re-reading them."""
import numpy as np
import pytest

from pat_core import Planner, PrefixAttentionWrapper, Tuning
from pat_core.forest import PrefixForest
from pat_core.inputs import as_block_table
from pat_core.packers import REQUEST_L2_SHARE, request_share, request_wins, shared_tokens
from pat_core.gpus import H100
from pat_core.reference import dense_attention, relative_error
from pat_core.workloads import build_tree_batch, random_kv_cache


def _plan(spec, hq, hk, d=128, ps=16, **tun):
    b = build_tree_batch(spec, page_size=ps)
    return b, Planner("pat", "h100", Tuning(**tun)).plan(b.block_tables, b.seq_lens, hq, hk, d, ps)


@pytest.mark.parametrize("hq", [16, 32, 64])
def test_long_leaves_under_short_levels_run_one_cta_per_request(hq):
    b, plan = _plan("1,32,256_64,64,1024", hq, 8)
    assert plan.one_cta_per_request and plan.packer == "pat"
    assert plan.stats()["partial_bytes"] == 0          # no slot written, no merge
    _, off = _plan("1,32,256_64,64,1024", hq, 8, request_share=0.0)
    assert off.num_ctas > off.batch_size and off.stats()["partial_bytes"] > 0


def test_shared_pages_beyond_the_l2_keep_sharing():
    """32:32: the shared levels' pages over 32 KV heads are 34 MB, more than a quarter of the
    H100's 50 MB L2."""
    b = build_tree_batch("1,32,256_64,64,1024", page_size=16)
    foot = shared_tokens(PrefixForest(as_block_table(b.block_tables, b.seq_lens, 16))) \
        * 32 * 2 * 128 * 2
    assert foot > REQUEST_L2_SHARE * H100.l2_bytes
    # the share forced to 32:8's, so that only the L2 check can refuse
    _, plan = _plan("1,32,256_64,64,1024", 32, 32, request_share=0.3)
    assert not plan.one_cta_per_request and plan.num_ctas > plan.batch_size
    _, fits = _plan("1,256_128,1024", 32, 32, request_share=0.3)    # 2 MB of shared pages
    assert fits.one_cta_per_request


def test_rereading_too_much_or_needing_a_split_keeps_sharing():
    _, half = _plan("1,256_512,1024", 32, 8)            # +50% tokens per request
    assert not half.one_cta_per_request
    _, quick = _plan("1,4,8_128,256,2048", 32, 8)       # per request it would be split
    assert not quick.one_cta_per_request and quick.num_ctas > quick.batch_size
    # 16 requests x 8 KV heads fill the SMs once: one CTA each, unsplit, no merge
    _, wave = _plan("1,4,16_128,256,1024", 32, 8)
    assert wave.one_cta_per_request and wave.num_ctas == wave.batch_size
    _, root = _plan("1,16_2048,128", 32, 8)             # a wide root: sharing carries the step
    assert not root.one_cta_per_request


def test_rule_is_off_where_the_merge_stays():
    b = build_tree_batch("1,32,256_64,64,1024", page_size=16)
    args = (b.block_tables, b.seq_lens, 32, 8, 128, 16)
    assert Planner("pat", "h100").plan(*args).one_cta_per_request
    for tun, kw in ((Tuning(request_share=0.0), {}), (Tuning(), {"serial": True}),
                    (Tuning(max_rows=32), {}), (Tuning(), {"tile": (16, 64)})):
        assert not Planner("pat", "h100", tun).plan(*args, **kw).one_cta_per_request, (tun, kw)


def test_request_wins_threshold():
    assert request_wins(100, 130, 0.3) and not request_wins(100, 131, 0.3)
    assert not request_wins(100, 100, 0.0)
    # the share grows with the GQA group: partials scale with query heads, re-reads with KV heads
    assert request_share(2) < request_share(4) < request_share(8) <= 0.4
    assert request_share(16) == request_share(8)
    # off at group 1: every step measured there lost, real-trace steps at 4-5% more tokens too
    assert request_share(1) == 0.0


@pytest.mark.parametrize("spec,hq,hk,per_request", [
    ("1,256_256,1024", 32, 8, True),      # +25% at group 4: won 1.1% (H100)
    ("1,256_256,1024", 32, 32, False),    # +23% at group 1: lost 5%
    ("1,256_128,1024", 32, 32, False),    # +12% at group 1: lost 2%
    ("1,33_512,8000", 32, 32, False),     # +5% at group 1: real-trace steps like it lost 4-7%
    ("1,256_384,1024", 64, 8, True),      # +34% at group 8: won 1.1%
    ("1,256_512,1024", 64, 8, False),     # +50% at group 8: lost 1.6%
    ("1,256_128,1024", 16, 8, True),      # +11% at group 2: won 0.4%
    ("1,256_256,1024", 16, 8, False)])    # +25% at group 2: a tie
def test_share_follows_the_group(spec, hq, hk, per_request):
    _, plan = _plan(spec, hq, hk)
    assert plan.one_cta_per_request == per_request


def test_per_request_plan_matches_dense_attention_on_cpu():
    b = build_tree_batch("1,8_16,240", page_size=16)
    k, v = random_kv_cache(b.num_pages, 16, num_kv_heads=2, head_dim=64, dtype=np.float16)
    q = np.random.default_rng(3).standard_normal((b.batch_size, 8, 64)).astype(np.float16)
    w = PrefixAttentionWrapper(backend="cpu", packer="pat")
    plan = w.plan(b.block_tables, b.seq_lens, 8, 2, 64, 16)
    assert plan.one_cta_per_request
    out = w.run(q, (k, v))
    ref = dense_attention(q, (k, v), b.block_tables, b.seq_lens, 16)
    assert relative_error(out, ref) < 2e-3


@pytest.mark.parametrize("spec", ["1,8_48,144", "1,8_64,192", "1,8_32,88"])
def test_length_update_makes_the_choice_a_fresh_plan_makes(spec):
    """Leaves grown one token at a time inside their last page: the lazy update keeps or
    re-makes the choice exactly as planning the grown batch from scratch does.  On the first
    two batches growing leaves dilute the shared level's re-reads below the threshold: the
    choice flips on the way."""
    b = build_tree_batch(spec, page_size=16)
    start = b.seq_lens - 15
    lazy = Planner("pat", "h100")
    seen, reused = set(), False
    for grow in range(16):
        p1 = lazy.plan(b.block_tables, start + grow, 32, 8, 128, 16)
        p2 = Planner("pat", "h100").plan(b.block_tables, start + grow, 32, 8, 128, 16)
        assert p1.one_cta_per_request == p2.one_cta_per_request, (spec, grow, lazy.last_path)
        assert p1.num_ctas == p2.num_ctas
        for name in p1.ARRAY_FIELDS:
            assert np.array_equal(getattr(p1, name), getattr(p2, name)), (spec, grow, name)
        seen.add(p1.one_cta_per_request)
        assert grow == 0 or lazy.last_path in ("lengths", "full")
        # a per-request plan whose leaves grow inside their pages keeps its packing
        reused |= p1.one_cta_per_request and lazy.last_path == "lengths"
    assert len(seen) == (1 if spec == "1,8_32,88" else 2)
    assert reused
