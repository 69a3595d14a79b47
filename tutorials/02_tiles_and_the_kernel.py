# %% [markdown]
# # 2. Tiles and the multi-tile kernel
#
# **What you will learn**
#
# * what a *tile* `(m, n)` is: `m` query rows by `n` KV tokens, the piece of work one CTA does
#   per step;
# * the three hardware limits that decide which tiles a GPU can run well (shared memory,
#   registers, memory bandwidth in flight), computed for an H100 and an A100 with
#   `pat_core.tiles.check_tile` and `feasible_tiles`;
# * how `TileSelector` gives every CTA its own tile, and why pat compiles several kernels
#   instead of one;
# * one CTA walked tile by tile on the CPU executor (`pat_core.executor.trace_cta`), with the
#   online-softmax state after each tile;
# * how the CUDA kernel overlaps loading the next tiles with computing the current one
#   (a `cp.async` ring of shared-memory buffers), next to excerpts of the kernel source;
# * how an FP8 cache's bytes reach the tensor cores without a widening pass: fragment layouts
#   modelled lane by lane, and why the kernel permutes Q's columns instead of K's bytes.
#
# Tutorial 1 (CTAs and packers) is assumed. No GPU is needed. Every number in the text below is
# computed and checked (`assert`) in the cell next to it, from the package's own data: the
# compile rules in `pat_core.cuda_compile`, the compiler's resource report
# `pat_core/data/kernel_resources.json` and the tile solver.

# %%
import json
import math

import matplotlib.pyplot as plt
import numpy as np

import pat_core
from pat_core import cuda_compile
from pat_core.executor import execute_partials, trace_cta
from pat_core.tiles import M_CANDIDATES, N_CANDIDATES, TileSelector, check_tile, feasible_tiles
from pat_core.workloads import build_tree_batch, random_kv_cache

resources = json.loads(cuda_compile.resources_path().read_text())   # the compiler's report

# %% [markdown]
# ## What a tile is
#
# A CTA from tutorial 1 holds `rows = requests x group` query rows and a range of `kv_len`
# cached tokens. The kernel does not swallow that range at once: it walks it in steps of `n`
# tokens. At each step it copies `n` tokens of K and V from HBM into the SM's shared memory and
# multiplies them with all of its query rows, padded up to `m` rows, on the tensor cores. The
# pair `(m, n)` is the **tile**; each tile shape is a separately compiled kernel.
#
# Why not one tile for everything? Because pat's CTAs are very different from one another. The
# CTA for a shared system prompt may hold 48 query rows and 2,000 tokens; the CTA for one
# request's own suffix holds 4 rows and 30 tokens. A 64-row tile would leave 60 of 64 rows idle
# in the second; a 128-token KV step would leave 98 of 128 columns idle in its last step. A
# *multi-tile* kernel picks the shape per CTA.
#
# ## The limits, on one GPU
#
# The hardware description the solver uses:

# %%
h100 = pat_core.get_gpu("h100")
print(f"{h100.name}: {h100.num_sms} SMs, {h100.smem_per_sm // 1024} KiB shared memory per SM "
      f"({h100.smem_per_block // 1024} KiB max per CTA), {h100.regs_per_sm} registers per SM, "
      f"{h100.hbm_bandwidth:.0f} GB/s HBM, ~{h100.mem_latency_ns:.0f} ns memory latency")

# %% [markdown]
# **1. Shared memory.** A CTA keeps its query tile (`m x d` elements) and `stages` copies of a
# K tile and a V tile (`n x d` each) in shared memory, a ring the loads cycle through. How many
# stages a variant gets is a compile rule (`cuda_compile.FwdVariant.make`), so we ask it rather
# than assume a number. With fp16 (`b = 2` bytes), `d = 128`, `m = 64`, `n = 128`:

# %%
d, b = 128, 2
m, n = 64, 128
variant = cuda_compile.FwdVariant.make(m, n, d, "float16")
stages = variant.stages
smem = m * d * b + 2 * stages * n * d * b
print(f"variant {variant.key}: {stages} stages, {variant.warps} warps")
print(f"Q tile {m * d * b:,} B + {stages} stages x (K + V) {2 * stages * n * d * b:,} B "
      f"= {smem:,} B  (limit {h100.smem_per_block:,} B per CTA)")
report = resources["variants"][variant.key]["sm_90"]
reported = report["smem_static"] + report["smem_dynamic"]
chk = check_tile(m, n, d, "float16", "h100")
print(f"the compiler's report: {report['smem_dynamic']:,} B dynamic + {report['smem_static']} B "
      f"static = {reported:,} B; the tile solver uses {chk.resources.smem:,} B "
      f"(source: {chk.resources.source})")
assert smem == report["smem_dynamic"] and 0 < report["smem_static"] <= 256
assert reported == chk.resources.smem and chk.resources.source == "nvcc"
assert reported <= h100.smem_per_block

