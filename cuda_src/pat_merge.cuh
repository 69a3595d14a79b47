// Merge kernel: combine each request's partial results with the log-sum-exp rule.
//
// One warp per (request, query head).  Request r owns partial slots
// req_slot_indptr[r] : req_slot_indptr[r + 1]; each slot holds an fp32 output already normalised
// by its own softmax sum and the natural-log LSE of its scaled scores.  The merged output is
//   out = sum_s exp(lse_s - M) * o_s / sum_s exp(lse_s - M),   lse = M + log(sum_s exp(lse_s - M))
// with M = max_s lse_s.  Slots with lse = -inf (no keys) are skipped, so an empty state is the
// identity and never produces a NaN; a request with no finite state gets zeros and lse = -inf.
// A NaN LSE (non-finite q, K or V) is not empty: it makes the request's output and LSE NaN.
// A request with one slot takes the copy-and-convert fast path.
#pragma once

#include "pat_common.cuh"
#include "pat_params.cuh"

namespace pat {

// Merge the partial states of request r, query head h (slots s0 .. s1 - 1) into out / lse_out.
// One warp; each lane owns HEAD_DIM / 32 consecutive elements.  Partials are read through L2
// (ld.global.cg): they may have been written by other CTAs of the same launch, and an earlier
// run may have left stale copies of the same addresses in this SM's L1.
//
// The merge is latency bound (a few KB per warp), so its loads are issued in parallel: lane i
// loads the LSE of slot i (32 slots per round), the warp reduces the max and the weights with
// shuffles, and the output vectors are loaded UNROLL slots at a time.  A slot-by-slot loop
// waits for two dependent loads per slot (ncu, H100: 10.5 -> 8.2 us on a 16-request batch of 9
// slots per request, 39 -> 27 us on a tree of 1216 leaves).
// o += w * src[0 .. VEC), one vector load through L2.
template <int VEC>
__device__ __forceinline__ void accumulate_vec(float (&o)[VEC], const float* src, float w) {
  if constexpr (VEC == 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(src));
    o[0] += w * v.x; o[1] += w * v.y; o[2] += w * v.z; o[3] += w * v.w;
  } else {
    const float2 v = __ldcg(reinterpret_cast<const float2*>(src));
    o[0] += w * v.x; o[1] += w * v.y;
  }
}

