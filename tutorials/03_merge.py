# %% [markdown]
# # 3. Merging partial results
#
# **What you will learn**
#
# * what an *attention state* `(o, lse)` is, and why two states over different keys combine
#   into the state over all of them with the log-sum-exp rule (`pat_core.merge_state`);
# * that the merge does not care about order or grouping, checked on real numbers over every
#   order of seven partials;
# * how a plan's partial slots become the final output (`pat_core.merge_partials`), and how much
#   each CTA contributed to each request;
# * where the merge runs: a request whose KV one CTA holds gets its output from that CTA, the
#   merge combines the other requests' partials, and a step where every request has one CTA
#   needs no merge at all;
# * that the whole pipeline equals plain dense attention (`pat_core.dense_attention`) for every
#   packer.
#
# Tutorials 1 and 2 explain where the partials come from. CPU only.

# %%
import itertools

import matplotlib.pyplot as plt
import numpy as np

import pat_core
from pat_core import dense_attention, merge_partials, merge_state
from pat_core.executor import execute_partials
from pat_core.reference import lowp_attention, relative_error
from pat_core.workloads import build_tree_batch, random_kv_cache

rng = np.random.default_rng(0)

# %% [markdown]
# ## Attention states
#
# For one query head with scaled scores `s_k = q.k_k / sqrt(d)` over a set of keys `K`, attention
# returns the softmax-weighted average of the values:
#
# `o = sum_k exp(s_k) v_k / sum_k exp(s_k)`.
#
# Keep, next to `o`, the log of the denominator, `lse = log sum_k exp(s_k)` (the *log-sum-exp*).
# The pair `(o, lse)` is the **attention state** of the query over `K`; it is what every pat CTA
# writes for every (request, head) it serves. We compute states by hand with NumPy for one query
# against 1,000 keys, split into three uneven chunks.

# %%
d = 64
q = rng.standard_normal(d)
keys = rng.standard_normal((1000, d))
values = rng.standard_normal((1000, d))


def state(q, k, v):
    """(o, lse) of one query over keys k and values v, in float64."""
    s = k @ q / np.sqrt(len(q))
    mx = s.max()
    p = np.exp(s - mx)
    return p @ v / p.sum(), mx + np.log(p.sum())


