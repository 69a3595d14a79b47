// Merge kernel: combine each request's partial results with the log-sum-exp rule.
//
// One warp per (request, query head), or, with p.block_per_pair, one block per pair (its warps
// split the slots) when pairs are few and slots many.  Request r owns partial slots
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

// Slots per round of a warp merging NH heads: 8 / NH at head_dim 64 and 128, so a lane keeps 8
// output vectors (16 or 32 floats) in flight.  At head_dim 256 a vector is 8 floats a lane: 2
// slots per head for NH = 1 and 2 and 1 for NH = 4 (16, 32 and 32 floats), within the NH = 1
// kernel's 64 registers (4 slots spill there) and the others' 128.
template <int HEAD_DIM, int NH>
constexpr int kMergeRoundSlots = HEAD_DIM > 128 ? (NH == 4 ? 1 : 2) : 8 / NH;

// Merge the partial states of request r, query head h (slots s0 .. s1 - 1) into out / lse_out.
// One warp; each lane owns HEAD_DIM / 32 consecutive elements.  Partials are read through L2
// (ld.global.cg): they may have been written by other CTAs of the same launch, and an earlier
// run may have left stale copies of the same addresses in this SM's L1.
//
// The merge is latency bound (a few KB per warp), so its loads are issued in parallel: rounds of
// 8 slots whose LSEs (one per lane) and output vectors are all in flight at once, the running
// state raised to each round's max (online softmax), one memory latency per round.  A
// slot-by-slot loop waits for two dependent loads per slot (ncu, H100: 10.5 -> 8.2 us on a
// 16-request batch of 9 slots per request, 39 -> 27 us on a tree of 1216 leaves, when the LSEs
// were read in a first pass and the vectors four slots at a time in a second).
// dst[0 .. VEC) = src[0 .. VEC), one vector load through L2.
template <int VEC>
__device__ __forceinline__ void load_vec(float (&dst)[VEC], const float* src) {
  if constexpr (VEC == 8) {  // head_dim 256: two 16-byte loads
    const float4 a = __ldcg(reinterpret_cast<const float4*>(src));
    const float4 b = __ldcg(reinterpret_cast<const float4*>(src) + 1);
    dst[0] = a.x; dst[1] = a.y; dst[2] = a.z; dst[3] = a.w;
    dst[4] = b.x; dst[5] = b.y; dst[6] = b.z; dst[7] = b.w;
  } else if constexpr (VEC == 4) {
    const float4 v = __ldcg(reinterpret_cast<const float4*>(src));
    dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
  } else {
    const float2 v = __ldcg(reinterpret_cast<const float2*>(src));
    dst[0] = v.x; dst[1] = v.y;
  }
}

// A merge state: the largest LSE seen (mx), this lane's share of sum_s exp(lse_s - mx) (wsum,
// summed over the warp at the end) and this lane's VEC elements of sum_s exp(lse_s - mx) * o_s.
// nan: some slot's LSE was NaN (non-finite input), which makes the merged row NaN.
template <int VEC>
struct MergeState {
  float o[VEC];
  float wsum;
  float mx;
  bool nan;
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = 0.f;
    wsum = 0.f;
    mx = neg_inf();
    nan = false;
  }
  // Raise the max to m_new (never lower): rescale what is summed so far; returns the max to
  // weigh new slots against (0 while everything is empty, so -inf - -inf never happens).
  __device__ __forceinline__ float raise(float m_new) {
    const float m = fmaxf(mx, m_new);
    const float m_use = m == neg_inf() ? 0.f : m;
    const float a = expf(mx - m_use);  // 0 when nothing was summed yet
    wsum *= a;
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] *= a;
    mx = m;
    return m_use;
  }
};

