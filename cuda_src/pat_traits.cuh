// Tuning constants and the per-variant traits of the forward kernel: every size the kernel and
// the launcher agree on is derived once, here (pat_core/cuda_compile.py mirrors the shared-memory
// and thread formulas for the launcher and the resource report).
//
// The tuning constants are the measured defaults.  Each can be overridden at compile time for an
// experiment (NVRTC -D, which pat_core.cuda_backend.CudaBackend(defines=...) passes; the library
// passes none):
//   PAT_LOAD_UNROLL      unroll of a thread's gather loop (default 16: full)
//   PAT_KC_RW32          tokens per softmax step of 32-row warps (default 32)
//   PAT_WG_PINGPONG      warpgroup ping-pong: 0 off, 1 Q K^T in turn (default), 2 P V as well
//   PAT_SMEM_OCCUPANCY   short-KV tiles ask for the blocks their shared memory allows (default 1)
//   PAT_SHORT_TILE_REGS  the register cap that request never goes below (default 168)
//   PAT_BLOCK_CLOCK      instrumentation, off unless defined: record the clocks of that many
//                        blocks (pat_common.cuh; read by a block-timeline probe)
#pragma once

#include "pat_common.cuh"
#include "pat_wgmma.cuh"

#ifndef PAT_LOAD_UNROLL
#define PAT_LOAD_UNROLL 16
#endif
#ifndef PAT_KC_RW32
#define PAT_KC_RW32 32
#endif
#ifndef PAT_WG_PINGPONG
#define PAT_WG_PINGPONG 1
#endif
#ifndef PAT_SMEM_OCCUPANCY
#define PAT_SMEM_OCCUPANCY 1
#endif
#ifndef PAT_SHORT_TILE_REGS
#define PAT_SHORT_TILE_REGS 168
#endif

namespace pat {

// Unroll of a thread's gather loop (at most 8 rows per thread in every variant, so the default
// unrolls fully).  A smaller value bounds how many 64-bit gather addresses the compiler keeps live
// (4: ~167 instead of ~205 registers for the 16-row tiles); a tuning knob, see bench/NOTES.md.
constexpr int kLoadUnroll = PAT_LOAD_UNROLL;
// Tokens per softmax step of a 32-row warp (its accumulators leave fewer registers for scores).
constexpr int kKcRw32 = PAT_KC_RW32;
// The two warpgroups of a 128-row tile take turns issuing their Q K^T (FlashAttention-3's
// ping-pong, within the tile's barriers): measured 0.7-0.9% faster in geometric mean on the
// warpgroup-heavy batches of the development set, up to 2.5%, and 4-6% on forced 128x128 tiles
// (H100, bench/NOTES.md).  PAT_WG_PINGPONG (pat_traits.cuh's header): 0 turns it
// off (the ablation), 2 orders the groups' P V as well (measured level with 1).
constexpr bool kWgPingPong = PAT_WG_PINGPONG != 0;
constexpr bool kWgPingPong2 = PAT_WG_PINGPONG >= 2;  // 2: the groups' P V in turn as well
// Registers a 16-row warp needs without spilling at head_dim 128 (accumulators, Q fragments,
// scores, gather addresses: 164-168 as compiled); the occupancy request never asks for fewer.
constexpr int kShortTileRegs = PAT_SHORT_TILE_REGS;
constexpr bool kSmemOccupancy = PAT_SMEM_OCCUPANCY != 0;

// One traits struct per tile configuration.  Everything the kernel and the launcher need to agree
// on (threads, shared memory) is derived here; pat_core/cuda_compile.py mirrors the formulas.
//
// RW_ is the number of query rows one warp owns: 16 (one MMA row block; its Q fragments stay in
// registers for the whole KV walk) or 32 (two row blocks; every K/V fragment read from shared
// memory by ldmatrix feeds two MMAs, halving shared-memory traffic per FLOP, and the Q fragments
// are re-read from shared memory per k-step to keep the accumulators within the register budget).
// At head_dim 256 a 16-row warp's accumulators alone are 128 fp32 registers per thread, as many
// as a 32-row warp's at head_dim 128: it takes that layout's register plan (Q re-read from shared
// memory per k-step, gather and softmax loops rolled), and 32-row warps do not exist there.
//
// KV_ is the KV cache's element type: T_ (the default), or fp8_e4m3 (KV8 below).
//
// CAUSAL_ makes a multi-token variant: it reads the plan's token view and masks, in a CTA the
// plan flags (FwdParams::cta_causal), the positions past each query token's causal limit
// (FwdParams::cta_kv_limit).  The default, false, compiles none of that.
template <int HEAD_DIM_, typename T_, int M_, int N_, int WARPS_, int STAGES_, int RW_ = 16,
          typename KV_ = T_, bool CAUSAL_ = false>
struct FwdTraits {
  using T = T_;
  using KV = KV_;
  static constexpr bool KV8 = sizeof(KV_) == 1;                   // an fp8 cache
  static constexpr bool CAUSAL = CAUSAL_;                         // multi-token queries
  static constexpr int D = HEAD_DIM_;
  static constexpr int M = M_;
  static constexpr int N = N_;
  static constexpr int WARPS = WARPS_;
  static constexpr int STAGES = STAGES_;
  static constexpr int RW = RW_;
  static constexpr int THREADS = WARPS * 32;