o_full, lse_full = state(q, keys, values)
cuts = [0, 130, 720, 1000]
parts = [state(q, keys[a:b], values[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
for (a, b), (o, lse) in zip(zip(cuts[:-1], cuts[1:]), parts):
    print(f"keys {a:>4}-{b - 1:>4}: lse = {lse:.4f}, |o| = {np.linalg.norm(o):.4f}")
print(f"all keys   : lse = {lse_full:.4f}, |o| = {np.linalg.norm(o_full):.4f}")

# %% [markdown]
# ## The rule
#
# `exp(lse_a)` is the softmax denominator of chunk `a`, so the denominator over the union is
# `exp(lse_a) + exp(lse_b)`, i.e. `lse = log(exp(lse_a) + exp(lse_b))`. And `o_a * exp(lse_a)` is
# chunk `a`'s numerator, so
#
# `o = exp(lse_a - lse) * o_a + exp(lse_b - lse) * o_b`:
#
# a weighted average of the two outputs, weighted by how much softmax mass each chunk holds.
# `merge_state` computes this with the larger `lse` subtracted first so nothing overflows.

# %%
o, lse = parts[0]
for o_b, lse_b in parts[1:]:
    o, lse = merge_state(o, lse, o_b, lse_b)
print("max |o_merged - o_full|    :", float(np.abs(o - o_full).max()))
print("|lse_merged - lse_full|    :", float(abs(lse - lse_full)))
weights = np.exp(np.array([p[1] for p in parts]) - lse_full)
print("share of softmax mass per chunk:", np.round(weights, 4), "sum", weights.sum())

# %% [markdown]
# The *empty* state, over no keys at all, is `(0, -inf)`: zero mass. It must be the identity of
# the merge, and two empty states must merge into an empty state rather than `0 / 0 = NaN`. (A
# CTA can produce one when a long range is split so that a part holds no key for some row.)

# %%
empty = (np.zeros(d), -np.inf)
o1, l1 = merge_state(o_full, lse_full, *empty)
o2, l2 = merge_state(*empty, *empty)
print("state + empty == state:", np.array_equal(o1, o_full), l1 == lse_full)
print("empty + empty          :", "o all zero" if not o2.any() else o2, "lse", l2,
      "| any NaN:", bool(np.isnan(o2).any()))

# %% [markdown]
# ## Order does not matter
#
# Because the rule is a weighted average with weights `exp(lse_i)`, it is associative and
# commutative: merging partials in any order, in any tree shape, gives the same state (up to
# floating point rounding). pat relies on this: a request's partials come from CTAs that finish
# in whatever order the GPU runs them.
#
# Let us check it on numbers rather than take it on faith: split the keys into seven chunks and
# merge them left to right in **all 5,040 orders**, plus as balanced binary trees. `merge_state`
# works on whole arrays, so all orders go through in one batch.

# %%
cuts7 = np.sort(rng.choice(np.arange(1, 1000), size=6, replace=False))
bounds = np.concatenate([[0], cuts7, [1000]])
chunks = [state(q, keys[a:b], values[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
O = np.stack([c[0] for c in chunks])          # [7, d]
L = np.array([c[1] for c in chunks])          # [7]
perms = np.array(list(itertools.permutations(range(7))))   # [5040, 7]
o_acc, l_acc = O[perms[:, 0]], L[perms[:, 0]]
for j in range(1, 7):
    o_acc, l_acc = merge_state(o_acc, l_acc, O[perms[:, j]], L[perms[:, j]])
err_fold = np.abs(o_acc - o_full).max(axis=1)


def tree_merge(idx):
    """Merge the chunks idx as a balanced binary tree."""
    if len(idx) == 1:
        return O[idx[0]], L[idx[0]]
    h = len(idx) // 2
    return merge_state(*tree_merge(idx[:h]), *tree_merge(idx[h:]))


err_tree = np.array([np.abs(tree_merge(list(p))[0] - o_full).max() for p in perms[::10]])
eps = np.finfo(np.float64).eps
print(f"left-to-right, 5,040 orders: worst error {err_fold.max():.2e} "
      f"({err_fold.max() / eps:.1f} float64 ulps of 1)")
print(f"balanced trees, 504 orders : worst error {err_tree.max():.2e}")
print(f"lse over all orders spreads by {l_acc.max() - l_acc.min():.2e}")

fig, ax = plt.subplots(figsize=(8, 3.4))
bins = np.logspace(-17.5, -15, 41)
ax.hist(np.maximum(err_fold, 1e-18), bins=bins, alpha=0.7, label="left to right, every order")
ax.hist(np.maximum(err_tree, 1e-18), bins=bins, alpha=0.7, label="balanced tree")
ax.axvline(eps, color="black", ls="--", lw=1, label="float64 epsilon")
ax.set_xscale("log")
ax.set_xlabel("max |o_merged - o_dense| (values are O(0.1))")
ax.set_ylabel("number of orders")
ax.set_title("seven partials merged in every order: the result moves only by rounding",
             fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()
# the statements above: 5,040 orders, and every one equal to the dense result up to rounding
assert len(perms) == 5040 and len(err_tree) == 504
assert err_fold.max() < 8 * eps and err_tree.max() < 8 * eps

# %% [markdown]
# ## The merge of a real plan
#
# A `Plan` numbers the partial results: every (CTA, request) pair owns one *slot*, and request
# `r` owns the contiguous slots `req_slot_indptr[r] : req_slot_indptr[r + 1]`. The forward pass
# (`execute_partials` on the CPU, the CUDA kernels on a GPU) writes `o_partial [slots, heads, d]`
# and `lse_partial [slots, heads]`; `merge_partials` combines each request's slots in fp32, all
# requests and heads at once, as the merge kernel does.
#
# The batch: a 512-token shared prompt, four 128-token documents, eight requests with 48 tokens
# of their own; 8 query heads over 2 KV heads, head_dim 64, fp32.

# %%
spec = "1,4,8_512,128,48"
batch = build_tree_batch(spec, page_size=16)
hq, hk = 8, 2
k_cache, v_cache = random_kv_cache(batch.num_pages, 16, hk, d, dtype=np.float32, seed=3)
qs = rng.standard_normal((batch.batch_size, hq, d)).astype(np.float32)
plan = pat_core.Planner("pat", "h100").plan(batch.block_tables, batch.seq_lens, hq, hk, d, 16,
                                            kv_data_type="float32")
o_part, lse_part = execute_partials(plan, qs, k_cache, v_cache)
out, lse = merge_partials(o_part, lse_part, plan.req_slot_indptr)
ref, ref_lse = dense_attention(qs, (k_cache, v_cache), batch.block_tables, batch.seq_lens, 16,
                               return_lse=True)
print(f"{plan.num_ctas} CTAs, {plan.num_slots} partial slots for {batch.batch_size} requests")
print("relative error of the merged output vs float64 dense attention:",
      f"{relative_error(out, ref):.2e}")
print("max |lse - lse_dense|:", float(np.abs(lse - ref_lse).max()))

# %% [markdown]
# Which CTA contributed how much? The weight of slot `i` in its request's output is
# `exp(lse_i - lse)`: its share of the softmax mass. Below, for query head 0 of every request,
# each bar is split by the token range of the CTA that produced the slot.

# %%
slot_cta = np.empty(plan.num_slots, dtype=int)
for c in range(plan.num_ctas):
    slot_cta[plan.cta_slot[plan.cta_req_indptr[c]:plan.cta_req_indptr[c + 1]]] = c
ranges = sorted({(int(plan.cta_kv_start[c]), int(plan.cta_kv_len[c])) for c in slot_cta})
colour = {rg: f"C{i}" for i, rg in enumerate(ranges)}
fig, ax = plt.subplots(figsize=(9, 3.8))
for r in range(batch.batch_size):
    bottom = 0.0
    own = range(plan.req_slot_indptr[r], plan.req_slot_indptr[r + 1])
    for s in sorted(own, key=lambda s: plan.cta_kv_start[slot_cta[s]]):   # token order, bottom up
        c = slot_cta[s]
        rg = (int(plan.cta_kv_start[c]), int(plan.cta_kv_len[c]))
        w = float(np.exp(lse_part[s, 0] - lse[r, 0]))
        ax.bar(r, w, bottom=bottom, color=colour[rg], edgecolor="black", lw=0.5)
        bottom += w
handles = [plt.Rectangle((0, 0), 1, 1, color=colour[rg]) for rg in ranges]
ax.legend(handles[::-1], [f"tokens {s}-{s + n - 1}" for s, n in ranges][::-1], fontsize=7,
          loc="center left", bbox_to_anchor=(1.0, 0.5), title="CTA reading", title_fontsize=8)
ax.set_xlabel("request")
ax.set_ylabel("share of softmax mass (head 0)")
ax.set_title(f"{spec}: every request's output is a weighted sum of its partials", fontsize=10)
fig.tight_layout()
plt.show()
# the share of each request's mass (head 0) that comes from CTAs reading the 512-token prompt
prompt_share = np.zeros(batch.batch_size)
for r in range(batch.batch_size):
    for s in range(plan.req_slot_indptr[r], plan.req_slot_indptr[r + 1]):
        c = slot_cta[s]
        if plan.cta_kv_start[c] + plan.cta_kv_len[c] <= 512:
            prompt_share[r] += np.exp(lse_part[s, 0] - lse[r, 0])
print(f"mass from the prompt CTAs: {np.round(prompt_share, 3)}; "
      f"prompt tokens / all tokens = 512 / {int(batch.seq_lens[0])} = "
      f"{512 / int(batch.seq_lens[0]):.3f}")
assert set(np.asarray(batch.seq_lens).tolist()) == {688}
assert np.all(np.abs(prompt_share - 512 / 688) < 0.05)
assert len({(int(plan.cta_kv_start[c]), int(plan.cta_kv_len[c])) for c in slot_cta
            if plan.cta_kv_start[c] + plan.cta_kv_len[c] <= 512}) > 1   # the prompt was split

# %% [markdown]
# With random keys the scores carry no preference, so each CTA's share is close to its share of
# the tokens: about 512 / 688 (74%) of every request's mass comes from the prompt CTAs, within
# 5 points for every request (the cell above prints and checks the shares). (The planner split
# the long prompt into parts, so several colours share it.) With real keys the shares
# follow the model's attention, but the merge is the same.
#
# ## Every packer equals dense attention
#
# Different packers cut the same attention into different partials; the merge must make them all
# equal to the dense result. For fp32 inputs the executor should agree with float64 to about
# 1e-6 (below it, here). For fp16, the fair yardstick is a plain attention computed entirely in
# fp16 (the error any fp16 implementation has); pat's tests require pat to stay within twice
# that, and so does the cell below.

# %%
packers = list(pat_core.PACKERS)
errs = {}
for dtype in (np.float32, np.float16):
    kc, vc, qq = k_cache.astype(dtype), v_cache.astype(dtype), qs.astype(dtype)
    ref = dense_attention(qq, (kc, vc), batch.block_tables, batch.seq_lens, 16)
    for p in packers:
        w = pat_core.PrefixAttentionWrapper(backend="cpu", packer=p)
        w.plan(batch.block_tables, batch.seq_lens, hq, hk, d, 16,
               kv_data_type=np.dtype(dtype).name)
        errs[(np.dtype(dtype).name, p)] = relative_error(w.run(qq, (kc, vc)), ref)
    if dtype is np.float16:
        fp16_plain = relative_error(lowp_attention(qq, (kc, vc), batch.block_tables,
                                                   batch.seq_lens, 16), ref)

fig, ax = plt.subplots(figsize=(8, 3.6))
x = np.arange(len(packers))
for i, dt in enumerate(("float32", "float16")):
    ax.bar(x + (i - 0.5) * 0.38, [errs[(dt, p)] for p in packers], width=0.38, label=dt)
ax.axhline(fp16_plain, color="black", ls="--", lw=1, label="plain fp16 attention")
ax.axhline(2 * fp16_plain, color="red", ls=":", lw=1, label="fp16 tolerance (2x plain)")
ax.set_yscale("log")
ax.set_xticks(x, packers)
ax.set_ylabel("relative error vs float64 dense")
ax.set_title("pack, forward, merge == dense attention, for every packer", fontsize=10)
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
fig.tight_layout()
plt.show()
for (dt, p), e in errs.items():
    print(f"{dt:>8} {p:>8}: {e:.2e}")
print(f"plain fp16 attention: {fp16_plain:.2e}")
assert all(e < 1e-6 for (dt, _), e in errs.items() if dt == "float32")
assert all(e <= 2 * fp16_plain for (dt, _), e in errs.items() if dt == "float16")

# %% [markdown]
# ## Where the merge runs
#
# On a GPU the merge is a kernel of its own, launched after the forward launches. It only has
# work for requests of more than one slot. A request whose KV one CTA holds entirely has exactly
# one slot, and merging one state with nothing changes nothing: so that CTA writes the request's
# final output itself (`o` in the output dtype, and its LSE), no partial is written for it, and
# the merge kernel skips it (`Plan.direct_requests()` counts such requests). When every request
# of a step has one slot (`plan.num_slots == plan.batch_size`) the merge is not launched at
# all. (`pat_core.launch.merge_needed` states the backend's rule; it also launches the merge when
# a forward block had to draw a second work item, only to reset the work counters.)
#
# A batch with both kinds: three requests under a 128-token shared prompt, and two requests that
# share nothing. The step is small and merges anyway, so the split cuts the prompt into two
# 64-token parts (tutorial 1's last section): each of the three requests gets three slots.

# %%
tables = [[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5, 6, 7, 9], [0, 1, 2, 3, 4, 5, 6, 7, 10],
          [11, 12, 13], [14, 15, 16, 17]]
lens = [140, 140, 140, 48, 64]
mixed = pat_core.Planner("pat", "h100").plan(tables, lens, hq, hk, d, 16,
                                             kv_data_type="float32")
slots = np.diff(mixed.req_slot_indptr)
print(f"slots per request: {slots.tolist()}; requests written by their own CTA: "
      f"{mixed.direct_requests()}")
print(f"partial bytes: {mixed.stats()['partial_bytes']:,} (written and read back, for the "
      f"{int((slots > 1).sum())} requests the merge combines)")
assert slots.tolist() == [3, 3, 3, 1, 1] and mixed.direct_requests() == 2
# fp32 partials (d values and an LSE per query head), written once and read once
assert mixed.stats()["partial_bytes"] == 2 * (mixed.num_slots - 2) * hq * (d + 1) * 4

# %% [markdown]
# The CPU executor runs every CTA into its slots and merges every request, one slot or several:
# merging a single slot returns it unchanged (weight `exp(lse - lse) = 1`), so its output is
# bit for bit what the GPU's CTA writes directly.

# %%
kc2, vc2 = random_kv_cache(18, 16, hk, d, dtype=np.float32, seed=5)
q2 = rng.standard_normal((len(lens), hq, d)).astype(np.float32)
o2, l2 = execute_partials(mixed, q2, kc2, vc2)
out2, lse2 = merge_partials(o2, l2, mixed.req_slot_indptr)
for r in np.flatnonzero(slots == 1):
    s0 = mixed.req_slot_indptr[r]
    assert np.array_equal(out2[r], o2[s0]) and np.array_equal(lse2[r], l2[s0])
ref2 = dense_attention(q2, (kc2, vc2), tables, lens, 16)
print(f"merged output vs dense attention: relative error {relative_error(out2, ref2):.1e}")
assert relative_error(out2, ref2) < 1e-5

# %% [markdown]
# The `pat` packer uses this on purpose. On a batch of long private leaves under short shared
# levels, sharing the levels costs a partial per request and level, the merge launch and the
# shared CTAs' own blocks, while one CTA per request re-reads the short shared pages (mostly from
# L2) and needs no merge. Its *per-request rule* (`pat_core.packers.request_packing`) takes the
# per-request plan where it re-reads few tokens and needs no merge: then no partial is written.

# %%
# 256 requests, each with a 1,024-token leaf under two 64-token levels (one shared by all 256,
# the other by groups of 8);
# 32 query heads over 8 KV heads, head_dim 128 (planned only)
leafy = build_tree_batch("1,32,256_64,64,1024", page_size=16)
per_req = pat_core.Planner("pat", "h100").plan(leafy.block_tables, leafy.seq_lens, 32, 8, 128, 16)
shared = pat_core.Planner("pat", "h100", pat_core.Tuning(request_share=0.0)).plan(
    leafy.block_tables, leafy.seq_lens, 32, 8, 128, 16)
for name, p in (("rule off", shared), ("default", per_req)):
    print(f"{name:>8}: {p.num_ctas} CTAs, {p.num_slots} slots for {p.batch_size} requests, "
          f"partial bytes {p.stats()['partial_bytes']:,}")
assert per_req.one_cta_per_request and per_req.num_slots == per_req.batch_size
assert per_req.stats()["partial_bytes"] == 0 < shared.stats()["partial_bytes"]

# %% [markdown]
# **Try it yourself:** merge only *some* of a request's slots (drop one from `o_part`'s range)
# and watch the error jump: every token must be covered exactly once. Or scale the keys
# (`random_kv_cache(..., scale=8.0)`) so that the softmax becomes peaked and one CTA takes almost
# all of the mass.
#
# Next: [tutorial 4](04_simulator.ipynb) asks how long all of this takes on a GPU, without one.
