# %% [markdown]
# # 1. From block table to prefix forest to CTAs
#
# **What you will learn**
#
# * how a paged KV cache's *block table* reveals which requests share a prefix, and how pat turns
#   it into a *prefix forest* (a radix tree over page ids);
# * why decode attention is paid for in bytes, and exactly how many bytes sharing saves;
# * the *profit model* pat uses to decide which requests go into the same CTA (a GPU thread
#   block), worked out by hand on a small batch and checked against the library;
# * what each packer (`pat`, `query`, `node`, `compute`, `cascade`) does to the same batch, and
#   what each one costs in HBM traffic according to `Plan.stats()`.
#
# You need to know what attention is; no GPU knowledge is assumed. Everything here runs on a CPU
# in a few seconds.

# %%
import matplotlib.pyplot as plt
import numpy as np

import pat_core
from pat_core.inputs import as_block_table
from pat_core.packers import cost_constants
from pat_core.split import split_threshold
from pat_core.tiles import TileSelector
from pat_core.workloads import build_tree_batch

# %% [markdown]
# ## Decode attention is a memory problem
#
# In a decode step every request contributes **one** new query token. That token attends to
# every key and value the request has cached so far. For one query head and `L` cached tokens,
# attention does about `4 * L * head_dim` floating point operations and reads `2 * L * head_dim`
# cached numbers (K and V). That is two flops per byte in fp16: a modern GPU can do hundreds of
# flops in the time it takes to fetch one byte from HBM. So the time of a decode attention
# kernel is, to a first approximation, *the number of bytes it reads divided by the memory
# bandwidth*. Every idea in this project is about reading fewer bytes, or reading them with the
# whole GPU busy.
#
# ## The block table
#
# Serving engines (vLLM, SGLang, FlashInfer) store the KV cache in fixed-size *pages* of
# `page_size` tokens. A request's *block table* row lists the pages that hold its tokens, in
# order. With prefix caching, two requests that start with the same text point at the **same
# physical pages** for that text. Here is a hand-written batch of four requests with
# `page_size = 4`:

# %%
page_size = 4
block_tables = [
    [7, 3, 9, 1],         # request 0: a 4-page system prompt ... (16 tokens)
    [7, 3, 9, 1, 12, 5],  # request 1: ... the same prompt, then its own question
    [7, 3, 9, 1, 12, 8],  # request 2: shares the prompt *and* page 12 with request 1
    [7, 3, 4],            # request 3: shares two pages, then diverges
]
seq_lens = [15, 22, 24, 11]
bt = as_block_table(block_tables, seq_lens, page_size)
forest = pat_core.PrefixForest(bt)
print(forest.describe())

# %% [markdown]
# Each line is a **node**: a run of token positions `[start, end)` read by exactly the same set of
# requests. Reading it top down: all four requests share tokens 0-7 (pages 7 and 3); request 3
# then goes its own way (page 4). Requests 0, 1 and 2 go on together over pages 9 and 1. Request
# 0 has only 15 tokens, so it *ends* at token 14, in the middle of page 1; requests 1 and 2 still
# share the last token of page 1 and all of page 12 (tokens 15-19), then split. The forest is
# token-accurate: it cuts at token 15 although no page boundary is there, because that is where
# the set of readers changes.
#
# The nodes are numbered in construction order; the numbers themselves mean nothing.
#
# ## A bigger batch, drawn
#
# Real batches are built from a *tree spec*, the format of the PAT paper: `"1,2,6_64,8,28"`
# means one 64-token root (a system prompt), two 8-token children (say, two tool templates) and
# six 28-token leaves (the requests' own text); node `j` of a level hangs under node
# `j * n_parent // n_child` of the level above. The builder hands out shuffled page ids the way a
# prefix cache would.

# %%
spec = "1,2,6_64,8,28"
batch = build_tree_batch(spec, page_size=4)
print("block table (one row per request, page ids):")
print(batch.block_tables)
print("seq_lens:", batch.seq_lens)
forest = pat_core.PrefixForest(as_block_table(batch.block_tables, batch.seq_lens, 4))
print(forest.describe())


