// The forward kernel's KV gather: token -> page -> K and V rows of one KV head into a
// shared-memory stage (cp.async), and the barriers of a block and of one token slice.
#pragma once

#include "pat_common.cuh"
#include "pat_params.cuh"
#include "pat_traits.cuh"

namespace pat {

extern __shared__ __align__(128) unsigned char pat_dyn_smem[];


// Gathers one token slice (NW tokens starting at row0) of a KV tile into a shared-memory stage:
// token -> page id (through the CTA's page list) -> K row and V row of this KV head.  Layouts are
// plain strides in elements (page, token, head), so NHD, HND and strided views share one code
// path.  A thread keeps one 16-byte column `ch` and strides over rows
// (SLICE_THREADS % CHUNKS == 0).
//
// The gather is most of a short block's instructions, so each row costs little: the host checks
// that a page's stride and every offset inside a page fit in 32 bits, so a row's address is one
// 32x32->64 multiply (page id x page stride) plus a 32-bit in-page offset; rows past the range
// are clamped to the last token (a valid address) and copy 0 bytes (zero fill), so the loop has
// no branches; power-of-two pages (the common case) get their own loop without a division.
//
// An fp8 cache (Tr::KV8) takes the same path with 16 elements per 16-byte chunk, into byte
// tiles at swz8 offsets, which the walk reads as they are (pat_mma_walk.cuh).
template <typename Tr>
struct KvTileLoader {
  using T = typename Tr::T;
  using KV = typename Tr::KV;
  const KV* __restrict__ k_cache;
  const KV* __restrict__ v_cache;
  const int* __restrict__ pages;  // indexed by absolute page number (pos / page_size)
  int kv_start, kv_len, page_size, page_shift;  // page_shift: log2(page_size) or -1
  int k_sp, k_st, k_head, v_sp, v_st, v_head;   // element strides; *_head = kv_head x head stride

  // One token slice into K and V destinations `dK`, `dV` of a stage: the 16-bit tiles at their
  // swizzled offsets (Dst = T, 8 elements per 16-byte chunk), or for an fp8 cache the byte
  // tiles (Dst = unsigned char, 16 elements per chunk).
  template <bool POW2, typename Dst>
  __device__ __forceinline__ void load_rows(Dst* dK, Dst* dV, int tile_base, int row0,
                                            int tid) const {
    constexpr int N = Tr::N, THREADS = Tr::SLICE_THREADS, NW = Tr::NW;
    constexpr int CHUNKS = Tr::KV8 ? Tr::CHUNKS8 : Tr::CHUNKS;
    constexpr int LOADS = Tr::KV8 ? Tr::KV_LOADS8 : Tr::KV_LOADS;
    const int ch = tid % CHUNKS;
    const int k_col = k_head + ch * (16 / int(sizeof(KV)));
    const int v_col = v_head + ch * (16 / int(sizeof(KV)));
    const int last = kv_len - 1;  // >= 0: a tile is only loaded when the range has tokens
#pragma unroll Tr::LOAD_UNROLL
    for (int it = 0; it < LOADS; ++it) {
      const int id = tid + it * THREADS;
      if ((NW * CHUNKS) % THREADS == 0 || id < NW * CHUNKS) {
// <tutorial:gather>
        const int row = row0 + id / CHUNKS;
        const int tok = tile_base + row;
        const int bytes = tok <= last ? 16 : 0;
        const int pos = kv_start + (tok <= last ? tok : last);
        const int pidx = POW2 ? (pos >> page_shift) : pos / page_size;
        const int slot = pos - pidx * page_size;
        const int page = pages[pidx];
        const KV* ks = k_cache + (mul_wide(page, k_sp) + (slot * k_st + k_col));
        const KV* vs = v_cache + (mul_wide(page, v_sp) + (slot * v_st + v_col));
        const int off = Tr::KV8 ? swz8<Tr::D>(row, ch) : Tr::template off<N>(row, ch);
        cp_async_16(smem_u32(dK + off), ks, bytes);
        cp_async_16(smem_u32(dV + off), vs, bytes);
// </tutorial:gather>
      }
    }
  }

  // Tile `tile` (this slice's rows) into stage `stage` of the K and V rings sK, sV (stages
  // Tr::KV_STAGE_T elements of T apart; byte tiles for an fp8 cache).
  __device__ __forceinline__ void load(T* sK, T* sV, int tile, int stage, int row0,
                                      int tid) const {
    if constexpr (Tr::KV8)
      load_tile(reinterpret_cast<unsigned char*>(sK + stage * Tr::KV_STAGE_T),
                reinterpret_cast<unsigned char*>(sV + stage * Tr::KV_STAGE_T), tile, row0, tid);
    else
      load_tile(sK + stage * Tr::KV_STAGE_T, sV + stage * Tr::KV_STAGE_T, tile, row0, tid);
  }

  template <typename Dst>
  __device__ __forceinline__ void load_tile(Dst* dK, Dst* dV, int tile, int row0,
                                            int tid) const {
    if (page_shift >= 0)
      load_rows<true>(dK, dV, tile * Tr::N, row0, tid);
    else
      load_rows<false>(dK, dV, tile * Tr::N, row0, tid);
  }
};

// Barrier over the variant's own THREADS threads (bar.sync 0 with an explicit count, so a kernel
// that dispatches several variants in one launch can let the warps a variant does not use exit).
template <typename Tr>
__device__ __forceinline__ void cta_sync() {
  asm volatile("bar.sync 0, %0;\n" ::"n"(Tr::THREADS) : "memory");
}

// Barrier among the warps of one token slice (they share that slice's K/V rows).
template <typename Tr>
__device__ __forceinline__ void slice_sync(int wn) {
  if constexpr (Tr::WARPS_M == 1) {
    __syncwarp();
  } else if constexpr (Tr::WARPS_N == 1) {
    cta_sync<Tr>();
  } else {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + wn), "n"(Tr::SLICE_THREADS) : "memory");
  }
}

}  // namespace pat