# %% [markdown]
# The formula gives the dynamic shared memory, the ring and the query tile, to the byte (the
# cell asserts it). The compiler reports a few bytes more, static shared memory the kernel
# declares itself (the indices of the next work items its block draws, shared by its threads),
# and the number the solver uses is the report's total. That is why the solver reads the report
# rather than the formula: a kernel may reserve shared memory the formula does not know about.
#
# **2. Registers.** Each thread holds its share of the fp32 output accumulator and of the score
# tile in registers. The numbers come from the compiler's resource report, stored with the
# package, not from a guess; with no report the solver falls back to an estimate and says so.
# Registers and shared memory together decide how many CTAs can sit on one SM at once, `C`.
#
# **3. Bandwidth in flight.** HBM answers a request only after roughly `L` nanoseconds (the
# latency printed above). To keep the memory system busy, the GPU needs enough bytes requested
# and not yet delivered to cover that latency: by Little's law, `L x B` bytes in flight (`B` the
# bandwidth). With `S` SMs each holding `C` CTAs, and each CTA keeping `stages - 1` tiles of K
# *and* V in flight while it computes on one (`n` tokens of `d` elements of `b` bytes each):
#
# `n >= n_min = ceil(L * B / (S * C * (stages - 1) * 2 * d * b))`
#
# Below, that formula by hand for a few shapes next to what the solver computes.

# %%
for m, n in [(16, 64), (64, 32), (64, 128), (128, 16)]:
    chk = check_tile(m, n, d, "float16", "h100")
    if chk.resources is None:
        print(f"(m={m:>3}, n={n:>3}): no compiled variant")
        continue
    C, st = chk.ctas_per_sm, chk.resources.stages
    n_min = math.ceil(h100.mem_latency_ns * h100.bytes_per_ns
                      / (h100.num_sms * max(C, 1) * (st - 1) * 2 * d * b))
    print(f"(m={m:>3}, n={n:>3}): C = {C} CTAs/SM, {st} stages -> n_min = "
          f"ceil({h100.mem_latency_ns:.0f} * {h100.bytes_per_ns:.0f} / ({h100.num_sms} * {C} * "
          f"{st - 1} * 2 * {d} * {b})) = {n_min}; solver: n_min {chk.n_min}, "
          f"feasible {chk.feasible}, violated {chk.violated}")
    assert n_min == chk.n_min
    assert ("bandwidth" in chk.violated) == (n < n_min)

# %% [markdown]
# **4.** `m` and `n` are powers of two, at least 16 (the tensor-core instruction works on 16-row
# blocks).
#
# ## The feasible set
#
# `check_tile` applies all four rules to one shape; `feasible_tiles` keeps the shapes that pass.
# Below: every candidate on two GPUs and two head sizes. Green cells are feasible; the number is
# `C`, the CTAs that fit on one SM; red cells name the rule that fails.

# %%
def draw_feasible(ax, gpu, head_dim, dtype="float16"):
    grid = np.zeros((len(M_CANDIDATES), len(N_CANDIDATES)))
    for i, m in enumerate(M_CANDIDATES):
        for j, n in enumerate(N_CANDIDATES):
            chk = check_tile(m, n, head_dim, dtype, gpu)
            grid[i, j] = 1.0 if chk.feasible else 0.0
            label = f"C={chk.ctas_per_sm}" if chk.feasible else "\n".join(chk.violated)
            ax.text(j, i, label, ha="center", va="center", fontsize=8)
    ax.imshow(grid, cmap="RdYlGn", vmin=-0.3, vmax=1.3)
    ax.set_xticks(range(len(N_CANDIDATES)), [str(x) for x in N_CANDIDATES])
    ax.set_yticks(range(len(M_CANDIDATES)), [str(x) for x in M_CANDIDATES])
    ax.set_xlabel("n (KV tokens per step)")
    ax.set_ylabel("m (query rows)")
    ax.set_title(f"{pat_core.get_gpu(gpu).name.split('-')[0]}, head_dim {head_dim}", fontsize=10)


# rule 4: the candidate sizes are powers of two, at least 16
assert all(x >= 16 and x & (x - 1) == 0 for x in M_CANDIDATES + N_CANDIDATES)
fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
for ax, (gpu, hd) in zip(axes, [("h100", 64), ("h100", 128), ("a100", 64), ("a100", 128)]):
    draw_feasible(ax, gpu, hd)
fig.tight_layout()
plt.show()
for gpu in ("h100", "a100"):
    print(gpu, "head_dim 128:", feasible_tiles(128, "float16", gpu))

# %% [markdown]
# The rule that fails is named in each red cell. The bandwidth rule bites where the fewest CTAs
# fit on an SM (a big tile uses many registers and much shared memory), so each must keep more
# bytes in flight. With the current kernels one tile fails it on the H100 at head_dim 128:
# 128x16, whose 8-warp block (the Hopper warpgroup layout) fits two to an SM and keeps one
# 16-token tile of K and V in flight each. The measured speed table agrees: forced onto long
# CTAs, 128x16 reached 77% of copy bandwidth where 128x32 reached 97% (the cell below reads both
# from `pat_core/data/variant_speed_h100.json`). The A100 has less shared memory per block, so
# the largest H100 tiles fail its shared-memory limit (checked below).

# %%
sets = {g: set(feasible_tiles(128, "float16", g)) for g in ("h100", "a100")}
only = {g: sorted(sets[g] - sets[o]) for g, o in (("h100", "a100"), ("a100", "h100"))}
for g, o in (("h100", "a100"), ("a100", "h100")):
    why = {t: check_tile(*t, 128, "float16", o).violated for t in only[g]}
    print(f"feasible on {g} only: {only[g]}; on {o} they fail {why}")