# %% [markdown]
# A good picture of a prefix forest puts **token positions** on the x axis and **requests** on the
# y axis (in the forest's sorted order, so that every node's requests are neighbours). Each node
# is then a rectangle: its width is the number of tokens it holds, its height the number of
# requests that read them.
#
# This picture answers the byte question directly. A kernel that processes each request on its
# own reads the *area* of the picture. A kernel that reads each node once reads only the *sum of
# the widths*.

# %%
def draw_forest(forest, ax, title=""):
    """Icicle picture of a PrefixForest: x = token position, y = sorted request position."""
    sizes, lens = forest.node_size(), forest.node_len()
    cmap = plt.get_cmap("Pastel1")
    for u in range(1, forest.num_nodes):
        x0, x1 = forest.start[u], forest.end[u]
        y0, y1 = forest.lo[u], forest.hi[u]
        ax.add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, facecolor=cmap(forest.level[u]),
                                   edgecolor="black", lw=1))
        ax.text((x0 + x1) / 2, (y0 + y1) / 2, f"node {u}\n{lens[u]} tok x {sizes[u]}",
                ha="center", va="center", fontsize=8)
    ax.set_xlim(0, int(forest.end.max()))
    ax.set_ylim(forest.batch_size, 0)
    ax.set_yticks(np.arange(forest.batch_size) + 0.5)
    ax.set_yticklabels([f"req {r}" for r in forest.order])
    ax.set_xlabel("token position")
    ax.set_title(title)


fig, ax = plt.subplots(figsize=(10, 3.2))
draw_forest(forest, ax, f"prefix forest of {spec}")
plt.show()

unique = forest.unique_tokens()
total = int(batch.seq_lens.sum())
print(f"tokens read one request at a time: {total}")
print(f"distinct tokens (each node once):  {unique}  ({total / unique:.2f}x fewer)")

# %% [markdown]
# ## The profit model, by hand
#
# On a GPU the unit of work is a **CTA** (cooperative thread array, CUDA's "thread block"): a
# group of threads that runs on one streaming multiprocessor (SM) and shares that SM's fast
# on-chip shared memory. A prefix-aware kernel gives one CTA a *set of requests* and a *token
# range they all share*; the CTA loads each K/V token of that range into shared memory once and
# uses it for all of its requests' queries.
#
# That saving is not free. A request whose tokens are spread over several CTAs gets one
# **partial result** from each, and the partials have to be written to HBM and read back by a
# merge step (tutorial 3). pat's profit model counts both sides in bytes, per KV head, with
# `cost_constants(head_dim, kv_bytes, q_bytes)`:
#
# * `kv_tok_bytes`: one cached token's K and V for one KV head, `2 * head_dim * kv_bytes`;
# * `row_slot_bytes`: one extra partial result for one query row: an fp32 output vector plus its
#   fp32 log-sum-exp, written and read back (`2 * 4 * (head_dim + 1)`), plus loading that row's
#   query once more (`head_dim * q_bytes`).
#
# With grouped-query attention (GQA) several query heads share one KV head; a CTA then holds
# `requests x group` query rows. We use 8 query heads over 2 KV heads (group 4), head_dim 64,
# fp16.

# %%
num_qo_heads, num_kv_heads, head_dim = 8, 2, 64
group = num_qo_heads // num_kv_heads
kv_tok_bytes, row_slot_bytes = cost_constants(head_dim, kv_bytes=2, q_bytes=2)
print(f"kv_tok_bytes = 2 * {head_dim} * 2          = {kv_tok_bytes}")
print(f"row_slot_bytes = 8 * ({head_dim} + 1) + {head_dim} * 2 = {row_slot_bytes}")

# %% [markdown]
# **Sharing a node.** If node `u` holds `l_u` tokens read by `s_u` requests, one CTA for all of
# them reads `l_u` tokens instead of `s_u * l_u`: it saves `(s_u - 1) * l_u * kv_tok_bytes`. It
# costs every one of its `s_u * group` rows one more partial result.