  // RW_ == 64: the Hopper warpgroup layout (pat_wgmma.cuh): each group of 4 warps owns 64 rows
  // through wgmma, each warp holding 16 of them in registers; sm_90a only.  One token slice, or
  // for 64-row tiles on 8 warps two: two warpgroups over the same rows, each walking its half of
  // every tile's tokens as an independent pipeline (twice the warps issuing a block's gather
  // and softmax where one block fills an SM), their states combined at the end.
  static constexpr bool WG = RW == 64;
  static constexpr int MI = WG ? 1 : RW / 16;                     // 16-row MMA blocks per warp
  static constexpr bool Q_IN_REGS = !WG && MI == 1 && D <= 128;
  // Q fragments a warp keeps in registers ([QF_MI][QF_K][4]; a 1 x 1 dummy when Q stays in smem)
  static constexpr int QF_MI = Q_IN_REGS ? MI : 1;
  static constexpr int QF_K = Q_IN_REGS ? D / 16 : 1;
  static constexpr int WARPS_M = WG ? M / 16 : M / RW;            // warps splitting the rows
  static constexpr int WARPS_N = WARPS / WARPS_M;                 // warps splitting a tile's tokens
  static constexpr int NW = N / WARPS_N;                          // tokens per warp per tile
  static constexpr int KC_MAX = MI == 1 ? 64 : kKcRw32;           // tokens per softmax step
  static constexpr int KC = WG ? NW : (NW < KC_MAX ? NW : KC_MAX);
  static constexpr int CHUNKS = D / 8;                            // 16-byte chunks per row

  static constexpr int Q_BYTES = M * D * 2;
  // One K (or V) stage in units of T.  An fp8 cache stays fp8 in shared memory: byte tiles
  // ([N][D] bytes, swz8, half as many T) that the walk's ldmatrix reads and widens in
  // registers (pat_mma_walk.cuh).
  static constexpr int KV_STAGE_T = KV8 ? N * D / 2 : N * D;
  static constexpr int KV_BYTES = STAGES * 2 * KV_STAGE_T * 2;
  // the warpgroup layout aligns its tiles to 1024 bytes (the swizzle atom) at run time
  static constexpr int SMEM_ALIGN_PAD = WG ? 1024 : 0;
  // fp8: 16 elements per 16-byte chunk (CHUNKS8 per row, KV_LOADS8 chunks per thread and stage)
  static constexpr int CHUNKS8 = D / 16;
  static constexpr int SMEM_BYTES = Q_BYTES + KV_BYTES + SMEM_ALIGN_PAD;  // dynamic smem

  // Element offset of 16-byte chunk `ch` of row `row` in a tile of R rows (Q: R = M, K/V: R = N).
  template <int R>
  static __device__ __forceinline__ int off(int row, int ch) {
    if constexpr (WG) return wg_swz<R>(row, ch);
    else return swz<D>(row, ch);
  }

  // Cross-warp combine buffer (aliases the Q tile and KV ring after the main loop): per writing
  // warp, the accumulator fragment plus running max and sum, stored [register][lane].  When the
  // states of all WARPS_N - 1 token slices do not fit at once, they are combined in rounds.
  static constexpr int ACC_REGS = MI * (D / 8) * 4;
  static constexpr int STATE_REGS = ACC_REGS + MI * 4;
  static constexpr int COMB_SLOT_BYTES = WARPS_M * STATE_REGS * 32 * 4;  // one token slice
  static constexpr int COMB_FIT = SMEM_BYTES / COMB_SLOT_BYTES;
  static constexpr int COMB_PER_ROUND =
      WARPS_N - 1 < COMB_FIT ? (WARPS_N > 1 ? WARPS_N - 1 : 1) : COMB_FIT;

  // Token slices: the WARPS_M warps with the same wn read the same NW tokens of every tile and
  // nothing else, so each slice group gathers its own rows and synchronises only among itself
  // (a warp-level or named barrier): the slices run as independent pipelines.
  static constexpr int SLICE_THREADS = WARPS_M * 32;
  static constexpr int Q_LOADS = (M * CHUNKS + THREADS - 1) / THREADS;
  static constexpr int KV_LOADS = (NW * CHUNKS + SLICE_THREADS - 1) / SLICE_THREADS;
  static constexpr int KV_LOADS8 = (NW * CHUNKS8 + SLICE_THREADS - 1) / SLICE_THREADS;