// Add the slots of request r, query heads h0 .. h0 + NH - 1 that belong to `part` of `nparts`
// (slots s0 + part, s0 + part + nparts, ...) to st[0 .. NH).  Rounds of CH slots: lane
// hh * CH + j loads the LSE of the round's slot j for head h0 + hh while every lane loads its
// elements of all NH x CH output vectors, so a round costs one memory latency (the weights need
// the max, the loads do not).  With NH > 1 one warp keeps NH heads' vectors in flight at once:
// a request with few slots per head then still gives each warp several KB to load.  One warp;
// NH * CH <= 32, CH a power of two.
template <int HEAD_DIM, int CH, int NH>
__device__ __forceinline__ void merge_accumulate(const float* __restrict__ o_partial,
                                                 const float* __restrict__ lse_partial, int s0,
                                                 int s1, int h0, int num_qo_heads, int part,
                                                 int nparts, MergeState<HEAD_DIM / 32> (&st)[NH],
                                                 int lane) {
  constexpr int VEC = HEAD_DIM / 32;  // elements per lane: 2, 4 or 8
  static_assert(CH >= 1 && CH <= 8 && (CH & (CH - 1)) == 0, "1, 2, 4 or 8 slots per round");
  static_assert(NH >= 1 && NH * CH <= 32, "one LSE per lane");
  constexpr unsigned FULL = 0xffffffffu;
  const int first = s0 + part;
  const int count = first < s1 ? (s1 - first + nparts - 1) / nparts : 0;
  const int jh = lane / CH, js = lane - jh * CH;  // the (head, slot) whose LSE this lane loads
  for (int base = 0; base < count; base += CH) {
    const int cnt = count - base < CH ? count - base : CH;  // warp-uniform
    const float ls = jh < NH && js < cnt
        ? __ldcg(lse_partial + (long long)(first + (base + js) * nparts) * num_qo_heads + h0 + jh)
        : neg_inf();
    float v[NH][CH][VEC];
#pragma unroll
    for (int hh = 0; hh < NH; ++hh)
#pragma unroll
      for (int u = 0; u < CH; ++u) {
        if (u < cnt) {
          const long long slot = first + (base + u) * nparts;
          load_vec<VEC>(v[hh][u],
                        o_partial + (slot * num_qo_heads + h0 + hh) * HEAD_DIM + lane * VEC);
        }
      }
    // the round's max per head: reduce within each group of CH lanes
    float m = ls;
#pragma unroll
    for (int off = CH / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, off));
    const unsigned nan_lanes = __ballot_sync(FULL, ls != ls);
    float my_use = 0.f;  // the max this lane's slot is weighed against (its head's)
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      const float mh = __shfl_sync(FULL, m, hh * CH);
      st[hh].nan |= ((nan_lanes >> (hh * CH)) & ((1u << CH) - 1u)) != 0u;
      const float m_use = st[hh].raise(mh);
      if (jh == hh) my_use = m_use;
    }
    // an empty state (lse = -inf) weighs 0 and is skipped, so its output never enters the sum
    const float w = ls == neg_inf() ? 0.f : expf(ls - my_use);
#pragma unroll
    for (int hh = 0; hh < NH; ++hh) {
      st[hh].wsum += jh == hh ? w : 0.f;  // per-lane shares, summed over the warp at the end
#pragma unroll
      for (int u = 0; u < CH; ++u) {
        const float wu = __shfl_sync(FULL, w, hh * CH + u);
        if (u < cnt && wu != 0.f) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) st[hh].o[i] += wu * v[hh][u][i];
        }
      }
    }
  }
}

// Write one merged row: out = o / wsum (converted to TO) and lse = mx + log(wsum); no finite
// state gives zeros and -inf, a NaN LSE gives NaN.  One warp.
template <int HEAD_DIM, typename TO>
__device__ __forceinline__ void merge_store(MergeState<HEAD_DIM / 32>& st, int r, int h,
                                            TO* __restrict__ out, float* __restrict__ lse_out,
                                            long long out_sb, long long out_sh, long long lse_sb,
                                            long long lse_sh, int lane) {
  constexpr int VEC = HEAD_DIM / 32;
  float lse = st.mx;
  if (st.nan) {
    lse = __int_as_float(0x7fc00000);
#pragma unroll
    for (int i = 0; i < VEC; ++i) st.o[i] = lse;
  } else if (st.mx != neg_inf()) {
    float wsum = st.wsum;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, off);
    const float inv = 1.f / wsum;  // wsum >= 1: the max slot contributes exp(0)
#pragma unroll
    for (int i = 0; i < VEC; ++i) st.o[i] *= inv;
    lse = st.mx + logf(wsum);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) st.o[i] = 0.f;
  }
  TO* dst = out + (long long)r * out_sb + (long long)h * out_sh + lane * VEC;
