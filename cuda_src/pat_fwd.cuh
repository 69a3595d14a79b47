// Multi-tile prefix-aware decode forward kernel.
//
// One work item = one Plan CTA of one tile variant for one KV head; a launch's blocks run the
// variant's live items in turn (run_items), the KV heads of a CTA adjacent in item order, so blocks
// running at the same time read neighbouring heads of the same tokens (one contiguous row per
// token in the NHD layout).  The CTA's query rows are its requests x the GQA group: row
// i * group + j is request i of the CTA, query head kv_head * group + j.  The rows are packed at
// run time, so one compiled variant serves every group size that fits m.  A multi-token plan
// arrives as its token view (every query token a "request" of the CTA) and runs on the CAUSAL
// variants, which also mask each row's positions past its token's causal limit (CausalRows).
// Every argument comes in one pat::FwdParams (pat_params.cuh).
//
// Per CTA:
//   1. cp.async the Q rows (zero-padded to M) and the first KV tile(s) into shared memory.
//   2. Walk the KV range [kv_start, kv_start + kv_len) in tiles of N tokens, gathering each token's
//      K and V row through the CTA's page list (16-byte cp.async, STAGES-deep ring: tiles t + 1
//      .. t + STAGES - 1 are in flight while tile t is computed).  Tokens past kv_len are
//      zero-filled and masked.
//   3. Each warp owns 16 * MI query rows and one token slice: NW = N / WARPS_N tokens of every
//      tile.  The warps of a slice gather that slice themselves and synchronise only with each
//      other, so slices are independent pipelines (no CTA-wide barrier in the KV walk).
//      S = Q K^T and O += P V run on the tensor cores (mma.sync m16n8k16, fp32 accumulate) with
//      the online softmax kept in registers (running max and sum per row, log2 domain).
//   4. Slices combine their states through shared memory; the first warp of each row group
//      normalises and writes o_partial[slot, head, :] and the natural-log LSE of the scaled
//      scores to lse_partial[slot, head].
//
// The kernel's pieces: pat_traits.cuh (every size of a variant, the tuning constants),
// pat_kv_loader.cuh (the paged gather), pat_softmax.cuh (the online softmax), pat_mma_walk.cuh
// and pat_wg_walk.cuh (one KV tile on the mma.sync and the warpgroup layouts); this file holds
// the work items, the CTA's prologue and KV loop (pat_fwd_body), the epilogue and the entry
// points.
#pragma once

#include "pat_common.cuh"
#include "pat_kv_loader.cuh"
#include "pat_merge.cuh"
#include "pat_mma_walk.cuh"
#include "pat_softmax.cuh"
#include "pat_traits.cuh"
#include "pat_wg_walk.cuh"
#include "pat_wgmma.cuh"

