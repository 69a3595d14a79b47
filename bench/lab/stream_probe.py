"""What one wave of blocks can read: the bandwidth ceiling of a split shared prefix.

    python3 bench/lab/stream_probe.py [--mb 67] [--out DIR]

A long shared prefix is cut into one CTA per SM (``pat_core.split.one_wave_share``), so its
forward launch is a single wave of blocks that each stream a contiguous share of the KV.  This
probe times a plain read of the same number of bytes under that shape: ``B`` blocks of ``T``
threads, each block reading ``MB / B`` contiguous bytes with 16-byte loads, ``U`` loads in flight
per thread, and one float written per block (so the reads cannot be dropped).  Timed with CUDA
events, L2 flushed before every run, median of 20.  It separates what the memory system gives
one wave of ``B`` blocks (no MMA, no gather, no partials) from what the attention kernel adds.
A second pattern (``head-rows``) reads the same bytes the way the kernel's gather does in the NHD
cache layout: each block one KV head's 256-byte rows of a token range, 2 KB apart (8 heads).

Prints a table (pattern, blocks, threads, loads in flight, L2 flush mode of ``common.flush_mode``, µs,
TB/s, fraction of a device-to-device copy) and writes ``DIR/stream_probe.json`` when ``--out``
is given.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/stream_probe.py
    sys.path.insert(0, str(ROOT))

_SRC = r"""
template <int U>
__global__ void read_wave(const uint4* __restrict__ src, long long per_block, float* out) {
    // per_block: 16-byte words this block reads, contiguous
    const uint4* p = src + (long long)blockIdx.x * per_block;
    unsigned acc = 0;
    for (long long i = threadIdx.x; i < per_block; i += (long long)blockDim.x * U) {
        uint4 r[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            long long j = i + (long long)u * blockDim.x;
            r[u] = j < per_block ? __ldg(p + j) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
    }
    // one write per block keeps every load live
    acc = __reduce_xor_sync(0xffffffffu, acc);
    if ((threadIdx.x & 31) == 0) atomicXor((unsigned*)out + blockIdx.x, acc);
}

// The gather's pattern in the NHD cache layout: block b reads head (b % heads) of the tokens
// of its range (b / heads): 256 bytes (16 words) of every 2 KB token row, the heads of a range
// in adjacent blocks.  Threads keep one 16-byte column and stride over rows.
template <int U>
__global__ void read_head_rows(const uint4* __restrict__ src, long long rows_per_block,
                               int heads, float* out) {
  const int head = blockIdx.x % heads, range = blockIdx.x / heads;
  const int col = threadIdx.x & 15, r0 = threadIdx.x >> 4, rstep = blockDim.x >> 4;
  const uint4* p = src + (long long)range * rows_per_block * heads * 16 + head * 16 + col;
  unsigned acc = 0;
  for (long long r = r0; r < rows_per_block; r += (long long)rstep * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      long long rr = r + (long long)u * rstep;
      v[u] = rr < rows_per_block ? __ldg(p + rr * heads * 16) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  acc = __reduce_xor_sync(0xffffffffu, acc);
  if ((threadIdx.x & 31) == 0) atomicXor((unsigned*)out + blockIdx.x, acc);
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=67.1, help="bytes to read, MB (default: the "
                    "16k-token prefix at 8 KV heads, d 128, fp16, K and V)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import cupy as cp
    import numpy as np
    import torch
    from bench.common import FLUSH_MODES, copy_bandwidth, l2_flusher, time_events
    from bench.lab.kernel_lab import environment

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mod = cp.RawModule(code=_SRC, options=("-std=c++17",),
                       name_expressions=[f"{k}<{u}>" for k in ("read_wave", "read_head_rows")
                                         for u in (1, 2, 4, 8, 16)])
    words = int(args.mb * 1e6) // 16
    buf = torch.empty(words * 4, dtype=torch.int32, device="cuda").random_()
    out = torch.zeros(8 * sms, dtype=torch.int32, device="cuda")
    src, dst = cp.asarray(buf), cp.asarray(out)   # zero-copy views for the kernels
    flushes = {m: l2_flusher(128 << 20, m) for m in FLUSH_MODES}
    copy_bw = copy_bandwidth() / 1e12
    rows = []

    def timed(pattern, fn, blocks, threads, u, nbytes):
        """One row per flush mode: ``fn`` reading ``nbytes`` with that launch shape."""
        fn()
        torch.cuda.synchronize()
        for mode, flush in flushes.items():
            us = float(np.median(time_events(fn, args.iters, flush=flush))) * 1e3
            rows.append({"pattern": pattern, "blocks": blocks, "threads": threads,
                         "in_flight": u, "flush": mode, "bytes": nbytes, "us": us,
                         "tb_s": nbytes / us / 1e6, "of_copy": nbytes / us / 1e6 / copy_bw})

    shapes = [(sms, t, u) for t in (128, 256, 512) for u in (2, 4, 8, 16)]
    shapes += [(128, 128, 8), (128, 256, 8), (2 * sms, 128, 8), (2 * sms, 256, 4),
               (4 * sms, 128, 4), (8 * sms, 128, 4)]
    for blocks, threads, u in shapes:
        per = words // blocks          # every block reads the same count, inside the buffer
        ker = mod.get_function(f"read_wave<{u}>")

        def fn(ker=ker, blocks=blocks, threads=threads, per=per):
            ker((blocks,), (threads,), (src, np.int64(per), dst))
        timed("contiguous", fn, blocks, threads, u, per * blocks * 16)
    # the NHD gather's pattern: 8 heads, 2 KB token rows, each block one head of a token range
    heads = 8
    for blocks, threads, u in ((128, 128, 8), (128, 128, 16), (128, 256, 8), (128, 512, 8),
                               (256, 128, 8), (1024, 128, 4)):
        ker = mod.get_function(f"read_head_rows<{u}>")
        rows_per_block = (words // (heads * 16)) // (blocks // heads)

        def fn(ker=ker, blocks=blocks, threads=threads, rpb=rows_per_block):
            ker((blocks,), (threads,), (src, np.int64(rpb), np.int32(heads), dst))
        timed("head-rows", fn, blocks, threads, u,
              rows_per_block * (blocks // heads) * heads * 256)
    print(f"copy bandwidth {copy_bw:.2f} TB/s, {sms} SMs, {args.mb:.1f} MB read")
    print(f"{'pattern':>10} {'blocks':>6} {'thr':>4} {'U':>3} {'flush':>5} {'us':>7} {'TB/s':>6} "
          f"{'of copy':>7}")
    for r in rows:
        print(f"{r['pattern']:>10} {r['blocks']:6d} {r['threads']:4d} {r['in_flight']:3d} "
              f"{r['flush']:>5} "
              f"{r['us']:7.1f} {r['tb_s']:6.2f} {r['of_copy']:7.2f}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "stream_probe.json").write_text(json.dumps(
            {"env": environment(), "copy_tb_s": copy_bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
