# %% [markdown]
# # 4. Simulating packing decisions without a GPU
#
# **What you will learn**
#
# * how the simulator (`sim`) turns a `Plan` into bytes, SM occupancy, a per-SM timeline and a
#   predicted latency, on a laptop;
# * how to read a per-SM timeline: waves, concurrent tile groups on separate streams, the merge
#   kernel, and idle "bubbles";
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

# sim.plots writes image files and selects Matplotlib's file-only backend when imported; give
# this notebook its inline figures back (a plain comment when run as a script)
# %matplotlib inline

# %% [markdown]
# ## One plan, simulated
#
# The running example of the README: one 128-token system prompt, four 256-token documents, 16
# requests with 1,024 tokens each of their own; 32 query heads over 8 KV heads, head_dim 128,
# fp16, planned for an H100.

# %%
HQ, HK, D = 32, 8, 128


def plan_for(spec, packer="pat", heads=(HQ, HK), gpu="h100", **kw):
    b = build_tree_batch(spec, page_size=16)
    return pat_core.Planner(packer, gpu).plan(b.block_tables, b.seq_lens, heads[0], heads[1], D,
                                              16, **kw)


spec = "1,4,16_128,256,1024"
plan = plan_for(spec)
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
# A few definitions the printout uses:
#
# * a **thread block** is one CTA for one KV head (the kernel launches `num_kv_heads` copies of
#   each Plan CTA), so 37 CTAs x 8 KV heads = 296 blocks;
# * a **wave** is one SM-full round of blocks: with 132 SMs holding one 16x128 block each, 256
#   such blocks need about two rounds;
# * the **bubble** is the share of SM time, between the first block starting and the last one
#   ending, in which an SM has nothing to run.
#
# ## The per-SM timeline
#
# `sim.plots.gantt` draws every block as a bar on the SM it ran on, coloured by launch: each tile
# group is its own kernel launch on its own stream, the grey bars are the merge kernel. We
# compare pat with the query-centric baseline and with pat's own plan launched one group at a
# time (`serial=True`, the way a cascade runs its levels).

# %%
outdir = tempfile.mkdtemp(prefix="pat_tutorial_")
runs = {
    "pat": sim.simulate(plan),
    "pat, groups launched serially": sim.simulate(plan, serial=True),
    "query": sim.simulate(plan_for(spec, "query")),
}
for name, r in runs.items():
    path = sim.plots.gantt(r, os.path.join(outdir, f"gantt_{len(os.listdir(outdir))}.png"),
                           title=f"{name}: {r.latency_us:.1f} us predicted, bubble "
                                 f"{100 * r.bubble:.0f} %, {r.bytes['total'] / 1e6:.1f} MB")
    display(Image(filename=path))

# %% [markdown]
# What to look for:
#
# * **query** reads the 384 shared tokens 16 times over, so its blocks are longer; with one
#   request per CTA it also has the fewest blocks, so most SMs run a single long block.
# * **pat** runs three tile groups at once on separate streams: the long per-request CTAs, and the
#   short shared-prefix CTAs that fill SMs the long ones leave free. The merge kernel at the end
#   is the price of splitting each request over several CTAs.
# * launching the same groups **serially** leaves SMs idle at the end of each launch (a tail
#   where a few blocks finish while the rest of the GPU waits) and pays each launch's overhead
#   in turn.
#
# ## Several trees, every packer
#
# The shapes from the PAT paper's evaluation cover one big shared document, a deep
# few-shot/tool tree, and a batch with no sharing at all (the last one: every packer should tie
# with `query` there, not lose).

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

# %% [markdown]
# The gain grows with both knobs, roughly as the bytes the shared prefix would have cost
# (`(requests - 1) x prefix`) compare with the bytes every request reads anyway. The top rows
# are where pat stops paying off. Let us take the worst cell apart: what does each plan move,
# and what changes without the long-KV split (tutorial 1's last step)?

# %%
i, j = np.unravel_index(np.argmin(grid), grid.shape)
worst = tree(batch=batches[j], prefix=prefixes[i])
print(f"worst cell: {worst} ({batches[j]} requests, {prefixes[i]} shared tokens)")
for name, pl in [("query", plan_for(worst, "query")), ("pat", plan_for(worst, "pat")),
                 ("pat, no long-KV split", plan_for(worst, "pat", split=False))]:
    r = sim.simulate(pl)
    st = pl.stats()
    print(f"{name:<22} {st['num_ctas']:>4} CTAs  {len(pl.tile_configs)} tile groups  "
          f"KV {st['kv_bytes'] / 1e6:5.2f} MB  partials {st['partial_bytes'] / 1e6:5.2f} MB  "
          f"total {st['total_bytes'] / 1e6:5.2f} MB  -> {r.latency_us:6.2f} us")

# %% [markdown]
# The profit model (tutorial 1) decides to share a node by comparing bytes, one edge at a time.
# Two things it does not see show up here: each extra tile group is one more kernel launch
# (microseconds of fixed cost when the whole step takes ten), and the long-KV split that runs
# after packing cuts every CTA longer than the batch's mean; a tiny shared-prefix CTA pulls that
# mean down, so the requests' own ranges get cut too, each cut adding partial results. For such
# batches the simple rule "use the query plan when the shared bytes are small" would do better;
# the simulator is the place to find that threshold for your own traffic.
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