namespace pat {

// What a work item reads of its Plan CTA (the CTA tables of pat_core/plan.py).
struct CtaWork {
  int req_begin;  // the CTA's first entry in cta_req / cta_slot
  int n_rows;     // live query rows: requests x group (at most M)
  int kv_start;   // first KV position of the range
  int kv_len;     // tokens in the range
  int page_base;  // cta_pages + page_base, indexed by absolute page number, is the page list
};

template <typename Tr>
__device__ __forceinline__ CtaWork cta_work(const FwdParams& p, int cta) {
  const int* __restrict__ cta_req_indptr = p.cta_req_indptr;
  CtaWork w;
  w.req_begin = cta_req_indptr[cta];
  const int rows = (cta_req_indptr[cta + 1] - w.req_begin) * p.group;
  w.n_rows = rows < Tr::M ? rows : Tr::M;  // the planner guarantees rows <= m; never overrun smem
  w.kv_start = p.cta_kv_start[cta];
  w.kv_len = p.cta_kv_len[cta];
  w.page_base = p.cta_page_indptr[cta] - w.kv_start / p.page_size;
  return w;
}

// row / group for a row of a tile (row < 256), given inv_group = 1.f / group: an integer division
// costs tens of instructions, and a short block does several.  The fraction of (row + 0.5) / group
// is at least 0.5 / group away from an integer (or the quotient is 0 when group > 256), far more
// than the float product's error (< 2^-15).
__device__ __forceinline__ int div_rows(int row, float inv_group) {
  return __float2int_rz(((float)row + 0.5f) * inv_group);
}

// Q rows of the item -> shared memory (cp.async; rows >= n_rows zero-filled).  Row i * group + j
// is request i of the CTA, query head kv_head * group + j.
template <typename Tr>
__device__ __forceinline__ void load_q_rows(const FwdParams& p, const CtaWork& w, int kv_head,
                                            typename Tr::T* sQ, int tid) {
  using T = typename Tr::T;
  constexpr int M = Tr::M, CHUNKS = Tr::CHUNKS, THREADS = Tr::THREADS;
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const int* __restrict__ cta_req = p.cta_req;
  const int group = p.group;
  const float inv_group = 1.f / (float)group;
#pragma unroll
  for (int it = 0; it < Tr::Q_LOADS; ++it) {
    const int id = tid + it * THREADS;
    if ((M * CHUNKS) % THREADS == 0 || id < M * CHUNKS) {
      const int row = id / CHUNKS, ch = id % CHUNKS;
      const T* src = q;
      int bytes = 0;
      if (row < w.n_rows) {
        const int ri = div_rows(row, inv_group);
        const int head = kv_head * group + (row - ri * group);
        // 32-bit strides and in-row offsets (the host checks: _check_offsets_32bit)
        src = q + (mul_wide(cta_req[w.req_begin + ri], (int)p.q_sb) +
                   (head * (int)p.q_sh + ch * 8));
        bytes = 16;
      }
      cp_async_16(smem_u32(sQ + Tr::template off<M>(row, ch)), src, bytes);
    }
  }
}

// The KV gatherer of one item: token -> page -> (K row, V row) of this KV head.
template <typename Tr>
__device__ __forceinline__ KvTileLoader<Tr> kv_loader(const FwdParams& p, const CtaWork& w,
                                                      int kv_head) {
  using KV = typename Tr::KV;
  const int page_size = p.page_size;
  const int page_shift = (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
  // 32-bit strides: the host checks that they and every in-page offset fit (_check_offsets_32bit)
  return KvTileLoader<Tr>{static_cast<const KV*>(p.k_cache), static_cast<const KV*>(p.v_cache),
                          p.cta_pages + w.page_base, w.kv_start, w.kv_len, page_size, page_shift,
                          (int)p.k_sp, (int)p.k_st, kv_head * (int)p.k_sh,
                          (int)p.v_sp, (int)p.v_st, kv_head * (int)p.v_sh};
}

// The causal limits of a multi-token item (Tr::CAUSAL; mask_causal reads them): limit(row) is
// the positions of the CTA's range (from its start) that the row's token sees, cta_kv_limit of
// its (CTA, token) pair, and "no limit" for a padding row (the range mask covers it); lo is the
// smallest limit of this thread's accumulator rows (those of for_each_row), or "no limit" in a
// CTA the plan does not flag (cta_causal), which then masks exactly as a one-token variant.
constexpr int kNoLimit = 0x7fffffff;
struct CausalRows {
  const int* limits;  // cta_kv_limit of the CTA's first (CTA, token) pair
  int n_rows;         // live rows of the CTA
  int group;
  int lo;
  __device__ __forceinline__ int limit(int row) const {
    return row < n_rows ? limits[div_rows(row, 1.f / (float)group)] : kNoLimit;
  }
};

template <typename Tr>
__device__ __forceinline__ CausalRows causal_rows(const FwdParams& p, int cta, const CtaWork& w,
                                                  int wm, int lane) {
  CausalRows c{p.cta_kv_limit + w.req_begin, w.n_rows, p.group, kNoLimit};
  if (p.cta_causal[cta] != 0) {
#pragma unroll
    for (int mi = 0; mi < Tr::MI; ++mi)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int l = c.limit((wm * Tr::MI + mi) * 16 + (lane >> 2) + hr * 8);
        c.lo = l < c.lo ? l : c.lo;
      }
  }
  return c;
}

// The online-softmax state of a warp's rows: accumulator, running max (log2 domain) and running
// sum (this thread's columns only until finish_item reduces it over the quad), set to empty.
template <typename Tr>
__device__ __forceinline__ void init_state(float (&acc)[Tr::MI][Tr::D / 8][4],
                                           float (&m_run)[Tr::MI][2], float (&l_run)[Tr::MI][2]) {
#pragma unroll
  for (int mi = 0; mi < Tr::MI; ++mi) {
#pragma unroll
    for (int dt = 0; dt < Tr::D / 8; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][dt][e] = 0.f;
    m_run[mi][0] = m_run[mi][1] = neg_inf();
    l_run[mi][0] = l_run[mi][1] = 0.f;
  }
}

// The rows of this thread's accumulator fragment that are real rows of the CTA, in order: for
// each, fn(mi, hr, ri, head, inv, lse) with ri the row's request within the CTA, head its query
// head, inv = 1 / l (0 when every key scored -inf, the empty state; a NaN l from non-finite
// input is kept) and lse its natural-log LSE (-inf for the empty state).  The one row decode
// that the partial write and the finisher's output write share.
template <typename Tr, typename RowFn>
__device__ __forceinline__ void for_each_row(const CtaWork& w, int kv_head, int group,
                                             float inv_group, int wm, int lane,
                                             const float (&m_run)[Tr::MI][2],
                                             const float (&l_run)[Tr::MI][2], RowFn&& fn) {
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int mi = 0; mi < Tr::MI; ++mi) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = (wm * Tr::MI + mi) * 16 + (lane >> 2) + hr * 8;
      if (row < w.n_rows) {
        const int ri = div_rows(row, inv_group);
        const float l = l_run[mi][hr];
        const float inv = l != 0.f ? 1.f / l : 0.f;
        const float lse = l != 0.f ? (m_run[mi][hr] + __log2f(l)) * kLn2 : neg_inf();
        fn(mi, hr, ri, kv_head * group + (row - ri * group), inv, lse);
      }
    }
  }
}

