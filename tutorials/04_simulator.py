# %% [markdown]
# # 4. Simulating packing decisions without a GPU
#
# **What you will learn**
#
# * how the simulator (`sim`) turns a `Plan` into bytes, SM occupancy, a per-SM timeline and a
#   predicted latency, on a laptop;
# * how to read a per-SM timeline: waves, the forward launches (one per tile shape, chained on
#   one stream), the merge kernel, and idle "bubbles";
# * how the packers compare on several batch shapes;
# * sweeps over shared-prefix length, batch size, tree depth and GQA ratio, and where prefix-aware
#   packing stops paying off.
#
# The simulator's numbers are predictions from a model with a handful of constants per GPU
# (bandwidth, per-block latency, launch overhead...). Each result says whether those constants
# were fitted to measurements on that GPU or are first-principles estimates; treat estimates as
# a guide to *trends*, not as microseconds to quote.

# %%
import os
import tempfile

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Image, display

import pat_core
import sim
import sim.plots
from pat_core.workloads import build_tree_batch

# sim.plots writes image files (shown below with `Image`); the notebook's own figures are drawn
# inline (a plain comment when run as a script)
# %matplotlib inline

# %% [markdown]
# ## One plan, simulated
#
# The running example of the README with a longer system prompt: one 1,024-token system prompt,
# four 256-token documents, 16 requests with 1,024 tokens each of their own; 32 query heads over
# 8 KV heads, head_dim 128, fp16, planned for an H100.  (With the README's 128-token prompt the
# planner gives every request one CTA of its own: re-reading 384 shared tokens, mostly from L2,
# costs less there than a partial result per request and a merge; a longer prompt keeps the
# sharing.)

# %%
HQ, HK, D = 32, 8, 128


def plan_for(spec, packer="pat", heads=(HQ, HK), gpu="h100", **kw):
    b = build_tree_batch(spec, page_size=16)
    return pat_core.Planner(packer, gpu).plan(b.block_tables, b.seq_lens, heads[0], heads[1], D,
                                              16, **kw)


spec = "1,4,16_1024,256,1024"
plan = plan_for(spec)
# the README's batch (128-token prompt): one CTA per request; this one shares
assert plan_for("1,4,16_128,256,1024").one_cta_per_request and not plan.one_cta_per_request
res = sim.simulate(plan)
print(f"constants: {res.constants.source}")
print(f"predicted latency {res.latency_us:.1f} us  (forward {res.forward_ns / 1e3:.1f} us, "
      f"merge kernel {res.merge_ns / 1e3:.1f} us)")
print("bytes by kind (MB):", {k: round(v / 1e6, 2) for k, v in res.bytes.items()})
print(f"idle SM time (bubble): {100 * res.bubble:.1f} %,  padding waste in tiles: "
      f"{100 * res.waste['total']:.1f} %")
for o in res.occupancy:
    print(f"tile {o.m:>3}x{o.n:<3}: {o.blocks:>4} thread blocks, {o.ctas_per_sm} fit per SM "
          f"(limited by {o.limiter}), {o.waves:.2f} waves")

# %% [markdown]
# Two things about that number. It is a **graph-mode** prediction (`timing="graph"`, the
# default): what a serving loop that captures the decode step in a CUDA graph sees, with only
# in-graph gaps between kernels; `timing="eager"` adds the host's cost of each launch, for
# `run()` called from Python. And bytes are split by where they are served: a KV page that
# another running block read shortly before is an **L2 hit**; only HBM bytes compete for DRAM
# bandwidth. The query-centric plan re-reads the shared prefix once per request, and the model
# serves much of that re-reading from L2 (the cell below computes both for this batch).

# %%
eager = sim.simulate(plan, timing="eager")
q_res = sim.simulate(plan_for(spec, "query"))
print(f"pat: graph {res.latency_us:.1f} us, eager {eager.latency_us:.1f} us")
for name, r in (("pat", res), ("query", q_res)):
    print(f"{name:>5}: HBM {r.bytes_level['hbm'] / 1e6:.1f} MB, L2 hits "
          f"{r.bytes_level['l2'] / 1e6:.1f} MB of {r.bytes['total'] / 1e6:.1f} MB")
