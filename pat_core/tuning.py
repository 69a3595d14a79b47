"""The planner's knobs: :class:`Tuning`, one value a :class:`pat_core.Planner` plans with
(checked on construction; its fields are part of the key under which the planner reuses the
last step)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .packers import NARROW_SHARE, PARTIAL_WEIGHT


@dataclass
class Tuning:
    """Planner knobs measured by ``bench/lab/kernel_lab.py --cases planner`` (defaults: the rules
    that measured best; see ``bench/NOTES.md``).

    ``max_rows``: cap on a CTA's query rows (``None``: the largest feasible tile).  Smaller
    caps cut shared nodes into more CTAs that re-read the same pages (mostly from L2).
    ``split_share``: resident thread blocks per SM assumed by the ``"sm"`` split rule
    (``None``: :func:`pat_core.split.choose_split_share`: the rule of
    :func:`pat_core.split.auto_split_share` (2; 3 when only packs of at most 16 rows are cut;
    at most 1, so that the cut CTAs make no more blocks than SMs, when a cut pack has more
    rows), or another share where the pull-launch model predicts it clearly faster).
    ``min_part``: shortest part the split makes (tokens).
    ``merge_min_part``: shortest part of a plan that merges anyway (more partial slots than
    requests: shared nodes or a cut request; tokens; ``None``: :data:`MERGE_MIN_PART`, except
    in graph-safe wrappers, which size their buffers for ``min_part``'s parts and keep those;
    ``min_part`` or more turns the rule off).  Under the default ``"sm"`` split rule such a
    plan is split again with parts down to this length where the coarser bound stopped the
    split: only steps of few KV tokens in all (less than ``min_part`` x 6 x SMs / KV heads:
    ~25k tokens at 8 KV heads on an H100), where the GPU is underfilled and the finer parts
    add no merge launch.  Chosen on 35 small batches at 32:8 (1-32 requests, one H100, graph
    replay; ``bench/NOTES.md``): 64 against 256 took 0.946x the time in geometric mean at
    head_dim 128 (0.82-1.09x) and 0.924x at 256 (0.72-1.15x), and left two of them below
    FlashInfer 0.2.5 decode's speed where twelve were; larger batches of few tokens were not
    measured.  A plan without a merge (the per-request rule's, one CTA per request) keeps
    ``min_part``: cutting it would add the merge (up to 1.4x slower).  Nor is a plan cut where
    the finer parts need a second wave of some tile and the coarse ones do not
    (:func:`pat_core.planner.second_wave`; H100, head_dim 256, ``1,2_2048,64`` at 32:8: 23.9
    against 20.8 us; of the 35 batches and the development set at every head_dim, heads and
    cache type, the only plan this changes).
    ``partial_weight``: multiplies the partial-result bytes in the ``pat`` profit model (above 1
    favours merging short nodes into their children's CTAs: fewer partials and thread blocks
    for more KV re-read; see :data:`pat_core.packers.PARTIAL_WEIGHT`).
    ``kv_tile_table``: replaces the GPU's KV-length -> ``n`` table of the tile selector
    (``None``: the GPU's own, :attr:`pat_core.gpus.GPUSpec.kv_tile_table`).
    ``split_by``: what the ``"sm"`` long-KV split shares out: ``"tokens"``, or ``"work"``
    (tokens times the measured time per token of the CTA's tile rows,
    :meth:`pat_core.tiles.TileSelector.row_time_weight`: 128-row tiles run slower per token).
    ``order``: order of the plan's tile groups and of the CTAs inside each: ``"tile"``
    (ascending ``(m, n)``, pack order inside) or ``"work"`` (groups by their largest per-CTA
    work, and longest KV first inside a group) or ``"shared"`` (groups ranked by the most
    requests one of their CTAs holds, and inside a group the most requests first, then the
    longest KV).  The CUDA backend launches the tiles in its own order (tallest first,
    :func:`pat_core.static_plan.order_tiles`) and each launch's blocks draw its CTAs in plan
    order, so inside a group ``"work"`` starts the CTAs that take longest first; the order of
    the groups themselves orders no launch.
    ``narrow_share``: the ``pat`` packer's narrow-packing rule
    (:func:`pat_core.packers.narrow_packing`): with no ``max_rows`` set and no forced tile,
    every CTA is packed into the narrowest tile's rows when that re-reads at most this share
    more KV tokens (``0``: off).
    ``request_share``: the ``pat`` packer's per-request rule
    (:func:`pat_core.packers.request_packing`): with no ``max_rows`` set, no forced tile and
    no serial plan, the step runs one CTA per request when that re-reads at most this share
    more KV tokens, its re-read pages fit the L2, and it needs no merge where the ``pat``
    packing does (each CTA then writes its request's output; ``None``:
    :func:`pat_core.packers.request_share` of the GQA group; ``0``: off).
    ``exclude_tiles``: ``(m, n)`` pairs the tile selector must not pick (``None``: none).
    Graph-safe mode sets it for a fused pull launch set
    (:func:`pat_core.static_plan.fused_pull_exclusions`).
    ``invariant_chunk``: tokens of a batch-invariant plan's fixed KV chunks, before rounding
    up to a multiple of the page size and of the tile's ``n``
    (:func:`pat_core.split.invariant_chunk`; ``None``:
    :data:`pat_core.split.INVARIANT_CHUNK_TOKENS`).  Changing it changes the bits: requests
    are bit-identical across batches planned with the same value.
    """

    max_rows: int | None = None
    split_share: float | None = None
    min_part: int = 256
    merge_min_part: int | None = None
    partial_weight: float = PARTIAL_WEIGHT
    kv_tile_table: tuple | None = None
    order: str = "work"
    split_by: str = "tokens"
    exclude_tiles: tuple | None = None
    narrow_share: float = NARROW_SHARE
    request_share: float | None = None
    invariant_chunk: int | None = None

    def __post_init__(self):
        if self.max_rows is not None and (not isinstance(self.max_rows, (int, np.integer))
                                          or self.max_rows < 1):
            raise ValueError(f"max_rows must be None or a positive int, got {self.max_rows!r}")
        for name in ("split_share", "partial_weight"):
            v = getattr(self, name)
            if name == "split_share" and v is None:
                continue
            if not isinstance(v, (int, float, np.number)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if not isinstance(self.narrow_share, (int, float, np.number)) or \
                not math.isfinite(self.narrow_share) or self.narrow_share < 0:
            raise ValueError(f"narrow_share must be a number >= 0, got {self.narrow_share!r}")
        if self.request_share is not None and (
                not isinstance(self.request_share, (int, float, np.number))
                or not math.isfinite(self.request_share) or self.request_share < 0):
            raise ValueError(f"request_share must be None or a number >= 0, got "
                             f"{self.request_share!r}")
        if self.invariant_chunk is not None and (
                not isinstance(self.invariant_chunk, (int, np.integer))
                or isinstance(self.invariant_chunk, (bool, np.bool_))
                or not 1 <= self.invariant_chunk <= 2**31 - 1):
            raise ValueError(f"invariant_chunk must be None or an int in 1..2**31-1, got "
                             f"{self.invariant_chunk!r}")
        if not isinstance(self.min_part, (int, np.integer)) or self.min_part < 1:
            raise ValueError(f"min_part must be a positive int, got {self.min_part!r}")
        if self.merge_min_part is not None and (
                not isinstance(self.merge_min_part, (int, np.integer))
                or isinstance(self.merge_min_part, (bool, np.bool_)) or self.merge_min_part < 1):
            raise ValueError(f"merge_min_part must be None or a positive int, got "
                             f"{self.merge_min_part!r}")
        if self.split_by not in ("tokens", "work"):
            raise ValueError(f"split_by must be 'tokens' or 'work', got {self.split_by!r}")
        if self.order not in ("tile", "work", "shared"):
            raise ValueError(f"order must be 'tile', 'work' or 'shared', got {self.order!r}")
        if self.exclude_tiles is not None:
            try:
                ex = tuple((int(m), int(n)) for m, n in self.exclude_tiles)
            except (TypeError, ValueError):
                raise ValueError("exclude_tiles must be None or (m, n) pairs, got "
                                 f"{self.exclude_tiles!r}") from None
            self.exclude_tiles = ex
        if self.kv_tile_table is not None:
            t = tuple(tuple(x) for x in self.kv_tile_table)
            if not t or any(len(x) != 2 or x[1] < 16 for x in t) or \
                    any(a[0] >= b[0] for a, b in zip(t, t[1:])):
                raise ValueError("kv_tile_table must be (max_kv_len, n) pairs with increasing "
                                 f"max_kv_len and n >= 16, got {self.kv_tile_table!r}")


_TUNING_FIELDS = tuple(f.name for f in dataclasses.fields(Tuning))

# Tuning.merge_min_part's value when it is None (tokens; its docstring has the measurements)
MERGE_MIN_PART = 64


def merge_min_part(tuning: Tuning) -> int:
    """The shortest part of a plan that merges anyway under ``tuning``."""
    return MERGE_MIN_PART if tuning.merge_min_part is None else int(tuning.merge_min_part)


def _tuning_key(t: Tuning) -> tuple:
    """The tuning's values (what its ``repr`` shows, at a fraction of the cost: every
    ``plan()`` call compares it with the last step's)."""
    return tuple(getattr(t, f) for f in _TUNING_FIELDS)