// This lane's accumulator values of row half hr (row lane / 4 + 8 hr) of block mi, in pairs of
// adjacent columns: fn(col, x, y) for the values at columns col and col + 1.  The mma.sync
// layout holds columns 8 dt + 2 (lane % 4) + {0, 1} in block dt.  An fp8 walk (Tr::KV8)
// holds columns 16 ch + 4 (lane % 4) + {0, 1, 2, 3}: the even ones in block 2 ch, the odd ones
// in block 2 ch + 1 (pat_mma_walk.cuh, O += P V).
template <typename Tr, typename Fn>
__device__ __forceinline__ void for_each_col_pair(const float (&acc)[Tr::MI][Tr::D / 8][4],
                                                  int mi, int hr, int lane, Fn&& fn) {
  const int c = lane & 3;
  if constexpr (Tr::KV8) {
#pragma unroll
    for (int ch = 0; ch < Tr::D / 16; ++ch)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        fn(16 * ch + 4 * c + 2 * j, acc[mi][2 * ch][2 * hr + j], acc[mi][2 * ch + 1][2 * hr + j]);
  } else {
#pragma unroll
    for (int dt = 0; dt < Tr::D / 8; ++dt)
      fn(8 * dt + 2 * c, acc[mi][dt][2 * hr], acc[mi][dt][2 * hr + 1]);
  }
}

// Row (mi, hr) of this lane's accumulators as request r's final output for query head `head`
// (input dtype, normalised by `inv`) and its natural-log LSE (lse_out may be null): what the
// merge kernel writes for a request, written by the item that holds all of its KV.
template <typename Tr>
__device__ __forceinline__ void store_out_row(const MergeArgs& merge, long long r, int head,
                                              const float (&acc)[Tr::MI][Tr::D / 8][4], int mi,
                                              int hr, float inv, float lse, int lane) {
  using T = typename Tr::T;
  T* dst = static_cast<T*>(merge.out) + r * merge.out_sb + head * merge.out_sh;
  for_each_col_pair<Tr>(acc, mi, hr, lane, [&](int col, float x, float y) {
    dst[col] = ElemOps<T>::from_float(x * inv);
    dst[col + 1] = ElemOps<T>::from_float(y * inv);
  });
  if (merge.lse_out != nullptr && (lane & 3) == 0)
    merge.lse_out[r * merge.lse_sb + head * merge.lse_sh] = lse;
}