# the statements above: eager adds launch cost; query's re-reads (its bytes beyond pat's) are
# largely L2 hits, pat's L2 hits a few percent of its bytes
assert eager.latency_us > res.latency_us
assert q_res.bytes_level["l2"] > 0.8 * (q_res.bytes["total"] - res.bytes["total"])
assert res.bytes_level["l2"] < 0.05 * res.bytes["total"]
assert q_res.bytes_level["l2"] + q_res.bytes_level["hbm"] == q_res.bytes["total"]

# %% [markdown]
# Two rules decide which reads are hits, and when they move. A page is a hit when another block
# read it while it was still in L2, and the model replays the reads the way the GPU runs them:
# every resident block reads its next page in turn, so a prefix that many blocks read together
# comes from HBM once however long it is. And a request's shared prefix comes before its own
# pages, so a block streams those hits **first**, except the few KV tiles its pipeline has in
# flight together with the misses behind them (the "lead" below); blocks that start together
# therefore read the shared part from L2 and then meet at the DRAM cap. From L2 is not the same
# as at L2 speed: while DRAM is the bottleneck, hits wait in the same queues as the misses, so a
# block streaming hits moves no faster than the blocks streaming from DRAM (they just cost DRAM
# nothing). Two more rules of the timeline come from clocking every block of a step on an
# H100: blocks share the bandwidth in proportion to the loads each keeps
# in flight (a 16x32 block with one 32-token tile in flight gets a quarter of what a 16x64 block
# with two 64-token tiles in flight gets), and a tile whose kernel raises its shared-memory
# limit (above 40 KB) never shares an SM with one that does not. The cell below counts the
# leading bytes of each plan: for query, a large share of its hits (its 1,280-token prefix re-read
# by every request); pat's few hits (prefix pages two of its CTAs both read, a few per block,
# and the merge kernel's partial reads) stay within what a block has in flight, so none of them
# lead; then it shows the weights and classes of a deep tree's blocks.

# %%
from sim.model import prepare

for name, p in (("pat", plan), ("query", plan_for(spec, "query"))):
    wl = prepare(p)
    lead, hits = wl.blk_lead.sum(), wl.blk_l2.sum()
    print(f"{name:>5}: L2 hits {hits / 1e6:.1f} MB, of which streamed first {lead / 1e6:.1f} MB "
          f"({100 * lead / hits:.0f} %)")
    assert np.all(wl.blk_lead <= wl.blk_l2) and np.all(wl.blk_l2 <= wl.blk_bytes)
    if name == "query":   # the statements above: query's re-read prefix leads, pat's hits do not
        assert lead > 0.25 * hits
    else:
        assert lead == 0 and hits > 0

# the other two rules, on a deep tree of 32-token nodes at 16:8 (16x32 leaves of one tile beside
# 16x64 blocks): each block's bandwidth weight and each tile's shared-memory class
deep_plan = plan_for("1,2,4,8,16,32,64,128_32,32,32,32,32,32,32,32", heads=(16, 8))
deep = prepare(deep_plan)
fwd = deep.blk_tiles > 0
tiles = [tuple(t) for t in deep_plan.tile_configs.tolist()]
for k, (m, n) in enumerate(tiles):
    sel = fwd & (deep.blk_cfg == k)
    print(f"{m}x{n}: shared memory {deep.need[k, 0] // 1024} KB, class {deep.cfg_class[k]}, "
          f"weights {sorted(set(np.round(deep.blk_weight[sel], 2).tolist()))}")
leaf, root = tiles.index((16, 32)), tiles.index((16, 64))
# the statements above: a one-tile 16x32 leaf weighs a quarter of a 16x64 block with two
# 64-token tiles in flight; 16x32 and 16x64 sit on either side of the 40 KB line
one_tile = fwd & (deep.blk_cfg == leaf) & (deep.blk_tiles == 1)
assert one_tile.any() and np.all(deep.blk_weight[one_tile] == 0.25)
assert deep.blk_weight[fwd & (deep.blk_cfg == root)].max() == 1.0
assert deep.need[leaf, 0] <= 40 * 1024 < deep.need[root, 0]
assert deep.cfg_class[leaf] != deep.cfg_class[root]

# %% [markdown]
# A few definitions the printout uses (the cell below computes each for this plan):
#
# * a **thread block** is one CTA for one KV head (the kernel runs `num_kv_heads` copies of
#   each Plan CTA), so the plan's CTAs times its KV heads give the blocks;
# * a **wave** is one SM-full round of blocks: `blocks / (SMs x blocks that fit per SM)`, per
#   tile shape;
# * the **bubble** is the share of SM time, between the first block starting and the last one
#   ending, in which an SM has nothing to run.

