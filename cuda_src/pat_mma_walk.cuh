// The KV walk of the mma.sync layouts: Q fragments and one KV tile per call
// (S = Q K^T, online softmax, O += P V on the tensor cores).
#pragma once

#include "pat_kv_loader.cuh"
#include "pat_softmax.cuh"
#include "pat_traits.cuh"

namespace pat {

// ldmatrix row of this lane for an A operand (16 x 16 fragment).
__device__ __forceinline__ int a_frag_row(int lane) { return (lane & 7) + ((lane >> 3) & 1) * 8; }

// An fp8 walk (Tr::KV8) reads K's bytes with ldmatrix as they are: in an 8-token x
// 16-byte matrix, lane l gets 4 bytes of token l / 4, the head_dim columns 4 (l % 4) + {0..3}
// of that 16-column block, which widen into two halves pairs.  As the B operand of Q K^T they
// stand at the k slots 2 (l % 4) + {0, 1} and 8 + 2 (l % 4) + {0, 1}, so Q's columns take the
// same places: within every 16-column block, slot 2 c + i holds column 4 c + i and slot
// 8 + 2 c + i column 4 c + 2 + i (c < 4, i < 2).  In 32-bit words (column pairs) of a block,
// word c <- word 2 c and word 4 + c <- word 2 c + 1.  The dot products over head_dim are
// unchanged; this pass rewrites the Q tile in place once per item, before its fragments are
// read.  Each thread permutes whole blocks of its own, so only the caller's barriers order it.
template <typename Tr>
__device__ __forceinline__ void permute_q_fp8(typename Tr::T* sQ, int tid) {
  constexpr int BLOCKS = Tr::M * (Tr::D / 16);
#pragma unroll 1
  for (int id = tid; id < BLOCKS; id += Tr::THREADS) {
    const int row = id / (Tr::D / 16), blk = id % (Tr::D / 16);
// <tutorial:fp8-q-permute>
    uint4* lo = reinterpret_cast<uint4*>(sQ + swz<Tr::D>(row, 2 * blk));
    uint4* hi = reinterpret_cast<uint4*>(sQ + swz<Tr::D>(row, 2 * blk + 1));
    const uint4 a = *lo, b = *hi;  // the block's words 0-3 and 4-7 (column pairs)
    *lo = make_uint4(a.x, a.z, b.x, b.z);
    *hi = make_uint4(a.y, a.w, b.y, b.w);
// </tutorial:fp8-q-permute>
  }
}

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
    if constexpr (Tr::KV8) {
      // fp8 K: one ldmatrix_x4 reads 16 tokens x 32 bytes (n blocks 2j, 2j + 1; k steps kk,
      // kk + 1), each register widening into the b0, b1 pair of one (n block, k step); Q is
      // permuted to match (permute_q_fp8).
      const unsigned char* k8 = reinterpret_cast<const unsigned char*>(cK);
#pragma unroll
      for (int kk = 0; kk < D / 16; kk += 2) {
        unsigned qs[Tr::Q_IN_REGS ? 1 : MI][2][4];
        if constexpr (!Tr::Q_IN_REGS) {
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              ldmatrix_x4(qs[mi][h], smem_u32(sQ + swz<D>((wm * MI + mi) * 16 + q_lrow,
                                                          (kk + h) * 2 + (lane >> 4))));
        }
#pragma unroll
        for (int j = 0; j < KC / 16; ++j) {
          unsigned r[4], b[4][2];
          const int row = tok0 + j * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
          ldmatrix_x4(r, smem_u32(k8 + swz8<D>(row, kk + (lane >> 4))));
#pragma unroll
          for (int i = 0; i < 4; ++i) e4m3x4_to<T>(r[i], b[i][0], b[i][1]);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // r[i]: n block 2j + i % 2, k step kk + i / 2
              if constexpr (Tr::Q_IN_REGS)
                mma_16816<T>(s[0][2 * j + (i & 1)], qf[0][kk + (i >> 1)], b[i][0], b[i][1]);
              else
                mma_16816<T>(s[mi][2 * j + (i & 1)], qs[mi][i >> 1], b[i][0], b[i][1]);
            }
        }
      }
    } else {
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
      if constexpr (Tr::KV8) {
        // fp8 V: ldmatrix.trans on 16 tokens x 32 bytes moves 16-bit pairs, so lane l holds,
        // per 8-token x 16-column matrix, tokens 2 (l % 4) + {0, 1} at the columns 2 (l / 4)
        // and 2 (l / 4) + 1.  A byte permute makes one token pair per column, i.e. the B
        // operand (k = those tokens, n = l / 4) of two n blocks: the even columns of the
        // 16-column chunk (block 2 ch) and the odd ones (2 ch + 1).  for_each_col_pair (the
        // writers) knows this column order.
        const unsigned char* v8 = reinterpret_cast<const unsigned char*>(cV);
#pragma unroll
        for (int dq = 0; dq < D / 32; ++dq) {
          unsigned r[4];
          ldmatrix_x4_trans(r, smem_u32(v8 + swz8<D>(row, dq * 2 + (lane >> 4))));
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // chunk 2 dq + h: r[2h] tokens 0-7, r[2h+1] 8-15
            const int ch = 2 * dq + h;
            unsigned e0, o0, e1, o1;
            e4m3x4_to<T>(__byte_perm(r[2 * h], 0, 0x3120), e0, o0);
            e4m3x4_to<T>(__byte_perm(r[2 * h + 1], 0, 0x3120), e1, o1);
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
              mma_16816<T>(acc[mi][2 * ch], pa[mi], e0, e1);
              mma_16816<T>(acc[mi][2 * ch + 1], pa[mi], o0, o1);
            }
          }
        }
      } else {
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
}

}  // namespace pat