// The end of a work item, after its KV walk: full row sums, the token slices' states combined
// (through `scratch`, shared memory of at least Tr::SMEM_BYTES that the item no longer reads),
// then for every live row the normalised partial output o_partial[slot, head, :] and its
// natural-log LSE, or, for a request of one slot, its final output (store_out_row).  Warps of
// token slices other than 0 return after the combine.
template <typename Tr>
__device__ __forceinline__ void finish_item(const FwdParams& p, const CtaWork& w,
                                            int kv_head, float (&acc)[Tr::MI][Tr::D / 8][4],
                                            float (&m_run)[Tr::MI][2], float (&l_run)[Tr::MI][2],
                                            int wn, int wm, int lane,
                                            unsigned char* scratch) {
  constexpr int D = Tr::D, MI = Tr::MI;
  float* __restrict__ o_partial = p.o_partial;
  float* __restrict__ lse_partial = p.lse_partial;
  const int* __restrict__ cta_req = p.cta_req;
  const int* __restrict__ cta_slot = p.cta_slot;
  const int group = p.group, num_qo_heads = p.num_qo_heads;
  const float inv_group = 1.f / (float)group;
  const MergeArgs& merge = p.merge;
  const int req_begin = w.req_begin;

  // Full row sums: reduce the per-thread partial sums over the quad.
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      l_run[mi][hr] += __shfl_xor_sync(0xffffffffu, l_run[mi][hr], 1);
      l_run[mi][hr] += __shfl_xor_sync(0xffffffffu, l_run[mi][hr], 2);
    }

  if constexpr (Tr::WARPS_N > 1) {
    // Warps that split the tile's tokens combine (max, sum, acc) with the same rule
    // (raise_max), in rounds of COMB_PER_ROUND token slices when not all fit the KV ring.
    // Layout [slot][register][lane]: each lane reads back exactly what the same lane of the
    // partner warp wrote, so no fragment re-layout is needed and accesses are conflict-free.
    float* comb = reinterpret_cast<float*>(scratch);
    constexpr int SR = Tr::STATE_REGS;
    constexpr int PR = Tr::COMB_PER_ROUND;
#pragma unroll 1
    for (int base = 1; base < Tr::WARPS_N; base += PR) {
      // Barrier: every slice has finished its KV walk and its Q reads (first round) or warp
      // wn == 0 has read the previous round's states (later rounds), so the buffer is free.
      cta_sync<Tr>();
      if (wn >= base && wn < base + PR) {
        float* dst = comb + ((wm * PR + (wn - base)) * SR) * 32 + lane;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) dst[((mi * (D / 8) + dt) * 4 + e) * 32] = acc[mi][dt][e];
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            dst[(Tr::ACC_REGS + mi * 4 + hr) * 32] = m_run[mi][hr];
            dst[(Tr::ACC_REGS + mi * 4 + 2 + hr) * 32] = l_run[mi][hr];
          }
        }
      }
      // Barrier: this round's states are in shared memory before warp wn == 0 reads them.
      cta_sync<Tr>();
      if (wn == 0) {
        const int end = base + PR < Tr::WARPS_N ? base + PR : Tr::WARPS_N;
#pragma unroll 1
        for (int w = base; w < end; ++w) {
          const float* src = comb + ((wm * PR + (w - base)) * SR) * 32 + lane;
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
              const float mo = src[(Tr::ACC_REGS + mi * 4 + hr) * 32];
              const float lo = src[(Tr::ACC_REGS + mi * 4 + 2 + hr) * 32];
              float a;
              const float m_use = raise_max(m_run[mi][hr], mo, a);
              const float b = exp2f(mo - m_use);
              l_run[mi][hr] = l_run[mi][hr] * a + lo * b;
#pragma unroll
              for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
                for (int e = 2 * hr; e < 2 * hr + 2; ++e)
                  acc[mi][dt][e] = acc[mi][dt][e] * a + src[((mi * (D / 8) + dt) * 4 + e) * 32] * b;
            }
          }
        }
      }
    }
  }

  if (wn != 0) return;
  if constexpr (Tr::KV8) {
    // an fp8 cache's v_scale: out = softmax @ (v_scale * v), the partials as the final output
    // (the merge is linear in them; the LSE does not depend on V)
    const float vs = p.v_scale;
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mi][dt][e] *= vs;
  }
  // ---- Write the normalised partial output and its LSE for every real row -------------------
  // A request whose only partial slot this is gets its final output here, and the merge kernel
  // (direct_single) leaves it alone, so a step of private requests moves no partials at all.
  for_each_row<Tr>(w, kv_head, group, inv_group, wm, lane, m_run, l_run,
                   [&](int mi, int hr, int ri, int head, float inv, float lse) {
    const int r = cta_req[req_begin + ri];
    if (merge.req_slot_indptr[r + 1] - merge.req_slot_indptr[r] == 1) {
      store_out_row<Tr>(merge, r, head, acc, mi, hr, inv, lse, lane);
      return;
    }
    const long long slot = cta_slot[req_begin + ri];
    float* dst = o_partial + (slot * num_qo_heads + head) * D;
    for_each_col_pair<Tr>(acc, mi, hr, lane, [&](int col, float x, float y) {
      *reinterpret_cast<float2*>(dst + col) = make_float2(x * inv, y * inv);
    });
    if ((lane & 3) == 0) lse_partial[slot * num_qo_heads + head] = lse;
  });
}