# %%
sizes, lens = forest.node_size(), forest.node_len()
print(f"{'node':>4} {'l_u':>4} {'s_u':>4} {'KV bytes saved':>15} {'partial bytes':>14}  verdict")
for u in range(1, forest.num_nodes):
    if sizes[u] < 2:
        continue
    saved = (sizes[u] - 1) * lens[u] * kv_tok_bytes
    cost = sizes[u] * group * row_slot_bytes
    print(f"{u:>4} {lens[u]:>4} {sizes[u]:>4} {saved:>15,} {cost:>14,}  "
          f"{'share' if saved > cost else 'do not share'}")

# %%
middle = [u for u in range(1, forest.num_nodes) if sizes[u] >= 2 and lens[u] == 8]
assert len(middle) == 2
for u in middle:
    saved = (sizes[u] - 1) * lens[u] * kv_tok_bytes
    cost = sizes[u] * group * row_slot_bytes
    assert saved == 4 * 1024 and round(cost / 1024, 1) == 7.6
    print(f"node {u}: saves {saved / 1024:.1f} KiB per KV head, costs {cost / 1024:.1f} KiB")

# %% [markdown]
# The root shares plainly. The two 8-token middle nodes are the interesting case: sharing them
# saves 4 KiB per KV head, but costs 7.6 KiB of partial traffic (the cell above checks both).
#
# **Merge or split, edge by edge.** pat's packer (TreeHeuristic, PAT Algorithm 1) walks each tree
# once from the root. At every edge from a node `u` to a child `c` it asks one question: should
# `c`'s requests stay in `u`'s CTA (*split*: each of `c`'s rows pays one more partial result) or
# leave it, with `c`'s own CTA re-reading the `L` tokens accumulated down to `u` (*merge*: pay
# `L * kv_tok_bytes` again, once per CTA that `c`'s rows need)? It merges when
#
# `w * rows_c * row_slot_bytes  >  L * kv_tok_bytes * chunks_c`
#
# where `chunks_c` is how many CTAs `c`'s rows fill (a CTA has at most as many rows as the
# largest feasible tile has, `max_rows`, which the tile solver of tutorial 2 gives for the GPU,
# head_dim and dtype), and `w` weighs a partial result above its bytes. With `w = 1` this is the
# PAT paper's pure byte count. We work that case by hand first; a merge carries `L` down, so a
# child of a merged node counts its parent's tokens too:

# %%
max_rows = TileSelector(head_dim, "float16", "h100").max_rows
print(f"max_rows = {max_rows} (H100, head_dim {head_dim}, fp16)")