# %%
n_blocks = sum(o.blocks for o in res.occupancy)
print(f"{plan.num_ctas} CTAs x {HK} KV heads = {plan.num_ctas * HK} thread blocks")
assert n_blocks == plan.num_ctas * HK == res.num_blocks - res.timeline.blocks_of("merge").sum()
for o in res.occupancy:
    waves = o.blocks / (res.gpu.num_sms * o.ctas_per_sm)
    print(f"tile {o.m}x{o.n}: {o.blocks} blocks / ({res.gpu.num_sms} SMs x {o.ctas_per_sm} "
          f"per SM) = {waves:.2f} waves")
    assert abs(waves - o.waves) < 1e-9

# %% [markdown]
# ## The per-SM timeline
#
# `sim.plots.gantt` draws every block as a bar on the SM it ran on, coloured by launch; the grey
# bars are the merge kernel. The simulator lays a plan out as the CUDA backend runs every plan
# (tutorial 5): one forward launch per tile shape the plan uses, tallest tile first, all on the
# caller's stream, then the merge for the requests of several partials. On Hopper each forward
# launch is a programmatic dependent of the one before it: its blocks are placed as soon as the
# previous launch's blocks all are, so the launches overlap as SMs free up. We compare pat with
# the query-centric baseline. The running example plans a single tile shape, so this section
# takes a batch whose pat plan has three: 4 documents of 256 tokens under a 1,024-token prompt,
# 64 requests with 64 tokens each of their own.

# %%
outdir = tempfile.mkdtemp(prefix="pat_tutorial_")
spec2 = "1,4,64_1024,256,64"
plan2 = plan_for(spec2)
runs = {
    "pat": sim.simulate(plan2),
    "query": sim.simulate(plan_for(spec2, "query")),
}
for name, r in runs.items():
    path = sim.plots.gantt(r, os.path.join(outdir, f"gantt_{len(os.listdir(outdir))}.png"),
                           title=f"{name}: {r.latency_us:.1f} us predicted, bubble "
                                 f"{100 * r.bubble:.0f} %, {r.bytes['total'] / 1e6:.1f} MB")
    display(Image(filename=path))

# %% [markdown]
# What to look for (the cell below prints the numbers behind each point and checks them):
#
# * **query** reads the 1,280 shared tokens (prompt and document) once per request, so its
#   blocks are longer; it has one tile shape, so one forward launch, and every request has one
#   CTA that writes its output itself: nothing to merge. Its merge kernel still runs, briefly,
#   and moves nothing: the launch's 512 work items (64 CTAs x 8 KV heads) are more than the
#   blocks an H100 holds at once, so blocks draw a second item, and the merge resets the work
#   counters (`pat_core.launch.merge_needed`).
# * **pat** has one launch per tile shape, tallest first: the launches are issued one after
#   another (dashed lines), a launch's blocks start only once it is issued and the launch before
#   it is placed, and the launches overlap as soon as SMs free up. The merge kernel at the end is
#   the price of splitting requests over several CTAs.
# * on a GPU without programmatic dependent launch (an A100) the same launches run one after
#   another in stream order: each waits for the one before it to finish.

# %%
r_pat, r_q = runs["pat"], runs["query"]
q_plan = plan_for(spec2, "query")
print(f"query: {len(q_plan.stats()['tiles'])} tile shape; pat: tiles {plan2.stats()['tiles']}")
assert len(q_plan.stats()["tiles"]) == 1 and len(plan2.stats()["tiles"]) == 3
assert [ln.kind for ln in r_q.timeline.launches] == ["forward", "merge"]
assert q_plan.num_slots == q_plan.batch_size and r_q.bytes["partial_read"] == 0
items = q_plan.num_ctas * HK
print(f"query: {items} work items for {r_q.occupancy[0].ctas_per_sm * r_q.gpu.num_sms} "
      f"resident blocks; its merge only resets the counters")