// One work item: Plan CTA `cta` for KV head `kv_head`.  Returns with every cp.async group drained;
// a caller that runs another item in the same block puts a cta_sync<Tr>() in between (the last
// phase reads shared memory that the next item's prologue overwrites).
template <typename Tr>
__device__ __forceinline__ void pat_fwd_body(const FwdParams& p, const int cta,
                                             const int kv_head) {
  using T = typename Tr::T;
  constexpr int N = Tr::N, STAGES = Tr::STAGES, NW = Tr::NW;

  unsigned char* smem_base = pat_dyn_smem;
  if constexpr (Tr::WG)  // 1024-byte aligned tiles (the 128-byte swizzle repeats every 1024 B)
    smem_base += (1024u - (smem_u32(pat_dyn_smem) & 1023u)) & 1023u;
  T* sQ = reinterpret_cast<T*>(smem_base);
  // [STAGES][N][D], swizzled rows (byte tiles for an fp8 cache: KV_STAGE_T apart)
  T* sK = reinterpret_cast<T*>(smem_base + Tr::Q_BYTES);
  T* sV = sK + STAGES * Tr::KV_STAGE_T;

  // Opaque to the optimiser: in the graph-safe loop (run_items) nothing derived from the thread
  // index is hoisted out of the loop and kept live across items (the large tiles spilled).
  int tid_ = threadIdx.x;
  asm volatile("" : "+r"(tid_));
  const int tid = tid_;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  // Token slice outermost: warps w and w + 4 share an SM sub-partition (scheduler), so with more
  // than one slice the two warps a scheduler holds belong to different slices, which are
  // independent pipelines and drift apart: one computes softmax while the other issues MMAs.
  const int wn = warp / Tr::WARPS_M;  // token slice of this warp
  const int wm = warp - wn * Tr::WARPS_M;  // row group of this warp

  const CtaWork w = cta_work<Tr>(p, cta);
  const int kv_len = w.kv_len;
  const int num_tiles = (kv_len + N - 1) / N;

  load_q_rows<Tr>(p, w, kv_head, sQ, tid);
  const KvTileLoader<Tr> loader = kv_loader<Tr>(p, w, kv_head);
  // causal limits of this item's rows (multi-token variants; never read by the others)
  CausalRows rows{};
  if constexpr (Tr::CAUSAL) rows = causal_rows<Tr>(p, cta, w, wm, lane);

  const int slice_row0 = wn * NW;  // this warp's token slice within every tile
  const int stid = wm * 32 + lane;  // thread index within the slice group

// <tutorial:prologue>
  // Prologue: group 0 = Q, groups 1..PRE = tiles 0..PRE-1 (possibly empty groups); PRE is
  // STAGES - 1, or 1 for a single-stage ring.
  cp_async_commit();
#pragma unroll
  for (int s = 0; s < Tr::PRE; ++s) {
    if (s < num_tiles) loader.load(sK, sV, s, s % STAGES, slice_row0, stid);
    cp_async_commit();
  }
// </tutorial:prologue>

  // Q fragments of the 16-row warps stay in registers for the whole KV walk; 32-row warps and
  // head_dim 256 re-read theirs from shared memory per k-step (FlashAttention-2's layout).
  unsigned qf[Tr::QF_MI][Tr::QF_K][4];
  float acc[Tr::MI][Tr::D / 8][4];
  float m_run[Tr::MI][2];  // running max of the scaled scores (log2 domain), rows g and g + 8
  float l_run[Tr::MI][2];  // running sum of exponentials
  init_state<Tr>(acc, m_run, l_run);

  // Wait for the Q group only (the PRE tile groups behind it may still be in flight).
  cp_async_wait<Tr::PRE>();
  // Barrier: every thread's Q copies have landed and are visible before any warp reads Q rows
  // that other threads fetched.
  cta_sync<Tr>();
  if constexpr (Tr::KV8) {
    permute_q_fp8<Tr>(sQ, tid);
    cta_sync<Tr>();  // the permuted rows are visible before any warp reads them
  }
  load_q_frags<Tr>(sQ, wm, lane, qf);

  if constexpr (Tr::WG) {
    pat_wg_loop<Tr>(sQ, sK, sV, loader, num_tiles, kv_len, p.scale_log2, wn, wm, lane, tid,
                    stid, acc, m_run, l_run, rows);
  } else {
  for (int t = 0; t < num_tiles; ++t) {
// <tutorial:loop-top>
    // Keep STAGES - 1 tiles in flight: issue (this slice of) tile t + STAGES - 1 into the stage
    // read during iteration t - 1 (released by that iteration's trailing barrier).  Always
    // commit, even an empty group, so that the wait below counts groups uniformly.
    // A single stage has no room to prefetch: tile t (t > 0) loads here, into the stage the
    // previous iteration released, and is waited for at once.
    const int tn = STAGES > 1 ? t + STAGES - 1 : t;
    if (tn < num_tiles && (STAGES > 1 || t > 0))
      loader.load(sK, sV, tn, tn % STAGES, slice_row0, stid);
    cp_async_commit();
    cp_async_wait<STAGES - 1>();
    // Slice barrier: every copy of this slice of tile t has landed (each thread waited for its
    // own); make them visible to the slice's warps before any of them reads the rows.
    slice_sync<Tr>(wn);
// </tutorial:loop-top>

    sync_tile<Tr>(sQ, qf, sK + (t % STAGES) * Tr::KV_STAGE_T,
                  sV + (t % STAGES) * Tr::KV_STAGE_T, kv_len - t * N, wn, wm, lane,
                  p.scale_log2, acc, m_run, l_run, t * N, rows);
// <tutorial:loop-end>
    // Slice barrier: the slice's warps are done reading their rows of stage t % STAGES before
    // iteration t + 1 issues cp.async into the stage it frees.
    slice_sync<Tr>(wn);
  }
  cp_async_wait<0>();  // only empty groups can remain; drain them before smem is reused
// </tutorial:loop-end>
  }

  finish_item<Tr>(p, w, kv_head, acc, m_run, l_run, wn, wm, lane, pat_dyn_smem);
}

}  // namespace pat