checks = [check_tile(m, n, 128, "float16", "h100") for m in M_CANDIDATES for n in N_CANDIDATES]
built = [c for c in checks if c.resources is not None]
starved = [c for c in built if "bandwidth" in c.violated]
print("bandwidth failures on the H100:", [(c.m, c.n) for c in starved],
      "; CTAs per SM over all shapes:", sorted({c.ctas_per_sm for c in built}))
# the statements above: one bandwidth failure on the H100 at head_dim 128 (128x16, two CTAs per
# SM, one stage in flight); the H100-only tiles fail the A100's shared-memory limit
assert [(c.m, c.n, c.ctas_per_sm, c.resources.stages) for c in starved] == [(128, 16, 2, 2)]
assert only["h100"] and all("smem" in check_tile(*t, 128, "float16", "a100").violated
                            for t in only["h100"])
assert pat_core.get_gpu("a100").smem_per_block < h100.smem_per_block
speed = cuda_compile.variant_speed()                 # measured on an H100, head_dim 128
pct = {n: round(100 * speed[(128, n)]["frac_copy"]) for n in (16, 32)}
print(f"measured: 128x16 at {pct[16]}% of copy bandwidth, 128x32 at {pct[32]}%")
table_meta = json.loads(cuda_compile.variant_speed_path().read_text())
print("the table's workload:", table_meta["workload"])
assert table_meta["workload"].startswith("256_4096")    # every CTA 4,096 tokens long
assert pct == {16: 77, 32: 97}

# %% [markdown]
# ## Picking a tile per CTA
#
# `TileSelector` turns the feasible set into a per-CTA rule:
#
# * `m` = the smallest feasible `m >= rows` (round up; never split a CTA because its `m` is too
#   small);
# * `n` from a per-GPU table of KV length, as an upper bound: small `n` for short ranges (less
#   waste in the last, partly empty step), large `n` allowed for long ones;
# * among the feasible `n` at or below that bound, the one that **measured** fastest for this
#   `m` (`pat_core/data/variant_speed_h100.json`: every tile forced onto 4096-token CTAs on an
#   H100, as a fraction of copy bandwidth); the largest `n` within 3 points of the fastest wins,
#   so ties go to fewer, fatter steps. Without measurements for the GPU and head_dim, the largest
#   feasible `n` under the bound.

# %%
sel = TileSelector(128, "float16", "h100")
print("KV length -> preferred n:", h100.kv_tile_table[:-1], "and above: n =",
      h100.kv_tile_table[-1][1])
rows = np.array([1, 4, 8, 16, 24, 32, 48, 64, 96, 128])
kv_lens = np.array([16, 64, 96, 200, 384, 1000, 8000])
R, K = np.meshgrid(rows, kv_lens, indexing="ij")
mn = sel.select(R.ravel(), K.ravel()).reshape(len(rows), len(kv_lens), 2)

fig, ax = plt.subplots(figsize=(8, 4.6))
ax.imshow(np.log2(mn[..., 0]), cmap="Blues", vmin=3, vmax=8, aspect="auto")
for i in range(len(rows)):
    for j in range(len(kv_lens)):
        ax.text(j, i, f"{mn[i, j, 0]}x{mn[i, j, 1]}", ha="center", va="center", fontsize=8)
ax.set_xticks(range(len(kv_lens)), [str(x) for x in kv_lens])
ax.set_yticks(range(len(rows)), [str(x) for x in rows])
ax.set_xlabel("CTA KV length (tokens)")
ax.set_ylabel("CTA query rows")
ax.set_title("tile m x n chosen per CTA (H100, head_dim 128, fp16); shade = m", fontsize=10)
fig.tight_layout()
plt.show()

# every choice follows the rules above
moved = set()
for i, r in enumerate(rows):
    for j, L in enumerate(kv_lens):
        m_sel, n_sel = (int(x) for x in mn[i, j])
        assert m_sel == min(m for m in sel.m_values if m >= r)
        pref = h100.preferred_n(int(L))
        cands = [n for n in sel.n_by_m[m_sel] if n <= pref] or [sel.n_by_m[m_sel][0]]
        speed = {n: sel.measured_speed(m_sel, n) for n in cands}
        best = max(speed.values())
        assert n_sel == max(n for n in cands if speed[n] >= best - 0.03)
        if n_sel != pref:
            moved.add((m_sel, pref, n_sel, tuple(round(100 * speed[n]) for n in cands)))
for m_sel, pref, n_sel, pct in sorted(moved):
    print(f"m = {m_sel}, bound n <= {pref}: measured % of copy for n = "
          f"{[n for n in sel.n_by_m[m_sel] if n <= pref]}: {list(pct)} -> chose n = {n_sel}")
if not moved:
    print("every CTA got the bound's n: it measured fastest, or within 3 points of the fastest")
print("measured % of copy bandwidth, 128-row tiles:",
      {n: round(100 * sel.measured_speed(128, n)) for n in sel.n_by_m[128]})
# the 128-row tiles are the compute-heavy ones: their speed depends on n (the warpgroup
# layout on the H100: n = 32 and 64 at 97-100% of copy bandwidth, n = 128 at 91%)
pct128 = {n: round(100 * sel.measured_speed(128, n)) for n in sel.n_by_m[128]}
assert pct128 == {32: 97, 64: 100, 128: 91}
# FLOP per KV byte of a 128-row tile: every 2-byte K or V element takes part in one
# multiply-add (2 FLOP) per query row
flop_per_kv_byte = 2 * 128 / b
print(f"a 128-row tile does {flop_per_kv_byte:.0f} FLOP per fp16 KV byte")
assert flop_per_kv_byte == 128