assert items == 64 * 8 == 512 and items > r_q.occupancy[0].ctas_per_sm * r_q.gpu.num_sms
tl = r_pat.timeline
spans = []
for ln in tl.launches:
    sel = slice(ln.begin, ln.end)
    spans.append((ln.name, ln.issue_ns / 1e3, float(tl.block_start[sel].min()) / 1e3,
                  float(tl.block_end[sel].max()) / 1e3))
    print(f"  {ln.name:<14} issued at {spans[-1][1]:6.1f} us, blocks run "
          f"{spans[-1][2]:6.1f} - {spans[-1][3]:6.1f} us")
    assert spans[-1][2] >= spans[-1][1]                 # nothing runs before it is issued
fwd = [s for s in spans if not s[0].startswith("merge")]
rows = [int(name.split()[1].split("x")[0]) for name, *_ in fwd]
assert rows == sorted(rows, reverse=True)               # the tallest tile first
overlap = any(a[2] < b[3] and b[2] < a[3] for i, a in enumerate(fwd) for b in fwd[i + 1:])
print(f"forward launches overlap in time: {overlap}; predicted {r_pat.latency_us:.1f} us")
assert overlap and spans[-1][0] == "merge" and spans[-1][2] >= max(s[3] for s in fwd)
assert r_q.bytes["kv"] > r_pat.bytes["kv"]
# the same batch planned for an A100: its forward launches one after another
a100 = sim.simulate(plan_for(spec2, gpu="a100"))
fa = [ln for ln in a100.timeline.launches if ln.kind == "forward"]
ta = a100.timeline
assert len(fa) >= 2 and all(ta.block_start[b.begin:b.end].min() >= ta.block_end[a.begin:a.end].max()
                            for a, b in zip(fa, fa[1:]))
print(f"A100: {len(fa)} forward launches, none overlapping the one before it")
b2 = build_tree_batch(spec2, page_size=16)          # 64 requests, 1,280 shared tokens each
assert b2.batch_size == 64 and set(np.asarray(b2.seq_lens).tolist()) == {1024 + 256 + 64}

# %% [markdown]
# ## Several trees, every packer
#
# The shapes from the PAT paper's evaluation cover one big shared document, a deep
# few-shot/tool tree, and a batch with no sharing at all (the last one: every packer makes the
# same plan there, one CTA per request that writes its own output, so they tie; the cell checks
# it).

# %%
trees = ["1,16_2048,128", "1,4,64_256,1024,64", "1,2,8,128_512,128,256,32", "128_2048"]
packers = ["query", "node", "cascade", "compute", "pat"]
lat = {t: {p: sim.simulate(plan_for(t, p)).latency_us for p in packers} for t in trees}

fig, ax = plt.subplots(figsize=(10, 3.8))
w = 0.8 / len(packers)
for i, p in enumerate(packers):
    speed = [lat[t]["query"] / lat[t][p] for t in trees]
    ax.bar(np.arange(len(trees)) + (i - (len(packers) - 1) / 2) * w, speed, width=w, label=p)
ax.axhline(1.0, color="black", lw=0.8)
ax.set_xticks(range(len(trees)), trees, fontsize=8)
ax.set_ylabel("predicted speed-up over query")
ax.set_title(f"simulated H100, {HQ}:{HK} heads, head_dim {D} ({res.constants.source})",
             fontsize=10)
ax.legend(fontsize=8, ncol=len(packers))
fig.tight_layout()
plt.show()
for t in trees:
    print(f"{t:<28}" + "  ".join(f"{p} {lat[t][p]:7.1f} us" for p in packers))
assert all(abs(lat["128_2048"][p] - lat["128_2048"]["query"]) < 1e-6 for p in packers)

# %% [markdown]
# ## Sweeps: when does sharing pay?
#
# The base batch: `batch` requests sharing a prefix of `prefix` tokens (split over `depth - 1`
# shared levels, each level doubling the node count), each request with 128 tokens of its own.
# We vary one knob at a time and compare pat with query.