namespace pat {
// Block -> work items.  Every forward launch has a grid of at most the blocks that can be
// resident at once, and its items (CTA x KV head, the KV heads of a CTA adjacent, so blocks
// running side by side read neighbouring heads of the same tokens) are the launch's live CTAs in
// device memory: p.live = {first CTA, CTA count}, written by plan() (so one captured launch
// serves every later plan in graph-safe mode).  Block b's first item is item b (no atomic);
// later items come from p.work_counter, offset by the grid (item gridDim.x + k for the k-th
// draw), and a launch whose live items fit its grid draws none: a small step's blocks run one
// item each (H100: the two atomic round trips per block that drawing every item cost showed on
// 15 us steps; bench/NOTES.md).  Pulling rather than striding lets a block that drew a
// short item take the next one (a tile's CTAs are ordered longest first).  The merge kernel
// zeroes the counter.
// `items`: the launch's live items, p.live[1] x KV heads.
template <typename Tr>
__device__ __forceinline__ void run_items(const FwdParams& p, const int items) {
  const int hk = p.num_kv_heads;
  // Blocks past the live item count never get work (the others take every item): leave
  // before anything else, so an unused variant's launch costs one load per block.
  if ((int)blockIdx.x >= items) return;
  // Later items: thread 0 draws one into a double-buffered slot (the block reads slot k & 1
  // after the barrier that ends item k; the slot is written again two items later, past the
  // next barrier), so one barrier per item and only k stays live across an item.
  __shared__ int s_next[2];
  int item = (int)blockIdx.x;
#pragma unroll 1
  for (int k = 0;; ++k) {
    const int c = item / hk;
    pat_fwd_body<Tr>(p, p.live[0] + c, item - c * hk);
    if (items <= (int)gridDim.x) break;  // every item was some block's first
    if (threadIdx.x == 0) s_next[k & 1] = (int)gridDim.x + atomicAdd(p.work_counter, 1);
    cta_sync<Tr>();  // every warp is past item k (its shared memory free) and s_next written
    item = s_next[k & 1];
    if (item >= items) break;  // block-uniform
  }
}

// bar.sync on a named barrier: waits for `count` threads.
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// Run the fused launch's variant `want` (the idx-th of the pack) on this item.
template <typename Tr>
__device__ __forceinline__ bool run_if(int want, int& idx, const FwdParams& p, int cta,
                                       int kv_head) {
  if (idx++ != want) return false;
  if ((int)threadIdx.x < Tr::THREADS) pat_fwd_body<Tr>(p, cta, kv_head);
  return true;
}
}  // namespace pat