  static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
  static_assert(RW == 16 || RW == 32 || RW == 64, "16 or 32 rows per warp, or 64 per warpgroup");
  static_assert(D <= 128 || RW == 16,
                "head_dim 256: 16 rows per warp (32 rows' accumulators would be 256 registers)");
  static_assert(!WG || (D == 128 && M % 64 == 0 && (WARPS == M / 16 || WARPS == 2 * M / 16)),
                "warpgroup layout: head_dim 128, 64 or 128 rows, one warp per 16 rows of each "
                "of one or two token slices");
  static_assert(!(WG && KV8), "an fp8 cache runs the mma.sync layouts (wgmma reads 16-bit B "
                              "tiles from shared memory)");
  static_assert(M % RW == 0 && M >= 16 && M <= 128, "m must be a multiple of the warp rows, <= 128");
  static_assert(N % 16 == 0 && N >= 16 && N <= 256, "n must be a multiple of 16 in [16, 256]");
  static_assert(WARPS >= 1 && WARPS <= 8, "1..8 warps");
  static_assert(WARPS % WARPS_M == 0, "warps must tile the rows");
  static_assert(N % WARPS_N == 0 && NW % 16 == 0, "each warp needs whole k16 token blocks");
  static_assert(NW % KC == 0 && KC % 16 == 0, "softmax steps must tile a warp's tokens");
  static_assert(STAGES >= 1 && STAGES <= 4, "1..4 pipeline stages");
  static_assert(!WG || STAGES >= 2, "the warpgroup layout needs a ring of at least 2 stages");
  // Tiles the prologue issues: STAGES - 1, or with a single stage tile 0 (together with Q, so
  // a short range costs one memory round trip; later tiles then load one at a time).
  static constexpr int PRE = STAGES > 1 ? STAGES - 1 : 1;
  static_assert(SLICE_THREADS % CHUNKS == 0, "a thread keeps one 16-byte column across rows");
  static_assert(sizeof(KV_) == sizeof(T_) || sizeof(KV_) == 1, "KV: T or an fp8 type");
  static_assert(WARPS_N <= 15, "one named barrier per token slice");
  static_assert(WARPS_N == 1 || COMB_FIT >= 1,
                "one token slice's state must fit in the shared memory it reuses");

  // Unroll of a thread's gather loop: full for 16-row warps; 2 for 32-row warps and head_dim
  // 256, whose accumulators leave no room for many live 64-bit gather addresses (full unroll
  // spills).
  static constexpr int LOAD_UNROLL = Q_IN_REGS ? kLoadUnroll : 2;
  // Softmax steps of a tile are unrolled for 16-row warps; rolled for 32-row warps and head_dim
  // 256 (registers).
  static constexpr int STEP_UNROLL = Q_IN_REGS ? 8 : 1;
  static_assert(SMEM_BYTES <= 227 * 1024, "exceeds the per-block shared-memory limit");
  static_assert(ACC_REGS + (Q_IN_REGS ? MI * (D / 16) * 4 : 0) + MI * (KC / 8) * 4 <= 200,
                "register arrays too large for one thread");
};

// Short-KV tiles: registers never limit them below what their shared memory allows.  The
// selector gives 16-row tiles n <= 32 only for CTAs of at most 96 tokens (tree leaves of a few
// pages), whose blocks are latency bound: what matters is how many an SM holds at once.
// Registers are dealt per scheduler (16384 each, four per SM), so a few registers more can cost
// a resident block: left free, the compiler gave the 2-warp 16x32 block ~170 registers, 2 warps
// per scheduler, 4 blocks per SM where its shared memory holds 6 (ncu, the 16x32 kernel of a
// 1216-leaf tree: 360 us, and 290 us once it held 6).  MIN_BLOCKS = the blocks shared memory
// allows (1 KB reserved per block; 228 KB per SM on sm_90, 164 KB on sm_80), but never more
// than leaves each thread kShortTileRegs registers, which caps registers at
// 65536 / (MIN_BLOCKS * THREADS) (a single-stage ring's small blocks would spill otherwise).
// Not for long-KV tiles: with it the no-sharing batch 128_2048 (one 2048-token CTA per
// request) ran 3% slower on 16x64 and 11% on 16x32, and the larger tiles' accumulators spill
// under such a cap (32x32: 48 bytes, 128x16: 776 bytes at head_dim 128).  PAT_SMEM_OCCUPANCY=0 turns the request off.
constexpr int smem_per_sm() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return 167936;
#else
  return 233472;
#endif
}
template <typename Tr>
constexpr int fwd_min_blocks() {
  constexpr int M = Tr::M, N = Tr::N, WARPS = Tr::WARPS;
  constexpr int by_smem = smem_per_sm() / (Tr::SMEM_BYTES + 1024);  // 1 KB reserved per block
  constexpr int by_threads = 2048 / (WARPS * 32);
  constexpr int by_regs = 65536 / (WARPS * 32 * kShortTileRegs);
  constexpr int b0 = by_smem < by_threads ? by_smem : by_threads;
  constexpr int b = b0 < by_regs ? b0 : by_regs;
  return (!kSmemOccupancy || M > 16 || N > 32 || b < 1) ? 1 : (b > 32 ? 32 : b);
}

}  // namespace pat