# %% [markdown]
# The printout under the picture lists the cells where the selector took an `n` below the
# KV-length bound, with the measured speeds that decided it (if any), and the measured speeds of
# the 128-row tiles: they are the compute-heavy ones (128 FLOP per KV byte), and their speed
# depends most on `n` (97-100% of copy bandwidth at n = 32 and 64, 91% at 128, asserted above),
# so for them the choice of `n` matters most.
#
# In a real plan the tiles mix. The batch of tutorial 1's last example, on an H100:

# %%
big = build_tree_batch("1,4,16_1024,256,64", page_size=16)
plan = pat_core.Planner("pat", "h100").plan(big.block_tables, big.seq_lens, 32, 8, 128, 16)
print("tiles used (m x n: CTAs):", plan.stats()["tiles"])
for g, (m, n), b0, b1 in plan.groups():
    print(f"launch group {g}: {b1 - b0} CTAs with tile {m}x{n}, "
          f"rows {sorted(set(plan.cta_rows()[b0:b1].tolist()))}, "
          f"KV lengths {sorted(set(plan.cta_kv_len[b0:b1].tolist()))}")
    assert (plan.cta_mn()[b0:b1] == (m, n)).all()
tiles_used = {tuple(int(x) for x in t) for t in plan.cta_mn()}
assert plan.num_groups == len(tiles_used)      # pat: one group per tile shape

# %% [markdown]
# A launch group is the set of CTAs that run the same compiled variant (for `pat`, one group
# per tile shape; `cascade` also separates tree levels). The CUDA backend runs one forward
# launch per tile shape, tallest tile first, whatever the groups (tutorial 4 shows the
# simulator's picture of it, tutorial 5 the backend).
#
# ## One CTA, tile by tile
#
# The CPU executor runs a plan exactly as the kernel does: same CTAs, same `n`-token steps, fp32
# accumulators. `trace_cta` replays one CTA for one KV head in NumPy and records the state after
# every tile. We build a batch where one CTA is worth watching: four requests sharing a
# 320-token prefix, 8 query heads over 4 KV heads (group 2, so the shared CTA has 4 x 2 = 8 rows),
# head_dim 64, fp32 inputs (so nothing is rounded and the numbers match to the last digit).

# %%
small = build_tree_batch("1,4_320,32", page_size=16)
hq, hk, d = 8, 4, 64
plan = pat_core.Planner("pat", "h100").plan(small.block_tables, small.seq_lens, hq, hk, d, 16,
                                            kv_data_type="float32", split=False)
k_cache, v_cache = random_kv_cache(small.num_pages, 16, hk, d, dtype=np.float32, seed=1)
q = np.random.default_rng(2).standard_normal((small.batch_size, hq, d)).astype(np.float32)
c = int(np.argmax(plan.cta_rows()))           # the shared-prefix CTA
reqs = plan.cta_req[plan.cta_req_indptr[c]:plan.cta_req_indptr[c + 1]]
m_tile, n_tile = (int(x) for x in plan.cta_mn()[c])
print(f"CTA {c}: requests {reqs.tolist()}, tokens [{plan.cta_kv_start[c]}, "
      f"{plan.cta_kv_start[c] + plan.cta_kv_len[c]}), {plan.cta_rows()[c]} rows, "
      f"tile {m_tile}x{n_tile}")
