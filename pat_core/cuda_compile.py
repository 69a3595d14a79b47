"""Kernel variants of the CUDA backend: names, launch resources and sources.

Pure Python (no CuPy import): the launcher (:mod:`pat_core.cuda_backend`), the nvcc resource
report (``bench/kernel_resources.py``) and the CPU tests share these functions, so that the
shared-memory size a variant is launched with and the one recorded in
``pat_core/data/kernel_resources.json`` come from one formula.

A forward variant is one instantiation of
``pat_fwd_kernel<HEAD_DIM, T, M, N, WARPS, STAGES, ROWS_PER_WARP>`` (``cuda_src/pat_fwd.cuh``); its
key names every template parameter, e.g. ``pat_fwd_d128_f16_m16_n64_w4_s2_r16``.  This module is
the one home of the variant rules (rows per warp, warps, stages; the measured layouts of
``pat_core/data/variant_speed_h100.json``): the launcher, the nvcc resource report, the tile
solver and the tutorials read them from here.  A fused variant (``pat_fwd_fused_kernel``) runs
several forward variants in one launch, chosen per CTA.  The key is the CuPy name expression's label, the compile
cache key and the log line.  A merge variant is ``pat_merge_kernel<HEAD_DIM, TO, WARPS, NH>`` (NH heads of a
request per warp).
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .gpus import A100, H100

DTYPE_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
DTYPE_SHORT = {"float16": "f16", "bfloat16": "bf16"}
# KV-cache-only element types: the forward kernel's last template argument (its default, the
# query's type, for every other cache) and the key's suffix.  Queries and output of such a
# variant are a DTYPE_CTYPE type.
KV_CTYPE = {"float8_e4m3fn": "pat::fp8_e4m3"}
KV_SHORT = {"float8_e4m3fn": "kv8"}
HEAD_DIMS = (64, 128, 256)
TILE_MS = (16, 32, 64, 128)
TILE_NS = (16, 32, 64, 128, 256)
# the most dynamic shared memory one block may opt in to, per architecture (gpus.py's limits)
SMEM_LIMIT = {"sm_80": A100.smem_per_block, "sm_90": H100.smem_per_block}
# a kernel with more dynamic shared memory than this is loaded with its own maximum set (the
# opt-in above 48 KB, with room for static shared memory); measured on H100 and H200 with the
# driver's default carveout, blocks of such kernels and of kernels below it never share an SM
# (bench/NOTES.md), which the simulator models (sim.occupancy.smem_class)
SMEM_OPT_IN_BYTES = 40 * 1024
MERGE_WARPS = 4
MERGE_HEADS = (1, 2, 4)   # heads per merge warp (pat_core.launch.merge_heads_per_warp)
SOURCE_SUFFIXES = (".cu", ".cuh", ".h")


def cuda_src_dir() -> Path:
    """Directory holding the CUDA sources.

    Installed: the package ``pat_core.cuda_src`` (``pyproject.toml`` maps ``cuda_src/`` there).
    Checkout: ``<repo>/cuda_src`` next to ``pat_core/``.  The installed location wins.
    """
    here = Path(__file__).resolve().parent
    candidates = []
    try:  # installed package data (also covers editable installs with a path finder)
        import importlib.util
        spec = importlib.util.find_spec("pat_core.cuda_src")
        if spec is not None:
            for loc in (spec.submodule_search_locations or []):
                candidates.append(Path(loc))
    except (ImportError, ValueError):
        pass
    candidates += [here / "cuda_src", here.parent / "cuda_src"]
    for c in candidates:
        if (c / "pat_fwd.cuh").is_file():
            return c
    raise FileNotFoundError(
        "pat CUDA sources not found; looked in " + ", ".join(str(c) for c in candidates))


def source_files(src_dir: Path | None = None) -> list:
    src_dir = Path(src_dir) if src_dir is not None else cuda_src_dir()
    return sorted(p for p in src_dir.iterdir() if p.suffix in SOURCE_SUFFIXES and p.is_file())


def source_hash(src_dir: Path | None = None) -> str:
    """SHA-256 (first 16 hex digits) over the names and contents of every CUDA source file.

    Goes into the compile options (CuPy's cache keys on the source string only, so an edited
    header would otherwise leave a stale binary) and into kernel_resources.json.
    """
    h = hashlib.sha256()
    for p in source_files(src_dir):
        h.update(p.name.encode())
        h.update(b"\0")
        # normalise line endings so a checkout on another OS hashes the same
        h.update(p.read_bytes().replace(b"\r\n", b"\n"))
        h.update(b"\0")
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------ variant rules
# rows_per_warp value that selects the Hopper warpgroup (wgmma) layout: 64 rows per group of four
# warps, one warp per 16 rows (cuda_src/pat_wgmma.cuh); head_dim 128, m 64 or 128, sm_90a only.
WG_ROWS = 64
def default_rows_per_warp(m: int, head_dim: int = 128) -> int:
    """Query rows one warp owns: 32 for tiles of 64 rows or more, else 16; always 16 at
    head_dim 256.

    Large-row tiles are the compute-heavy ones (a 128-row tile does 128 FLOP per KV byte): with
    32 rows per warp every K/V fragment read from shared memory by ``ldmatrix`` feeds two MMAs,
    halving shared-memory reads per FLOP (FlashAttention-2's layout).  Small tiles are memory
    bound and keep 16 rows per warp with Q in registers.  At head_dim 256 a 16-row warp's fp32
    output accumulators already take 128 registers per thread (32 rows would take all 256), so
    every tile keeps 16 rows per warp and re-reads Q from shared memory
    (``cuda_src/pat_traits.cuh``).
    """
    if head_dim > 128:
        return 16
    return 32 if m >= 64 else 16


def rule_warps(m: int, n: int, head_dim: int = 128) -> int:
    """Warps of the (m, n) variant by rule (before any measured layout, see default_warps).

    ``m / rows_per_warp`` warps split the rows; while that leaves fewer than 8 warps, extra warps
    split each KV tile's tokens, down to 16 tokens per warp for 16-row warps and 32 for 32-row
    warps (fewer tokens would make the per-k-step Q re-read as costly as the K read it saves).
    More warps per CTA means more threads issuing the tile's cp.async gathers and computing in
    parallel: with the large tiles only one CTA fits an SM.  At head_dim 256 (16-row warps that
    re-read Q per k-step) the split goes down to 16 tokens as well: an SM there holds one to four
    blocks, and the warps, not the Q reads, are what it is short of.
    """
    rw = default_rows_per_warp(m, head_dim)
    wm = m // rw
    min_tokens = 16 if rw == 16 else min(32, n)
    wn = max(1, min(n // min_tokens, 8 // wm))
    return wm * wn


def rule_stages(m: int, n: int, head_dim: int = 128) -> int:
    """cp.async ring depth by rule: 3 (two tiles in flight while one is computed) where the ring
    fits the sm_90 per-block shared memory, else 2."""
    for stages in (3, 2):
        if fwd_smem_bytes(m, n, head_dim, stages) <= SMEM_LIMIT["sm_90"]:
            return stages
    return 2   # fits nowhere (n >= 128 at head_dim 256): fwd_variant_feasible leaves it out


def variant_speed_path(head_dim: int = 128) -> Path:
    """The measured variant-speed table of ``head_dim``: ``variant_speed_h100.json`` (128),
    ``variant_speed_d{head_dim}.json`` otherwise (the GPU it was measured on is in the file)."""
    name = "variant_speed_h100.json" if int(head_dim) == 128 else \
        f"variant_speed_d{int(head_dim)}.json"
    return Path(__file__).resolve().parent / "data" / name


@functools.lru_cache(maxsize=None)
def variant_speed(head_dim: int = 128) -> dict:
    """Measured speed of every tile ``(m, n)`` at ``head_dim``: ``{(m, n): record}``.

    Written by ``bench/lab/kernel_lab.py --cases layouts --head-dim D --write-table`` on an
    H100 or H200 (the file's ``device``): each (m, n) with its candidate layouts (warps,
    stages, rows per warp) forced onto every CTA of a no-sharing batch (4096 KV tokens per
    CTA), the fastest layout kept with its fraction of copy bandwidth (``frac_copy``).  Empty when the file is absent (head_dim 64 and
    256 have none yet: their layouts and tile widths follow the rules).
    """
    p = variant_speed_path(head_dim)
    if not p.is_file():
        return {}
    data = json.loads(p.read_text())
    if int(data.get("head_dim", 128)) != int(head_dim):
        raise ValueError(f"{p.name} holds head_dim {data.get('head_dim')}, not {head_dim}")
    return {(int(r["m"]), int(r["n"])): r for r in data.get("tiles", {}).values()}


def layout_record(m: int, n: int, head_dim: int = 128, arch: str = "sm_90",
                  kv_fp8: bool = False):
    """The measured record (:func:`variant_speed`) of the layout the (m, n) variant can take on
    ``arch``: the tile's fastest, or its fastest mma.sync one (the record's ``sync``) where the
    fastest is the warpgroup layout and the variant cannot run it (not sm_90, or an fp8 cache,
    see :func:`default_layout`); ``None`` without a record."""
    rec = variant_speed(int(head_dim)).get((int(m), int(n)))
    if rec is not None and int(rec["rows_per_warp"]) == WG_ROWS and (arch != "sm_90" or kv_fp8):
        rec = rec.get("sync")
    return rec


def default_layout(m: int, n: int, head_dim: int = 128, arch: str = "sm_90",
                   kv_fp8: bool = False) -> tuple:
    """``(warps, stages, rows_per_warp)`` of the (m, n) variant on ``arch``: the fastest measured
    layout at this head_dim (:func:`variant_speed`, where it fits shared memory; where that is
    the warpgroup layout, which only sm_90 runs, other GPUs take the fastest measured mma.sync
    layout, the record's ``sync``), else the rules (:func:`rule_warps`, :func:`rule_stages`,
    :func:`default_rows_per_warp`; the only source where a head_dim has no table).

    ``kv_fp8``: the layout of an fp8 cache's variant, always an mma.sync one (the record's
    ``sync`` where the fastest is the warpgroup layout).  Those widen the fp8 fragments in
    registers; ``wgmma`` would need 16-bit K and V tiles in shared memory, and the kernel that
    widened into them measured 1.04x slower than the mma.sync layouts in geometric mean over
    the fp8 synthetic batches (12-25% on five sharing batches, 3% faster on one;
    bench/NOTES.md)."""
    rec = layout_record(m, n, head_dim, arch, kv_fp8)
    if rec is not None:
        w, st, rw = int(rec["warps"]), int(rec["stages"]), int(rec["rows_per_warp"])
        if fwd_smem_bytes(m, n, head_dim, st, rw) <= SMEM_LIMIT["sm_90"]:
            return w, st, rw
    return (rule_warps(m, n, head_dim), rule_stages(m, n, head_dim),
            default_rows_per_warp(m, head_dim))


# Architectures whose kernels the resource file describes: sm_90 (Hopper, the primary target)
# and sm_80 (A100).  The warpgroup variants exist for sm_90 only (built as sm_90a).
ARCHS = ("sm_80", "sm_90")


def variant_archs(variant) -> tuple:
    """Architectures ``variant`` is built for."""
    return ("sm_90",) if getattr(variant, "warpgroup", False) else ARCHS


def default_warps(m: int, n: int, head_dim: int = 128) -> int:
    return default_layout(m, n, head_dim)[0]


def default_stages(m: int, n: int, head_dim: int = 128) -> int:
    return default_layout(m, n, head_dim)[1]


# Benchmarks may override (warps, stages[, rows_per_warp]) per (m, n) to sweep variants; empty in
# normal use.
VARIANT_OVERRIDES: dict = {}


@dataclass(frozen=True, order=True)
class FwdVariant:
    """One forward kernel variant.  ``dtype``: the queries' and output's type (a
    :data:`DTYPE_CTYPE` key); ``kv_dtype``: the cache's element type when it differs (a
    :data:`KV_CTYPE` key, fp8), else ``""``, which keeps the key and kernel name of the 16-bit
    variants as they were.  ``causal``: the multi-token variant (the kernel's ``CAUSAL``
    template argument, key suffix ``_mt``), which runs a plan's token view and masks each query
    token's positions past its causal limit; the same layout and shared memory as the
    one-token variant of its tile."""

    head_dim: int
    dtype: str
    m: int
    n: int
    warps: int
    stages: int
    rows_per_warp: int = 16
    kv_dtype: str = ""
    causal: bool = False

    @classmethod
    def make(cls, m: int, n: int, head_dim: int, dtype: str,
             arch: str = "sm_90", kv_dtype: str | None = None,
             causal: bool = False) -> "FwdVariant":
        """The (m, n) variant in its default layout for ``arch`` ("sm_90", "sm_80", ...), or in
        the layout VARIANT_OVERRIDES names.  An fp8 ``dtype`` alone (a cache dtype, as
        ``Plan.kv_dtype``) names the variant of float16 queries over that cache (the same
        layout and resources as the bfloat16 one)."""
        if dtype in KV_CTYPE:
            dtype, kv_dtype = "float16", dtype
        kv = "" if kv_dtype is None or kv_dtype == dtype else str(kv_dtype)
        over = VARIANT_OVERRIDES.get((int(m), int(n)))
        if over is None:
            w, st, rw = default_layout(m, n, head_dim, arch, kv_fp8=bool(kv))
        else:
            w, st = over[0], over[1]
            rw = over[2] if len(over) > 2 else default_rows_per_warp(m, head_dim)
        return cls(int(head_dim), str(dtype), int(m), int(n), int(w), int(st), int(rw), kv,
                   bool(causal))

    @property
    def key(self) -> str:
        kv = f"_{KV_SHORT[self.kv_dtype]}" if self.kv_dtype else ""
        mt = "_mt" if self.causal else ""
        return (f"pat_fwd_d{self.head_dim}_{DTYPE_SHORT[self.dtype]}_m{self.m}_n{self.n}"
                f"_w{self.warps}_s{self.stages}_r{self.rows_per_warp}{kv}{mt}")

    def _tail_args(self) -> str:
        """The template arguments after rows-per-warp: the KV type when it is not the default
        (or when CAUSAL follows it), then ``true`` for a causal variant."""
        if self.causal:
            kv = KV_CTYPE[self.kv_dtype] if self.kv_dtype else DTYPE_CTYPE[self.dtype]
            return f", {kv}, true"
        return f", {KV_CTYPE[self.kv_dtype]}" if self.kv_dtype else ""

    @property
    def name_expression(self) -> str:
        return (f"pat_fwd_kernel<{self.head_dim}, {DTYPE_CTYPE[self.dtype]}, {self.m}, {self.n}, "
                f"{self.warps}, {self.stages}, {self.rows_per_warp}{self._tail_args()}>")

    @property
    def traits(self) -> str:
        """The variant's ``pat::FwdTraits`` (the fused kernel's template arguments)."""
        return (f"pat::FwdTraits<{self.head_dim}, {DTYPE_CTYPE[self.dtype]}, {self.m}, "
                f"{self.n}, {self.warps}, {self.stages}, {self.rows_per_warp}"
                f"{self._tail_args()}>")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        return fwd_smem_bytes(self.m, self.n, self.head_dim, self.stages, self.rows_per_warp,
                              kv_fp8=bool(self.kv_dtype))

    @property
    def warpgroup(self) -> bool:
        """The Hopper warpgroup (wgmma) layout: rows_per_warp 64, built for sm_90a only."""
        return self.rows_per_warp == WG_ROWS

    def explicit_instantiation(self) -> str:
        return f"template __global__ void {self.name_expression}(const __grid_constant__ pat::FwdParams);"


@dataclass(frozen=True)
class FusedVariant:
    """One kernel running several forward variants (``pat_fwd_fused_pull_kernel``, the small
    graph-safe buckets): a fixed grid whose blocks pull items over the members' live CTA ranges
    (the state's live table, in member order); the block has the largest member's threads and
    shared memory."""

    head_dim: int
    dtype: str
    members: tuple

    @property
    def threads(self) -> int:
        return max(v.threads for v in self.members)

    @property
    def smem_bytes(self) -> int:
        return max(v.smem_bytes for v in self.members)

    @property
    def warpgroup(self) -> bool:
        """Built for sm_90a when any member uses the warpgroup (wgmma) layout."""
        return any(v.warpgroup for v in self.members)

    @property
    def key(self) -> str:
        kv = self.members[0].kv_dtype if self.members else ""
        mt = "mt_" if self.members and self.members[0].causal else ""
        return (f"pat_fwd_fused_d{self.head_dim}_"
                f"{DTYPE_SHORT[self.dtype]}_" + (f"{KV_SHORT[kv]}_" if kv else "") + mt +
                "_".join(f"m{v.m}n{v.n}w{v.warps}s{v.stages}r{v.rows_per_warp}"
                         for v in self.members))

    @property
    def name_expression(self) -> str:
        ct = DTYPE_CTYPE[self.dtype]
        tr = ", ".join(v.traits for v in self.members)
        return f"pat_fwd_fused_pull_kernel<{self.head_dim}, {ct}, {self.threads}, {tr}>"


@dataclass(frozen=True, order=True)
class MergeVariant:
    head_dim: int
    dtype: str
    warps: int = MERGE_WARPS
    heads: int = 1     # heads of one request per warp in warp mode (1, 2 or 4)

    @property
    def key(self) -> str:
        suffix = f"_h{self.heads}" if self.heads > 1 else ""
        return f"pat_merge_d{self.head_dim}_{DTYPE_SHORT[self.dtype]}_w{self.warps}{suffix}"

    @property
    def name_expression(self) -> str:
        return (f"pat_merge_kernel<{self.head_dim}, {DTYPE_CTYPE[self.dtype]}, {self.warps}, "
                f"{self.heads}>")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        return 0

    def explicit_instantiation(self) -> str:
        return f"template __global__ void {self.name_expression}(const __grid_constant__ pat::MergeParams);"


def fwd_smem_bytes(m: int, n: int, head_dim: int, stages: int, rows_per_warp: int = 16,
                   kv_fp8: bool = False) -> int:
    """Dynamic shared memory of a forward variant (mirrors FwdTraits::SMEM_BYTES).

    Q tile (m x d, 2 bytes) + `stages` x (K tile + V tile) (n x d, 2 bytes each), plus 1024 bytes
    for the warpgroup layout, which aligns its tiles to the 1024-byte swizzle atom at run time.
    The cross-warp combine buffer reuses the KV ring, so it adds nothing.  ``kv_fp8``: an fp8
    cache's K and V tiles stay bytes (1 byte per element; mma.sync layouts only).
    """
    pad = 1024 if rows_per_warp == WG_ROWS else 0
    kv_elem = 1 if kv_fp8 else 2
    return m * head_dim * 2 + stages * 2 * n * head_dim * kv_elem + pad


def fwd_variant_feasible(v: FwdVariant, smem_limit: int = SMEM_LIMIT["sm_90"]) -> bool:
    """Whether ``v`` compiles: its shared memory fits ``smem_limit`` and its layout is one the
    kernel's traits accept (``cuda_src/pat_traits.cuh``: 16 rows per warp at head_dim 256, the
    warpgroup layout at head_dim 128 over a 16-bit cache only; an fp8 tile only where the
    16-bit tile exists)."""
    if v.head_dim > 128 and v.rows_per_warp != 16:
        return False
    if v.warpgroup and (v.head_dim != 128 or v.kv_dtype):
        return False
    if v.kv_dtype and not fwd_variant_feasible(
            FwdVariant.make(v.m, v.n, v.head_dim, v.dtype), smem_limit):
        # an fp8 tile exists where its 16-bit twin does (byte tiles would fit larger ones,
        # which no layout table or selector knows)
        return False
    return v.smem_bytes <= smem_limit


def all_fwd_variants(head_dims=HEAD_DIMS, dtypes=tuple(DTYPE_CTYPE), ms=TILE_MS, ns=TILE_NS,
                     kv_dtype: str | None = None):
    """Every forward variant that fits the sm_90 shared-memory limit (n = 256 only at d = 64;
    n <= 64 at d = 256, whose K and V rows are twice as long), in the default layouts of sm_90
    and of sm_80.  ``kv_dtype``: the variants over a cache of that KV-only dtype (fp8) instead
    of the 16-bit ones (the same tiles, :func:`fwd_variant_feasible`)."""
    out = []
    for d in head_dims:
        for dt in dtypes:
            for m in ms:
                for n in ns:
                    for arch in ("sm_90", "sm_80"):   # their default layouts may differ
                        v = FwdVariant.make(m, n, d, dt, arch, kv_dtype=kv_dtype)
                        if fwd_variant_feasible(v) and v not in out:
                            out.append(v)
    return out


def resource_variants() -> list:
    """Every variant the resource file (``bench/kernel_resources.py``) lists: the forward
    variants over 16-bit and fp8 caches, and the merge variants."""
    return all_fwd_variants() + all_fwd_variants(kv_dtype="float8_e4m3fn") + \
        all_merge_variants()


def all_merge_variants(head_dims=HEAD_DIMS, dtypes=tuple(DTYPE_CTYPE)):
    return [MergeVariant(d, dt, MERGE_WARPS, nh) for d in head_dims for dt in dtypes
            for nh in MERGE_HEADS]


def plan_fwd_variants(plan, arch: str = "sm_90") -> list:
    """Forward variants a Plan launches on ``arch`` (one per distinct tile config of its launch
    groups; the multi-token variants for a plan with several tokens in a request)."""
    seen = []
    for _, (m, n), b, e in plan.groups():
        if e <= b:
            continue
        v = FwdVariant.make(m, n, plan.head_dim, plan.io_dtype, arch=arch,
                            kv_dtype=plan.kv_dtype, causal=plan.multi_token)
        if v not in seen:
            seen.append(v)
    return seen


# ------------------------------------------------------------------------------ sources
def module_source(variant) -> str:
    """Source string of the run-time module of one variant.

    The variant's key is part of the text so that CuPy's on-disk cache (keyed on source and
    options) gives every variant its own entry; the headers come in through ``-I``.
    """
    return (f"// pat kernel module: {variant.key}\n"
            f'#include "pat_kernels.cu"\n')


def nvrtc_options(src_dir: Path | None = None, defines: tuple = ()) -> tuple:
    """NVRTC options of every module: C++17, the source directory, the source hash (so an edited
    header never reuses a stale cached binary) and fast math.  ``defines``: ``"NAME=VALUE"``
    strings overriding the tuning constants of ``cuda_src/pat_traits.cuh`` (experiments only;
    the library passes none)."""
    src_dir = Path(src_dir) if src_dir is not None else cuda_src_dir()
    for d in defines:
        if not isinstance(d, str) or not d or not d.split("=")[0].isidentifier():
            raise ValueError(f"defines: expected 'NAME' or 'NAME=VALUE' strings, got {d!r}")
    return ("-std=c++17", f"-I{src_dir}", f"-DPAT_SOURCE_HASH=0x{source_hash(src_dir)}ULL",
            "--use_fast_math") + tuple(f"-D{d}" for d in defines)


def fwd_variant_supported(m: int, n: int, head_dim: int, kv_dtype: str | None = None) -> bool:
    """Whether a forward kernel variant exists (and fits sm_90 shared memory) for (m, n, d)
    (``kv_dtype``: over a cache of that KV-only dtype, fp8).  Memoised per arguments and the
    tile's layout override (every plan's tiles are checked on the way to the device)."""
    key = (m, n, head_dim, kv_dtype, VARIANT_OVERRIDES.get((m, n)))
    ok = _SUPPORTED.get(key)
    if ok is None:
        ok = (head_dim in HEAD_DIMS and m in TILE_MS and n in TILE_NS and fwd_variant_feasible(
            FwdVariant.make(m, n, head_dim, "float16", kv_dtype=kv_dtype)))
        _SUPPORTED[key] = ok
    return ok


_SUPPORTED: dict = {}


def nvcc_source(variants) -> str:
    """A .cu file instantiating `variants` explicitly, for offline nvcc resource reports."""
    lines = ['#include "pat_kernels.cu"']
    lines += [v.explicit_instantiation() for v in variants]
    return "\n".join(lines) + "\n"


def nvcc_version(nvcc: str = "nvcc") -> str:
    import subprocess
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    for ln in lines:
        if "release" in ln:
            return ln.strip()
    return lines[-1].strip() if lines else "unknown"


def resources_path() -> Path:
    return Path(__file__).resolve().parent / "data" / "kernel_resources.json"
