"""What a ring of shared-memory stages streams: ``cp.async`` gathers against TMA page copies.

    python3 bench/lab/ring_probe.py [--tokens 16384] [--heads 8] [--out DIR]

The 64- and 128-row warpgroup tiles stream paged KV into a ring of shared-memory stages, one
block per SM on a long shared prefix (``pat_core.split.one_wave_share``), and reach ~0.68 of
copy bandwidth there, against 0.86 for a plain read of the same bytes (``stream_probe.py``).
Deeper rings and more warps did not help the kernel (NOTES, rounds 17 and 20).  This probe takes
the attention out and keeps only the data movement, so the ring itself can be measured:

* ``cp``: 128 threads gather each 64-token tile (K and V, one KV head, NHD pages of 16 tokens)
  with 16-byte ``cp.async`` through the page table, as the kernel's loader does; a ring of
  ``S`` stages keeps ``S - 1`` tiles in flight while a tile is consumed.
* ``tma``: thread 0 copies each page's 16 rows with ``cp.async.bulk.tensor`` (a 3-D tensor map
  over the cache, 128-byte swizzle, two 64-column boxes per page for K and for V: 16 copies of
  2 KB per tile) and an ``mbarrier`` per stage counts the bytes in; all ``S`` stages are in
  flight while none is consumed.

Each block consumes a tile by XOR-reading one 16-byte word per thread per row group, then
waits ``delay`` ns (a stand-in for the tile's MMAs and softmax: ~0.5 us for a 64x64 tile), then
frees the stage.  Blocks: one KV head of one token range each, ``heads x ranges`` blocks.  Timed
with CUDA events, L2 flushed before every run (``common.flush_mode``), median of ``--iters``.
Prints a table (mode, stages, blocks, delay, us, TB/s, fraction of a device-to-device copy) and
writes ``DIR/ring_probe.json`` with ``--out``.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:     # run as a script: python bench/lab/ring_probe.py
    sys.path.insert(0, str(ROOT))

_SRC = r"""
struct __align__(64) TmaDesc { unsigned long long v[16]; };

__device__ __forceinline__ unsigned su32(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void spin_ns(int ns) {
  if (ns <= 0) return;
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  unsigned long long t = t0;
  while (t - t0 < (unsigned long long)ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
}

// Tile layout in a stage: [K | V], each [64 rows][256 B] (cp) or [2 halves][64 rows][128 B] (tma).
__device__ __forceinline__ unsigned consume(const unsigned char* stage, int tid) {
  unsigned acc = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) {  // 32 KB / 16 B / 128 threads = 16 words per thread
    const uint4 w = reinterpret_cast<const uint4*>(stage)[tid + i * 128];
    acc ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  return acc;
}

template <int S>
__global__ void __launch_bounds__(128) cp_ring(const unsigned char* __restrict__ k,
                                               const unsigned char* __restrict__ v,
                                               const int* __restrict__ pages, int pages_per_block,
                                               int heads, int tiles, int delay, unsigned* out) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int head = blockIdx.x % heads, range = blockIdx.x / heads, tid = threadIdx.x;
  const int* pg = pages + (long long)range * pages_per_block;
  auto load = [&](int t, int s) {
    unsigned char* base = smem + s * 32768;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int c = tid + i * 128, row = c >> 4, col = c & 15, tok = t * 64 + row;
      const long long page = pg[tok >> 4];
      const long long off = ((page * 16 + (tok & 15)) * heads + head) * 256 + col * 16;
      const unsigned d = su32(base + row * 256 + ((col ^ (row & 7)) * 16));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(k + off));
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + 16384), "l"(v + off));
    }
  };
  unsigned acc = 0;
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < tiles) load(s, s);
    asm volatile("cp.async.commit_group;");
  }
  for (int t = 0; t < tiles; ++t) {
    const int tn = t + S - 1;
    if (tn < tiles) load(tn, tn % S);
    asm volatile("cp.async.commit_group;");
    asm volatile("cp.async.wait_group %0;" ::"n"(S - 1));
    __syncthreads();
    acc ^= consume(smem + (t % S) * 32768, tid);
    spin_ns(delay);
    __syncthreads();
  }
  asm volatile("cp.async.wait_group 0;");
  acc = __reduce_xor_sync(0xffffffffu, acc);
  if ((tid & 31) == 0) atomicXor(out + blockIdx.x, acc);
}

