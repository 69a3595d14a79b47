"""GPU hardware descriptions used by the tile solver, the tile selector and the simulator.

Numbers are the vendors' published limits for the SXM parts (SM count, shared memory, register
file, HBM bandwidth, L2).  ``mem_latency_ns`` is the flat part of the global-to-shared transfer
latency curve (PAT Fig. 7a): the time a small ``cp.async`` batch takes before bandwidth matters.
It and ``achieved_bw_fraction`` are estimates until a calibration run on that GPU replaces them
(the simulator stores its fitted constants separately and does not edit these).

L2: ``l2_bytes`` is the size the driver reports (``torch.cuda.get_device_properties().
L2_cache_size``: 40 MB A100, 50 MB H100 SXM, 60 MB on the H200s measured here).
``l2_bandwidth`` is an estimate, not a measurement: NVIDIA's A100 whitepaper gives the L2 read
width as 5120 bytes per clock; the H100 and H200 are assumed to have the same width at their own
clock.  The simulator fits its own L2 bandwidth constant (``sim/data/<gpu>.json``) starting from
this figure.

``kv_tile_table`` is the piecewise "KV length -> n" rule of the tile selector (PAT §5.2): a list
of ``(max_kv_len, n)`` pairs, scanned in order; the first pair whose ``max_kv_len`` is ``>=`` the
CTA's KV length gives the largest ``n`` the selector may take (it then picks the fastest measured
``n`` under it, see :mod:`pat_core.tiles`).  Short KV gets a small ``n`` (less compute in the
last, partly empty tile).  The boundaries were measured on an H100 with 16-row tiles (query
packer, % of copy bandwidth): at 256 tokens n = 128 reaches 66% against 82-84% for n <= 64; at
1024 tokens n = 32/64 reach 94% against 88% for n = 128; at 2048 tokens (`128_2048`) n = 64
reaches 95-100% against 92-95% for n = 128 (a 16x128 CTA fills an SM's shared memory alone, so
its pipeline start is not hidden behind another CTA); at 4096 all reach 98-100%.  So n = 128 is
never preferred: the table stops at 64.  A CTA of at most 16 tokens takes n = 16: a 32-token step
would be half padding, and the one-warp 16x16 block leaves room for more blocks per SM (on
``1,1024_1024,16``, 1024 leaves of 16 tokens, the step time fell 10-22%; see bench/NOTES.md).

``busy_kv_tile_tables`` replaces that table, per head_dim, in steps that fill the GPU many times
over: a step whose packs times KV heads number at least ``busy_items_per_sm`` x the SMs (before
the long-KV split) plans with it (:meth:`pat_core.tiles.TileSelector.for_step`).  At head_dim
256 the 16x64 tile's layout holds one 4-warp block per SM (200 KB of shared memory) and 16x32
two 2-warp blocks: on an H200 (graph replay, 32:8) the n <= 32 table took 0.79-1.00x the
time on the eight development batches of 832 to 4608 such items (``512_1024`` 1067.7 -> 1012.8
us, the 256-leaf trees 580.9 -> 530.4 and 133.9 -> 124.6, ``32,256_1024,128`` 215.3 -> 168.9)
and 0.94-1.60x on the eleven of at most 592 (``8_4096`` 73.7 -> 113.6,
``1,3,48_1024,6144,4096`` 474.8 -> 510.2): with few items, a 2-warp block is half the
per-item throughput.  Measured on sm_90 only (the threshold lies between 592 and 832); the
A100 has no busy table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model.  All sizes in bytes, bandwidth in bytes per nanosecond (== GB/s / 1)."""

    name: str
    num_sms: int
    smem_per_sm: int            # usable shared memory per SM (bytes)
    smem_per_block: int         # max dynamic shared memory one CTA may opt in to (bytes)
    regs_per_sm: int            # 32-bit registers per SM
    regs_per_thread: int        # max registers one thread may use
    max_threads_per_sm: int
    max_ctas_per_sm: int
    hbm_bandwidth: float        # bytes / ns (GB/s numerically divided by 1e0: 3350 GB/s -> 3350.0)
    mem_latency_ns: float       # inherent global-memory latency seen by a tile load
    l2_bytes: int
    sm_clock_ghz: float
    l2_bandwidth: float = 0.0   # bytes / ns, L2 hits to the SMs (estimate, see module docstring)
    achieved_bw_fraction: float = 0.85  # copy-kernel bandwidth / datasheet bandwidth (estimate)
    kv_tile_table: tuple = field(default=((16, 16), (96, 32), (1 << 62, 64)))
    # {head_dim: table} as ((head_dim, table), ...): the table of busy steps (docstring)
    busy_kv_tile_tables: tuple = ()
    busy_items_per_sm: float = 6.0

    def __post_init__(self):
        if not (isinstance(self.busy_items_per_sm, (int, float))
                and math.isfinite(self.busy_items_per_sm) and self.busy_items_per_sm > 0):
            raise ValueError(f"busy_items_per_sm must be a positive number, got "
                             f"{self.busy_items_per_sm!r}")
        try:
            tables = dict(self.busy_kv_tile_tables)
            ok = all(isinstance(d, int) and d > 0 and len(t) > 0
                     and all(len(x) == 2 and int(x[1]) >= 16 for x in t)
                     and all(a[0] < b[0] for a, b in zip(t, t[1:]))
                     for d, t in tables.items())
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError("busy_kv_tile_tables must be ((head_dim, ((max_kv_len, n), ...)), "
                             "...) with increasing max_kv_len and n >= 16, got "
                             f"{self.busy_kv_tile_tables!r}")

    @property
    def bytes_per_ns(self) -> float:
        """Datasheet HBM bandwidth in bytes per nanosecond."""
        return self.hbm_bandwidth

    def busy_kv_tile_table(self, head_dim: int):
        """The KV-length table of busy steps at ``head_dim`` (``None``: the one table)."""
        return dict(self.busy_kv_tile_tables).get(int(head_dim))

    def preferred_n(self, kv_len: int) -> int:
        """KV tile ``n`` the piecewise table prefers for a CTA of ``kv_len`` tokens."""
        for max_len, n in self.kv_tile_table:
            if kv_len <= max_len:
                return n
        return self.kv_tile_table[-1][1]