#pragma unroll
  for (int i = 0; i < VEC; ++i) dst[i] = ElemOps<TO>::from_float(st.o[i]);
  if (lse_out != nullptr && lane == 0) lse_out[(long long)r * lse_sb + (long long)h * lse_sh] = lse;
}

// Merge request r, query head h (slots s0 .. s1 - 1) with one warp, CH slots per round (the
// in-kernel merge of the forward kernel uses fewer: its registers count against the forward's).
// With NH > 1: query heads h .. h + NH - 1 of request r together (CH slots of each per round).
template <int HEAD_DIM, typename TO, int CH = 8, int NH = 1>
__device__ __forceinline__ void merge_pair(const float* __restrict__ o_partial,
                                           const float* __restrict__ lse_partial, int s0, int s1,
                                           int r, int h, int num_qo_heads, TO* __restrict__ out,
                                           float* __restrict__ lse_out, long long out_sb,
                                           long long out_sh, long long lse_sb, long long lse_sh,
                                           int lane) {
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256,
                "head_dim must be 64, 128 or 256");
  MergeState<HEAD_DIM / 32> st[NH];
#pragma unroll
  for (int hh = 0; hh < NH; ++hh) st[hh].init();
  merge_accumulate<HEAD_DIM, CH, NH>(o_partial, lse_partial, s0, s1, h, num_qo_heads, 0, 1, st,
                                     lane);
#pragma unroll
  for (int hh = 0; hh < NH; ++hh)
    merge_store<HEAD_DIM, TO>(st[hh], r, h + hh, out, lse_out, out_sb, out_sh, lse_sb, lse_sh,
                              lane);
}

// The same pair merged by all WARPS warps of the block, warp w taking slots s0 + w, s0 + w +
// WARPS, ...; the warps' states meet in shared memory (the same raise rule) and warp 0 stores.
// For steps with few (request, head) pairs and many slots each (one long shared prefix split
// over the SMs: 33 slots per pair on 1,16_16384,16), where a warp per pair leaves SMs idle.
template <int HEAD_DIM, typename TO, int WARPS>
__device__ __forceinline__ void merge_pair_block(const float* __restrict__ o_partial,
                                                 const float* __restrict__ lse_partial, int s0,
                                                 int s1, int r, int h, int num_qo_heads,
                                                 TO* __restrict__ out, float* __restrict__ lse_out,
                                                 long long out_sb, long long out_sh,
                                                 long long lse_sb, long long lse_sh) {
  constexpr int VEC = HEAD_DIM / 32;
  constexpr int NR = WARPS > 1 ? WARPS - 1 : 1;
  __shared__ float red_o[NR][HEAD_DIM];
  __shared__ float red_w[NR][32];
  __shared__ float red_m[NR];
  __shared__ int red_nan[NR];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  MergeState<VEC> sts[1];
  sts[0].init();
  merge_accumulate<HEAD_DIM, kMergeRoundSlots<HEAD_DIM, 1>, 1>(
      o_partial, lse_partial, s0, s1, h, num_qo_heads, warp, WARPS, sts, lane);
  MergeState<VEC>& st = sts[0];
  if (warp > 0) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) red_o[warp - 1][lane * VEC + i] = st.o[i];
    red_w[warp - 1][lane] = st.wsum;
    if (lane == 0) {
      red_m[warp - 1] = st.mx;
      red_nan[warp - 1] = st.nan;
    }
  }
  __syncthreads();  // the other warps' states are in shared memory
  if (warp == 0) {
#pragma unroll 1
    for (int w = 0; w < WARPS - 1; ++w) {
      const float mw = red_m[w];
      st.nan |= red_nan[w] != 0;
      const float m_use = st.raise(mw);
      const float b = expf(mw - m_use);  // 0 for an empty warp state
#pragma unroll
      for (int i = 0; i < VEC; ++i) st.o[i] += b * red_o[w][lane * VEC + i];
      st.wsum += b * red_w[w][lane];
    }
    merge_store<HEAD_DIM, TO>(st, r, h, out, lse_out, out_sb, out_sh, lse_sb, lse_sh, lane);
  }
  __syncthreads();  // warp 0 has read the buffers before the next pair overwrites them
}

