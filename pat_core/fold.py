"""The finisher phase: a request's last CTA folds in its other partials and writes the output.

Without it every step ends with a merge launch that reads every request's fp32 partial slots
back and writes the output (3-10 µs on an H100, more on batches of thousands of (request, head)
pairs).  When each request has a CTA of its own (its private leaf, or its only CTA), that CTA
can do the merge instead: run it after every other CTA of the step and, when its KV walk ends,
merge the request's other slots into its online-softmax state (the log-sum-exp rule of
:mod:`pat_core.merge`) and write the final output.  No merge launch, no partial slot written or
read for the finisher itself.

The price is order: the finisher CTAs run as a second phase, after the first has finished, so the
first phase's time is no longer hidden behind the leaves.  That pays where the first phase is
small next to the second (long private leaves under short shared prefixes, or no sharing at all,
where the first phase is empty) and costs where the shared part is the step (a long system prompt
over short leaves).  :func:`finisher_ctas` decides with the share of KV tokens the first phase
reads.

Which CTA finishes request ``r``: one that holds ``r`` alone (its rows are ``r``'s query heads, so
its end writes only ``r``'s output) and has at most :data:`FINISH_MAX_ROWS` rows' tile (the
``mma.sync`` layouts, whose per-row state the kernel folds into; the warpgroup tiles of 64 and
128 rows keep the merge launch); of several, the one reading the most tokens.
"""
from __future__ import annotations

import numpy as np

# Tile rows up to which a CTA can be a finisher (the kernels' mma.sync layouts).
FINISH_MAX_ROWS = 32
# Default largest share of the step's KV tokens the first phase may read (None: no finisher phase)
# (:attr:`pat_core.planner.Tuning.finish_share`).  0: only steps with no first phase fold, where
# every request has one CTA; that CTA writes the output and the merge launch goes.  Measured on an
# H100 (bench/NOTES.md, rounds 14 and 16): 0.4-0.6% faster on the no-sharing batches, and the
# per-request plans of the ``pat`` packer's request rule 2-3% faster than with their copy-merge;
# larger shares lose 16-20% where the first phase has several groups, so they stay opt-in.
FINISH_SHARE = None
# Default smallest number of (request, query head) pairs from which a step folds whatever share
# of its tokens the first phase reads, provided each phase is one tile group on a GPU with
# dependent launches (so the finishers are one launch dependent on one first-phase launch,
# starting while it runs) (:attr:`pat_core.planner.Tuning.finish_pairs`; ``None``: off).
# Measured on an H100 (bench/NOTES.md, round 19): on two-group plans of 32768 and 65536 pairs
# the finisher phase was 2-9% faster (it drops the leaves' partial slots, half the merge's
# reads, and the merge launch: 34-68 MB at 1024 requests x 32-64 heads) or level (0.998); at
# 16384 and 1024 pairs it lost 8% and 3%.  With a first phase of several groups it lost
# everywhere (2-27%).
FINISH_PAIRS = 32768
# ... and provided no first-phase CTA reads more than this many KV tokens: the finishers fold
# only once the whole first phase has ended, so a long first-phase CTA holds them back longer
# than the merge would take.  Measured (round 19): the four two-group plans of 32768+ pairs
# whose first phase has CTAs of 2048-4096 tokens were 1.004-1.025x slower folded; the eleven
# whose longest first-phase CTA read 256-1024 tokens 0.88-1.00x; then nine more, chosen after
# the bound was set, 0.86-0.97x.
FINISH_FIRST_TOKENS = 1024


