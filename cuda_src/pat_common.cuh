// Shared device helpers of the pat kernels: element types, 16-byte cp.async, ldmatrix, the
// m16n8k16 tensor-core MMA and the shared-memory swizzle.
//
// Compiled both by NVRTC (through CuPy, at run time) and by nvcc (bench/kernel_resources.py), so
// this file uses no standard-library headers: only the CUDA half/bfloat16 headers, which both
// toolchains provide.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace pat {

// ---------------------------------------------------------------------------------------------
// Element types.  ElemOps<T> packs two fp32 values into the 32-bit register pair layout the MMA
// expects (lower column in the low 16 bits) and converts for the merge kernel's stores.
// ---------------------------------------------------------------------------------------------
template <typename T> struct ElemOps;

template <> struct ElemOps<__half> {
  static constexpr bool kIsBF16 = false;
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <> struct ElemOps<__nv_bfloat16> {
  static constexpr bool kIsBF16 = true;
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// ---------------------------------------------------------------------------------------------
// FP8 KV caches.  fp8_e4m3 names the element type of a float8_e4m3fn cache (1 sign, 4 exponent
// bits of bias 7, 3 mantissa bits, no infinities, 0x7F / 0xFF NaN): the forward kernel gathers
// its bytes into shared memory as they are and widens its fragments to the query's type (T) in
// registers, before the MMAs.
// ---------------------------------------------------------------------------------------------
struct fp8_e4m3 {
  unsigned char bits;
};

// Two e4m3 values (low byte first) -> two halves (low half first), exactly: every e4m3 value is
// an fp16 value.  sm_89+ converts in one instruction; older GPUs place the 7 exponent+mantissa
// bits under fp16's and rescale by 2^(15 - 7) (exact, subnormals included: fp16 arithmetic keeps
// them), then restore the NaN code, which that rescale would make 480.
__device__ __forceinline__ unsigned e4m3x2_to_half2(unsigned short v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(v));
  return r;
#else
  const unsigned x = v;
  const unsigned bits = ((x & 0x80u) << 8) | ((x & 0x7Fu) << 7) |
                        ((x & 0x8000u) << 16) | ((x & 0x7F00u) << 15);
  __half2 h = *reinterpret_cast<const __half2*>(&bits);
  h = __hmul2(h, __float2half2_rn(256.f));
  unsigned r = *reinterpret_cast<unsigned*>(&h);
  if ((x & 0x7Fu) == 0x7Fu) r |= 0x7FFFu;                 // NaN (sign kept)
  if ((x & 0x7F00u) == 0x7F00u) r |= 0x7FFF0000u;
  return r;
#endif
}

// Four e4m3 values (one 32-bit word, lowest byte first) -> two 32-bit pairs of T, in order.
template <typename T>
__device__ __forceinline__ void e4m3x4_to(unsigned w, unsigned& lo, unsigned& hi) {
  lo = e4m3x2_to_half2(static_cast<unsigned short>(w & 0xFFFFu));
  hi = e4m3x2_to_half2(static_cast<unsigned short>(w >> 16));
  if constexpr (ElemOps<T>::kIsBF16) {
    // through fp32: exact (e4m3 values have 4 significant bits and fit bf16's range)
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
    lo = ElemOps<T>::pack2(a.x, a.y);
    hi = ElemOps<T>::pack2(b.x, b.y);
  }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous global -> shared copies (sm_80+).  `src_bytes` is 16 or 0; with 0 nothing is read
// and the 16 destination bytes are zero-filled, which is how out-of-range tokens and padded query
// rows become zeros in shared memory (so 0 * garbage can never produce a NaN).
// .cg: bypass L1, the KV stream is read once per CTA.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

// a * b as a 64-bit product of two 32-bit operands: one wide multiply-add in SASS, where a
// product of two sign-extended 64-bit values may cost several
__device__ __forceinline__ long long mul_wide(int a, int b) {
  long long r;
  asm("mul.wide.s32 %0, %1, %2;\n" : "=l"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `N` of this thread's committed copy groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------------------------------------
// ldmatrix: four 8x8 b16 matrices; lane l supplies the row address of matrix l / 8, row l % 8.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---------------------------------------------------------------------------------------------
// D (16x8 fp32) += A (16x16, row) * B (16x8, col) on the tensor cores.
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0,
                                          unsigned b1) {
  if constexpr (ElemOps<T>::kIsBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---------------------------------------------------------------------------------------------
// Shared-memory swizzle.  A tile row holds head_dim b16 elements = head_dim / 8 chunks of 16
// bytes; rows are 128 or 256 bytes long, so the same chunk of 8 consecutive rows would fall in
// the same four banks (an 8-way conflict for ldmatrix).  XOR-ing the chunk index with the row's
// low three bits spreads any 8 consecutive rows over all 32 banks, both for the cp.async writes
// and for the ldmatrix reads.  Returns the element offset of (row, chunk).
// ---------------------------------------------------------------------------------------------
template <int HEAD_DIM>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * HEAD_DIM + ((chunk ^ (row & 7)) << 3);
}

// The same for a tile of fp8 rows (D bytes = D / 16 chunks): returns the byte offset of
// (row, chunk).  A 64-byte row is half a 128-byte line, so there rows 2i and 2i + 1 share a
// line and the XOR takes row / 2: any 8 consecutive rows' same chunk still covers all banks.
template <int D>
__device__ __forceinline__ int swz8(int row, int chunk) {
  constexpr int CH = D / 16;
  if constexpr (CH >= 8) return row * D + ((chunk ^ (row & 7)) << 4);
  else return row * D + ((chunk ^ ((row >> 1) & (CH - 1))) << 4);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Programmatic dependent launch (Hopper and later; no-ops before sm_90 and when the next launch
// does not ask for it).  A forward kernel lets the launch after it start at once
// (pdl_launch_dependents); a kernel launched that way calls pdl_wait before it reads anything the
// launch before it writes: the wait returns once that grid has finished and its writes are
// visible (pat_core/cuda_backend.py, the finisher phase).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}


// The end of a chained forward launch (pat_core/cuda_backend.py, fwd_chain "pdl").  The forward
// launches of a step go on one stream, each a programmatic dependent of the one before it, so the
// next launch's blocks are placed as soon as every block of this one is (pdl_launch_dependents at
// the start of each block), with no fork and join and in a fixed order.  Nothing in a forward
// launch reads what another writes, but whatever follows the last launch (the merge, the caller's
// next kernel) must find all of them finished: so this grid may not finish before the one before
// it.  Of the `workers` blocks that drew an item (blocks 0 .. workers - 1), the one that finishes
// last waits for that grid (pdl_wait; a no-op when the launch was not a dependent one) before it
// exits, and resets the counter for the next run; with no item at all, block 0 waits.  The other
// blocks free their SM slots at once, and a block that had no item leaves without touching the
// counter: the launches of a graph-safe set have resident-sized grids, mostly idle, and their
// blocks' same-address atomics cost about 2% of such a replay (bench/NOTES.md).
__device__ __forceinline__ void chain_exit(int* chain, int workers) {
  if (chain == nullptr || threadIdx.x != 0) return;
  const int b = (int)blockIdx.x;
  if (workers <= 0) {
    if (b == 0) pdl_wait();
    return;
  }
  if (b < workers && atomicAdd(chain, 1) == workers - 1) {
    pdl_wait();
    *chain = 0;
  }
}

// ---------------------------------------------------------------------------------------------
// Per-block clock records, for bench/lab/block_timeline.py only: compiled in with
// -DPAT_BLOCK_CLOCK=CAP (CudaBackend(defines=...)), a no-op otherwise.  Block b (< CAP) of a module's
// kernel writes pat_block_clock[slot][b] = {start, ready, end, start cycle, end cycle, SM id}:
// %globaltimer (ns) when its thread 0 starts, when it is ready to work (the merge: after its
// pdl_wait; else the start), and the latest end of its warps; the SM's clock64 at the same start
// and end (globaltimer may tick coarsely; the cycle count does not).  Slot 1 is the finisher
// kernel, slot 0 every other kernel.  The caller zeroes the array before the run it records.
// ---------------------------------------------------------------------------------------------
struct BlockClock {
#ifdef PAT_BLOCK_CLOCK
  unsigned long long* rec;
  __device__ __forceinline__ static unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  __device__ __forceinline__ explicit BlockClock(int slot);
  __device__ __forceinline__ void ready() {
    if (rec != nullptr && threadIdx.x == 0) rec[1] = now();
  }
  __device__ __forceinline__ void end() {
    if (rec == nullptr || (threadIdx.x & 31) != 0) return;
    const unsigned long long c = (unsigned long long)clock64();
    atomicMax(rec + 2, now());
    atomicMax(rec + 4, c);
  }
#else
  __device__ __forceinline__ explicit BlockClock(int) {}
  __device__ __forceinline__ void ready() {}
  __device__ __forceinline__ void end() {}
#endif
};

}  // namespace pat

#ifdef PAT_BLOCK_CLOCK
// global namespace, so that the host finds it by this name (RawModule.get_global)
__device__ unsigned long long pat_block_clock[2][PAT_BLOCK_CLOCK][6];

__device__ __forceinline__ pat::BlockClock::BlockClock(int slot) : rec(nullptr) {
  const unsigned b = blockIdx.x;
  if (b >= (unsigned)PAT_BLOCK_CLOCK) return;
  rec = pat_block_clock[slot][b];
  if (threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const unsigned long long c = (unsigned long long)clock64();
    const unsigned long long t = now();
    rec[0] = t;
    rec[1] = t;
    rec[3] = c;
    rec[5] = sm;
  }
}
#endif
