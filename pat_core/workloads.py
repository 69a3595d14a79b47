"""Synthetic decode batches: prefix trees -> paged block tables.

Tree spec (the PAT paper's format): ``"1,4,16_128,256,1024"`` means three levels with 1, 4 and
16 nodes holding 128, 256 and 1024 tokens each; the last level's nodes are the requests; node
``j`` of level ``i`` hangs below node ``j * n[i-1] // n[i]`` of level ``i-1``.

Page ids are handed out as a serving engine with prefix caching would: a page is shared by the
requests whose tokens agree over the whole page prefix they cover, and a partly filled page at
the end of a shared node is copied for each child that continues it (copy-on-write).  Physical
ids are shuffled so that sharing is visible only through the table.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TreeBatch:
    """A synthetic batch.

    ``block_tables`` int32 ``[batch, max_pages]`` (padding ``-1`` or junk), ``seq_lens`` int32
    ``[batch]``, ``num_pages`` the cache size needed, ``paths`` each request's node path.
    """

    block_tables: np.ndarray
    seq_lens: np.ndarray
    num_pages: int
    page_size: int
    paths: list
    node_lens: np.ndarray

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])


def parse_tree_spec(spec: str):
    """``"1,4,16_128,256,1024"`` -> ``([1, 4, 16], [128, 256, 1024])``."""
    if not isinstance(spec, str) or spec.count("_") != 1:
        raise ValueError(f"tree spec must look like '1,4,16_128,256,1024', got {spec!r}")
    a, b = spec.split("_")
    try:
        counts = [int(x) for x in a.split(",")]
        lens = [int(x) for x in b.split(",")]
    except ValueError:
        raise ValueError(f"tree spec {spec!r}: counts and lengths must be integers") from None
    if len(counts) != len(lens) or not counts:
        raise ValueError(f"tree spec {spec!r}: as many node counts as lengths are needed")
    if any(c < 1 for c in counts) or any(x < 1 for x in lens):
        raise ValueError(f"tree spec {spec!r}: counts and lengths must be >= 1")
    return counts, lens


def paths_from_spec(spec: str):
    """Node paths and node token counts of a tree spec: ``(paths, node_lens)``."""
    counts, lens = parse_tree_spec(spec)
    node_lens = []
    level_ids = []
    for lvl, (c, l) in enumerate(zip(counts, lens)):
        level_ids.append(list(range(len(node_lens), len(node_lens) + c)))
        node_lens.extend([l] * c)
    paths = []
    for j in range(counts[-1]):
        path = [level_ids[-1][j]]
        idx = j
        for lvl in range(len(counts) - 1, 0, -1):
            idx = idx * counts[lvl - 1] // counts[lvl]
            path.append(level_ids[lvl - 1][idx])
        paths.append(path[::-1])
    return paths, np.array(node_lens, dtype=np.int64)


def block_tables_from_paths(paths, node_lens, page_size: int, rng=None, pad_value=-1,
                            extra_cols: int = 0):
    """Block tables for requests given as node paths (see module docstring for page sharing).

    ``paths``: list of lists of node ids (root first).  ``node_lens``: tokens per node.
    Returns ``(block_tables int32 [B, max_pages + extra_cols], seq_lens int32 [B], num_pages)``.
    """
    node_lens = np.asarray(node_lens, dtype=np.int64)
    B = len(paths)
    seq = np.array([int(node_lens[p].sum()) for p in paths], dtype=np.int64)
    npg = -(-seq // page_size)
    width = int(npg.max())
    keys = np.full((B, width), -1, dtype=np.int64)
    num_nodes = int(node_lens.shape[0])
    for r, p in enumerate(paths):
        ends = np.cumsum(node_lens[p])
        k = np.arange(npg[r])
        last_pos = np.minimum((k + 1) * page_size, seq[r]) - 1
        node = np.asarray(p)[np.searchsorted(ends, last_pos, side="right")]
        keys[r, : npg[r]] = k * num_nodes + node
    used = keys >= 0
    uniq, inv = np.unique(keys[used], return_inverse=True)
    ids = np.arange(uniq.shape[0])
    if rng is not None:
        ids = rng.permutation(uniq.shape[0])
    table = np.full((B, width + extra_cols), pad_value, dtype=np.int64)
    sub = table[:, :width]
    sub[used] = ids[inv.reshape(-1)]
    table[:, :width] = sub
    return table.astype(np.int32), seq.astype(np.int32), int(uniq.shape[0])


def build_tree_batch(spec: str, page_size: int = 16, seed: int | None = 0) -> TreeBatch:
    """A :class:`TreeBatch` from a tree spec (shuffled page ids when ``seed`` is not None)."""
    paths, node_lens = paths_from_spec(spec)
    rng = None if seed is None else np.random.default_rng(seed)
    table, seq, n = block_tables_from_paths(paths, node_lens, page_size, rng)
    return TreeBatch(block_tables=table, seq_lens=seq, num_pages=n, page_size=page_size,
                     paths=paths, node_lens=node_lens)


def random_kv_cache(num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                    dtype=np.float32, kv_layout: str = "NHD", seed: int = 0, scale: float = 1.0):
    """Random ``(k_cache, v_cache)`` NumPy arrays in ``kv_layout``."""
    rng = np.random.default_rng(seed)
    shape = ((num_pages, page_size, num_kv_heads, head_dim) if kv_layout == "NHD"
             else (num_pages, num_kv_heads, page_size, head_dim))
    k = (rng.standard_normal(shape) * scale).astype(dtype)
    v = rng.standard_normal(shape).astype(dtype)
    return k, v


DESIGN_WORKLOADS = (
    "1,16_2048,128", "1,4,64_256,1024,64", "1,2,8,128_512,128,256,32", "3,24,96_1024,64,512",
    "1,32,256_64,64,1024", "1,1024_1024,16", "1,8,64,512_128,512,64,32", "128_2048", "256_4096",
)
HEAD_CONFIGS = ((32, 32), (16, 8), (32, 8), (64, 8))

# Deep single-root trees whose lower levels are many short (32-token) nodes: the shape where a
# fixed cost per work item dominates.  5 levels / 256 leaves, 6 levels / 1024 leaves, 7 levels /
# 64 leaves (a binary tree), 7 levels / 1024 leaves (from the PAT paper's kernel benchmark).
DEEP_WORKLOADS = (
    "1,4,16,64,256_512,256,128,64,32",
    "1,4,16,64,256,1024_1024,256,128,64,32,32",
    "1,2,4,8,16,32,64_256,128,64,64,32,32,32",
    "1,8,16,32,64,128,1024_256,128,64,32,32,32,32",
)
# One long shared prefix over 16 or 32 short requests (64 and 128 query rows at GQA 4).
LONG_PREFIX_WORKLOADS = ("1,16_16384,16", "1,32_16384,16")
DEEP_HEAD_CONFIGS = ((32, 32), (32, 8))
# name -> (tree specs, head configs); the development set of the benchmarks is "design" + "deep"
WORKLOAD_SETS = {
    "design": (DESIGN_WORKLOADS, HEAD_CONFIGS),
    "deep": (DEEP_WORKLOADS, DEEP_HEAD_CONFIGS),
    "long": (LONG_PREFIX_WORKLOADS, DEEP_HEAD_CONFIGS),
}