_KIB = 1024
# head_dim 256: n <= 32 for every KV length longer than 16 tokens in busy steps
_BUSY_SM90 = ((256, ((16, 16), (1 << 62, 32))),)

A100 = GPUSpec(
    name="A100-SXM4-80GB", num_sms=108, smem_per_sm=164 * _KIB, smem_per_block=163 * _KIB,
    regs_per_sm=65536, regs_per_thread=255, max_threads_per_sm=2048, max_ctas_per_sm=32,
    hbm_bandwidth=2039.0, mem_latency_ns=700.0, l2_bytes=40 * 1024 * _KIB, sm_clock_ghz=1.41,
    l2_bandwidth=round(5120 * 1.41, 1),
)

H100 = GPUSpec(
    name="H100-SXM5-80GB", num_sms=132, smem_per_sm=228 * _KIB, smem_per_block=227 * _KIB,
    regs_per_sm=65536, regs_per_thread=255, max_threads_per_sm=2048, max_ctas_per_sm=32,
    hbm_bandwidth=3350.0, mem_latency_ns=650.0, l2_bytes=50 * 1024 * _KIB, sm_clock_ghz=1.755,
    l2_bandwidth=round(5120 * 1.755, 1), busy_kv_tile_tables=_BUSY_SM90,
)

H200 = GPUSpec(
    name="H200-SXM-141GB", num_sms=132, smem_per_sm=228 * _KIB, smem_per_block=227 * _KIB,
    regs_per_sm=65536, regs_per_thread=255, max_threads_per_sm=2048, max_ctas_per_sm=32,
    hbm_bandwidth=4800.0, mem_latency_ns=650.0, l2_bytes=60 * 1024 * _KIB, sm_clock_ghz=1.755,
    l2_bandwidth=round(5120 * 1.755, 1), busy_kv_tile_tables=_BUSY_SM90,
)

GPUS = {"a100": A100, "h100": H100, "h200": H200}


def get_gpu(gpu) -> GPUSpec:
    """Return a :class:`GPUSpec` from a spec or a name (``"a100"``, ``"h100"``, ``"h200"``)."""
    if isinstance(gpu, GPUSpec):
        return gpu
    if not isinstance(gpu, str):
        raise TypeError(f"gpu must be a GPUSpec or one of {sorted(GPUS)}, got {type(gpu).__name__}")
    key = gpu.lower().replace("-", "").replace("_", "")
    for short, spec in GPUS.items():
        if key.startswith(short):
            return spec
    raise ValueError(f"gpu: unknown GPU {gpu!r}; known: {sorted(GPUS)}")


def detect_gpu_name(device_name: str) -> str:
    """Map a CUDA device name (``"NVIDIA H100 80GB HBM3"``) to a key of :data:`GPUS`."""
    low = device_name.lower()
    for short in ("h200", "h100", "a100"):
        if short in low:
            return short
    import warnings
    warnings.warn(f"no GPU spec for {device_name!r}; planning with the H100's (pass gpu= to "
                  f"choose)", stacklevel=2)
    return "h100"
