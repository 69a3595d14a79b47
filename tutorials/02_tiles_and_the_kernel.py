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
# * how the CUDA kernel overlaps loading the next tile with computing the current one
#   (`cp.async` double buffering), next to the kernel source.
#
# Tutorial 1 (CTAs and packers) is assumed. No GPU is needed.

# %%
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

import pat_core
from pat_core.executor import execute_partials, trace_cta
from pat_core.tiles import (M_CANDIDATES, N_CANDIDATES, STAGES, TileSelector, check_tile,
                            feasible_tiles)
from pat_core.workloads import build_tree_batch, random_kv_cache

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
# **1. Shared memory.** A CTA keeps its query tile (`m x d` elements) and `STAGES` copies of a
# K tile and a V tile (`n x d` each) in shared memory. With fp16 (`b = 2` bytes) and
# `d = 128`, `m = 64`, `n = 128`, two stages:

# %%
d, b = 128, 2
m, n = 64, 128
smem = m * d * b + 2 * STAGES * n * d * b
print(f"Q tile {m * d * b:,} B + {STAGES} stages x (K + V) {2 * STAGES * n * d * b:,} B "
      f"= {smem:,} B  (limit {h100.smem_per_block:,} B per CTA)")
chk = check_tile(m, n, d, "float16", "h100")
print(f"the compiled kernel reports {chk.resources.smem:,} B "
      f"(source: {chk.resources.source})")

# %% [markdown]
# The solver trusts the compiler's number rather than the formula: the two agree here, but a
# kernel may reserve extra shared memory (for example a buffer where warps combine results).
#
# **2. Registers.** Each thread holds its share of the fp32 output accumulator and of the score
# tile in registers. The numbers come from the compiler's resource report, stored with the
# package, not from a guess; with no report the solver falls back to an estimate and says so.
# Registers and shared memory together decide how many CTAs can sit on one SM at once, `C`.
#
# **3. Bandwidth in flight.** HBM answers a request only after roughly `L = 650 ns`. To keep the
# memory system busy, every SM needs enough bytes requested and not yet delivered to cover that
# latency: by Little's law, `latency x bandwidth` bytes in flight over the whole GPU. With `S`
# SMs each holding `C` CTAs, each CTA loading one `n`-token tile of `d` elements of `b` bytes:
#
# `n >= ceil(L * B / (S * C * d * b))`

# %%
for m, n in [(64, 128), (64, 32)]:
    chk = check_tile(m, n, d, "float16", "h100")
    C = chk.ctas_per_sm
    n_min = math.ceil(h100.mem_latency_ns * h100.bytes_per_ns / (h100.num_sms * C * d * b))
    print(f"(m={m:>3}, n={n:>3}): C = {C} CTAs/SM -> n_min = ceil({h100.mem_latency_ns:.0f} * "
          f"{h100.bytes_per_ns:.0f} / ({h100.num_sms} * {C} * {d} * {b})) = {n_min}; "
          f"solver: n_min {chk.n_min}, feasible {chk.feasible}, violated {chk.violated}")

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


fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
for ax, (gpu, hd) in zip(axes, [("h100", 64), ("h100", 128), ("a100", 64), ("a100", 128)]):
    draw_feasible(ax, gpu, hd)
fig.tight_layout()
plt.show()
for gpu in ("h100", "a100"):
    print(gpu, "head_dim 128:", feasible_tiles(128, "float16", gpu))

# %% [markdown]
# The pattern to notice: big `m` with small `n` fails on bandwidth (a big tile uses many
# registers, so few CTAs fit per SM, so each one must keep more bytes in flight), and the A100,
# with fewer SMs and less bandwidth to cover, accepts shapes the H100 rejects.
#
# ## Picking a tile per CTA
#
# `TileSelector` turns the feasible set into a per-CTA rule:
#
# * `m` = the smallest feasible `m >= rows` (round up; never split a CTA because its `m` is too
#   small);
# * `n` from a per-GPU table of KV length: small `n` for short ranges (less waste in the last,
#   partly empty step), large `n` for long ones (fewer steps, fewer CTAs per SM to schedule),
#   moved to the nearest shape that is feasible for that `m`.

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

# %% [markdown]
# Where `n` is not what the table asked for, the preferred shape was not feasible for that `m`
# (a 64-row tile cannot use `n = 32` on an H100, so it gets 64; a 32-row tile has no `n = 32`
# either and drops to 16).
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

# %% [markdown]
# Each launch group is one kernel launch of one compiled variant; on the GPU the groups run
# concurrently on separate CUDA streams.
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
# than any before it. The running sum `l` is not monotone: when `m` jumps, everything summed
# so far is rescaled by `exp(m_old - m_new) < 1` (look at the second row's `l` at tile 4 in the
# printout above). The running output wanders while tiles arrive and lands on the final
# value at the last tile.
#
# The trace is the executor's arithmetic, not a separate model: its final state equals the
# partial result the full executor writes for this CTA's slots.

