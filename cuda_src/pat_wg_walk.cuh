// The KV walk of the Hopper warpgroup layout (wgmma from shared memory; sm_90a).
#pragma once

#include "pat_kv_loader.cuh"
#include "pat_softmax.cuh"
#include "pat_traits.cuh"
#include "pat_wgmma.cuh"

namespace pat {

// The KV walk of the warpgroup layout (Tr::WG): the warps of token slice wn gather their NW
// tokens of each tile (slice barriers: with two slices the two warpgroups of a 64-row tile run as
// independent pipelines), then warpgroup g of the slice computes S = Q[64g .. 64g + 63] K^T with
// wgmma from shared memory, the online softmax on S in registers, and O += P V with P from
// registers.  Each tile's MMAs are waited for before the registers are touched.  A slice whose
// tokens of the last tile all lie past the range skips that tile's MMAs (a fully masked step
// would turn an empty state's -inf max into NaN); it still takes both barriers.  Causal
// variants (Tr::CAUSAL) also mask each row past its token's limit (mask_causal; rows: the
// item's CausalRows), which the other variants never read.
template <typename Tr, typename Loader, typename Rows>
__device__ __forceinline__ void pat_wg_loop(typename Tr::T* sQ, typename Tr::T* sK,
                                            typename Tr::T* sV, const Loader& loader,
                                            int num_tiles, int kv_len, float scale_log2, int wn,
                                            int wm, int lane, int tid, int stid,
                                            float (&acc)[1][Tr::D / 8][4],
                                            float (&m_run)[1][2], float (&l_run)[1][2],
                                            const Rows& rows) {
  using T = typename Tr::T;
  constexpr int M = Tr::M, N = Tr::N, NW = Tr::NW, D = Tr::D, STAGES = Tr::STAGES;
  constexpr bool ONE = Tr::WARPS_N == 1;
  const int g = wm >> 2;  // warpgroup of the slice: rows 64g .. 64g + 63
  const unsigned q_addr = smem_u32(sQ) + g * 64 * 128;  // first row of this group, first half
  // this slice's first token row in each half of a stage (NW * 128 bytes: whole swizzle atoms);
  // a compile-time 0 with one slice
  const int row0 = ONE ? 0 : wn * NW;
  const unsigned k_addr = smem_u32(sK) + row0 * 128, v_addr = smem_u32(sV) + row0 * 128;
  constexpr unsigned Q_HALF = M * 128, KV_HALF = N * 128, STAGE_BYTES = N * D * 2;
  for (int t = 0; t < num_tiles; ++t) {
    const int tn = t + STAGES - 1;
    if (tn < num_tiles) loader.load(sK, sV, tn, tn % STAGES, row0, ONE ? tid : stid);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    fence_proxy_async();  // this thread's copies of tile t (and Q) -> the tensor cores' view
    slice_sync<Tr>(ONE ? 0 : wn);  // every copy of this slice of tile t has landed
    const unsigned st = (t % STAGES) * STAGE_BYTES;
    const int valid = kv_len - t * N;  // tokens of tile t inside the range

    if (ONE || row0 < valid) {  // uniform over the warpgroup
      // S = Q K^T: D / 16 steps of k16; the first overwrites S
      float s[1][NW / 8][4];
      if constexpr (kWgPingPong && ONE && M == 128) {
        // the second warpgroup issues its Q K^T only once the first has issued its own, so
        // the tensor cores take them in turn and one group's softmax runs under the other's
        // MMAs (both groups pass this once per tile, between the tile's two block barriers)
        if (g == 1) asm volatile("bar.sync 2, 256;\n" ::: "memory");
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const unsigned koff = (kk & 3) * 32;  // k16 step inside a 64-element half
        const unsigned long long da = wg_desc(q_addr + (kk >> 2) * Q_HALF + koff, 16, 1024);
        const unsigned long long db = wg_desc(k_addr + st + (kk >> 2) * KV_HALF + koff, 16, 1024);
        wgmma_ss<T, NW>(s[0], da, db, kk > 0);
      }
      wgmma_commit();
      if constexpr (kWgPingPong && ONE && M == 128) {
        if (g == 0) asm volatile("bar.arrive 2, 256;\n" ::: "memory");
      }
      wgmma_wait<0>();
      wg_fence_regs(s[0]);

      mask_past_end<1, NW / 8>(s, row0, valid, lane);
      if constexpr (Tr::CAUSAL) mask_causal<1, NW / 8>(s, t * N + row0, rows, wm * 16, lane);
      online_softmax_step<1, NW / 8, D / 8>(s, m_run, l_run, acc, scale_log2);

      // O += P V: k16 steps over the slice's tokens, P from registers
      wg_fence_regs(acc[0]);
      if constexpr (kWgPingPong2 && ONE && M == 128) {
        if (g == 1) asm volatile("bar.sync 3, 256;\n" ::: "memory");  // after the first's P V
      }
      wgmma_fence();
#pragma unroll
      for (int kt = 0; kt < NW / 16; ++kt) {
        unsigned pa[4];
        pack_p<T, NW / 8>(s[0], kt, pa);
        const unsigned long long db = wg_desc(v_addr + st + kt * 16 * 128, KV_HALF, 1024);
        wgmma_rs_n128<T>(acc[0], pa, db);
      }
      wgmma_commit();
      if constexpr (kWgPingPong2 && ONE && M == 128) {
        if (g == 0) asm volatile("bar.arrive 3, 256;\n" ::: "memory");
      }
      wgmma_wait<0>();
      wg_fence_regs(acc[0]);
    }
    slice_sync<Tr>(ONE ? 0 : wn);  // the slice is done with its rows of stage t % STAGES
  }
  cp_async_wait<0>();
}

}  // namespace pat