template <int HEAD_DIM, typename TO>
__device__ __forceinline__ void merge_pair(const float* __restrict__ o_partial,
                                           const float* __restrict__ lse_partial, int s0, int s1,
                                           int r, int h, int num_qo_heads, TO* __restrict__ out,
                                           float* __restrict__ lse_out, long long out_sb,
                                           long long out_sh, long long lse_sb, long long lse_sh,
                                           int lane) {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim must be 64 or 128");
  constexpr int VEC = HEAD_DIM / 32;  // elements per lane: 2 or 4
  constexpr int UNROLL = 4;           // output vectors in flight per lane
  constexpr unsigned FULL = 0xffffffffu;
  float o[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) o[i] = 0.f;
  float lse = neg_inf();

  auto load = [&](int slot, float w) {
    const float* src = o_partial + ((long long)slot * num_qo_heads + h) * HEAD_DIM + lane * VEC;
    accumulate_vec<VEC>(o, src, w);
  };
  auto lse_of = [&](int slot) { return __ldcg(lse_partial + (long long)slot * num_qo_heads + h); };

  if (s1 - s0 == 1) {
    lse = lse_of(s0);
    if (lse != neg_inf()) load(s0, 1.f);
  } else {
    // pass 1: the largest LSE, and whether any is NaN (fmaxf drops NaN: look for it separately)
    float mx = neg_inf();
    bool nan_lse = false;
    float ls0 = neg_inf();  // this lane's slot of the first round, kept for pass 2
    for (int base = s0; base < s1; base += 32) {
      const float ls = base + lane < s1 ? lse_of(base + lane) : neg_inf();
      if (base == s0) ls0 = ls;
      mx = fmaxf(mx, ls);
      nan_lse |= ls != ls;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, off));
    nan_lse = __any_sync(FULL, nan_lse);
    if (nan_lse) {
      const float nan = __int_as_float(0x7fc00000);
#pragma unroll
      for (int i = 0; i < VEC; ++i) o[i] = nan;
      lse = nan;
    } else if (mx != neg_inf()) {
      // pass 2: weights w_s = exp(lse_s - max) (0 for an empty state: the identity), then the
      // weighted sum of the output vectors, UNROLL independent loads at a time
      float wsum = 0.f;
      for (int base = s0; base < s1; base += 32) {
        const float ls = base == s0 ? ls0 : (base + lane < s1 ? lse_of(base + lane) : neg_inf());
        const float w = ls == neg_inf() ? 0.f : expf(ls - mx);
        wsum += w;
        const int cnt = s1 - base < 32 ? s1 - base : 32;  // warp-uniform
        for (int j = 0; j < cnt; j += UNROLL) {
          float wj[UNROLL];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) wj[u] = __shfl_sync(FULL, w, (j + u) & 31);
#pragma unroll
          for (int u = 0; u < UNROLL; ++u)
            if (j + u < cnt && wj[u] != 0.f) load(base + j + u, wj[u]);
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) wsum += __shfl_xor_sync(FULL, wsum, off);
      const float inv = 1.f / wsum;  // wsum >= 1: the max slot contributes exp(0)
#pragma unroll
      for (int i = 0; i < VEC; ++i) o[i] *= inv;
      lse = mx + logf(wsum);
    }
  }

  TO* dst = out + (long long)r * out_sb + (long long)h * out_sh + lane * VEC;
#pragma unroll
  for (int i = 0; i < VEC; ++i) dst[i] = ElemOps<TO>::from_float(o[i]);
  if (lse_out != nullptr && lane == 0) lse_out[(long long)r * lse_sb + (long long)h * lse_sh] = lse;
}

// Grid-stride over the (request, head) pairs, so a graph-safe launch can use a fixed grid while
// the live batch (p.live_batch) changes between replays.  Block 0 also zeroes the forward work
// counters (p.reset): the merge runs after every forward launch of the step has finished.
template <int HEAD_DIM, typename TO, int WARPS>
__device__ __forceinline__ void pat_merge_body(const MergeParams& p) {
  if (p.reset != nullptr && blockIdx.x == 0 && (int)threadIdx.x < p.reset_n) p.reset[threadIdx.x] = 0;
  const int lane = threadIdx.x & 31;
  const int batch = p.live_batch != nullptr ? *p.live_batch : p.batch;
  const long long pairs = (long long)batch * p.num_qo_heads;
  for (long long pair = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); pair < pairs;
       pair += (long long)gridDim.x * WARPS) {
    const int r = (int)(pair / p.num_qo_heads);
    const int h = (int)(pair - (long long)r * p.num_qo_heads);
    merge_pair<HEAD_DIM, TO>(p.o_partial, p.lse_partial, p.req_slot_indptr[r],
                             p.req_slot_indptr[r + 1], r, h, p.num_qo_heads,
                             static_cast<TO*>(p.out), p.lse_out, p.out_sb, p.out_sh, p.lse_sb,
                             p.lse_sh, lane);
  }
}

}  // namespace pat

// Template arguments: head_dim, output element type, warps per block (one (request, head) pair
// per warp at a time).  The Python side names each instantiation pat_merge_d{D}_{dtype}_w{W}.
template <int HEAD_DIM, typename TO, int WARPS>
// At least 48 resident warps per SM (75% occupancy): room for 40 registers.  With the thread
// count alone ptxas aims at full occupancy on sm_80 (32 registers) and spills.
__global__ void __launch_bounds__(WARPS * 32, 48 / WARPS) pat_merge_kernel(
    const __grid_constant__ pat::MergeParams p) {
  pat::pat_merge_body<HEAD_DIM, TO, WARPS>(p);
}