# %%
def tree(batch=64, prefix=1024, suffix=128, depth=2):
    """Tree spec of the sweeps: depth - 1 shared levels (1, 2, 4, ... nodes) over `prefix`
    tokens, then `batch` leaves of `suffix` tokens; depth 1 means no sharing."""
    if depth == 1:
        return f"{batch}_{prefix + suffix}"
    levels = depth - 1
    counts = [min(2 ** i, batch) for i in range(levels)] + [batch]
    lens = [prefix // levels] * levels + [suffix]
    return ",".join(map(str, counts)) + "_" + ",".join(map(str, lens))


def predict(spec, packer, heads=(HQ, HK)):
    return sim.simulate(plan_for(spec, packer, heads)).latency_us


sweeps = {
    "shared prefix tokens": ([0, 32, 128, 512, 2048, 8192],
                             lambda v: (tree(prefix=v) if v else tree(depth=1, prefix=0),
                                        (HQ, HK))),
    "batch size": ([1, 2, 4, 16, 64, 256], lambda v: (tree(batch=v), (HQ, HK))),
    "tree depth (levels)": ([1, 2, 3, 4, 6], lambda v: (tree(depth=v), (HQ, HK))),
    "GQA ratio (query heads per KV head)": ([1, 2, 4, 8, 16], lambda v: (tree(), (8 * v, 8))),
}
fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
sweep_results = {}
for ax, (knob, (values, make)) in zip(axes, sweeps.items()):
    rows = []
    for v in values:
        spec_v, heads = make(v)
        rows.append((predict(spec_v, "query", heads), predict(spec_v, "pat", heads)))
    q_us, p_us = np.array(rows).T
    sweep_results[knob] = (values, q_us, p_us)
    ax.plot(range(len(values)), q_us, marker="o", label="query")
    ax.plot(range(len(values)), p_us, marker="o", label="pat")
    for i, (a, b) in enumerate(zip(q_us, p_us)):
        ax.annotate(f"{a / b:.1f}x", (i, b), textcoords="offset points", xytext=(0, -12),
                    ha="center", fontsize=7)
    ax.set_xticks(range(len(values)), [str(v) for v in values])
    ax.set_yscale("log")
    ax.set_xlabel(knob, fontsize=9)
    ax.grid(alpha=0.3)
axes[0].set_ylabel("predicted latency (us)")
axes[0].legend(fontsize=8)
fig.suptitle("one knob at a time (base: 64 requests, 1,024 shared + 128 own tokens, depth 2, "
             "32:8 heads); labels: speed-up of pat over query", fontsize=10)
fig.tight_layout()
plt.show()

# %% [markdown]
# Where the gain disappears:
#
# * **No or short shared prefix.** With nothing shared there is nothing to save, and pat's plan
#   is the query plan. With a few dozen shared tokens the saving is tiny, and the plan's fixed
#   costs (an extra kernel launch for the shared CTAs, more partial results to merge) can make
#   pat *slower* than query; we take that case apart below.
# * **Tiny batches.** One or two requests share with no one (or one other); the savings are a
#   fraction of a small batch that does not fill the GPU anyway.
# * **Depth** matters little once the prefix is shared at all: the prefix bytes are read once
#   either way, deeper trees only add nodes and partials.
# * **GQA** raises the *rows* per request: each shared-prefix CTA fills its tile with fewer
#   requests, so a prefix is re-read once per CTA-full of requests, and the saving shrinks.
#
# The last picture puts the two strongest knobs together: predicted speed-up of pat over query
# for every combination of batch size and shared-prefix length.

# %%
batches = [1, 2, 4, 8, 16, 32, 64, 128]
prefixes = [16, 64, 256, 1024, 4096]
grid = np.array([[predict(tree(batch=b, prefix=p), "query") / predict(tree(batch=b, prefix=p),
                                                                      "pat")
                  for b in batches] for p in prefixes])
fig, ax = plt.subplots(figsize=(8, 3.8))
im = ax.imshow(grid, cmap="RdYlGn", norm=matplotlib.colors.LogNorm(vmin=0.5, vmax=8),
               aspect="auto")
for i in range(len(prefixes)):
    for j in range(len(batches)):
        ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
ax.set_xticks(range(len(batches)), [str(b) for b in batches])
ax.set_yticks(range(len(prefixes)), [str(p) for p in prefixes])
ax.set_xlabel("requests sharing the prefix")
ax.set_ylabel("shared prefix tokens")
ax.set_title("predicted speed-up of pat over query (each request adds 128 own tokens)",
             fontsize=10)
fig.colorbar(im, ax=ax)
fig.tight_layout()
plt.show()
print(f"smallest predicted speed-up: {grid.min():.3f}x, largest: {grid.max():.2f}x")
ib, jb = np.unravel_index(np.argmax(grid), grid.shape)
print(f"largest at {batches[jb]} requests sharing {prefixes[ib]} tokens")
# the statements below: the largest gain is at the longest prefix and the largest batch of the
# grid; at the shortest prefix pat's plan is query's (speed-up exactly 1); the next one, 64
# tokens, is where pat can lose
assert (ib, jb) == (len(prefixes) - 1, len(batches) - 1)
assert np.all(grid[0] == 1.0)
assert grid.min() < 1.0 and np.unravel_index(np.argmin(grid), grid.shape)[0] == 1

# %% [markdown]
# The gain is largest where many requests share a long prefix (the bottom-right corner),
# roughly as the bytes the shared prefix would have cost (`(requests - 1) x prefix`) compare
# with the bytes every request reads anyway. In the top row, a 16-token prefix, the profit model
# does not share at all: every request's CTA re-reads the prefix, which is exactly the query
# plan. The second row, 64 tokens, is where pat shares and stops paying off at small batches
# (the cell checks all three). Let us take the worst cell apart: what does each plan move, and
# what changes without the long-KV split (tutorial 1's last step)?

# %%
i, j = np.unravel_index(np.argmin(grid), grid.shape)
worst = tree(batch=batches[j], prefix=prefixes[i])
print(f"worst cell: {worst} ({batches[j]} requests, {prefixes[i]} shared tokens)")
cell = {}
for name, pl in [("query", plan_for(worst, "query")), ("pat", plan_for(worst, "pat")),
                 ("pat, no long-KV split", plan_for(worst, "pat", split=False))]:
    r = sim.simulate(pl)
    st = pl.stats()
    cell[name] = (pl, st, r)
    print(f"{name:<22} {st['num_ctas']:>4} CTAs  {len(st['tiles'])} forward launches  "
          f"KV {st['kv_bytes'] / 1e6:5.2f} MB  partials {st['partial_bytes'] / 1e6:5.2f} MB  "
          f"total {st['total_bytes'] / 1e6:5.2f} MB  -> {r.latency_us:6.2f} us")
(qp, qs, qr), (pp, ps_, pr), (np_, ns, nr) = cell.values()
split_changes = not np.array_equal(pp.cta_kv_len, np_.cta_kv_len)
print("the default long-KV split changes this plan:", split_changes)
# the statements below
assert pr.latency_us > qr.latency_us and len(ps_["tiles"]) > len(qs["tiles"])
assert ps_["partial_bytes"] > qs["partial_bytes"]

# %% [markdown]
# The profit model (tutorial 1) decides to share a node by comparing bytes, one edge at a time.
# Here pat's plan is predicted slower than query's, and the printout shows what the byte count
# leaves out: pat's plan has more tile shapes than query's, each one more forward launch with a
# fixed cost (large next to a step this short), and it writes and reads back more partial
# results. The last line says whether the long-KV split (tutorial 1's last step, default rule)
# had any part in it. For such batches the simple rule "use the query plan when the shared bytes
# are small" would do better; the simulator is the place to find that threshold for your own
# traffic.
#
# `sim.choose_packer` does that per batch: it plans with `pat` and with `query`, simulates both,
# and keeps `pat` unless `query` is predicted faster by more than 2% (a margin for the
# model's error, `sim.choose.DEFAULT_MARGIN`). The cell asks it about the worst cell above.

# %%
b_worst = build_tree_batch(worst, page_size=16)
choice = sim.choose_packer(b_worst.block_tables, b_worst.seq_lens, HQ, HK, D, 16)
print(f"{worst}: predicted {choice.predicted_us} -> run the {choice.packer!r} packer")
assert choice.packer == "query" and choice.plan.num_groups == qp.num_groups
assert sim.choose.DEFAULT_MARGIN == 0.02                                       # "2%"

# %% [markdown]
#
# **Try your own batch.** The simulator takes any `Plan`, so a block table from your own server
# works the same way:
#
# ```python
# plan = pat_core.Planner("pat", "h100").plan(block_tables, seq_lens, 32, 8, 128, page_size)
# print(sim.simulate(plan).summary_row())
# ```
#
# From a shell, `python -m sim compare --tree 1,4,16_128,256,1024 --heads 32:8` prints the same
# comparison for every method, and `python -m sim timeline ... --out pat.png` draws the timeline.
#
# Next: [tutorial 5](05_on_a_gpu.ipynb) runs the kernels, or reads the measurements of a run.