def walk(w):
    """The packer's decisions by hand: [(u, c, L, rows_c, weighted partials, re-read, merge)]."""
    out, acc = [], {}
    todo = [(u, int(forest.start[u])) for u in forest.node_children(0)]
    while todo:
        u, a = todo.pop(0)
        L = int(forest.end[u]) - a
        for c in forest.node_children(u):
            rows_c = int(sizes[c]) * group
            chunks = -(-rows_c // max_rows)
            keep, reread = w * rows_c * row_slot_bytes, L * kv_tok_bytes * chunks
            out.append((u, c, L, rows_c, keep, reread, keep > reread))
            todo.append((c, a if keep > reread else int(forest.start[c])))
    return out


def show(rows):
    print(f"{'edge':>8} {'L':>3} {'rows_c':>6} {'w x partials':>13} {'re-read':>8}  decision")
    for u, c, L, rows_c, keep, reread, m in rows:
        print(f"{u:>3} -> {c:<2} {L:>3} {rows_c:>6} {keep:>13,.0f} {reread:>8,}  "
              f"{'merge' if m else 'split'}")


by_hand = walk(1.0)
show(by_hand)
assert [m for *_, m in by_hand] == [False, False, True, True, True, True, True, True]

# %% [markdown]
# So with `w = 1` pat should make **one CTA for the 64-token root** (all six requests) and **one
# CTA per leaf** that also re-reads its parent's 8 tokens: 7 CTAs. Let us ask the library.
# `Planner` runs the whole chain (forest, packer, tiles, long-KV split) and returns a `Plan`; its
# knobs live in a `Tuning`, where `partial_weight` is `w`. We turn the long-KV split off for now
# so that each CTA is one pack (more on the split at the end).

# %%
def ctas_of(plan):
    """(first token, tokens, requests) of every CTA, sorted."""
    return sorted((int(plan.cta_kv_start[c]), int(plan.cta_kv_len[c]),
                   int(plan.cta_req_indptr[c + 1] - plan.cta_req_indptr[c]))
                  for c in range(plan.num_ctas))


def print_plan(plan):
    for c in range(plan.num_ctas):
        reqs = plan.cta_req[plan.cta_req_indptr[c]:plan.cta_req_indptr[c + 1]]
        s, n = int(plan.cta_kv_start[c]), int(plan.cta_kv_len[c])
        print(f"CTA {c}: tokens [{s:>3}, {s + n:>3})  requests {reqs.tolist()}  "
              f"tile m x n = {tuple(int(x) for x in plan.cta_mn()[c])}")


plan_w1 = pat_core.Planner("pat", "h100", pat_core.Tuning(partial_weight=1.0)).plan(
    batch.block_tables, batch.seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size=4,
    split=False)
print_plan(plan_w1)
# the hand calculation: one CTA for the root with all six requests, one per leaf from token 64
assert plan_w1.num_ctas == 7
assert ctas_of(plan_w1) == [(0, 64, 6)] + [(64, 36, 1)] * 6

# %% [markdown]
# **The default weight.** A partial result costs a GPU more than its bytes: the CTA that writes
# it pays a fixed start-up latency (loading its queries, filling its pipeline), and the merge
# reads it back after every CTA has finished. Measured on an H100 over multi-level batches,
# weights above 1 gave shorter decode steps than the pure byte count, and `w = 4` did best of
# the weights tried, so it is the default (`pat_core.packers.PARTIAL_WEIGHT`). On this batch it
# changes the first decision:

# %%
w = pat_core.Tuning().partial_weight
by_default = walk(w)
show(by_default)
assert w == 4.0
assert [m for *_, m in by_default][:2] == [True, True]      # root -> middle nodes: merge now
plan = pat_core.Planner("pat", "h100").plan(
    batch.block_tables, batch.seq_lens, num_qo_heads, num_kv_heads, head_dim, page_size=4,
    split=False)
print_plan(plan)
assert ctas_of(plan) == [(0, 72, 3)] * 2 + [(72, 28, 1)] * 6
extra = sum(n for _, n, _ in ctas_of(plan)) - sum(n for _, n, _ in ctas_of(plan_w1))
print(f"tokens read per KV head: w = 1 {sum(n for _, n, _ in ctas_of(plan_w1))}, "
      f"w = {w:g} {sum(n for _, n, _ in ctas_of(plan))} ({extra:+d})")
assert extra == 32

# %% [markdown]
# Each middle node's three requests now get a CTA that reads the root and the middle node (72
# tokens), and the leaves stay apart: 8 CTAs. The root is read twice (on a GPU the second read
# is mostly served by the L2 cache) and each request still gets two partial results. The walk is
# greedy: it settles the root's edges before it sees that, with `w = 1`, the leaves would have
# taken the middle nodes' tokens anyway. On this toy batch that costs 32 tokens per KV head; on
# the deep trees of the benchmark, where most nodes are short and shared by a few requests, the
# weight pays.
#
# (The `m x n` tile shape is the subject of tutorial 2.)
#
# ## Every packer on the same batch
#
# pat ships five packers, all producing the same `Plan` type:
#
# | packer | rule |
# |---|---|
# | `query` | one request per CTA: the classic query-centric kernel (FlashInfer/vLLM decode) |
# | `node` | one CTA per forest node, never merge downward |
# | `cascade` | `node`'s packing, executed level by level (multi-level cascade inference) |
# | `compute` | a compute-oriented cost model (padded tile area, as FastTree) |
# | `pat` | the memory-centric profit model above |
#
# Below, each CTA is drawn as a coloured bar over the tokens it reads, one bar per request it
# serves; bars of the same colour in one column are the same CTA reading those tokens once.

# %%
def draw_ctas(plan, forest, ax, title):
    """One bar per (CTA, request): x = the CTA's token range, y = the request's sorted row."""
    row_of = np.empty(forest.batch_size, dtype=int)
    row_of[forest.order] = np.arange(forest.batch_size)
    cmap = plt.get_cmap("tab20")
    for c in range(plan.num_ctas):
        s, n = int(plan.cta_kv_start[c]), int(plan.cta_kv_len[c])
        for r in plan.cta_req[plan.cta_req_indptr[c]:plan.cta_req_indptr[c + 1]]:
            ax.add_patch(plt.Rectangle((s, row_of[r] + 0.08), n, 0.84, facecolor=cmap(c % 20),
                                       edgecolor="black", lw=0.5))
    ax.set_xlim(0, int(forest.end.max()))
    ax.set_ylim(forest.batch_size, 0)
    ax.set_yticks([])
    st = plan.stats()
    ax.set_title(f"{title}: {st['num_ctas']} CTAs, {st['kv_tokens']} KV tokens read",
                 fontsize=10)


packers = ["query", "node", "compute", "cascade", "pat"]
assert sorted(packers) == sorted(pat_core.PACKERS)        # the five the library ships
plans = {p: pat_core.Planner(p, "h100").plan(batch.block_tables, batch.seq_lens, num_qo_heads,
                                             num_kv_heads, head_dim, 4, split=False)
         for p in packers}


def packing(pl):
    """The CTAs of a plan as (first token, tokens, requests) triples, sorted."""
    return sorted((int(pl.cta_kv_start[c]), int(pl.cta_kv_len[c]),
                   tuple(sorted(pl.cta_req[pl.cta_req_indptr[c]:pl.cta_req_indptr[c + 1]])))
                  for c in range(pl.num_ctas))


assert packing(plans["node"]) == packing(plans["compute"]) == packing(plans["cascade"])
assert plans["cascade"].serial and not plans["node"].serial   # same CTAs, level by level
fig, axes = plt.subplots(len(packers), 1, figsize=(10, 9), sharex=True)
for ax, p in zip(axes, packers):
    draw_ctas(plans[p], forest, ax, p)
axes[-1].set_xlabel("token position")
fig.tight_layout()
plt.show()

# %% [markdown]
# `node`, `compute` and `cascade` agree on this batch; `cascade` differs in *when* its CTAs run
# (one level after another), which tutorial 4's simulator makes visible. `query` reads the
# 64-token prompt six times; `pat` (default weight) reads it twice, once with each middle node,
# and keeps the leaves apart.
#
# ## Bytes per packer
#
# `Plan.stats()` adds up what a plan moves through HBM over all heads: K/V tokens read, query rows
# read (a request in `k` CTAs is loaded `k` times), fp32 partial results written and read back,
# and the final output written.

# %%
kinds = ["kv_bytes", "q_bytes", "partial_bytes", "out_bytes"]


def bytes_bar(plans, title):
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bottom = np.zeros(len(plans))
    for kind in kinds:
        vals = np.array([pl.stats()[kind] for pl in plans.values()]) / 1024
        ax.bar(list(plans), vals, bottom=bottom, label=kind.replace("_bytes", ""))
        bottom += vals
    for i, tot in enumerate(bottom):
        ax.text(i, tot, f"{tot:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("KiB moved")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plt.show()


bytes_bar(plans, f"{spec}, 8 query / 2 KV heads, head_dim 64, fp16")
for p, pl in plans.items():
    st = pl.stats()
    print(f"{p:>8}: {st['total_bytes']:>8,} bytes  ({st['num_ctas']} CTAs, "
          f"{st['num_slots']} partial slots)")
st_ = {p: pl.stats() for p, pl in plans.items()}
assert st_["node"]["kv_bytes"] == min(s["kv_bytes"] for s in st_.values())
assert st_["node"]["num_slots"] - st_["query"]["num_slots"] == 12
assert st_["pat"]["kv_bytes"] > st_["node"]["kv_bytes"]
st_w1 = plan_w1.stats()
print(f"pat, w=1: {st_w1['total_bytes']:>8,} bytes  ({st_w1['num_ctas']} CTAs, "
      f"{st_w1['num_slots']} partial slots)")
assert st_w1["total_bytes"] < min(s["total_bytes"] for s in st_.values())
assert st_["pat"]["num_slots"] == st_w1["num_slots"] < st_["node"]["num_slots"]

# %% [markdown]
# `node` reads the fewest KV bytes but pays for twelve more partial slots than `query`; `pat`
# spends a few more KV bytes to avoid most of them. With `w = 1` it moves the fewest bytes of
# all; the default weight gives a few of those bytes back on this batch (the greedy choice seen
# above) for the same number of partial slots (the cell checks all of this). On this toy batch the margins
# are small. A realistic batch tells a clearer story: one 1024-token system prompt, four
# 256-token documents, 16 requests with 64 tokens of their own, 32 query heads over 8 KV heads,
# head_dim 128.

# %%
big = build_tree_batch("1,4,16_1024,256,64", page_size=16)
big_plans = {p: pat_core.Planner(p, "h100").plan(big.block_tables, big.seq_lens, 32, 8, 128, 16)
             for p in packers}
bytes_bar(big_plans, "1,4,16_1024,256,64, 32 query / 8 KV heads, head_dim 128, fp16")
q_total = big_plans["query"].stats()["total_bytes"]
for p, pl in big_plans.items():
    print(f"{p:>8}: {pl.stats()['total_bytes'] / 1e6:6.2f} MB  "
          f"({q_total / pl.stats()['total_bytes']:.2f}x less than query)")
big_totals = {p: pl.stats()["total_bytes"] for p, pl in big_plans.items()}
assert big_totals["pat"] == min(big_totals.values())
# a clearer story: pat's saving over query is larger here than on the toy batch
assert q_total / big_totals["pat"] > st_["query"]["total_bytes"] / st_["pat"]["total_bytes"]

# %% [markdown]
# Here every prefix-aware packer finds the same plan (the packers part ways on less regular
# trees; `python -m pat_core demo` shows one), and all of them move several times fewer bytes
# than `query`.

# %% [markdown]
# ## The last step: long-KV split
#
# One more rule runs after packing. A CTA whose KV range is much longer than the others would
# keep one SM busy long after the rest finished. The planner cuts every CTA longer than a
# threshold into parts no longer than it (each part one more partial result to merge). The
# default rule (`split=True`, the same as `split="sm"`) sets the threshold to an SM's fair share
# of the work: all CTAs' tokens times the KV heads, over twice the number of SMs, and never
# below a minimum part length (`pat_core.split.split_threshold`). "Twice" is the default share
# of blocks per SM, and the planner moves it with what would be cut
# (`pat_core.split.auto_split_share`): three when every CTA it would cut is a long private
# request of at most 16 query rows, where a part's partial results are small, and one block per
# SM, never more cut blocks than SMs, where a cut CTA holds more rows, whose partials grow with
# every part; where a model of the forward launch predicts another share clearly faster, the
# planner takes that one (`pat_core.split.choose_split_share`). The big batch below has a cut
# CTA of 64 rows, but there every share falls under the 256-token minimum part, so the
# share-2 plan is the plan at that minimum (the cell checks these numbers). The PAT paper's
# rule, the batch's mean CTA length, is `split="mean"`. The split is on by default; above we
# turned it off to keep the picture one CTA per pack. Below, the threshold of each rule and
# what it does, on the small batch and on the big one, with the 256-token minimum alone (the
# tuning's `merge_min_part` set to `min_part`; the next cell shows what the default adds):

# %%
from pat_core import split as split_rules

gpu = pat_core.get_gpu("h100")
# the shares and sizes the text names
assert (split_rules.DEFAULT_SPLIT_SHARE, split_rules.SHORT_ROWS_SPLIT_SHARE,
        split_rules.MANY_ROWS_SPLIT_SHARE, split_rules.SHORT_ROWS) == (2, 3, 1, 16)
assert pat_core.Tuning().min_part == 256
coarse = pat_core.Tuning(merge_min_part=256)       # parts of at least 256 tokens, always
for name, b, heads, d_ in (("small", batch, (num_qo_heads, num_kv_heads), head_dim),
                           ("big", big, (32, 8), 128)):
    ps = b.page_size if hasattr(b, "page_size") else 4
    off = pat_core.Planner("pat", "h100").plan(b.block_tables, b.seq_lens, *heads, d_, ps,
                                               split=False)
    plans_by_rule = {}
    for rule in ("sm", "mean"):
        thr = split_threshold(off.cta_kv_len, heads[1], gpu.num_sms, rule=rule)
        pl = pat_core.Planner("pat", "h100", coarse).plan(b.block_tables, b.seq_lens, *heads,
                                                          d_, ps, split=rule)
        print(f"{name} batch, split={rule!r}: threshold {thr} tokens; {off.num_ctas} CTAs -> "
              f"{pl.num_ctas}, longest CTA {int(off.cta_kv_len.max())} -> "
              f"{int(pl.cta_kv_len.max())} tokens")
        # every CTA longer than the threshold became ceil(length / threshold) parts
        assert pl.num_ctas - off.num_ctas == sum(-(-int(n) // thr) - 1 for n in off.cta_kv_len)
        plans_by_rule[rule] = pl
    default = pat_core.Planner("pat", "h100", coarse).plan(b.block_tables, b.seq_lens, *heads,
                                                           d_, ps)
    assert np.array_equal(default.cta_kv_len, plans_by_rule["sm"].cta_kv_len)   # split=True
    if name == "big":   # a cut CTA of 64 rows; every share's threshold is the 256-token minimum
        cut = off.cta_kv_len > split_threshold(off.cta_kv_len, heads[1], gpu.num_sms)
        assert off.cta_rows()[cut].tolist() == [64]
        assert {split_threshold(off.cta_kv_len, heads[1], gpu.num_sms, share=s)
                for s in (1.0, *split_rules.CANDIDATE_SHARES)} == {256}
        big_coarse = default

# %% [markdown]
# That minimum keeps each part's partial write small next to its KV, and a plan whose requests
# each fit one CTA needs no merge at all. But a plan that merges anyway (shared nodes, or a cut
# request) pays for the merge whatever the part length, and on a batch this small the GPU is
# mostly idle: there the default cuts again with parts down to
# `pat_core.tuning.MERGE_MIN_PART` = 64 tokens (`pat_core.planner.assemble_plan`; chosen on 35
# small batches measured on an H100, `Tuning`'s docstring has the numbers). The big batch
# merges (96 partial slots for 16 requests), and at the 64-token minimum every share's
# threshold is under 256 tokens, so the 1024-token prefix of 64 rows is cut into more, shorter
# parts:

# %%
assert pat_core.tuning.MERGE_MIN_PART == 64
fine = pat_core.Planner("pat", "h100").plan(big.block_tables, big.seq_lens, 32, 8, 128, 16)
off = pat_core.Planner("pat", "h100").plan(big.block_tables, big.seq_lens, 32, 8, 128, 16,
                                           split=False)
print(f"256-token minimum: {big_coarse.num_ctas} CTAs, {big_coarse.num_slots} partial slots, "
      f"longest {int(big_coarse.cta_kv_len.max())} tokens")
print(f"default (64 where the plan merges): {fine.num_ctas} CTAs, {fine.num_slots} partial "
      f"slots, longest {int(fine.cta_kv_len.max())} tokens")
assert big_coarse.num_slots > big_coarse.batch_size == 16       # it merges
assert max(split_threshold(off.cta_kv_len, 8, gpu.num_sms, share=s, min_part=64)
           for s in (1.0, *split_rules.CANDIDATE_SHARES)) < 256
assert (big_coarse.num_ctas, fine.num_ctas) == (24, 30)
assert int(fine.cta_kv_len.max()) < int(big_coarse.cta_kv_len.max()) == 256

# %% [markdown]
# **Try your own batch.** Change `spec` (more levels, longer or shorter nodes), the head counts
# or `head_dim` above and re-run: watch when the middle nodes start to be shared, and when `pat`
# and `node` become the same plan. A block table from your own server works too: pass its rows
# (lists of page ids) and `seq_lens` to `Planner.plan` or to
# `pat_core.PrefixAttentionWrapper.plan`.
#
# Next: [tutorial 2](02_tiles_and_the_kernel.ipynb) looks inside one CTA.