// Warp per (request, NH consecutive heads) unit, grid-stride over `units`, CH slots per round.
template <int HEAD_DIM, typename TO, int WARPS, int CH, int NH>
__device__ __forceinline__ void merge_warps(const MergeParams& p, long long units, int lane) {
  const int hg = p.num_qo_heads / NH;  // head groups per request
  for (long long u = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); u < units;
       u += (long long)gridDim.x * WARPS) {
    const int r = (int)(u / hg);
    const int h = (int)(u - (long long)r * hg) * NH;
    const int s0 = p.req_slot_indptr[r], s1 = p.req_slot_indptr[r + 1];
    if (p.direct_single && s1 - s0 == 1) continue;  // its forward item wrote it (warp-uniform)
    merge_pair<HEAD_DIM, TO, CH, NH>(p.o_partial, p.lse_partial, s0, s1, r, h, p.num_qo_heads,
                                     static_cast<TO*>(p.out), p.lse_out, p.out_sb, p.out_sh,
                                     p.lse_sb, p.lse_sh, lane);
  }
}

// Grid-stride over the (request, head) pairs, so a graph-safe launch can use a fixed grid while
// the live batch (p.live_batch) changes between replays.  Block 0 also zeroes the forward work
// counters (p.reset): the merge runs after every forward launch of the step has finished.
template <int HEAD_DIM, typename TO, int WARPS, int NH>
__device__ __forceinline__ void pat_merge_body(const MergeParams& p) {
  if (p.reset != nullptr && blockIdx.x == 0 && (int)threadIdx.x < p.reset_n) p.reset[threadIdx.x] = 0;
  const int lane = threadIdx.x & 31;
  const int batch = p.live_batch != nullptr ? *p.live_batch : p.batch;
  const long long pairs = (long long)batch * p.num_qo_heads;
  if (NH == 1 && p.block_per_pair) {  // block-uniform; the launcher pairs it with NH == 1
    for (long long pair = blockIdx.x; pair < pairs; pair += gridDim.x) {
      const int r = (int)(pair / p.num_qo_heads);
      const int h = (int)(pair - (long long)r * p.num_qo_heads);
      const int s0 = p.req_slot_indptr[r], s1 = p.req_slot_indptr[r + 1];
      if (p.direct_single && s1 - s0 == 1) continue;  // block-uniform, as above
      merge_pair_block<HEAD_DIM, TO, WARPS>(p.o_partial, p.lse_partial, s0, s1, r, h,
                                            p.num_qo_heads,
                                            static_cast<TO*>(p.out), p.lse_out, p.out_sb,
                                            p.out_sh, p.lse_sb, p.lse_sh);
    }
    return;
  }
  // NH heads per warp (the launcher checks num_qo_heads % NH == 0)
  merge_warps<HEAD_DIM, TO, WARPS, kMergeRoundSlots<HEAD_DIM, NH>, NH>(p, pairs / NH, lane);
}

}  // namespace pat

// Template arguments: head_dim, output element type, warps per block, heads of a request per
// warp in warp mode (NH: 1, 2 or 4).  The Python side names each instantiation
// pat_merge_d{D}_{dtype}_w{W}, with an _h{NH} suffix for NH > 1.
// Registers: NH = 1 asks for 32 resident warps per SM (50% occupancy), room for 64 registers
// (8 output vectors in flight per lane, 2 at head_dim 256: kMergeRoundSlots; with the thread
// count alone ptxas aims at full occupancy on sm_80, 32 registers, and spills).  NH heads keep
// NH x kMergeRoundSlots vectors plus NH merge states per lane: 2 and 4 heads spill at 64 and
// 80 registers, so they ask for 16 warps (128 registers); each of their warps has NH times the
// loads in flight.
namespace pat {
constexpr int merge_min_blocks(int warps, int nh) { return (nh == 1 ? 32 : 16) / warps; }
}  // namespace pat
template <int HEAD_DIM, typename TO, int WARPS, int NH>
__global__ void __launch_bounds__(WARPS * 32, pat::merge_min_blocks(WARPS, NH)) pat_merge_kernel(
    const __grid_constant__ pat::MergeParams p) {
  // launched as a programmatic dependent of the forward launch (CudaBackend.merge_launch "pdl"),
  // the blocks may start before the partials are written: wait for that launch here (at once
  // otherwise)
  pat::BlockClock clock(0);
  pat::pdl_wait();
  clock.ready();
  pat::pat_merge_body<HEAD_DIM, TO, WARPS, NH>(p);
  clock.end();
}
