// The online softmax of the forward kernel: the running-max rule, masking past the KV range,
// P packed for the next MMA, and one softmax step over a block of scores (log2 domain).
#pragma once

#include "pat_common.cuh"

namespace pat {

// The one online-softmax rule, used per KV step and when token slices combine: raise the running
// max m_run (log2 domain) to cover a candidate max; returns the max to subtract from new scores
// (0 while everything is masked, so (-inf) - (-inf) never happens) and sets alpha, the factor that
// rescales the old sum and accumulator.  A state with max m_b joins with factor exp2(m_b - m_use).
__device__ __forceinline__ float raise_max(float& m_run, float m_cand, float& alpha) {
  const float mx = fmaxf(m_run, m_cand);
  const float m_use = mx == neg_inf() ? 0.f : mx;
  alpha = exp2f(m_run - m_use);
  m_run = mx;
  return m_use;
}

// Scores of tokens at or past `valid` set to -inf: s holds MI row blocks x J column blocks of 8
// (the m16n8 accumulator layout both tensor-core paths share) for the tile tokens tok0 ..
// tok0 + 8J - 1.  Only the last step of a range has any (warp-uniform test).
template <int MI, int J>
__device__ __forceinline__ void mask_past_end(float (&s)[MI][J][4], int tok0, int valid,
                                              int lane) {
  if (tok0 + 8 * J > valid) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = tok0 + j * 8 + ((lane & 3) << 1) + (e & 1);
          if (tok >= valid) s[mi][j][e] = neg_inf();
        }
  }
}

// Causal limits of a multi-token CTA (FwdTraits::CAUSAL): each row sees the positions of the
// CTA's range below its limit, rows.limit(row) (counted from the range's start); scores at or
// past it become -inf, so they get weight 0 and never raise a row's max (a row whose every score
// so far is -inf keeps the empty state: raise_max subtracts 0, never (-inf) - (-inf)).  s holds
// the scores of the positions pos0 .. pos0 + 8J - 1 of the range for the rows row0 + 16 mi +
// lane / 4 (+ 8) (layout of mask_past_end).  rows.lo, the smallest limit of this thread's rows,
// lets the steps wholly below every limit (all but the last few of a range, and every step of
// an unflagged CTA) skip the rest; the few steps past it read their rows' limits again (cached
// loads) rather than keep them in registers for the whole walk.
template <int MI, int J, typename Rows>
__device__ __forceinline__ void mask_causal(float (&s)[MI][J][4], int pos0, const Rows& rows,
                                            int row0, int lane) {
  if (pos0 + 8 * J > rows.lo) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int lim = rows.limit(row0 + mi * 16 + (lane >> 2) + hr * 8);
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
          for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
            const int pos = pos0 + j * 8 + ((lane & 3) << 1) + (e & 1);
            if (pos >= lim) s[mi][j][e] = neg_inf();
          }
      }
  }
}

// P for O += P V: the k16 A fragment of column blocks 2kk and 2kk + 1 of one row block of
// scores, rounded to the input type (the same register layout for mma.sync and wgmma).
template <typename T, int J>
__device__ __forceinline__ void pack_p(const float (&s)[J][4], int kk, unsigned (&a)[4]) {
  a[0] = ElemOps<T>::pack2(s[2 * kk][0], s[2 * kk][1]);
  a[1] = ElemOps<T>::pack2(s[2 * kk][2], s[2 * kk][3]);
  a[2] = ElemOps<T>::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = ElemOps<T>::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// One online-softmax step over the scores of MI row blocks x J column blocks of 8 (the m16n8
// accumulator layout of both tensor-core paths: s[mi][j][0..1] row lane/4, [2..3] row + 8):
// raise each row's running max m_run (log2 domain), turn the raw scores into
// P = exp2(score * scale - max) in place, rescale the running sum l_run and the accumulator acc.
template <int MI, int J, int DJ>
__device__ __forceinline__ void online_softmax_step(float (&s)[MI][J][4], float (&m_run)[MI][2],
                                                    float (&l_run)[MI][2],
                                                    float (&acc)[MI][DJ][4], float scale_log2) {
// <tutorial:online-softmax>
  // Online softmax, per row (hr = 0: row g, hr = 1: row g + 8): raise the running max, turn
  // the scores into exp2(score * scale - max) with one FFMA each, rescale the running sum.
  float alpha[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float mx = neg_inf();
#pragma unroll
      for (int j = 0; j < J; ++j) mx = fmaxf(mx, fmaxf(s[mi][j][2 * hr], s[mi][j][2 * hr + 1]));
      // the four lanes of a quad hold the same row
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // scale > 0, so max(raw) * scale is the max of the scaled scores (-inf stays -inf)
      const float neg_m = -raise_max(m_run[mi][hr], mx * scale_log2, alpha[mi][hr]);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        s[mi][j][2 * hr] = exp2f(fmaf(s[mi][j][2 * hr], scale_log2, neg_m));
        s[mi][j][2 * hr + 1] = exp2f(fmaf(s[mi][j][2 * hr + 1], scale_log2, neg_m));
        sum += s[mi][j][2 * hr] + s[mi][j][2 * hr + 1];
      }
      l_run[mi][hr] = l_run[mi][hr] * alpha[mi][hr] + sum;
    }
  }
  // Rescale the accumulator only when some row's max moved (once the max has settled, most
  // steps skip these MI * D / 2 multiplies); warp-uniform vote.
  bool moved = false;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) moved |= (alpha[mi][0] != 1.f) | (alpha[mi][1] != 1.f);
  if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int dt = 0; dt < DJ; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][dt][e] *= alpha[mi][e >> 1];
  }
// </tutorial:online-softmax>
}

}  // namespace pat
