// Kernel parameter blocks: every launch of the forward and merge kernels takes one of these
// structs by value (a __grid_constant__ parameter), so each argument is spelled once here and once
// on the host (pat_core/kernel_params.py mirrors the layout field by field; a CPU test parses
// this file and compares the two).  Only pointers, 32-bit and 64-bit scalars: the C layout is the
// same under nvcc and ctypes.
#pragma once

namespace pat {

// What a forward CTA needs to merge finished requests itself (the in-kernel merge ablation, see
// pat_fwd.cuh): a counter per (request, KV head) of the partial slots written so far (zero
// between runs: the CTA that completes a request resets it), each request's slot range, and the
// output.  counters == nullptr: no in-kernel merge (the separate merge kernel runs).
struct MergeArgs {
  int* counters;               // [batch * num_kv_heads]
  const int* req_slot_indptr;  // [batch + 1]
  void* out;                   // [batch, num_qo_heads, head_dim] in the input dtype
  float* lse_out;              // [batch, num_qo_heads] or nullptr
  long long out_sb, out_sh, lse_sb, lse_sh;  // element strides
};

// One forward launch.  The Plan arrays are those of pat_core/plan.py (int32, device memory).
struct FwdParams {
  const void* q;               // [batch, num_qo_heads, head_dim] (element strides q_sb, q_sh)
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
  const int* cta_variant;      // fused kernel: variant index of each CTA; otherwise unused
  // Graph-safe launches (fixed grid): live = {first CTA, CTA count} of this launch in device
  // memory, written by plan() between graph replays, and work_counter = items drawn past the
  // grid so far (block b's first item is b; the merge kernel zeroes the counter).
  // live == nullptr: block b runs item b of cta_offset + [0, n_ctas).
  const int* live;
  int* work_counter;
  // Chained launches (pat_core/cuda_backend.py, fwd_chain): a counter of this launch's blocks
  // that have finished, zero between runs (the last block resets it); nullptr: not chained.
  int* chain;
  long long q_sb, q_sh, k_sp, k_st, k_sh, v_sp, v_st, v_sh;
  int cta_offset;              // first CTA of this launch (live == nullptr)
  int n_ctas;                  // CTAs of this launch (live == nullptr)
  int num_kv_heads;
  int head_minor;              // 1: a CTA's KV heads adjacent in block order (graph-safe: always)
  int group;                   // num_qo_heads / num_kv_heads
  int num_qo_heads;
  int page_size;
  float scale_log2;            // sm_scale * log2(e)
  // Finisher kernel (pat_fwd_finish_kernel): its items of CTAs below finish_cta are first-phase
  // items (they write their slots and count them), the others finish their request.
  int finish_cta;
  MergeArgs merge;
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
static_assert(sizeof(MergeArgs) == 64, "MergeArgs layout changed: update kernel_params.py");
static_assert(sizeof(FwdParams) == 296, "FwdParams layout changed: update kernel_params.py");
static_assert(sizeof(MergeParams) == 112, "MergeParams layout changed: update kernel_params.py");

}  // namespace pat