assert len(reqs) == 4 and plan.cta_rows()[c] == 4 * (hq // hk)
assert plan.cta_kv_start[c] == 0 and plan.cta_kv_len[c] == 320
trace = trace_cta(plan, c, q, k_cache, v_cache, kv_head=0)
for t, st in enumerate(trace):
    print(f"after tile {t} (tokens {st['tokens'][0]:>3}-{st['tokens'][1] - 1:>3}): "
          f"max m = {np.round(st['m'][:4], 3)} ...  sum l = {np.round(st['l'][:4], 2)} ...")

# %% [markdown]
# The kernel never holds all 320 scores of a row at once. It keeps three things per row:
#
# * `m`, the largest score seen so far;
# * `l`, the sum of `exp(score - m)` over the tokens seen so far;
# * `acc`, the sum of `exp(score - m) * v` over those tokens (a `d`-vector).
#
# When a new tile brings a larger maximum `m_new`, everything accumulated so far was scaled by
# `exp(-m)` instead of `exp(-m_new)`; multiplying `l` and `acc` by `exp(m - m_new)` fixes that,
# and the new tile's terms are added. After the last tile, `acc / l` is the softmax-weighted
# average of the values. This *online softmax* is what lets the CTA stream its KV through
# shared memory one tile at a time.

# %%
scores = np.concatenate([st["scores"] for st in trace], axis=1)
tiles_x = [st["tokens"][0] - trace[0]["tokens"][0] for st in trace[1:]]
final_o = trace[-1]["o"]
fig, axes = plt.subplots(1, 3, figsize=(15, 3.6), gridspec_kw={"width_ratios": [2.2, 1, 1]})
ax = axes[0]
im = ax.imshow(scores, aspect="auto", cmap="viridis")
for x in tiles_x:
    ax.axvline(x - 0.5, color="white", lw=1.5)
ax.set_xlabel(f"KV token of the CTA (white lines: tile boundaries, n = {n_tile})")
ax.set_ylabel("query row")
ax.set_title("scaled scores q.k / sqrt(d)", fontsize=10)
fig.colorbar(im, ax=ax)
steps = np.arange(1, len(trace) + 1)
for row in range(scores.shape[0]):
    axes[1].plot(steps, [st["m"][row] for st in trace], marker="o", ms=3)
    err = [np.linalg.norm(st["o"][row] - final_o[row]) / np.linalg.norm(final_o[row])
           for st in trace]
    axes[2].plot(steps, err, marker="o", ms=3)
axes[1].set_title("running max m per row", fontsize=10)
axes[2].set_title("|o_t - o_final| / |o_final| per row", fontsize=10)
for ax in axes[1:]:
    ax.set_xlabel("tiles processed")
    ax.set_xticks(steps)
fig.tight_layout()
plt.show()

# %% [markdown]
# The running maximum only ever climbs, and it climbs exactly when a tile holds a larger score
# than any before it. The running sum `l` need not grow: when `m` jumps, everything summed so
# far is rescaled by `exp(m_old - m_new) < 1`, and if the new tile adds less than that takes
# away, `l` shrinks. The running output wanders while tiles arrive and lands on the final value
# at the last tile. The next cell checks each of these statements on the trace and names the
# places where `l` shrank.

# %%
ms = np.stack([st["m"] for st in trace])           # [tiles, rows]
ls = np.stack([st["l"] for st in trace])
tile_max = np.stack([st["scores"].max(axis=1) for st in trace])
assert (np.diff(ms, axis=0) >= 0).all()                                # never falls
assert (ms[0] == tile_max[0]).all()
assert ((np.diff(ms, axis=0) > 0) == (tile_max[1:] > ms[:-1])).all()   # climbs iff a new max
shrunk = np.argwhere(np.diff(ls, axis=0) < 0)
for t, row in shrunk:
    print(f"row {row}: m rose {ms[t, row]:.3f} -> {ms[t + 1, row]:.3f} at tile {t + 1}, "
          f"l went {ls[t, row]:.2f} -> {ls[t + 1, row]:.2f}")
assert all(ms[t + 1, row] > ms[t, row] for t, row in shrunk)            # only when m jumps
assert np.allclose(trace[-1]["o"], final_o)
print(f"l shrank {len(shrunk)} times in {ls.size - ls.shape[1]} tile steps")

# %% [markdown]
# The trace is the executor's arithmetic, not a separate model: its final state equals the
# partial result the full executor writes for this CTA's slots (to float32 rounding; the cell
# asserts agreement within 1e-5).

# %%
o_part, lse_part = execute_partials(plan, q, k_cache, v_cache)
slots = plan.cta_slot[plan.cta_req_indptr[c]:plan.cta_req_indptr[c + 1]]
g = plan.group_size
rows_o = np.stack([o_part[s, h] for s in slots for h in range(g)])   # KV head 0: q heads 0..g-1
rows_lse = np.array([lse_part[s, h] for s in slots for h in range(g)])
last = trace[-1]
d_o = float(np.abs(last["o"] - rows_o).max())
d_lse = float(np.abs(last["m"] + np.log(last["l"]) - rows_lse).max())
print("max |o_trace - o_executor|    :", d_o)
print("max |lse_trace - lse_executor|:", d_lse)
assert d_o < 1e-5 and d_lse < 1e-5

# %% [markdown]
# ## Hiding the memory latency: the cp.async ring
#
# The trace above is sequential: load tile `t`, compute with it, load tile `t + 1`... On a GPU
# that would leave the tensor cores idle during every load and the memory system idle during
# every compute. Decode attention is memory bound, so what matters is that **a load is always in
# flight**.
#
# The kernel keeps `stages` shared-memory buffers for K and V (section 1: the number is a
# per-variant compile rule). While it computes on the tile in one buffer, the next tiles are
# already being copied into the others by `cp.async`, an instruction that starts a
# global-to-shared copy and returns immediately (the copy completes in the background;
# `cp.async.wait_group` waits for it later). The timing picture, with a load taking three times
# as long as the compute on it, for one buffer and for two:

# %%
def draw_pipeline(ax, stages, tiles=5, load=3.0, compute=1.0):
    """Schematic: load and compute intervals of each tile with `stages` buffers; returns the
    time the last compute ends."""
    load_end, comp_end = [], []
    for t in range(tiles):
        if stages == 1:
            start = comp_end[-1] if comp_end else 0.0     # the only buffer is busy until then
        else:
            start = load_end[-1] if load_end else 0.0     # memory streams back to back
            if t >= stages:
                start = max(start, comp_end[t - stages])  # the buffer must be free
        load_end.append(start + load)
        cs = max(load_end[t], comp_end[-1] if comp_end else 0.0)
        comp_end.append(cs + compute)
        ax.barh(1, load, left=start, color=f"C{t}", edgecolor="black")
        ax.text(start + load / 2, 1, f"load {t}", ha="center", va="center", fontsize=8)
        ax.barh(0, compute, left=cs, color=f"C{t}", edgecolor="black")
        ax.text(cs + compute / 2, 0, f"{t}", ha="center", va="center", fontsize=8)
    ax.set_yticks([0, 1], ["tensor cores", "memory (cp.async)"])
    ax.set_title(f"{stages} buffer{'s' if stages > 1 else ''}: {comp_end[-1]:.0f} time units "
                 f"for {tiles} tiles", fontsize=10)
    return comp_end[-1]


tiles_, load_, compute_ = 5, 3.0, 1.0
fig, axes = plt.subplots(2, 1, figsize=(11, 3.8), sharex=True)
t_one = draw_pipeline(axes[0], 1, tiles_, load_, compute_)
t_two = draw_pipeline(axes[1], 2, tiles_, load_, compute_)
axes[1].set_xlabel("time")
fig.tight_layout()
plt.show()
assert t_one == tiles_ * (load_ + compute_)          # every load waits for the compute before
assert t_two == tiles_ * load_ + compute_            # loads back to back, one compute at the end

# %% [markdown]
# With one buffer each tile costs `load + compute`; with two or more, loads run back to back and
# the run takes `tiles x load + compute` (the cell asserts both). More stages help when a load's
# latency varies or exceeds the compute time by more than one tile, at the price of shared
# memory.
#
# ## The kernel source
#
# The CUDA sources ship with the package (`pat_core.cuda_compile.cuda_src_dir()` finds them in
# an installation or a checkout). The kernel marks the passages this tutorial shows with
# `// <tutorial:NAME>` and `// </tutorial:NAME>` comment lines; the cell below prints them by
# name and fails if a marker has gone (the test suite checks the markers too), so what you read
# here is always the current kernel.

# %%
KERNEL_FILES = {f.name: f.read_text().splitlines()
                for f in sorted(cuda_compile.cuda_src_dir().glob("*.cuh"))}


def excerpt(name):
    """``(file, [(line number, line), ...])``: the kernel lines between ``// <tutorial:name>``
    and ``// </tutorial:name>``, numbered as in their header."""
    found = []
    for fname, lines in KERNEL_FILES.items():
        opens = [i for i, s in enumerate(lines) if s.strip() == f"// <tutorial:{name}>"]
        closes = [i for i, s in enumerate(lines) if s.strip() == f"// </tutorial:{name}>"]
        found += [(fname, lines, o, c) for o, c in zip(opens, closes)]
    assert len(found) == 1 and found[0][2] < found[0][3], (
        f"cuda_src: the excerpt markers for {name!r} are missing or repeated")
    fname, lines, o, c = found[0]
    return fname, [(i + 1, lines[i]) for i in range(o + 1, c)]


def show(name):
    fname, lines = excerpt(name)
    print(f"--- {fname}: {name} ---")
    for num, line in lines:
        print(f"{num:4d}  {line}")
    print()


show("prologue")
show("loop-top")

# %% [markdown]
# Reading these with the picture in mind:
#
# * the **prologue** runs before the KV loop: it issues copies of the query rows and of the first
#   `STAGES - 1` tiles, and closes each batch of copies with `cp_async_commit()`, which makes it
#   one *commit group* the kernel can later wait for;
# * at the **top of iteration `t`** the kernel issues tile `t + STAGES - 1` into the buffer
#   (`% STAGES`) that an earlier iteration has finished with, commits it, and waits with
#   `cp_async_wait<STAGES - 1>()` until at most `STAGES - 1` groups are still in flight: the
#   oldest one, tile `t`, has landed. Each thread copied a different part of the tile, so a
#   barrier follows before any warp reads rows that other threads fetched (its scope, the whole
#   CTA or only the warps that share those rows, is in the excerpt's comments).
#
# Then comes the arithmetic of the trace above: `S = Q K^T` on the tensor cores, and the
# online-softmax update of the running maximum `m`, the running sum `l` and the accumulator,
# kept in registers (the kernel works in base 2, `exp2f`, with the scale folded into the scores):

# %%
show("online-softmax")

# %% [markdown]
# After `O += P V`, the **end of the iteration** holds the barrier that keeps the next
# iteration from overwriting a buffer that a slower warp is still reading, and after the loop
# the kernel drains the remaining (empty) commit groups:

# %%
show("loop-end")
kernel_text = "\n".join(line for part in ("prologue", "loop-top", "loop-end")
                        for _, line in excerpt(part)[1])
for call in ("cp_async_commit", "cp_async_wait<STAGES - 1>", "cp_async_wait<0>"):
    assert call in kernel_text, call

# %% [markdown]
# The gather itself is where paging shows up: each 16-byte `cp.async` copies part of one token's
# K or V row, and the token's address comes from the CTA's page list
# (`token -> page id -> row`), so a CTA can read a prefix scattered over any pages of the cache.
# Tokens past the CTA's range read the last token's address but copy zero bytes (`bytes = 0`)
# and are masked later.

# %%
show("gather")
gather = "\n".join(line for _, line in excerpt("gather")[1])
assert "pages[" in gather and "cp_async_16" in gather

# %% [markdown]
# ## Two tensor-core paths
#
# The excerpts above are the `mma.sync` path: each warp owns 16 or 32 query rows and feeds the
# tensor cores one `m16n8k16` instruction at a time from registers it loads with `ldmatrix`. A
# 128-row tile does 128 FLOP per KV byte, and there that path reaches only 66-77% of copy
# bandwidth on the H100 (the table's `sync` records, printed and checked below): the warps spend their
# issue slots waiting on instruction latencies. On Hopper
# (sm_90) the 64- and 128-row tiles instead run on `wgmma` (`cuda_src/pat_wgmma.cuh`): a
# *warpgroup* of four warps owns 64 rows, one instruction computes a 64 x n block of scores
# straight from shared memory, and the registers it leaves behind hold the scores in the same
# layout as `mma.sync`'s, so the online-softmax code above serves both. The tile's shared
# memory then has to be in the layout the instruction reads (128-byte swizzle, 1024-byte
# aligned). Which path a tile takes is a per-GPU choice of the variant's layout, from the same
# measured table as `n` (`rows_per_warp` 64 means the warpgroup layout):

# %%
for m, n in ((16, 64), (64, 64), (128, 32), (128, 64)):
    v90 = cuda_compile.FwdVariant.make(m, n, 128, "float16", arch="sm_90")
    v80 = cuda_compile.FwdVariant.make(m, n, 128, "float16", arch="sm_80")
    print(f"{m:3d}x{n:<3d} H100: {v90.warps} warps, rows/warp {v90.rows_per_warp:2d}"
          f"{' (wgmma)' if v90.warpgroup else ''};  A100: {v80.warps} warps, rows/warp "
          f"{v80.rows_per_warp}")
    assert not v80.warpgroup                     # sm_80 has no wgmma
    assert v90.warpgroup == (m >= 64)            # these tiles: wgmma exactly from 64 rows up
    if v90.warpgroup:                            # four warps to every 64 rows
        assert v90.rows_per_warp == 64 and v90.warps * 64 // m == 4
    else:                                        # a mma.sync warp owns 16 or 32 rows
        assert v90.rows_per_warp in (16, 32)
    assert v80.rows_per_warp in (16, 32)
print("128-row tiles, measured % of copy bandwidth on the H100 (the table's pick per n):",
      {n: round(100 * sel.measured_speed(128, n)) for n in sel.n_by_m[128]})
sync128 = {n: rec["sync"]["frac_copy"] for (m, n), rec in cuda_compile.variant_speed().items()
           if m == 128 and "sync" in rec}
print("the same tiles on the best mma.sync layout:",
      {n: round(100 * f) for n, f in sorted(sync128.items())})
sync_pct = sorted(round(100 * f) for f in sync128.values())
assert sync_pct[0] == 66 and sync_pct[-1] == 77                          # "66-77%"
wgmma_src = (cuda_compile.cuda_src_dir() / "pat_wgmma.cuh").read_text()
assert "128-byte swizzle" in wgmma_src and "1024-byte aligned" in wgmma_src

# %% [markdown]
# ## An FP8 cache: bytes in shared memory, widened in registers
#
# An FP8 (`float8_e4m3fn`) cache stores one byte per K or V element, so a memory-bound step
# reads half the bytes. The tensor cores still multiply 16-bit operands, so the bytes must be
# widened somewhere. Widening them in shared memory (read bytes, write halves, read the halves
# again with `ldmatrix`) makes every element cross shared memory three times; pat's kernel
# loads the *bytes* with `ldmatrix` and widens each fragment in registers. The catch:
# `ldmatrix` moves 16-bit units, so a fragment of bytes comes out holding other elements than
# the instruction expects. The kernel fixes that by moving the *other* operand instead of
# the bytes.
#
# The model below follows one warp through both products with the fragment layouts of
# `ldmatrix` (lane `l` gets row `l // 4`, units `2 (l % 4)` and `2 (l % 4) + 1` of an 8 x 8
# matrix of 16-bit units; the transposing form gives the column instead) and of `mma.m16n8k16`
# (A: rows `l // 4` and `+ 8`, k columns `2 (l % 4) + {0, 1}` and `+ 8`; B: k rows
# likewise, column `l // 4`). Integer values make every product exact.

# %%
def ldmatrix(units, trans=False):
    """Four 8x8 matrices of 16-bit units ([4, 8, 8, 2] bytes or [4, 8, 8] values) -> each
    lane's four registers, each a pair of units (low first)."""
    regs = []
    for lane in range(32):
        g, c = lane // 4, lane % 4
        pick = (lambda M: (M[2 * c][g], M[2 * c + 1][g])) if trans else \
               (lambda M: (M[g][2 * c], M[g][2 * c + 1]))
        regs.append([pick(units[i]) for i in range(4)])
    return regs


def mma(a_regs, b_regs):
    """One m16n8k16: per lane A [4 pairs] and B [2 pairs] -> the 16 x 8 product."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for r, (row, col) in enumerate(((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8),
                                        (g + 8, 2 * c + 8))):
            A[row, col:col + 2] = a_regs[lane][r]
        for r, k in enumerate((2 * c, 2 * c + 8)):
            B[k:k + 2, g] = b_regs[lane][r]
    return A @ B


rng = np.random.default_rng(0)
D = 64                                                  # head_dim (any multiple of 32 works)
q = rng.integers(-4, 5, (16, D)).astype(float)          # 16 query rows
k8 = rng.integers(-4, 5, (16, D)).astype(float)         # 16 tokens, one "byte" per element
v8 = rng.integers(-4, 5, (16, D)).astype(float)
p = rng.integers(-3, 4, (16, 16)).astype(float)         # probabilities of the 16 tokens

# %% [markdown]
# **Q K^T.** K is the B operand, and its rows are tokens. An 8-token x 16-byte matrix read as
# 16-bit units gives lane `l` the 4 consecutive bytes `4 (l % 4) .. 4 (l % 4) + 3` of token
# `l // 4` (each unit is two elements), widened into two half pairs. The instruction reads them
# as the k positions `2 (l % 4) + {0, 1}` and `8 + 2 (l % 4) + {0, 1}`. A dot product does not
# care about the order of its terms, as long as Q's columns are permuted the same way: within
# every 16-column block, k slot `2 c + i` must hold column `4 c + i` and slot `8 + 2 c + i`
# column `4 c + 2 + i`. The kernel permutes the Q tile in shared memory once per work item
# (`permute_q_fp8` in `cuda_src/pat_mma_walk.cuh`; below), and every K fragment is then used as
# it arrives.

# %%
perm = np.array([4 * (s % 8 // 2) + s % 2 + 2 * (s // 8) for s in range(16)])
print("Q's column at each k slot of a 16-column block:", perm.tolist())
assert perm.tolist() == [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
q_perm = np.concatenate([q[:, b * 16:(b + 1) * 16][:, perm] for b in range(D // 16)], axis=1)

scores = np.zeros((16, 16))
for blk in range(D // 16):                               # one k step per 16 columns
    cols = slice(blk * 16, blk * 16 + 16)
    qb = q_perm[:, cols]                                 # the 16-bit A operand, as usual:
    a = ldmatrix([qb[:8, :8], qb[8:, :8], qb[:8, 8:], qb[8:, 8:]])   # rows x k halves
    for nb in range(2):                                  # two 8-token n blocks
        tok = k8[8 * nb:8 * nb + 8, cols].reshape(8, 8, 2)   # 16 bytes a row = 8 units
        # one register = 4 bytes of a token, widened: (bytes 0, 1) is b0, (bytes 2, 3) is b1
        b = [regs[0] for regs in ldmatrix([tok] * 4)]
        scores[:, 8 * nb:8 * nb + 8] += mma(a, b)
assert np.array_equal(scores, q @ k8.T)
print("Q K^T from byte fragments and a permuted Q: exact")

# %% [markdown]
# **P V.** V is the B operand with tokens as its k dimension, so the kernel reads it with the
# transposing `ldmatrix`. Transposing moves 16-bit units, i.e. *pairs* of columns: lane `l`
# gets tokens `2 (l % 4)` and `2 (l % 4) + 1`, each at the two columns `2 (l // 4)` and
# `2 (l // 4) + 1`. One byte permute (`prmt` with selector `0x3120`) regroups the four bytes into
# one token pair per column, which is a B operand twice over: for an n block of the *even*
# columns of the 16-column chunk and one of the *odd* columns. The output accumulators then
# hold columns in that order, and the kernel's writers store them there (`for_each_col_pair` in
# `cuda_src/pat_fwd.cuh`).

# %%
out = np.zeros((16, D))
pa = [[(p[g, 2 * c], p[g, 2 * c + 1]), (p[g + 8, 2 * c], p[g + 8, 2 * c + 1]),
       (p[g, 2 * c + 8], p[g, 2 * c + 9]), (p[g + 8, 2 * c + 8], p[g + 8, 2 * c + 9])]
      for g, c in (divmod(lane, 4) for lane in range(32))]          # P as the A operand
for chunk in range(D // 16):
    mats = [v8[8 * h:8 * h + 8, chunk * 16:chunk * 16 + 16].reshape(8, 8, 2) for h in (0, 1)]
    regs = ldmatrix([mats[0], mats[1], mats[0], mats[1]], trans=True)
    even, odd = [], []
    for lane in range(32):
        (b0, b1), (b2, b3) = regs[lane][0]                # tokens 0-7 of the chunk
        (d0, d1), (d2, d3) = regs[lane][1]                # tokens 8-15
        even.append(((b0, b2), (d0, d2)))                 # the byte permute 0x3120: bytes 0, 2
        odd.append(((b1, b3), (d1, d3)))                  # ... and 1, 3
    out[:, chunk * 16:chunk * 16 + 16:2] = mma(pa, even)  # the even columns of the chunk
    out[:, chunk * 16 + 1:chunk * 16 + 16:2] = mma(pa, odd)
assert np.array_equal(out, p @ v8)
print("P V from transposed byte fragments: exact (even and odd column blocks)")

# %% [markdown]
# The Q pass in the kernel: each thread rewrites whole 16-column blocks of Q rows it owns (two
# 16-byte chunks, eight 32-bit words, each a pair of columns), so word `c` takes word `2 c` and
# word `4 + c` word `2 c + 1` — the permutation above, two columns at a time:

# %%
show("fp8-q-permute")
words = perm.reshape(8, 2)[:, 0] // 2                   # the word each new word comes from
assert words.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
src_permute = "\n".join(line for _, line in excerpt("fp8-q-permute")[1])
assert "make_uint4(a.x, a.z, b.x, b.z)" in src_permute and "make_uint4(a.y, a.w, b.y, b.w)" in src_permute

# %% [markdown]
# Next: [tutorial 3](03_merge.ipynb) puts the partial results back together.
