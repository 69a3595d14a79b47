"""SM occupancy: how many thread blocks of each tile config fit one SM at once.

Resources come from :func:`pat_core.tiles.kernel_resources` (the compiler's report when the CUDA
build has written ``pat_core/data/kernel_resources.json``, else the documented estimate), and the
per-config limit from :meth:`pat_core.tiles.TileResources.ctas_per_sm`.  The timeline also needs
the four resources as a vector, so that blocks of *different* configs can share an SM (the
chained forward launches of several tiles run at once): shared memory, registers (allocated per
warp in units of 256), threads and one hardware CTA slot.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pat_core.cuda_compile import MERGE_WARPS, SMEM_OPT_IN_BYTES
from pat_core.gpus import GPUSpec
from pat_core.tiles import TileResources, tile_resources

# The merge kernel: one warp per (request, query head), MERGE_WARPS warps per block.  It mirrors
# the CUDA launcher's constant; registers are a small-kernel guess (it holds head_dim / 32 fp32
# values per lane and a few scalars).  The shared-memory opt-in threshold (smem_class below)
# mirrors the launcher's too.
MERGE_REGISTERS = 40


def smem_class(smem: int) -> int:
    """Which forward blocks may share an SM: ``1`` for a kernel loaded with its shared-memory
    maximum raised (more than ``SMEM_OPT_IN_BYTES``), ``0`` for one below it.  Measured (H100 and
    H200, the driver's default carveout; bench/NOTES.md): a block never joins an SM
    that holds a forward block of the other class, however much room is left (a one-warp 16x32
    leaf waits for the 16x64 root blocks to leave), while the merge kernel's blocks (no shared
    memory) join either; the timeline takes the merge as compatible with both (class ``-1``)."""
    return 1 if smem > SMEM_OPT_IN_BYTES else 0


def resource_vector(threads: int, registers: int, smem: int) -> np.ndarray:
    """``[smem, registers, threads, 1]`` one block takes from its SM (registers rounded per warp)."""
    regs_warp = int(math.ceil(registers * 32 / 256.0)) * 256
    return np.array([smem, regs_warp * (threads // 32), threads, 1], dtype=np.int64)


def sm_capacity(gpu: GPUSpec) -> np.ndarray:
    """What one SM offers, in the order of :func:`resource_vector`."""
    return np.array([gpu.smem_per_sm, gpu.regs_per_sm, gpu.max_threads_per_sm,
                     gpu.max_ctas_per_sm], dtype=np.int64)


@dataclass(frozen=True)
class ConfigOccupancy:
    """Occupancy of one tile config ``(m, n)`` on one GPU."""

    m: int
    n: int
    resources: TileResources
    ctas_per_sm: int          # resident blocks per SM when the SM holds only this config
    limiter: str              # which resource sets ctas_per_sm: smem, registers, threads, cta_cap
    blocks: int               # thread blocks of this config in the plan (CTAs x KV heads)
    waves: float              # blocks / (ctas_per_sm x num_sms)

    def as_dict(self) -> dict:
        r = self.resources
        return {"m": self.m, "n": self.n, "threads": r.threads, "registers": r.registers,
                "smem": r.smem, "resource_source": r.source, "ctas_per_sm": self.ctas_per_sm,
                "limiter": self.limiter, "blocks": self.blocks, "waves": round(self.waves, 3)}


# resources of variant (m, n); the estimate when the data file lacks it (a plan may be made for
# another GPU than the one simulated)
config_resources = tile_resources


def limiter_of(res: TileResources, gpu: GPUSpec) -> str:
    vec = resource_vector(res.threads, res.registers, res.smem)
    cap = sm_capacity(gpu)
    per = cap // np.maximum(vec, 1)
    names = ("smem", "registers", "threads", "cta_cap")
    return names[int(np.argmin(per))]


def plan_occupancy(plan, gpu: GPUSpec) -> list:
    """:class:`ConfigOccupancy` of every tile config of ``plan`` (in ``plan.tile_configs`` order)."""
    counts = np.bincount(plan.cta_tile, minlength=plan.tile_configs.shape[0])
    out = []
    for k, (m, n) in enumerate(plan.tile_configs.tolist()):
        res = config_resources(int(m), int(n), plan.head_dim, plan.kv_dtype, gpu)
        c = res.ctas_per_sm(gpu)
        blocks = int(counts[k]) * plan.num_kv_heads
        waves = blocks / (c * gpu.num_sms) if c > 0 else math.inf
        out.append(ConfigOccupancy(int(m), int(n), res, c, limiter_of(res, gpu), blocks, waves))
    return out


def merge_resources() -> TileResources:
    threads = 32 * MERGE_WARPS
    return TileResources(m=0, n=0, threads=threads, registers=MERGE_REGISTERS, smem=0,
                         source="estimate")
