// The KV walk of the mma.sync layouts: Q fragments and one KV tile per call
// (S = Q K^T, online softmax, O += P V on the tensor cores).
#pragma once

#include "pat_kv_loader.cuh"
#include "pat_softmax.cuh"
#include "pat_traits.cuh"

namespace pat {

// ldmatrix row of this lane for an A operand (16 x 16 fragment).
__device__ __forceinline__ int a_frag_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }

// Q fragments of a 16-row warp (row group wm), kept in registers for the whole KV walk (head_dim
// 64 and 128; Tr::Q_IN_REGS, else nothing: sync_tile re-reads them per k-step).
template <typename Tr>
__device__ __forceinline__ void load_q_frags(const typename Tr::T* sQ, int wm, int lane,
                                             unsigned (&qf)[Tr::QF_MI][Tr::QF_K][4]) {
  if constexpr (Tr::Q_IN_REGS) {
    const int q_lrow = a_frag_row(lane);
#pragma unroll
    for (int kk = 0; kk < Tr::D / 16; ++kk)
      ldmatrix_x4(qf[0][kk],
                  smem_u32(sQ + swz<Tr::D>(wm * 16 + q_lrow, kk * 2 + (lane >> 4))));
  }
}

// One KV tile of the mma.sync layouts, for this warp's rows (group wm) and token slice wn: in
// softmax steps of KC tokens, S = Q K^T (raw scores), tokens at or past `valid` masked, the
// online-softmax step, O += P V with P straight from the S accumulators.  cK / cV: the tile's
// stage in shared memory; valid: tokens of the tile inside the range (may exceed N).  Causal
// variants (Tr::CAUSAL) also mask each row past its token's limit (mask_causal): tile0 is the
// tile's first position in the range, rows the item's CausalRows; the other variants never
// read these two.
template <typename Tr, typename Rows>
__device__ __forceinline__ void sync_tile(const typename Tr::T* sQ,
                                          const unsigned (&qf)[Tr::QF_MI][Tr::QF_K][4],
                                          const typename Tr::T* cK, const typename Tr::T* cV,
                                          int valid, int wn, int wm, int lane, float scale_log2,
                                          float (&acc)[Tr::MI][Tr::D / 8][4],
                                          float (&m_run)[Tr::MI][2], float (&l_run)[Tr::MI][2],
                                          int tile0, const Rows& rows) {
  using T = typename Tr::T;
  constexpr int D = Tr::D, MI = Tr::MI, NW = Tr::NW, KC = Tr::KC;
  const int q_lrow = a_frag_row(lane);
#pragma unroll Tr::STEP_UNROLL
  for (int c = 0; c < NW / KC; ++c) {
    const int tok0 = wn * NW + c * KC;  // first tile token of this softmax step
    if (tok0 >= valid) break;  // warp-uniform: the rest of this slice is past the end

    // S = Q K^T for KC tokens (raw scores; the scale is folded into the exponent below).
    float s[MI][KC / 8][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < KC / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][j][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      unsigned qs[Tr::Q_IN_REGS ? 1 : MI][4];
      if constexpr (!Tr::Q_IN_REGS) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
          ldmatrix_x4(qs[mi], smem_u32(sQ + swz<D>((wm * MI + mi) * 16 + q_lrow,
                                                   kk * 2 + (lane >> 4))));
      }
#pragma unroll
      for (int j = 0; j < KC / 16; ++j) {
        unsigned b[4];
        const int row = tok0 + j * 16 + ((lane >> 4) << 3) + (lane & 7);
        ldmatrix_x4(b, smem_u32(cK + swz<D>(row, kk * 2 + ((lane >> 3) & 1))));
        if constexpr (Tr::Q_IN_REGS) {
          mma_16816<T>(s[0][2 * j], qf[0][kk], b[0], b[1]);
          mma_16816<T>(s[0][2 * j + 1], qf[0][kk], b[2], b[3]);
        } else {
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            mma_16816<T>(s[mi][2 * j], qs[mi], b[0], b[1]);
            mma_16816<T>(s[mi][2 * j + 1], qs[mi], b[2], b[3]);
          }
        }
      }
    }

    mask_past_end<MI, KC / 8>(s, tok0, valid, lane);  // tokens past the range
    if constexpr (Tr::CAUSAL)
      mask_causal<MI, KC / 8>(s, tile0 + tok0, rows, wm * MI * 16, lane);

    online_softmax_step<MI, KC / 8, D / 8>(s, m_run, l_run, acc, scale_log2);

    // O += P V: P (rounded to the input dtype) comes straight from the S accumulators, two
    // adjacent n8 blocks forming one k16 A fragment.
#pragma unroll
    for (int kk = 0; kk < KC / 16; ++kk) {
      unsigned pa[MI][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) pack_p<T, KC / 8>(s[mi], kk, pa[mi]);
      const int row = tok0 + kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        unsigned b[4];
        ldmatrix_x4_trans(b, smem_u32(cV + swz<D>(row, dt * 2 + (lane >> 4))));
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
          mma_16816<T>(acc[mi][2 * dt], pa[mi], b[0], b[1]);
          mma_16816<T>(acc[mi][2 * dt + 1], pa[mi], b[2], b[3]);
        }
      }
    }
  }
}

}  // namespace pat
