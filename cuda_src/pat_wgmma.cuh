// Hopper warpgroup MMA (wgmma, sm_90a): the tensor-core path of the 64- and 128-row tiles.
//
// One warpgroup (4 consecutive warps, 128 threads) owns 64 query rows.  Per KV tile of N tokens:
//   S (64 x N, fp32 registers)   = Q (64 x 128, shared memory) . K^T (shared memory)   [SS form]
//   O (64 x 128, fp32 registers) += P (64 x N, fp16/bf16 registers) . V (shared memory)  [RS form]
// The accumulator layout of m64nNk16 gives warp w of the group rows 16w .. 16w + 15 in exactly the
// register layout of mma.sync m16n8k16 (d[j][0..3]: row lane/4 and + 8, columns 8j + 2(lane%4)
// and + 1), and the register A operand takes the m16n8k16 A-fragment layout, so the online
// softmax and the P packing are the same code as the mma.sync path.
//
// Operands in shared memory use the 128-byte swizzle: a tile of R rows x 128 elements is stored
// as two halves (elements 0-63, 64-127), each R rows of 128 bytes, and the 16-byte chunk c of row r
// sits at chunk position c ^ (r % 8) (wg_swz).  Descriptors: start address, leading and stride
// byte offsets (>> 4), swizzle mode 1 (128 B); the regions are 1024-byte aligned.
//   Q (A, K-major) and K (B of S, K-major): SBO = 1024 (8 rows of 128 B); a k16 step inside a half
//   advances the start by 32 bytes.
//   V (B of O, MN-major: tokens are K, head_dim is N, transposed): LBO = R * 128 (from one 64-element
//   half of head_dim to the other), SBO = 1024 (8 tokens); a k16 step advances 16 rows (2048 B).
// The instruction strings below differ only in N and the element type: one macro per N, the
// type pasted in as a string literal (inline PTX takes no template-dependent strings).
#pragma once

#include "pat_common.cuh"