def pick_finishers(first_req: np.ndarray, nreq: np.ndarray, kv_len: np.ndarray,
                   tile_m: np.ndarray, batch: int) -> np.ndarray | None:
    """Each request's candidate finisher CTA, or ``None`` when some request has none.

    Parameters (``C`` CTAs, in any order)
    ----------
    first_req : int ``[C]``, a request of each CTA (its only one where ``nreq == 1``).
    nreq : int ``[C]``, requests per CTA.
    kv_len : int ``[C]``, KV tokens each CTA reads.
    tile_m : int ``[C]``, rows of each CTA's tile.
    batch : requests in the step.

    Returns bool ``[C]``: per request, of its single-request CTAs on a tile of at most
    ``FINISH_MAX_ROWS`` rows, the one reading the most tokens (ties: the later CTA).
    """
    C = int(kv_len.shape[0])
    if C == 0 or batch == 0:
        return None
    cand = np.flatnonzero((nreq == 1) & (tile_m <= FINISH_MAX_ROWS))
    if cand.size == 0:
        return None
    req = first_req[cand].astype(np.int64)
    o = np.lexsort((cand, kv_len[cand], req))
    req_s = req[o]
    last = np.r_[req_s[1:] != req_s[:-1], True]
    if int(last.sum()) != batch:
        return None                         # some request has no CTA of its own
    fin = np.zeros(C, dtype=bool)
    fin[cand[o][last]] = True
    return fin


def finisher_ctas(first_req: np.ndarray, nreq: np.ndarray, kv_len: np.ndarray, tile_m: np.ndarray,
                  batch: int, share: float, picked=None) -> np.ndarray | None:
    """The finisher CTA of every request, or ``None`` when the step keeps its merge launch.

    Parameters: as :func:`pick_finishers`, plus ``share``, the largest share of all KV tokens
    the CTAs that are not finishers may read (``0``: a step only folds when every request has
    exactly one CTA), and ``picked``, :func:`pick_finishers`' answer when the caller has it
    (``None``: pick here).

    Returns bool ``[C]`` (``True``: the CTA finishes its request) when every request has a
    candidate and the others read at most ``share`` of the tokens; else ``None``.
    """
    fin = pick_finishers(first_req, nreq, kv_len, tile_m, batch) if picked is None else picked
    if fin is None:
        return None
    tok = kv_len.astype(np.int64)
    if int(tok[~fin].sum()) > share * int(tok.sum()):
        return None
    return fin


def large_merge_finishers(first_req: np.ndarray, nreq: np.ndarray, kv_len: np.ndarray,
                          tile_m: np.ndarray, tile_idx: np.ndarray, batch: int, num_qo_heads: int,
                          min_pairs: int | None,
                          max_first_tokens: int = FINISH_FIRST_TOKENS,
                          picked=None) -> np.ndarray | None:
    """The finisher CTAs of a step whose merge would be large, or ``None``.

    Where :func:`finisher_ctas`' share rule keeps the merge launch, a step of at least
    ``min_pairs`` (request, query head) pairs still folds when every request has a candidate
    finisher, each phase is a single tile group and no first-phase CTA reads more than
    ``max_first_tokens``: then the finishers are one launch that may start while the first
    phase's one launch runs (programmatic dependent launch), and what the fold saves (every
    request's leaf slot written and read back, and the merge launch) grows with the pairs while
    the wait for a short first phase does not.

    Parameters: as :func:`finisher_ctas`, plus ``tile_idx`` int ``[C]`` (each CTA's tile
    config: CTAs of one config form one launch group), ``num_qo_heads``, ``min_pairs``
    (``None``: never), ``max_first_tokens`` and ``picked`` (as :func:`finisher_ctas`).
    Returns bool ``[C]`` or ``None``.
    """
    if min_pairs is None or int(batch) * int(num_qo_heads) < min_pairs:
        return None
    fin = pick_finishers(first_req, nreq, kv_len, tile_m, batch) if picked is None else picked
    if fin is None or fin.all():
        return None   # no candidates, or no first phase (the share rule's case)
    if np.unique(tile_idx[fin]).size != 1 or np.unique(tile_idx[~fin]).size != 1:
        return None
    if int(kv_len[~fin].max()) > max_first_tokens:
        return None
    return fin