// Kernel entry point.  Template arguments: head_dim, element type, m, n, warps, stages, rows per
// warp; the Python side names each instantiation pat_fwd_d{D}_{dtype}_m{M}_n{N}_w{W}_s{S}_r{RW}.
// Every argument is in pat::FwdParams (pat_params.cuh).
// An fp8 cache adds the KV element type (pat::fp8_e4m3) as a template argument and "_kv8" to
// the name; every other variant leaves it at its default, T.  A multi-token variant (CAUSAL =
// true, "_mt" in the name) runs a plan's token view with its causal limits (FwdTraits).
template <int HEAD_DIM, typename T, int M, int N, int WARPS, int STAGES, int RW,
          typename KV = T, bool CAUSAL = false>
__global__ void __launch_bounds__(
    WARPS * 32,
    (pat::fwd_min_blocks<pat::FwdTraits<HEAD_DIM, T, M, N, WARPS, STAGES, RW, KV, CAUSAL>>()))
    pat_fwd_kernel(
    const __grid_constant__ pat::FwdParams p) {
  pat::BlockClock clock(0);
  // the next launch of the chain may place its blocks while these run
  pat::pdl_launch_dependents();
  const int items = p.live[1] * p.num_kv_heads;
  pat::run_items<pat::FwdTraits<HEAD_DIM, T, M, N, WARPS, STAGES, RW, KV, CAUSAL>>(p, items);
  clock.end();
  // chained launches: the last block to finish an item waits for the launch before
  pat::chain_exit(p.chain, items < (int)gridDim.x ? items : (int)gridDim.x);
}

// One launch for every tile variant of a graph-safe launch set (small buckets), so a replayed
// step has one forward launch whatever its plan.  Template arguments: head_dim, element type,
// threads per block (the largest variant's), then the variants' traits.  p.live holds {first
// CTA, CTA count} per variant in the order of Trs (each variant's CTAs contiguous); block b takes
// item b first and later items from p.work_counter as run_items does (none when the live items
// fit the grid), finds the variant whose CTAs hold the item / num_kv_heads-th live CTA, and runs
// it.  Warps the variant does not use wait at the block barrier (id 15: the variants' own
// barriers use ids 0 to WARPS_N with their own thread counts).  The block gets the largest
// variant's shared memory, so small tiles lose occupancy (see pat_core/static_plan.py).

template <int HEAD_DIM, typename T, int THREADS, typename... Trs>
__global__ void __launch_bounds__(THREADS, 1) pat_fwd_fused_pull_kernel(
    const __grid_constant__ pat::FwdParams p) {
  static_assert(((Trs::THREADS <= THREADS) && ...), "block too small for a variant");
  static_assert(((Trs::D == HEAD_DIM) && ...), "variants of one head_dim");
  constexpr int V = sizeof...(Trs);
  const int hk = p.num_kv_heads;
  int total = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) total += p.live[2 * i + 1];
  const int items = total * hk;
  // blocks past the live item count never get work: leave before anything else
  if ((int)blockIdx.x >= items) return;
  __shared__ int s_next[2];  // later items, double-buffered as in run_items<Tr, true>
  int item = (int)blockIdx.x;
#pragma unroll 1
  for (int k = 0;; ++k) {
    // every thread decodes the item: the live CTA's variant and its first CTA (block-uniform)
    int c = item / hk;
    const int head = item - c * hk;
    int var = 0;
#pragma unroll 1
    for (; var < V - 1 && c >= p.live[2 * var + 1]; ++var) c -= p.live[2 * var + 1];
    int idx = 0;
    (void)(pat::run_if<Trs>(var, idx, p, p.live[2 * var] + c, head) || ...);
    if (items <= (int)gridDim.x) break;  // every item was some block's first
    if (threadIdx.x == 0) s_next[k & 1] = (int)gridDim.x + atomicAdd(p.work_counter, 1);
    pat::named_sync(15, THREADS);  // every warp is past item k and s_next is written
    item = s_next[k & 1];
    if (item >= items) break;  // block-uniform
  }
}

