"""Kernel lab: build, check and time forward-kernel variants side by side in one GPU call.

    python3 bench/lab/kernel_lab.py --out DIR [--cases forced,long,sharing] [--iters 20]

Each case plans one workload (tree-spec format, see :mod:`pat_core.workloads`) with one packer,
optionally forcing every CTA onto one tile ``(m, n)`` and one variant layout
``(warps, stages, rows_per_warp)``; runs it; checks the output against float64 attention on the
GPU (relative error at most twice that of a plain same-dtype torch implementation, or 2**-11,
whichever is larger); then times it (CUDA events, L2 flushed before every run, median of
``--iters``; eager and CUDA-graph replay).  Reported per case: time, time / floor (the floor
is the bytes any kernel must move, unique KV once + q + out, at the copy bandwidth measured in
the same run) and the fraction of copy bandwidth the plan's own bytes move at.

Case sets:

* ``forced``: no-sharing ``256_4096`` (32:8) with every CTA forced onto a 64- or 128-row tile,
  so each 4096-token CTA computes a full tile of rows: the throughput of the compute-heavy
  tiles, layout A/B (16 vs 32 rows per warp).
* ``long``: one shared 16k-token prefix, 64 and 128 rows (``1,16_16384,16``, ``1,32_16384,16``).
* ``sharing``: the development sharing batches, pat and query.
* ``forced-wg``: the ``forced`` workload on the Hopper warpgroup (``wgmma``) layout of each
  64- and 128-row tile; ``wg``: the long and sharing batches with the default layouts and with
  the warpgroup layout forced for every tile of 64 or more rows (label ``wg``).
* ``layouts``: every tile with its candidate layouts (the data of ``--write-table``);
  ``short``: deep trees whose leaves are 16- and 32-token CTAs, under the short-KV layouts
  (single-stage ring, one warp); ``m128``: the batches with 128-row CTAs over a shared prefix,
  with their ``n`` forced to 64 or 128; ``short-check``: the batches that moved between full
  comparisons, default vs the single-stage 16x32 layout; ``long-tune``: the long-prefix
  batches under planner settings; ``planner``: the sharing batches under every planner setting
  of ``TUNINGS``; ``quickstart``, ``nosharing``, ``nosharing-n``: the quick-start batch per
  packer, the no-sharing batches; ``long-stages``: the long-prefix batches with deeper
  warpgroup rings and fewer, longer parts; ``share-low``: every batch whose plan moves with a
  split share below 2, at shares 2 (default then), 0.95 and 1; ``one-wave``: the default split
  (one block per SM for many-row CTAs) against share 2 where they differ;
  ``one-wave-layouts``: the long-prefix batches' one-wave CTAs on mma.sync layouts of several
  token-slice pipelines per block; ``hnd``: the long prefixes and a few sharing batches with the
  cache in the HND layout against NHD; ``wg-slices``: the batches whose plans have 64-row
  tiles, default layouts against the 64-row warpgroup tiles on two token slices (8 warps), and
  those tiles forced on the no-sharing batch; ``wg-gather``: every development batch whose plan
  has warpgroup tiles, and the forced warpgroup tiles of two stages on the no-sharing batch;
  ``wg-overlap``: the batches whose plans put many rows on warpgroup tiles, and the same forced
  tiles; ``wg-pp``: the warpgroup-heavy batches, default and with n 128 for the 128-row tiles,
  and the forced two-stage warpgroup tiles; ``rows64-all``: the multi-launch batches at four
  head configurations, default against CTAs of at most 64 rows; ``reread``,
  ``request-check``, ``leaf-query``: the ``pat`` plan against one CTA per request (the
  ``query`` packer) and the request rule; ``mixed``: 48 plans with several tile kernels (the
  sharing set and five validation-like batches at four head configurations), for build or
  environment A/Bs.  (The case sets of the deleted launch modes, such as ``finish-*``,
  ``chain``, ``one-tile``, ``merge-fwd`` and ``merge-heads``, are in git history with
  bench/NOTES.md's rounds that measured them.)

Writes ``DIR/kernel_lab.json`` (environment, copy bandwidth, every row) and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/kernel_lab.py
    sys.path.insert(0, str(ROOT))

# (workload, (hq, hk), packer, tile or None, variant override (warps, stages, rw) or None, label)
FORCED = tuple(
    ("256_4096", (32, 8), "query", tile, over, label)
    for tile, over, label in (
        ((64, 64), None, "default"), ((64, 64), (8, 3, 16), "rw16-w8"),
        ((64, 128), None, "default"), ((64, 128), (4, 2, 32), "w4-s2"),
        ((64, 32), None, "default"), ((64, 32), (2, 2, 32), "w2-s2"),
        ((128, 32), None, "default"), ((128, 32), (4, 2, 32), "w4-s2"),
        ((128, 64), None, "default"), ((128, 64), (4, 2, 32), "w4-s2"),
        ((128, 64), (8, 3, 16), "rw16-w8"),
        ((128, 128), None, "default"), ((128, 128), (4, 2, 32), "w4-s2")))
# the Hopper warpgroup (wgmma) layout for every tile of 64 or more rows: (warps, stages, 64)
WG_LAYOUTS = {(64, 16): (4, 3, 64), (64, 32): (4, 3, 64), (64, 64): (4, 3, 64),
              (64, 128): (4, 2, 64), (128, 16): (8, 3, 64), (128, 32): (8, 3, 64),
              (128, 64): (8, 2, 64), (128, 128): (8, 2, 64)}
FORCED_WG = tuple(
    ("256_4096", (32, 8), "query", tile, over, label)
    for tile, over, label in (
        ((64, 64), (4, 3, 64), "wg-s3"), ((64, 64), (4, 2, 64), "wg-s2"),
        ((64, 32), (4, 3, 64), "wg-s3"), ((64, 128), (4, 2, 64), "wg-s2"),
        ((128, 32), (8, 3, 64), "wg-s3"), ((128, 64), (8, 2, 64), "wg-s2"),
        ((128, 64), (8, 3, 64), "wg-s3"), ((128, 128), (8, 2, 64), "wg-s2")))
LONG = tuple(
    (spec, (32, 8), "pat", None, None, "default")
    for spec in ("1,16_16384,16", "1,32_16384,16"))
SHARING_SPECS = ("1,16_2048,128", "1,4,64_256,1024,64", "1,2,8,128_512,128,256,32",
                 "1,1024_1024,16", "1,8,64,512_128,512,64,32", "3,24,96_1024,64,512",
                 "1,4,16,64,256,1024_1024,256,128,64,32,32")
SHARING = tuple(
    (spec, heads, packer, None, None, "default")
    for spec in SHARING_SPECS for heads in ((32, 8), (32, 32)) for packer in ("pat", "query"))


# planner knobs (pat_core.Tuning fields), plus "layouts" (kernel layouts forced through
# cuda_compile.VARIANT_OVERRIDES), "n_by_m" (n forced per m) and "kv_layout" (the cache's
# layout).  Labels name what differs from the defaults.
_N16_32 = ((32, 16), (96, 32), (1 << 62, 64))
TUNINGS = {
    "default": {},
    "splitwork": {"split_by": "work"},
    "splitwork-s4": {"split_by": "work", "split_share": 4.0},
    "splitwork-rows64": {"split_by": "work", "max_rows": 64},
    "pw6": {"partial_weight": 6.0},
    "rows64": {"max_rows": 64},
    "n16to32": {"kv_tile_table": _N16_32},
    "tile-order": {"order": "tile"},
    "pw1": {"partial_weight": 1.0},
    "share1": {"split_share": 1.0},
    # the long-KV split's shortest part (pull launches: each part is an item a block runs in
    # turn, with its own Q load, prologue and partial write)
    "mp1024": {"min_part": 1024},
    "mp2048": {"min_part": 2048},
    "share2": {"split_share": 2.0},
    "share4": {"split_share": 4.0},
    "share6": {"split_share": 6.0},
    "rows32": {"max_rows": 32},
    "rows16": {"max_rows": 16},
    "narrow-off": {"narrow_share": 0.0},
    # batch-invariant plans' fixed KV chunk (tokens; bench/trace_replay.py pat-invariant@LABEL)
    "chunk256": {"invariant_chunk": 256},
    "chunk512": {"invariant_chunk": 512},
    "chunk1024": {"invariant_chunk": 1024},
    "wg": {"layouts": WG_LAYOUTS},
    "share3": {"split_share": 3.0},
    # the per-request rule off (the planner keeps its shared packing)
    "noreq": {"request_share": 0.0},
    # no long-KV split (a share this small makes the fair share the whole batch's KV)
    "nocut": {"split_share": 1e-6},
    "n32": {"kv_tile_table": ((1 << 62, 32),)},
    # one or two KV tile widths (a graph-safe launch set of fewer tiles)
    "n64": {"kv_tile_table": ((1 << 62, 64),)},
    "n32n64": {"kv_tile_table": ((96, 32), (1 << 62, 64))},
    "n64-m16n32": {"kv_tile_table": ((96, 32), (1 << 62, 64)),
                   "exclude_tiles": tuple((m, n) for m in (32, 64, 128) for n in (16, 32))},
    "n32-share3": {"kv_tile_table": ((1 << 62, 32),), "split_share": 3.0},
    # short-KV tiles with a single-stage ring (tile 0 loads with Q; smaller blocks, more per SM)
    "short-s1": {"layouts": {(16, 16): (1, 1, 16), (16, 32): (2, 1, 16)}},
    "short-w1s1": {"layouts": {(16, 16): (1, 1, 16), (16, 32): (1, 1, 16)}},
    "short-w1s2": {"layouts": {(16, 32): (1, 2, 16)}},
    # the 16x64 variant's layout (default 4 warps, 2 stages: 2 blocks per SM by registers)
    # finer splits of short steps (parts down to 64 tokens) with the one-warp 16x32 variant (10
    # blocks per SM) or the 16x64 one: every block resident at once, as FlashInfer decode does
    "n32-s6-mp64": {"kv_tile_table": ((1 << 62, 32),), "split_share": 6.0, "min_part": 64},
    "n32-s10-mp64": {"kv_tile_table": ((1 << 62, 32),), "split_share": 10.0, "min_part": 64},
    "n32-s20-mp64": {"kv_tile_table": ((1 << 62, 32),), "split_share": 20.0, "min_part": 64},
    "n32w1s2-s6-mp64": {"kv_tile_table": ((1 << 62, 32),), "split_share": 6.0, "min_part": 64,
                        "layouts": {(16, 32): (1, 2, 16)}},
    # round 17: the long shared prefix's warpgroup tiles with a deeper ring (one block per SM
    # keeps more tiles in flight) and fewer, longer parts (half the partial slots)
    "wg64-s3": {"layouts": {(64, 64): (4, 3, 64)}},
    "wg64-s4": {"layouts": {(64, 64): (4, 4, 64)}},
    # (split share 0.95: 16 parts of 1024 tokens, 128 blocks of 8 KV heads, one per SM)
    "share095": {"split_share": 0.95},
    "wg64-s3-share095": {"layouts": {(64, 64): (4, 3, 64)}, "split_share": 0.95},
    "wg64-s4-share095": {"layouts": {(64, 64): (4, 4, 64)}, "split_share": 0.95},
    "wg128-s3": {"layouts": {(128, 64): (8, 3, 64)}},
    "wg128-s3-share095": {"layouts": {(128, 64): (8, 3, 64)}, "split_share": 0.95},
    "wg128-s4-share095": {"layouts": {(128, 64): (8, 4, 64)}, "split_share": 0.95},
    # round 19: the one-wave long-prefix CTAs (one block per SM) on mma.sync layouts whose
    # token slices run as independent pipelines (8 warps: 2 or 4 slices for 64 rows, 1 or 2
    # for 128), against the warpgroup layout's single pipeline per block
    # round 20: the KV cache in the HND layout (each page holds one head's tokens
    # contiguously: a block's gather reads 4 KB runs instead of 256-byte rows 2 KB apart)
    "hnd": {"kv_layout": "HND"},
    # round 20: 64-row warpgroup tiles on two token slices (8 warps: two warpgroups over the
    # same rows, each walking half of every tile's tokens)
    "wg64-w8": {"layouts": {(64, 64): (8, 2, 64)}},
    "wg64-w8-s3": {"layouts": {(64, 64): (8, 3, 64)}},
    "wg64-w8-all": {"layouts": {(64, 32): (8, 3, 64), (64, 64): (8, 2, 64),
                                (64, 128): (8, 2, 64)}},
    "m64-w8r32": {"layouts": {(64, 64): (8, 2, 32)}},
    "m64-w8r16": {"layouts": {(64, 64): (8, 2, 16)}},
    "m64-w8r32-s3": {"layouts": {(64, 64): (8, 3, 32)}},
    "m64n128-w8r32": {"n_by_m": {64: 128}, "layouts": {(64, 128): (8, 2, 32)}},
    "m128-w8r32": {"layouts": {(128, 64): (8, 2, 32)}},
    "m128-w8r16": {"layouts": {(128, 64): (8, 2, 16)}},
    # the split's shortest part (default 256 tokens): only the smallest batches move
    "mp128": {"min_part": 128},
    "mp64": {"min_part": 64},
    "mp256": {"min_part": 256},   # the default before MIN_PART_TOKENS
    "s4-mp64": {"split_share": 4.0, "min_part": 64},
    "s6-mp64": {"split_share": 6.0, "min_part": 64},
    "l64-w4s3": {"layouts": {(16, 64): (4, 3, 16)}},
    "l64-w2s2": {"layouts": {(16, 64): (2, 2, 16)}},
    "l64-w2s3": {"layouts": {(16, 64): (2, 3, 16)}},
    "l64-w1s2": {"layouts": {(16, 64): (1, 2, 16)}},
    # 16x32 on one warp and one stage, and n = 32 only up to 32 tokens (one tile per CTA)
    "short32-w1s1": {"kv_tile_table": ((16, 16), (32, 32), (1 << 62, 64)),
                     "layouts": {(16, 16): (1, 1, 16), (16, 32): (1, 1, 16)}},
    # head_dim 256: the KV tile capped at 32 or 16 tokens for every KV length (the 16x64
    # tile's d256 layout holds one block of 4 warps per SM; 16x32 two of 2, 16x16 four of 1)
    "kv32": {"kv_tile_table": ((16, 16), (1 << 62, 32))},
    "kv16": {"kv_tile_table": ((1 << 62, 16),)},
    # the GPU's one KV-length table at every step size (a tuning's own table turns off the
    # busy-step table, GPUSpec.busy_kv_tile_tables): the ablation of that rule
    "one-table": {"kv_tile_table": ((16, 16), (96, 32), (1 << 62, 64))},
    # shared-prefix CTAs first in their tile's launch
    "shared-first": {"order": "shared"},
    # the pat packer's per-request rule off (pat_core.packers.request_packing)
    "request-off": {"request_share": 0.0},
    # n of the 128-row tiles forced (their KV is mostly shared, read from L2: compute bound)
    "m128n64": {"n_by_m": {128: 64}},
    # n of the 64-row tiles forced to 32 (a smaller warpgroup block: 4 per SM instead of 2)
    "m64n32": {"n_by_m": {64: 32}},
    "m128n128": {"n_by_m": {128: 128}},
    "m128n64-s3": {"n_by_m": {128: 64}, "layouts": {(128, 64): (8, 3, 64)}},
}


def apply_tuning(label: str, planner):
    """Set ``planner.tuning`` from ``TUNINGS[label]`` (``KeyError`` for an unknown label; the
    kernel layouts, forced n and cache layout are run_case's); returns a function that puts
    the planner's earlier tuning back."""
    from pat_core.planner import Tuning
    tun = dict(TUNINGS[label])
    tun.pop("layouts", None)   # kernel layouts: set by run_case (cuda_compile.VARIANT_OVERRIDES)
    tun.pop("n_by_m", None)    # forced n per m: set by run_case (forced_n)
    tun.pop("kv_layout", None)  # the cache's layout: set by run_case
    saved = planner.tuning
    planner.tuning = Tuning(**tun)

    def restore():
        planner.tuning = saved
    return restore


PLANNER_SPECS = ("1,16_2048,128", "1,4,64_256,1024,64", "1,2,8,128_512,128,256,32",
                 "1,1024_1024,16", "1,8,64,512_128,512,64,32", "1,4,16,64,256_512,256,128,64,32",
                 "1,2,4,8,16,32,64_256,128,64,64,32,32,32",
                 "1,8,16,32,64,128,1024_256,128,64,32,32,32,32",
                 "1,4,16,64,256,1024_1024,256,128,64,32,32")


def forced_n(n_by_m):
    """Make every TileSelector give tiles of ``m`` rows ``n_by_m[m]`` tokens per step (where
    that tile is feasible); returns a function that undoes it."""
    from pat_core import tiles
    orig = tiles.TileSelector.pick_n

    def pick_n(self, m, kv_len):
        n = n_by_m.get(int(m))
        return n if n is not None and n in self.n_by_m[int(m)] else orig(self, m, kv_len)
    tiles.TileSelector.pick_n = pick_n

    def undo():
        tiles.TileSelector.pick_n = orig
    return undo


SHORT_SPECS = ("1,4,16,64,256,1024_1024,256,128,64,32,32", "1,8,64,512_128,512,64,32",
               "1,1024_1024,16", "1,4,16,64,256_512,256,128,64,32",
               "1,8,16,32,64,128,1024_256,128,64,32,32,32,32")


#: head_dim of every case (``--head-dim``; the variant-speed table is per head_dim)
HEAD_DIM = 128


def _layout_candidates(head_dim: int = 128):
    """Per (m, n) at ``head_dim``: the rule layout, the other ring depth (2 vs 3 stages) and, at
    head_dim 256 (one row group of 16 per warp), half the warps, each forced onto every CTA of
    the no-sharing batch where the kernel's traits take it: the data behind a variant-speed
    table (pat_core.cuda_compile.variant_speed)."""
    import importlib
    cc = importlib.import_module("pat_core.cuda_compile")
    out = []

    def add(m, n, w, st, rw, label):
        # the traits' own rules (cuda_src/pat_traits.cuh): warps tile the rows, and each token
        # slice of a tile is whole blocks of 16 tokens
        wm = m // 16 if rw == cc.WG_ROWS else m // rw
        if w % wm or n % (w // wm) or (n // (w // wm)) % 16:
            return
        v = cc.FwdVariant(head_dim, "float16", m, n, w, st, rw)
        if cc.fwd_variant_feasible(v):
            out.append(("256_4096", (32, 8), "query", (m, n), (w, st, rw), label))

    for m in cc.TILE_MS:
        for n in (16, 32, 64, 128):
            rw = cc.default_rows_per_warp(m, head_dim)
            warps = {cc.rule_warps(m, n, head_dim)}
            if m == 128 and n >= 64:
                warps.add(4)   # one token slice: half the threads, the same rows per warp
            if head_dim > 128 and warps != {1}:
                warps.add(max(1, min(warps) // 2))
            for w in sorted(warps):
                for st in (2, 3):
                    add(m, n, w, st, rw, f"w{w}-s{st}-r{rw}")
            if m >= 64:   # the Hopper warpgroup layout: one warp per 16 rows
                for st in (2, 3, 4):
                    add(m, n, m // 16, st, cc.WG_ROWS, f"w{m // 16}-s{st}-wg")
    return tuple(out)


def _pair_cases(pairs, labels) -> tuple:
    """Cases (no forced tile or layout) for every ``(spec, (hq, hk))`` of ``pairs`` and every
    entry of ``labels``, pairs outermost: a tuning label (the ``pat`` packer) or a
    ``(packer, label)`` pair."""
    runs = [("pat", lab) if isinstance(lab, str) else tuple(lab) for lab in labels]
    return tuple((spec, heads, packer, None, None, label)
                 for spec, heads in pairs for packer, label in runs)


# sharing batches whose plans have two or more forward launches (round 21's chain)
CHAIN_SPECS = ("1,4,64_256,1024,64", "1,2,8,128_512,128,256,32", "3,24,96_1024,64,512",
               "1,8,64,512_128,512,64,32", "1,4,16,64,256_512,256,128,64,32",
               "1,4,16,64,256,1024_1024,256,128,64,32,32",
               "1,2,4,8,16,32,64_256,128,64,64,32,32,32",
               "1,8,16,32,64,128,1024_256,128,64,32,32,32,32", "1,16_2048,128",
               "1,1024_1024,16")

# the three head configurations of 8 KV heads the round-16 case sets sweep
_HEADS_X8 = ((16, 8), (32, 8), (64, 8))

# round 24: plans with several tile kernels (the block timelines showed a one-warp 16x32 block
# never sharing an SM with a 16x64 or 64x64 one), the shared-memory carveout's A/B
MIXED_SPECS = SHARING_SPECS + ("1,2,4,8,16,32,64,128_32,32,32,32,32,32,32,32",
                               "1,4,16,64_32,32,32,32", "2,8,64_256,512,64", "1,16,128_1024,64,32",
                               "1,4,16_128,256,1024")

CASE_SETS = {"forced": FORCED, "forced-wg": FORCED_WG,
             "mixed": _pair_cases(tuple((spec, heads) for spec in MIXED_SPECS
                                        for heads in ((16, 8), (32, 8), (64, 8), (32, 32))),
                                  ("default",)),
             "wg": tuple((spec, heads, "pat", None, None, label)
                         for spec in ("1,16_16384,16", "1,32_16384,16") + SHARING_SPECS
                         for heads in ((32, 8), (32, 32)) for label in ("default", "wg")),
             # round 23: CTAs capped at 64 rows (64x64 warpgroup blocks for the shared levels,
             # which leave an SM room for leaf blocks beside them) against the default
             "rows64-all": _pair_cases(tuple((spec, heads)
                                             for spec in CHAIN_SPECS + ("1,4,16_128,256,1024",)
                                             for heads in ((16, 8), (32, 8), (64, 8), (32, 32))),
                                       ("default", "rows64")),
             "long": LONG, "sharing": SHARING, "layouts": _layout_candidates(),
             "short": tuple((spec, heads, "pat", None, None, label)
                            for spec in SHORT_SPECS for heads in ((32, 8), (32, 32))
                            for label in ("default", "short-s1", "short-w1s1", "short-w1s2")),
             "short-check": _pair_cases((("1,8,64,512_128,512,64,32", (32, 32)),
                                         ("1,8,64,512_128,512,64,32", (32, 8)),
                                         ("1,4,16,64,256_512,256,128,64,32", (32, 32)),
                                         ("3,24,96_1024,64,512", (16, 8)),
                                         ("3,24,96_1024,64,512", (32, 8)),
                                         ("1,4,64_256,1024,64", (32, 8)),
                                         ("1,4,16,64,256,1024_1024,256,128,64,32,32", (32, 32))),
                                        ("default", "short-w1s1")),
             "leaf-check": tuple((spec, heads, packer, None, None, label)
                                 for spec in tuple(dict.fromkeys(SHARING_SPECS + PLANNER_SPECS))
                                 + ("128_2048",)
                                 for heads in ((32, 8), (32, 32))
                                 for packer in (("pat", "query") if spec == "128_2048"
                                                else ("pat",))
                                 for label in ("default", "short-w1s1", "short32-w1s1")),
             "m128": tuple((spec, (32, 8), "pat", None, None, label)
                           for spec in SHORT_SPECS[:3] + ("1,32_16384,16",)
                           for label in ("default", "m128n64", "m128n128", "m128n64-s3")),
             "nosharing-n": tuple(("128_2048", heads, "query", (16, n), None, f"n{n}")
                                  for heads in ((32, 8), (16, 8), (32, 32))
                                  for n in (32, 64, 128)),
             "planner": tuple((spec, heads, "pat", None, None, label)
                              for spec in PLANNER_SPECS for heads in ((32, 8), (32, 32))
                              for label in TUNINGS),
             "long-tune": tuple((spec, (32, 8), "pat", None, None, label)
                                for spec in ("1,16_16384,16", "1,32_16384,16", "1,16_2048,128")
                                for label in ("default", "share1", "share3", "share4", "rows32",
                                              "rows64", "n32",
                                              "n32-share3")),
             # a batch of long private leaves under short shared levels: the shared CTAs in the
             # leaves' own 16-row variant (one launch) or their own larger tile (round 13)
             "leaf-last": _pair_cases((("1,32,256_64,64,1024", (32, 8)),
                                       ("1,32,256_64,64,1024", (64, 8)),
                                       ("1,32,256_64,64,1024", (16, 8)),
                                       ("1,16_2048,128", (32, 8)),
                                       ("1,4,16_128,256,1024", (64, 8)),
                                       ("1,2,8,128_512,128,256,32", (32, 8))),
                                      ("default", "rows16")),
             # the configurations whose plans the narrow packing rule changes (round 13)
             "narrow": _pair_cases((("1,32,256_64,64,1024", (32, 8)),
                                    ("1,4,16_128,256,1024", (16, 8))),
                                   ("default", "narrow-off")),
             # the configurations whose plans the automatic split share changes (round 10)
             "auto-share": tuple((spec, heads, packer, None, None, label)
                                 for spec, heads, packer in (
                                     ("1,4,16_128,256,1024", (32, 8), "pat"),
                                     ("1,4,16_128,256,1024", (16, 8), "pat"),
                                     ("1,4,16_128,256,1024", (64, 8), "pat"),
                                     ("1,4,16_128,256,1024", (32, 8), "query"),
                                     ("1,16_2048,128", (32, 32), "pat"),
                                     ("1,16_2048,128", (32, 8), "query"),
                                     ("1,16_16384,16", (32, 32), "pat"),
                                     ("1,16_16384,16", (32, 8), "query"),
                                     ("1,16_16384,16", (32, 8), "pat"),
                                     ("1,1024_1024,16", (32, 8), "pat"))
                                 for label in ("default", "share2")),
             "m64": tuple((spec, heads, "pat", None, None, label)
                          for spec in ("1,16_16384,16", "1,32_16384,16", "1,16_2048,128",
                                       "1,2,8,128_512,128,256,32",
                                       "1,8,16,32,64,128,1024_256,128,64,32,32,32,32")
                          for heads in ((32, 8), (32, 32))
                          for label in ("default", "m64n32")),
             # the quick-start batch, where FlashInfer decode leads at 16:8 (round 16): the split
             # and the 16-row variants' layouts on a one-to-two-wave step
             "qs-tune": _pair_cases((("1,4,16_128,256,1024", (16, 8)),
                                     ("1,4,16_128,256,1024", (32, 8)),
                                     ("1,4,16_128,256,1024", (64, 8))),
                                    ("default", "share2", "share4", "share6", "mp128", "n32",
                                     "l64-w4s3", "l64-w2s2", "l64-w2s3", "l64-w1s2"))
             + _pair_cases((("1,32,256_64,64,1024", (64, 8)), ("128_2048", (32, 8))),
                           ("default", "l64-w4s3", "l64-w2s2"))
             + tuple(("1,4,16_128,256,1024", h, "query", None, None, "default")
                     for h in ((16, 8), (32, 8), (64, 8))),
             # batches whose steps are 16x64 blocks, for a kernel-level change to that variant
             # (round 16: its blocks per SM)
             "n64": _pair_cases((("1,4,16_128,256,1024", (16, 8)),
                                 ("1,4,16_128,256,1024", (32, 8)),
                                 ("1,4,16_128,256,1024", (64, 8)),
                                 ("1,32,256_64,64,1024", (16, 8)),
                                 ("1,32,256_64,64,1024", (32, 8)),
                                 ("1,32,256_64,64,1024", (64, 8)),
                                 ("128_2048", (16, 8)), ("128_2048", (32, 8)),
                                 ("256_4096", (32, 8)), ("1,16_2048,128", (32, 8)),
                                 ("1,4,64_256,1024,64", (32, 8)),
                                 ("3,24,96_1024,64,512", (32, 8))), ("default",))
             + (("1,4,16_128,256,1024", (32, 8), "query", None, None, "default"),),
             # one resident wave of small blocks on short steps (round 16)
             "wave": _pair_cases((("1,4,16_128,256,1024", (16, 8)),
                                  ("1,4,16_128,256,1024", (32, 8)),
                                  ("1,4,16_128,256,1024", (64, 8))),
                                 ("default", "n32-s6-mp64", "n32-s10-mp64", "n32-s20-mp64",
                                  "n32w1s2-s6-mp64", "s4-mp64", "s6-mp64"))
             + _pair_cases((("1,32,256_64,64,1024", (32, 8)), ("1,16_2048,128", (32, 8)),
                            ("1,4,64_256,1024,64", (32, 8))), ("default", "n32-s10-mp64")),
             # pat against the query plan on the leaf-last batch (sharing saves 0.8% of its bytes)
             "leaf-query": _pair_cases((("1,32,256_64,64,1024", h) for h in _HEADS_X8),
                                       (("pat", "default"), ("query", "default")))
             + _pair_cases((("1,4,16_128,256,1024", h) for h in ((16, 8), (32, 8))),
                           (("pat", "n32-s6-mp64"), ("query", "n32-s6-mp64"))),
             # the pat plan against one CTA per request with no merge (the query packer: each
             # request one slot, written by its CTA), as the share of KV tokens the per-request
             # plan re-reads grows (0.11 .. 0.58)
             "reread": _pair_cases(((spec, h) for spec in ("1,256_128,1024",
                                                           "1,8,256_128,128,1024",
                                                           "1,256_256,1024", "1,256_512,1024",
                                                           "1,256_1024,1024", "1,128_512,512",
                                                           "1,4,64_512,256,512")
                                    for h in _HEADS_X8), ("default", ("query", "default")))
             + _pair_cases((("1,32,256_64,64,1024", (32, 32)),),
                           ("default", ("query", "default"))),
             # the request rule on batches not used to set it (round 16): its plan, the shared
             # plan with the rule off, and one CTA per request with no merge
             "request-check": _pair_cases((("1,256_384,1024", (32, 8)),
                                           ("1,256_384,1024", (64, 8)),
                                           ("2,256_128,1024", (32, 8)),
                                           ("2,256_128,1024", (32, 32)),
                                           ("1,64_256,2048", (32, 8)),
                                           ("1,64_256,2048", (64, 8)),
                                           ("1,512_64,512", (32, 8)),
                                           ("1,512_64,512", (32, 32)),
                                           ("4,256_256,1024", (32, 8)),
                                           ("4,256_256,1024", (32, 32)),
                                           ("1,256_128,1024", (32, 32)),
                                           ("1,256_256,1024", (32, 32)),
                                           ("1,16,256_256,128,1024", (32, 8)),
                                           ("1,128_128,3072", (32, 8))),
                                          ("default", "request-off", ("query", "default"))),
             "quickstart": tuple(("1,4,16_128,256,1024", (32, 8), p, None, None, "default")
                                 for p in ("pat", "query", "node", "cascade")),
             "nosharing": tuple(("256_4096", (32, 8), p, None, None, "default")
                                for p in ("query", "pat")),
             "long-stages": _pair_cases(tuple((spec, (32, 8)) for spec in
                                              ("1,16_16384,16", "1,32_16384,16")),
                                        ("default", "share095", "wg64-s3", "wg64-s4",
                                         "wg64-s3-share095", "wg64-s4-share095", "wg128-s3",
                                         "wg128-s3-share095", "wg128-s4-share095")),
             # every development and long-prefix batch whose plan moves with a split share
             # below the default's 2 (round 17)
             "share-low": _pair_cases(tuple(
                 (spec, h) for spec, hs in (
                     ("1,16_2048,128", ((32, 32),)),
                     ("1,4,64_256,1024,64", ((16, 8), (32, 8), (64, 8))),
                     ("1,2,8,128_512,128,256,32", ((16, 8), (32, 8), (64, 8))),
                     ("1,1024_1024,16", ((16, 8),)),
                     ("1,16_16384,16", ((16, 8), (32, 8), (64, 8), (32, 32))),
                     ("1,32_16384,16", ((16, 8), (32, 8), (64, 8), (32, 32))),
                     ("1,4,16_128,256,1024", ((16, 8), (32, 8), (64, 8))))
                 for h in hs), ("default", "share095", "share1")),
             # round 17's one-wave split share for many-row packs against share 2, on every
             # development and long-prefix configuration whose plan it changes
             "one-wave": _pair_cases(tuple(
                 (spec, h) for spec, hs in (
                     ("1,4,64_256,1024,64", ((16, 8), (32, 8), (64, 8))),
                     ("1,2,8,128_512,128,256,32", ((16, 8), (32, 8), (64, 8))),
                     ("1,1024_1024,16", ((16, 8),)),
                     ("1,4,16,64,256_512,256,128,64,32", ((16, 8),)),
                     ("1,2,4,8,16,32,64_256,128,64,64,32,32,32", ((32, 8), (64, 8))),
                     ("1,16_16384,16", ((16, 8), (32, 8), (64, 8))),
                     ("1,32_16384,16", ((16, 8), (32, 8), (64, 8), (32, 32))))
                 for h in hs), ("default", "share2")),
             # round 19: the long shared prefixes' one-wave CTAs on layouts with several
             # independent token-slice pipelines per block (64-row, then 128-row packs)
             "one-wave-layouts": _pair_cases(
                 (("1,16_16384,16", (32, 8)), ("1,32_16384,16", (16, 8))),
                 ("default", "m64-w8r32", "m64-w8r16", "m64-w8r32-s3", "m64n128-w8r32"))
             + _pair_cases((("1,32_16384,16", (32, 8)), ("1,16_16384,16", (64, 8))),
                           ("default", "m128-w8r32", "m128-w8r16")),
             # round 19: every batch whose plan uses warpgroup tiles (64 and 128 rows), for
             # changes to their gather; and the forced warpgroup tiles on the no-sharing batch
             "wg-gather": _pair_cases(
                 (("1,16_16384,16", (32, 8)), ("1,16_16384,16", (64, 8)),
                  ("1,32_16384,16", (16, 8)), ("1,32_16384,16", (32, 8)),
                  ("1,1024_1024,16", (16, 8)), ("1,1024_1024,16", (32, 8)),
                  ("1,1024_1024,16", (64, 8)), ("1,1024_1024,16", (32, 32)),
                  ("1,4,16,64,256,1024_1024,256,128,64,32,32", (32, 8)),
                  ("1,8,16,32,64,128,1024_256,128,64,32,32,32,32", (32, 8)),
                  ("1,8,64,512_128,512,64,32", (32, 8)), ("1,2,8,128_512,128,256,32", (32, 8)),
                  ("1,4,16_128,256,1024", (32, 8))), ("default",))
             + tuple(c for c in FORCED_WG if c[5] in ("wg-s2",)),
             # round 20: the cache in the HND layout against NHD on the long prefixes and
             # batches of 64-row tiles
             "hnd": _pair_cases(
                 (("1,16_16384,16", (32, 8)), ("1,32_16384,16", (32, 8)),
                  ("1,4,64_256,1024,64", (32, 8)), ("1,16_2048,128", (32, 8)),
                  ("1,16_2048,128", (32, 32)), ("1,1024_1024,16", (32, 8)),
                  ("1,4,16_128,256,1024", (32, 8))), ("default", "hnd")),
             # round 20: the 64-row warpgroup tiles on two token slices, on every batch whose
             # plan has 64-row tiles, and forced on the no-sharing batch (memory bound)
             "wg-slices": _pair_cases(
                 (("1,16_16384,16", (32, 8)), ("1,16_16384,16", (16, 8)),
                  ("1,32_16384,16", (16, 8)), ("1,4,64_256,1024,64", (32, 8)),
                  ("1,4,64_256,1024,64", (16, 8)), ("1,4,64_256,1024,64", (64, 8)),
                  ("1,1024_1024,16", (16, 8)), ("1,2,8,128_512,128,256,32", (32, 8)),
                  ("1,8,64,512_128,512,64,32", (32, 8)), ("1,4,16_128,256,1024", (32, 8)),
                  ("1,4,16,64,256,1024_1024,256,128,64,32,32", (32, 8)),
                  ("1,8,16,32,64,128,1024_256,128,64,32,32,32,32", (32, 8)),
                  ("1,16_2048,128", (32, 32))), ("default", "wg64-w8", "wg64-w8-s3",
                                                 "wg64-w8-all"))
             + tuple(("256_4096", (32, 8), "query", (64, 64), over, label)
                     for over, label in (((4, 2, 64), "wg-s2"), ((8, 2, 64), "wg2-s2"),
                                         ((8, 3, 64), "wg2-s3"))),
             # round 19: the batches whose plans put many rows on warpgroup tiles (where a
             # tile is compute- rather than memory-bound), for changes to the warpgroup KV walk
             # (the overlapped walk of NOTES round 19); and the forced two-stage warpgroup tiles
             # on the no-sharing batch (memory-bound)
             "wg-overlap": _pair_cases(
                 (("1,1024_1024,16", (16, 8)), ("1,1024_1024,16", (32, 8)),
                  ("1,1024_1024,16", (64, 8)), ("1,1024_1024,16", (32, 32)),
                  ("1,4,16,64,256,1024_1024,256,128,64,32,32", (32, 8)),
                  ("1,8,16,32,64,128,1024_256,128,64,32,32,32,32", (32, 8)),
                  ("1,8,64,512_128,512,64,32", (32, 8)), ("1,8,64,512_128,512,64,32", (64, 8)),
                  ("1,16_16384,16", (32, 8)), ("1,32_16384,16", (32, 8)),
                  ("1,16_2048,128", (64, 8)), ("1,4,16_128,256,1024", (32, 8))), ("default",))
             + tuple(c for c in FORCED_WG if c[5] in ("wg-s2",)),
             # round 23: the same batches with the 128-row tiles' n forced to 128 as well, for
             # the warpgroup ping-pong (PAT_WG_PINGPONG)
             "wg-pp": _pair_cases(
                 (("1,1024_1024,16", (16, 8)), ("1,1024_1024,16", (32, 8)),
                  ("1,1024_1024,16", (64, 8)), ("1,1024_1024,16", (32, 32)),
                  ("1,4,16,64,256,1024_1024,256,128,64,32,32", (32, 8)),
                  ("1,4,16,64,256,1024_1024,256,128,64,32,32", (64, 8)),
                  ("1,8,16,32,64,128,1024_256,128,64,32,32,32,32", (32, 8)),
                  ("1,8,64,512_128,512,64,32", (32, 8)), ("1,8,64,512_128,512,64,32", (64, 8)),
                  ("1,32_16384,16", (32, 8)), ("1,16_2048,128", (64, 8)),
                  ("1,4,16,64,256_512,256,128,64,32", (64, 8))), ("default", "m128n128"))
             + tuple(c for c in FORCED_WG if c[5] in ("wg-s2",))}


_REFS: dict = {}


def run_case(backend, case, iters, copy_bw, flush, seed=0) -> dict:
    import torch
    from bench.compare import rel_err, torch_attention
    from bench.common import graph_times, time_events, unique_kv_tokens
    from pat_core import PrefixAttentionWrapper
    from pat_core import cuda_compile as cc
    from pat_core.workloads import build_tree_batch

    spec, (hq, hk), packer, tile, over, label = case
    d, ps = HEAD_DIM, 16
    row = {"workload": spec, "heads": f"{hq}:{hk}", "packer": packer,
           "tile": list(tile) if tile else None, "override": list(over) if over else None,
           "label": label}
    cc.VARIANT_OVERRIDES.clear()
    if TUNINGS.get(label):
        row["tuning"] = {k: (v if k != "layouts" else
                             {"x".join(map(str, key)): list(lay) for key, lay in v.items()})
                         for k, v in TUNINGS[label].items()}
    restore = lambda: None  # noqa: E731
    undo_n = forced_n(TUNINGS[label]["n_by_m"]) if "n_by_m" in TUNINGS.get(label, {}) \
        else (lambda: None)
    if over is not None and tile is not None:
        cc.VARIANT_OVERRIDES[tuple(tile)] = tuple(over)
    cc.VARIANT_OVERRIDES.update(TUNINGS.get(label, {}).get("layouts", {}))
    try:
        b = build_tree_batch(spec, page_size=ps, seed=seed)
        g = torch.Generator(device="cuda").manual_seed(seed)
        k = torch.randn((b.num_pages, ps, hk, d), generator=g, device="cuda", dtype=torch.float16)
        v = torch.randn(k.shape, generator=g, device="cuda", dtype=torch.float16)
        q = torch.randn((b.batch_size, hq, d), generator=g, device="cuda", dtype=torch.float16)
        w = PrefixAttentionWrapper(backend="cuda", packer=packer)
        w._gpu_backend = backend
        if label in TUNINGS:
            restore = apply_tuning(label, w.planner)
        plan = w.plan(b.block_tables, b.seq_lens, hq, hk, d, ps, kv_data_type="float16",
                      tile=tile)
        row["variants"] = [v_.key for v_ in backend.variants_for(plan)]
        backend.warmup(plan)
        out = torch.full((b.batch_size, hq, d), float("nan"), dtype=torch.float16, device="cuda")
        layout = TUNINGS.get(label, {}).get("kv_layout", "NHD")
        # the same values in the layout under test (the references read the NHD tensors)
        kl, vl = ((k, v) if layout == "NHD" else
                  (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()))
        fn = lambda: backend.run(plan, q, kl, vl, kv_layout=layout, out=out)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        key = (spec, hq, hk, seed)
        if key not in _REFS:   # same inputs for every case of a workload: compute once
            _REFS.clear()
            _REFS[key] = (
                torch_attention(torch, q, k, v, b.block_tables, b.seq_lens, ps, torch.float64),
                torch_attention(torch, q, k, v, b.block_tables, b.seq_lens, ps))
        ref, plain = _REFS[key]
        err, err_plain = rel_err(torch, out, ref), rel_err(torch, plain, ref)
        row.update(rel_err=err, rel_err_plain=err_plain,
                   correct=bool(err <= max(2 * err_plain, 2.0 ** -11)))
        # a second run must give bit-identical output (a moving result is a race)
        first = out.clone()
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        row["bit_identical"] = bool(torch.equal(first, out))
        if not row["correct"]:
            return row
        ts = time_events(fn, iters, flush=flush)
        row["eager_us"] = float(np.median(ts)) * 1e3
        try:
            row["graph_us"] = float(np.median(graph_times(fn, iters, flush))) * 1e3
        except Exception as e:  # not capturable: eager stands
            row["graph_us"] = float("nan")
            row["graph_error"] = f"{type(e).__name__}: {e}"[:200]
        uniq = unique_kv_tokens(b.block_tables, b.seq_lens, ps)
        must = uniq * hk * d * 2 * 2 + 2 * b.batch_size * hq * d * 2
        st = plan.stats()
        row.update(batch=b.batch_size, must_bytes=must, moved_bytes=st["total_bytes"],
                   num_ctas=st["num_ctas"], tiles=st["tiles"], groups=plan.num_groups,
                   floor_us=must / copy_bw * 1e6)
        best = min(row["eager_us"], row["graph_us"]) if row["graph_us"] == row["graph_us"] \
            else row["eager_us"]
        row["graph_over_floor"] = row["graph_us"] / row["floor_us"]
        row["eager_over_floor"] = row["eager_us"] / row["floor_us"]
        row["moved_frac_copy"] = st["total_bytes"] / (best * 1e-6) / copy_bw
        del k, v, q, out, kl, vl
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        restore()
        undo_n()
        cc.VARIANT_OVERRIDES.clear()
        torch.cuda.empty_cache()
    return row


def variant_speed_table(rows, res, prev=None, margin: float = 0.0) -> dict:
    """Fastest measured layout per (m, n) and its fraction of copy bandwidth (see
    pat_core.cuda_compile.variant_speed), from the 'layouts' rows of one run.

    ``prev`` (an earlier table) with ``margin`` > 0: a tile keeps its earlier layout, with this
    run's numbers, unless the fastest layout beats it by more than ``margin`` (a fraction).  On
    the 4096-token CTAs of this measurement the layouts of a tile often differ by less than the
    run-to-run noise, and a flip on noise can cost what this workload does not see (a deeper ring
    costs short-KV CTAs resident blocks)."""
    import platform
    from pat_core import cuda_compile as cc
    best, sync_best, measured = {}, {}, {}
    for r in rows:
        if not (r.get("correct") and r.get("bit_identical")) or "graph_us" not in r:
            continue
        t = r["graph_us"] if r["graph_us"] == r["graph_us"] else r["eager_us"]
        frac = r["must_bytes"] / (t * 1e-6) / (res["copy_bw_gbs"] * 1e9)
        key = f"{r['tile'][0]}x{r['tile'][1]}"
        cand = {"m": r["tile"][0], "n": r["tile"][1], "warps": r["override"][0],
                "stages": r["override"][1], "rows_per_warp": r["override"][2],
                "frac_copy": round(frac, 4), "time_us": round(t, 1)}
        measured[(key, cand["warps"], cand["stages"], cand["rows_per_warp"])] = cand
        if key not in best or cand["frac_copy"] > best[key]["frac_copy"]:
            best[key] = cand
        # the fastest layout without the warpgroup layout: what GPUs before sm_90 run
        if cand["rows_per_warp"] != cc.WG_ROWS:
            sync = sync_best.get(key)
            if sync is None or cand["frac_copy"] > sync["frac_copy"]:
                sync_best[key] = dict(cand)
    kept = []
    if prev and margin > 0:
        for key, rec in list(best.items()):
            p = prev.get("tiles", {}).get(key)
            if p is None:
                continue
            same = measured.get((key, p["warps"], p["stages"], p["rows_per_warp"]))
            if same is not None and same is not rec and \
                    rec["frac_copy"] <= same["frac_copy"] * (1 + margin):
                best[key] = dict(same)
                kept.append(key)
    for key, rec in best.items():
        if rec["rows_per_warp"] == cc.WG_ROWS and key in sync_best:
            rec["sync"] = {k: sync_best[key][k] for k in ("warps", "stages", "rows_per_warp",
                                                          "frac_copy", "time_us")}
    return {"generator": "bench/lab/kernel_lab.py --cases layouts --write-table",
            "device": res["env"]["device"], "git_sha": res["env"]["git_sha"],
            "source_hash": cc.source_hash(), "copy_bw_gbs": round(res["copy_bw_gbs"], 1),
            "workload": "256_4096, 32:8 heads, query packer, every CTA forced onto the tile",
            "head_dim": HEAD_DIM, "dtype": "float16", "python": platform.python_version(),
            "tiles": dict(sorted(best.items(), key=lambda kv: (kv[1]["m"], kv[1]["n"]))),
            "note": (f"a tile keeps the layout of the previous table (git {prev.get('git_sha')}) "
                     f"unless another measured more than {margin:.0%} faster; kept: "
                     f"{', '.join(kept) or 'none'}") if prev and margin > 0 else ""}


DEFINES: list = []   # the --defines of this run (recorded in environment())


def environment() -> dict:
    import platform
    import cupy
    import torch
    from bench.common import flush_mode, git_sha
    return {"device": torch.cuda.get_device_name(), "git_sha": git_sha(),
            "l2_flush": flush_mode(),
            "torch": torch.__version__, "cupy": cupy.__version__,
            "python": platform.python_version(), "cuda_runtime": torch.version.cuda,
            "nvrtc_defines": " ".join(DEFINES)}


def print_table(rows) -> None:
    print(f"{'workload':30s} {'heads':6s} {'packer':6s} {'tile':9s} {'label':10s} {'eager':>8s} "
          f"{'graph':>8s} {'floor':>8s} {'x':>5s} {'%copy':>6s} {'err':>8s} ok")
    for r in rows:
        tile = "x".join(map(str, r["tile"])) if r.get("tile") else "-"
        if "error" in r:
            print(f"{r['workload']:30s} {r['heads']:6s} {r['packer']:6s} {tile:9s} "
                  f"{r['label']:10s} ERROR {r['error'][:80]}")
            continue
        print(f"{r['workload']:30s} {r['heads']:6s} {r['packer']:6s} {tile:9s} {r['label']:10s} "
              f"{r.get('eager_us', math.nan):8.1f} {r.get('graph_us', math.nan):8.1f} "
              f"{r.get('floor_us', math.nan):8.1f} {r.get('graph_over_floor', math.nan):5.2f} "
              f"{100 * r.get('moved_frac_copy', math.nan):6.1f} {r.get('rel_err', math.nan):8.1e} "
              f"{'ok' if r.get('correct') and r.get('bit_identical') else 'WRONG'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--cases", default="forced,long,sharing",
                    help=f"comma-separated case sets of {sorted(CASE_SETS)}")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--defines", nargs="*", default=[], metavar="NAME=VALUE",
                    help="tuning defines of cuda_src/pat_traits.cuh for every kernel "
                         "(CudaBackend(defines=...))")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--write-table", default=None, metavar="PATH",
                    help="with the 'layouts' set: write the measured speed of every (m, n) and "
                         "the fastest layout per (m, n) as a variant-speed table (JSON)")
    ap.add_argument("--keep-within", type=float, default=0.02, metavar="FRACTION",
                    help="with --write-table: a tile keeps its layout in the packaged table "
                         "unless another measures more than this fraction faster (default 0.02)")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256),
                    help="head_dim of every case (with --write-table: that head_dim's table, "
                         "pat_core/data/variant_speed_h100[_dD].json)")
    ap.add_argument("--filter", nargs="+", default=[], metavar="TEXT",
                    help="run only cases whose 'workload heads packer MxN label' contains one of "
                         "these strings (one argument each: tree specs contain commas)")
    args = ap.parse_args(argv)
    global HEAD_DIM
    HEAD_DIM = args.head_dim
    if args.head_dim != 128:
        CASE_SETS["layouts"] = _layout_candidates(args.head_dim)
    names = [c for c in args.cases.split(",") if c]
    bad = [c for c in names if c not in CASE_SETS]
    if bad:
        ap.error(f"--cases: unknown case set(s) {bad}; choose from {sorted(CASE_SETS)}")
    import torch
    from bench.common import copy_bandwidth, l2_flusher
    from pat_core.cuda_backend import CudaBackend
    DEFINES[:] = args.defines
    backend = CudaBackend(defines=tuple(args.defines))
    t0 = time.perf_counter()
    backend.warmup(jobs=16)
    print(f"compiled all variants in {time.perf_counter() - t0:.1f} s", flush=True)
    copy_bw = copy_bandwidth()
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    flush = l2_flusher()
    rows = []
    for name in names:
        for case in CASE_SETS[name]:
            spec, (hq, hk), packer, tile, _, label = case
            desc = f"{spec} {hq}:{hk} {packer} {'x'.join(map(str, tile)) if tile else '-'} {label}"
            if args.filter and not any(f in desc for f in args.filter if f):
                continue
            r = run_case(backend, case, args.iters, copy_bw, flush)
            r["set"] = name
            rows.append(r)
            print_table([r])
            sys.stdout.flush()
    res = {"env": environment(), "copy_bw_gbs": copy_bw / 1e9, "iters": args.iters,
           "method": "CUDA events, L2 flushed before each run, median; graph = one capture "
                     "replayed", "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kernel_lab{args.tag}.json").write_text(json.dumps(res, indent=1) + "\n")
    if args.write_table:
        from pat_core import cuda_compile as cc
        prev_path = cc.variant_speed_path(HEAD_DIM)
        prev = json.loads(prev_path.read_text()) if prev_path.is_file() else None
        table = variant_speed_table([r for r in rows if r.get("set") == "layouts"], res,
                                    prev=prev, margin=args.keep_within)
        Path(args.write_table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write_table).write_text(json.dumps(table, indent=1) + "\n")
        (out / Path(args.write_table).name).write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {args.write_table}: {len(table['tiles'])} tiles")
    print("\n== summary ==")
    print_table(rows)
    return 0 if all(r.get("correct") and r.get("bit_identical") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
