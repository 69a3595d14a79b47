"""Simulator of PAT decode attention: memory traffic, SM occupancy, a timeline of the CUDA
backend's launches and predicted latency for any :class:`pat_core.Plan`, on a machine without a
GPU.

>>> import pat_core, sim
>>> from pat_core.workloads import build_tree_batch
>>> b = build_tree_batch("1,4,16_128,256,1024", page_size=16)
>>> plan = pat_core.Planner("pat", "h100").plan(b.block_tables, b.seq_lens, 32, 8, 128, 16)
>>> r = sim.simulate(plan)
>>> r.bytes["total"] == plan.stats()["total_bytes"]
True

Modules: :mod:`sim.traffic` (bytes by kind, padding waste), :mod:`sim.occupancy` (resident
blocks per SM), :mod:`sim.timeline` (event-driven scheduler), :mod:`sim.model` (cost model and
:func:`simulate`), :mod:`sim.constants` (per-GPU constants in ``sim/data``), :mod:`sim.methods`
(batches and methods), :mod:`sim.calibration` (fit and report), :mod:`sim.choose` (a packer
picked by predicted latency), :mod:`sim.plots`, :mod:`sim.cli` (``python -m sim``).
"""
from .choose import PackerChoice, choose_packer
from .constants import SimConstants, default_constants, load_constants, save_constants
from .model import SimResult, prepare, predict, simulate
from .occupancy import plan_occupancy
from .traffic import bytes_by_kind, padding_waste

__all__ = ["simulate", "SimResult", "prepare", "predict", "SimConstants", "load_constants",
           "save_constants", "default_constants", "plan_occupancy", "bytes_by_kind",
           "padding_waste", "choose_packer", "PackerChoice"]
