// Kernel parameter blocks: every launch of the forward and merge kernels takes one of these
// structs by value (a __grid_constant__ parameter), so each argument is spelled once here and once
// on the host (pat_core/kernel_params.py mirrors the layout field by field; a CPU test parses
// this file and compares the two).  Only pointers, 32-bit and 64-bit scalars: the C layout is the
// same under nvcc and ctypes.
#pragma once

namespace pat {

// Where a forward item writes the final output of a request whose only partial slot it holds
// (the merge kernel skips such requests): each request's slot range, and the output.
struct MergeArgs {
  const int* req_slot_indptr;  // [batch + 1]
  void* out;                   // [batch, num_qo_heads, head_dim] in the input dtype
  float* lse_out;              // [batch, num_qo_heads] or nullptr
  long long out_sb, out_sh, lse_sb, lse_sh;  // element strides
};

// One forward launch.  The Plan arrays are those of pat_core/plan.py (int32, device memory,
// written by plan() into the state's fixed buffer, each tile variant's CTAs contiguous).
struct FwdParams {
  const void* q;               // [batch, num_qo_heads, head_dim] (element strides q_sb, q_sh);
                               // [num_qo_tokens, ...] for a multi-token plan
  const void* k_cache;         // paged K (element strides k_sp page, k_st token, k_sh head)
  const void* v_cache;         // paged V (v_sp, v_st, v_sh)
  float* o_partial;            // [num_slots, num_qo_heads, head_dim] fp32
  float* lse_partial;          // [num_slots, num_qo_heads] fp32
  const int* cta_req_indptr;   // [C + 1]
  const int* cta_req;          // [num_slots]
  const int* cta_slot;         // [num_slots]
  const int* cta_kv_start;     // [C]
  const int* cta_kv_len;       // [C]
  const int* cta_page_indptr;  // [C + 1]
  const int* cta_pages;        // [num_page_entries]
  // live = {first CTA, CTA count} of this launch's variant in device memory (the fused launch:
  // one pair per variant), and work_counter = items drawn past the grid so far (block b's first
  // item is b; the merge kernel zeroes the counter).
  const int* live;
  int* work_counter;
  // Chained launches: a counter of this launch's blocks that have finished, zero between runs
  // (the last block resets it); nullptr: not chained.
  int* chain;
  long long q_sb, q_sh, k_sp, k_st, k_sh, v_sp, v_st, v_sh;
  int num_kv_heads;
  int group;                   // num_qo_heads / num_kv_heads
  int num_qo_heads;
  int page_size;
  float scale_log2;            // sm_scale * log2(e) (an fp8 cache: times k_scale)
  float v_scale;               // an fp8 cache's V scale (read by fp8 variants only; 1 otherwise)
  MergeArgs merge;
  // Multi-token queries (read by the causal variants only, FwdTraits::CAUSAL; nullptr for the
  // others).  In such a launch the request tables above are the plan's token view
  // (Plan.token_view): cta_req holds each (CTA, query token) pair's q row, cta_slot its partial
  // row, merge.req_slot_indptr each token's partial rows.  Last in the struct, so the fields
  // above keep their offsets.
  const int* cta_kv_limit;     // [num_pairs] positions of the CTA's range the pair's token sees
  const int* cta_causal;       // [C] 1: some pair of the CTA sees fewer than kv_len positions
};

// One merge launch: request r's slots req_slot_indptr[r] .. req_slot_indptr[r + 1] - 1 combine
// into out[r] and lse_out[r].
struct MergeParams {
  const float* o_partial;      // [num_slots, num_qo_heads, head_dim]
  const float* lse_partial;    // [num_slots, num_qo_heads]
  const int* req_slot_indptr;  // [batch + 1]
  void* out;                   // [batch, num_qo_heads, head_dim] in the input dtype
  float* lse_out;              // [batch, num_qo_heads] or nullptr
  const int* live_batch;       // nullptr: `batch` below; else the batch in device memory
  int* reset;                  // nullptr, or reset_n forward work counters to zero
  long long out_sb, out_sh, lse_sb, lse_sh;  // element strides
  int batch;
  int num_qo_heads;
  int reset_n;
  int block_per_pair;          // 0: one warp per (request, head) pair; 1: one block per pair
  int direct_single;           // 1: skip requests of one slot (the forward wrote their output)
};

// The host mirror (pat_core/kernel_params.py) checks its sizes against these.
static_assert(sizeof(MergeArgs) == 56, "MergeArgs layout changed: update kernel_params.py");
static_assert(sizeof(FwdParams) == 280, "FwdParams layout changed: update kernel_params.py");
static_assert(sizeof(MergeParams) == 112, "MergeParams layout changed: update kernel_params.py");

}  // namespace pat