namespace pat {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PAT_HAS_WGMMA 1
#else
#define PAT_HAS_WGMMA 0
#endif

// Element offset of 16-byte chunk `chunk` (0 .. 15) of row `row` in an R-row swizzled tile.
template <int R>
__device__ __forceinline__ int wg_swz(int row, int chunk) {
  return (chunk >> 3) * (R * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

__device__ __forceinline__ unsigned long long wg_desc(unsigned saddr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((saddr & 0x3FFFF) >> 4) |
         ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if PAT_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if PAT_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if PAT_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// cp.async (generic proxy) writes -> visible to the tensor cores' reads (async proxy); each
// writing thread, before the barrier that publishes the tile.
__device__ __forceinline__ void fence_proxy_async() {
#if PAT_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving reads or writes of accumulator registers across the wait.
template <int J>
__device__ __forceinline__ void wg_fence_regs(float (&d)[J][4]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

// The accumulator operands of one m64nN instruction: row blocks 0 .. N/8 - 1 of d, each one
// m16n8 fragment of four floats; each longer list extends the shorter one.
#define PAT_WG_D8(J) "+f"(d[J][0]), "+f"(d[J][1]), "+f"(d[J][2]), "+f"(d[J][3])
#define PAT_WG_D_N16 PAT_WG_D8(0), PAT_WG_D8(1)
#define PAT_WG_D_N32 PAT_WG_D_N16, PAT_WG_D8(2), PAT_WG_D8(3)
#define PAT_WG_D_N64 PAT_WG_D_N32, PAT_WG_D8(4), PAT_WG_D8(5), PAT_WG_D8(6), PAT_WG_D8(7)
#define PAT_WG_D_N128 \
  PAT_WG_D_N64, PAT_WG_D8(8), PAT_WG_D8(9), PAT_WG_D8(10), PAT_WG_D8(11), PAT_WG_D8(12), \
      PAT_WG_D8(13), PAT_WG_D8(14), PAT_WG_D8(15)

// Accumulator register numbers %0 .. %(N / 2 - 1), each longer list extending the shorter one;
// the descriptors and `accumulate` take the next three numbers.
#define PAT_WG_R8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define PAT_WG_R16 PAT_WG_R8 ", %8, %9, %10, %11, %12, %13, %14, %15"
#define PAT_WG_R32 PAT_WG_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31"
#define PAT_WG_R64 PAT_WG_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"

// One instruction per shape: SS = A and B from shared-memory descriptors (`accumulate` = 0
// overwrites D), RS = A from registers.  TY, the element type ("f16" or "bf16"), is pasted in as
// a string literal.
#define PAT_WGMMA_SS(N, TY, DREGS, DA, DB, ACC) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %" #ACC ", 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " \
      "{" DREGS "}, %" #DA ", %" #DB ", p, 1, 1, 0, 0;\n}\n" \
      : PAT_WG_D_N##N \
      : "l"(da), "l"(db), "r"(accumulate))

#define PAT_WGMMA_SS_N16(TY) PAT_WGMMA_SS(16, TY, PAT_WG_R8, 8, 9, 10)
#define PAT_WGMMA_SS_N32(TY) PAT_WGMMA_SS(32, TY, PAT_WG_R16, 16, 17, 18)
#define PAT_WGMMA_SS_N64(TY) PAT_WGMMA_SS(64, TY, PAT_WG_R32, 32, 33, 34)
#define PAT_WGMMA_SS_N128(TY) PAT_WGMMA_SS(128, TY, PAT_WG_R64, 64, 65, 66)

#define PAT_WGMMA_RS_N128(TY) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " \
      "{" PAT_WG_R64 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
      : PAT_WG_D_N128 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))

// S[64 x N] (+)= A (descriptor) . B (descriptor); accumulate = 0 overwrites S.
template <typename T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 8][4], unsigned long long da,
                                         unsigned long long db, int accumulate) {
  static_assert(N == 16 || N == 32 || N == 64 || N == 128, "wgmma tile n: 16, 32, 64 or 128");
#if PAT_HAS_WGMMA
  constexpr bool bf16 = ElemOps<T>::kIsBF16;
  if constexpr (N == 16) { if constexpr (bf16) PAT_WGMMA_SS_N16("bf16"); else PAT_WGMMA_SS_N16("f16"); }
  if constexpr (N == 32) { if constexpr (bf16) PAT_WGMMA_SS_N32("bf16"); else PAT_WGMMA_SS_N32("f16"); }
  if constexpr (N == 64) { if constexpr (bf16) PAT_WGMMA_SS_N64("bf16"); else PAT_WGMMA_SS_N64("f16"); }
  if constexpr (N == 128) { if constexpr (bf16) PAT_WGMMA_SS_N128("bf16"); else PAT_WGMMA_SS_N128("f16"); }
#else
  __trap();
#endif
}

// O[64 x 128] += P (registers, m16n8k16 A layout per warp) . V (descriptor, transposed).
template <typename T>
__device__ __forceinline__ void wgmma_rs_n128(float (&d)[16][4], const unsigned (&a)[4],
                                              unsigned long long db) {
#if PAT_HAS_WGMMA
  if constexpr (ElemOps<T>::kIsBF16) PAT_WGMMA_RS_N128("bf16"); else PAT_WGMMA_RS_N128("f16");
#else
  __trap();
#endif
}

#undef PAT_WGMMA_SS_N16
#undef PAT_WGMMA_SS_N32
#undef PAT_WGMMA_SS_N64
#undef PAT_WGMMA_SS_N128
#undef PAT_WGMMA_RS_N128
#undef PAT_WGMMA_SS
#undef PAT_WG_R8
#undef PAT_WG_R16
#undef PAT_WG_R32
#undef PAT_WG_R64
#undef PAT_WG_D_N16
#undef PAT_WG_D_N32
#undef PAT_WG_D_N64
#undef PAT_WG_D_N128
#undef PAT_WG_D8

}  // namespace pat