# %%
o_part, lse_part = execute_partials(plan, q, k_cache, v_cache)
slots = plan.cta_slot[plan.cta_req_indptr[c]:plan.cta_req_indptr[c + 1]]
g = plan.group_size
rows_o = np.stack([o_part[s, h] for s in slots for h in range(g)])   # KV head 0: q heads 0..g-1
rows_lse = np.array([lse_part[s, h] for s in slots for h in range(g)])
last = trace[-1]
print("max |o_trace - o_executor|    :", float(np.abs(last["o"] - rows_o).max()))
print("max |lse_trace - lse_executor|:", float(np.abs(last["m"] + np.log(last["l"])
                                                       - rows_lse).max()))

# %% [markdown]
# ## Hiding the memory latency: the cp.async double buffer
#
# The trace above is sequential: load tile `t`, compute with it, load tile `t + 1`... On a GPU
# that would leave the tensor cores idle during every load and the memory system idle during
# every compute. Decode attention is memory bound, so what matters is that **a load is always in
# flight**.
#
# The kernel keeps `STAGES = 2` shared-memory buffers for K and V. While it computes on the tile
# in one buffer, the next tile is already being copied into the other by `cp.async`, an
# instruction that starts a global-to-shared copy and returns immediately (the copy completes in
# the background; `cp.async.wait_group` waits for it later). The timing picture, with a load
# taking three times as long as the compute on it:

# %%
def draw_pipeline(ax, stages, tiles=5, load=3.0, compute=1.0):
    """Schematic: load and compute intervals of each tile with 1 or 2 buffers."""
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


fig, axes = plt.subplots(2, 1, figsize=(11, 3.8), sharex=True)
draw_pipeline(axes[0], 1)
draw_pipeline(axes[1], 2)
axes[1].set_xlabel("time")
fig.tight_layout()
plt.show()

# %% [markdown]
# With two buffers the memory system never waits for the tensor cores; the run takes about
# `tiles x load` instead of `tiles x (load + compute)`. Now the real thing. The CUDA sources ship
# with the package; the cell below finds them (installed package data or a checkout) and prints
# the prologue and the main loop of the forward kernel.

# %%
def find_cuda_sources():
    """The directory of pat's CUDA sources, or None when this installation has none."""
    finders = []
    try:
        from pat_core.cuda_backend import cuda_src_dir as f1
        finders.append(f1)
    except Exception:
        pass
    try:
        from pat_core.cuda_compile import cuda_src_dir as f2
        finders.append(f2)
    except Exception:
        pass
    for f in finders:
        try:
            return Path(f())
        except Exception:
            pass
    for cand in (Path.cwd().parent / "cuda_src", Path.cwd() / "cuda_src"):
        if cand.is_dir():
            return cand
    return None


def show_lines(path, start_marker, end_marker):
    """Print the lines of ``path`` from the first line containing ``start_marker`` to the first
    following line containing ``end_marker`` (with line numbers); False when not found."""
    lines = path.read_text().splitlines()
    i0 = next((i for i, s in enumerate(lines) if start_marker in s), None)
    if i0 is None:
        return False
    i1 = next((i for i in range(i0 + 1, len(lines)) if end_marker in lines[i]), None)
    if i1 is None:
        return False
    for i in range(i0, i1 + 1):
        print(f"{i + 1:4d}  {lines[i]}")
    return True


src_dir = find_cuda_sources()
fwd = src_dir / "pat_fwd.cuh" if src_dir is not None else None
if fwd is None or not fwd.is_file():
    print("The CUDA sources are not part of this installation; see cuda_src/pat_fwd.cuh in the "
          "repository.")
else:
    print(f"--- {fwd.name}: the prologue ---")
    ok = show_lines(fwd, "Prologue", "}")
    print(f"\n--- {fwd.name}: the main loop, up to the first barrier ---")
    ok2 = show_lines(fwd, "for (int t = 0; t < num_tiles; ++t)", "__syncthreads();")
    print("   ...   (S = Q K^T, online softmax, O += P V on the tensor cores)")
    ok3 = show_lines(fwd, "Barrier: all warps are done reading stage", "cp_async_wait<0>")
    if not (ok and ok2 and ok3):
        print("\n(The kernel's layout changed since this tutorial was written; every line that "
              "touches the pipeline:)")
        for i, s in enumerate(fwd.read_text().splitlines()):
            if "cp_async" in s or "__syncthreads" in s or "STAGES" in s:
                print(f"{i + 1:4d}  {s}")

# %% [markdown]
# Reading the loop with the picture in mind:
#
# * the **prologue** issues the query rows and the first `STAGES - 1` tiles before the loop, each
#   as a *commit group*;
# * at the top of iteration `t` the kernel issues tile `t + STAGES - 1` into the buffer that
#   iteration `t - 1` has just finished with, then `cp_async_wait<STAGES - 1>` waits until at most
#   `STAGES - 1` groups are still in flight, which means tile `t` has landed;
# * the first `__syncthreads()` makes every thread's copies of tile `t` visible to all warps
#   before any warp reads them (each thread copied a different part of the tile);
# * the barrier at the end of the iteration keeps the next iteration from overwriting a buffer
#   that a slower warp is still reading.
#
# The gather itself is where paging shows up: each 16-byte `cp.async` copies part of one token's
# K or V row, and the token's address comes from the CTA's page list (`token -> page id -> row`),
# so a CTA can read a prefix scattered over any pages of the cache.
#
# Next: [tutorial 3](03_merge.ipynb) puts the partial results back together.
