"""Batches and methods: where the simulator's inputs come from.

A *batch* is a tree spec (``"1,4,16_128,256,1024"``, built by
:func:`pat_core.workloads.build_tree_batch`) or a JSON file of block tables, so that real traces
can be simulated::

    {"block_tables": [[0, 1, 2], [0, 1, 3, 4]], "seq_lens": [40, 61], "page_size": 16}

A *method* is a packer plus planner options: the five packers of :data:`pat_core.PACKERS` and
one ablation of ``pat``: ``pat-fixed`` (one tile config, 64 x 128, for every CTA; 64 x 64 at
head_dim 256, where no kernel has n = 128: :func:`fixed_tile`).  (Files
measured before the one launch path also hold ``pat-serial``, tile groups launched one after
another, which no executor runs any more: :mod:`sim.calibration` skips those records.)
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from pat_core import Planner
from pat_core import cuda_compile as cc
from pat_core.workloads import build_tree_batch

FIXED_TILE = (64, 128)

# method -> (packer, planner keyword arguments)
METHODS = {
    "pat": ("pat", {}),
    "node": ("node", {}),
    "compute": ("compute", {}),
    "query": ("query", {}),
    "cascade": ("cascade", {}),
    "pat-fixed": ("pat", {"tile": FIXED_TILE}),
}


@dataclass
class Batch:
    """Block tables of one decode batch plus a label for reports."""

    label: str
    block_tables: object      # int32 [batch, max_pages] or list of lists
    seq_lens: np.ndarray
    page_size: int

    @property
    def batch_size(self) -> int:
        return int(len(self.seq_lens))


def load_batch(tree: str, page_size: int = 16, seed: int = 0) -> Batch:
    """A :class:`Batch` from a tree spec or from a JSON file of block tables.

    A JSON file's own ``page_size`` wins over the argument.  Its numbers must be integers
    (a float page size or length is refused, not truncated); range checks (int32 page ids and
    lengths) are the planner's.  A tree spec is checked against the size limits of
    :func:`pat_core.workloads.check_tree_size` before anything is built.
    """
    if os.path.isdir(tree):
        raise ValueError(f"--tree {tree}: a directory; expected a tree spec or a JSON file")
    if tree.endswith(".json") or os.path.isfile(tree):
        return _load_batch_file(tree, page_size)
    tb = build_tree_batch(tree, page_size, seed=seed)
    return Batch(label=tree, block_tables=tb.block_tables, seq_lens=tb.seq_lens,
                 page_size=page_size)


def _load_batch_file(path: str, page_size: int) -> Batch:
    """The JSON form (module docstring), every number checked to be an integer."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except ValueError as exc:                     # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    missing = {"block_tables", "seq_lens"} - set(data)
    if missing:
        raise ValueError(f"{path}: missing keys {sorted(missing)}; expected "
                         f"block_tables, seq_lens and page_size")
    ps = data.get("page_size", page_size)
    _check_int(ps, f"{path}: page_size")
    seq = data["seq_lens"]
    if not isinstance(seq, list):
        raise ValueError(f"{path}: seq_lens must be a list of integers")
    _check_ints(seq, f"{path}: seq_lens")
    tables = data["block_tables"]
    if not isinstance(tables, list) or not all(isinstance(r, list) for r in tables):
        raise ValueError(f"{path}: block_tables must be a list of page-id lists")
    for r, row in enumerate(tables):
        _check_ints(row, f"{path}: block_tables[{r}]")
    if tables and all(len(r) == len(tables[0]) for r in tables):
        tables = np.asarray(tables, dtype=np.int64).reshape(len(tables), -1)
    return Batch(label=os.path.basename(path), block_tables=tables,
                 seq_lens=np.asarray(seq, dtype=np.int64), page_size=int(ps))


def _check_ints(values, name: str) -> None:
    """:func:`_check_int` on every entry of ``values``."""
    for i, v in enumerate(values):
        _check_int(v, f"{name}[{i}]")


def _check_int(v, name: str) -> None:
    """``ValueError`` unless ``v`` is a JSON integer that fits in int64 (a float such as
    ``16.5`` would otherwise be truncated, a huge int overflow NumPy)."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} = {v!r}: expected an integer")
    if not -2**63 <= v < 2**63:
        raise ValueError(f"{name} = {v}: does not fit in int32 (the limit is 2^31 - 1)")


def save_batch(batch: Batch, path: str) -> None:
    """Write a batch as the JSON form :func:`load_batch` reads."""
    tables = batch.block_tables
    if isinstance(tables, np.ndarray):
        tables = [row[: -(-int(s) // batch.page_size)].tolist()
                  for row, s in zip(tables, batch.seq_lens)]
    with open(path, "w") as fh:
        json.dump({"block_tables": tables, "seq_lens": [int(s) for s in batch.seq_lens],
                   "page_size": batch.page_size}, fh)


def fixed_tile(head_dim: int) -> tuple:
    """The ``pat-fixed`` tile at ``head_dim``: :data:`FIXED_TILE`, or where the CUDA kernels of
    that head_dim have no such variant (head_dim 256: K and V stages of 128 tokens do not fit
    shared memory), the widest ``n`` below it that they have, at the same ``m``."""
    m, n = FIXED_TILE
    if int(head_dim) not in cc.HEAD_DIMS:   # a CPU-only head_dim: no kernel family to match
        return FIXED_TILE
    ns = [x for x in cc.TILE_NS if x <= n and cc.fwd_variant_supported(m, x, int(head_dim))]
    return (m, max(ns))


def method_options(method: str, head_dim: int) -> tuple:
    """``(packer, planner keyword arguments)`` of ``method`` at ``head_dim`` (:data:`METHODS`,
    with ``pat-fixed``'s tile from :func:`fixed_tile`)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")
    packer, kw = METHODS[method]
    if "tile" in kw:
        kw = dict(kw, tile=fixed_tile(head_dim))
    return packer, kw


def make_plan(batch: Batch, method: str, num_qo_heads: int, num_kv_heads: int, head_dim: int,
              gpu="h100", kv_data_type: str = "float16"):
    """Plan ``batch`` with ``method`` through :class:`pat_core.Planner`."""
    packer, kw = method_options(method, head_dim)
    return Planner(packer, gpu).plan(batch.block_tables, batch.seq_lens, num_qo_heads,
                                     num_kv_heads, head_dim, batch.page_size,
                                     kv_data_type=kv_data_type, **kw)