template <int S>
__global__ void __launch_bounds__(128) tma_ring(const __grid_constant__ TmaDesc tk,
                                                const __grid_constant__ TmaDesc tv,
                                                const int* __restrict__ pages, int pages_per_block,
                                                int heads, int tiles, int delay, unsigned* out) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) unsigned long long full[S];
  unsigned char* smem = smem_raw + ((1024u - (su32(smem_raw) & 1023u)) & 1023u);
  const int head = blockIdx.x % heads, range = blockIdx.x / heads, tid = threadIdx.x;
  const int* pg = pages + (long long)range * pages_per_block;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su32(&full[s])));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  const unsigned long long dk = reinterpret_cast<unsigned long long>(&tk);
  const unsigned long long dv = reinterpret_cast<unsigned long long>(&tv);
  auto issue = [&](int t, int s) {  // thread 0 only
    const unsigned bar = su32(&full[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(32768));
    unsigned char* base = smem + s * 32768;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int tok0 = pg[t * 4 + p] * 16;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const unsigned dst = su32(base + h * 8192 + p * 2048);
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst), "l"(dk), "r"(h * 64), "r"(head),
            "r"(tok0), "r"(bar) : "memory");
        asm volatile(
            "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst + 16384), "l"(dv), "r"(h * 64),
            "r"(head), "r"(tok0), "r"(bar) : "memory");
      }
    }
  };
  if (tid == 0)
    for (int s = 0; s < S && s < tiles; ++s) issue(s, s);
  unsigned acc = 0;
  for (int t = 0; t < tiles; ++t) {
    const int s = t % S;
    const unsigned bar = su32(&full[s]), parity = (t / S) & 1;
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                   "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    acc ^= consume(smem + s * 32768, tid);
    spin_ns(delay);
    __syncthreads();  // every thread has read stage s before it is refilled
    if (tid == 0 && t + S < tiles) issue(t + S, s);
  }
  acc = __reduce_xor_sync(0xffffffffu, acc);
  if ((tid & 31) == 0) atomicXor(out + blockIdx.x, acc);
}
"""

_STAGES = (2, 3, 4, 6)


def _encode_map(cache_ptr: int, tokens: int, heads: int, elem_bytes: int = 2) -> bytes:
    """The 128-byte CUtensorMap of one NHD cache [tokens, heads, 128] (fp16): box 64 columns x
    1 head x 16 tokens, 128-byte swizzle (``cuTensorMapEncodeTiled``, through ctypes)."""
    lib = ctypes.CDLL("libcuda.so.1")
    desc = (ctypes.c_uint64 * 16)()
    dims = (ctypes.c_uint64 * 3)(128, heads, tokens)
    strides = (ctypes.c_uint64 * 2)(128 * elem_bytes, heads * 128 * elem_bytes)
    box = (ctypes.c_uint32 * 3)(64, 1, 16)
    estr = (ctypes.c_uint32 * 3)(1, 1, 1)
    # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 = 6, INTERLEAVE_NONE = 0, SWIZZLE_128B = 3,
    # L2_PROMOTION_L2_256B = 3, FLOAT_OOB_FILL_NONE = 0
    err = lib.cuTensorMapEncodeTiled(desc, 6, 3, ctypes.c_void_p(cache_ptr), dims, strides, box,
                                     estr, 0, 3, 3, 0)
    if err:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {err}")
    return bytes(desc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384, help="shared prefix length")
    ap.add_argument("--heads", type=int, default=8, help="KV heads")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import cupy as cp
    import numpy as np
    import torch
    from cupy.cuda import driver
    from bench.common import copy_bandwidth, flush_mode, l2_flusher, time_events
    from bench.lab.kernel_lab import environment

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads, tokens = args.heads, args.tokens
    names = [f"{k}<{s}>" for k in ("cp_ring", "tma_ring") for s in _STAGES]
    mod = cp.RawModule(code=_SRC, options=("-std=c++17",), name_expressions=names)
    n_pages = tokens // 16
    gen = torch.Generator().manual_seed(0)
    # the prefix's pages scattered over a cache twice its size, as a paged pool would leave them
    pool = 2 * n_pages
    perm = torch.randperm(pool, generator=gen)[:n_pages].to(torch.int32)
    kc = torch.randn(pool * 16, heads, 128, dtype=torch.float16, device="cuda")
    vc = torch.randn_like(kc)
    pages = perm.cuda()
    out = torch.zeros(64 * sms, dtype=torch.int32, device="cuda")
    flush = l2_flusher(128 << 20)
    copy_bw = copy_bandwidth() / 1e12
    maps = [_encode_map(kc.data_ptr(), pool * 16, heads), _encode_map(vc.data_ptr(), pool * 16,
                                                                         heads)]
    stream = torch.cuda.current_stream().cuda_stream
    rows, checks = [], {}
    for ranges in (16, 32):
        blocks = heads * ranges
        ppb = n_pages // ranges
        tiles = ppb // 4
        nbytes = blocks * tiles * 32768
        for mode in ("cp", "tma"):
            for s in _STAGES:
                smem = s * 32768 + (1024 if mode == "tma" else 0)
                if smem > 227 * 1024:
                    continue
                fn_ = mod.get_function(f"{mode}_ring<{s}>")
                fn_.max_dynamic_shared_size_bytes = smem
                fptr = int(fn_.kernel.ptr)
                for delay in (0, 500):
                    if mode == "cp":
                        argv_ = [ctypes.c_uint64(kc.data_ptr()), ctypes.c_uint64(vc.data_ptr())]
                    else:
                        argv_ = [ctypes.create_string_buffer(m, 128) for m in maps]
                    argv_ += [ctypes.c_uint64(pages.data_ptr()), ctypes.c_int32(ppb),
                              ctypes.c_int32(heads), ctypes.c_int32(tiles),
                              ctypes.c_int32(delay), ctypes.c_uint64(out.data_ptr())]
                    ptrs = (ctypes.c_void_p * len(argv_))(
                        *[ctypes.addressof(a) for a in argv_])

                    def fn(fptr=fptr, blocks=blocks, smem=smem, ptrs=ptrs, keep=argv_):
                        driver.launchKernel(fptr, blocks, 1, 1, 128, 1, 1, smem, stream,
                                            ctypes.addressof(ptrs), 0)
                    out.zero_()
                    fn()
                    torch.cuda.synchronize()
                    # XOR of every word a block read: the same whatever the stage layout, so
                    # a TMA row that landed wrong (or not at all) shows as a mismatch
                    sums = out[:blocks].cpu().numpy().tobytes()
                    ref = checks.setdefault(blocks, sums)
                    us = float(np.median(time_events(fn, args.iters, flush=flush))) * 1e3
                    rows.append({"mode": mode, "stages": s, "blocks": blocks,
                                 "per_sm": -(-blocks // sms), "delay_ns": delay,
                                 "bytes": nbytes, "us": us, "tb_s": nbytes / us / 1e6,
                                 "of_copy": nbytes / us / 1e6 / copy_bw,
                                 "same_words": sums == ref})
    print(f"copy bandwidth {copy_bw:.2f} TB/s, {sms} SMs, {tokens} tokens x {heads} heads, "
          f"L2 flush {flush_mode()}")
    print(f"{'mode':>4} {'S':>2} {'blocks':>6} {'delay':>5} {'us':>7} {'TB/s':>6} {'of copy':>7} words")
    for r in rows:
        print(f"{r['mode']:>4} {r['stages']:2d} {r['blocks']:6d} {r['delay_ns']:5d} "
              f"{r['us']:7.1f} {r['tb_s']:6.2f} {r['of_copy']:7.2f} "
              f"{'same' if r['same_words'] else 'DIFFER'}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ring_probe.json").write_text(json.dumps(
            {"env": environment(), "copy_tb_s": copy_bw, "tokens": tokens, "heads": heads,
             "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
