"""Pick a packer for one batch by the simulator's predicted latency.

The ``pat`` packer's plans read each shared page once but pay for partial results, a merge and
more forward launches (one per tile shape); the ``query`` packer's plans re-read shared pages (mostly from L2) and need
none of that.  The planner chooses between its rules by bytes; on small steps of deep trees
(many 32-token nodes) bytes are the wrong measure, and ``query`` measures up to 1.5x faster.
The simulator ranks the two correctly on every sharing configuration of the H100 calibration
(``bench/results/calibration_h100_v13.json``: 76 of 76, fit and validation workloads), so
:func:`choose_packer` plans the batch with each candidate packer, simulates each plan and keeps
``pat`` unless another candidate is predicted faster by more than ``margin``.

Measured on the calibration files (``python bench/lab/sim_choice_check.py``; ``bench/NOTES.md``):
with the 2% margin, the chosen plans are never slower than ``pat``'s on any of the
four measurement sets checked (H100 and H200, chained and forked launches) and 5-8% faster in
geometric mean over their validation workloads (up to 2.2x on one configuration); they change
nothing on the benchmarks' development set, where ``pat`` is never slower.  The margin keeps
near ties on ``pat``: at 0% one configuration of 76 lost 9% (H100) and one lost 13% (H200).

Planning and simulating costs milliseconds per candidate, so this is a tool for choosing a
packer per workload (or per batch shape), not a step of every ``plan()``.  It lives here, not
in :mod:`pat_core`, so the library never depends on the simulator (plans flow one way: planner,
then executor or simulator).

>>> from pat_core.workloads import build_tree_batch
>>> b = build_tree_batch("1,2,4,8,16,32_32,32,32,32,32,32", page_size=16)
>>> choose_packer(b.block_tables, b.seq_lens, 32, 8, 128, 16).packer
'query'
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from pat_core import PACKERS, Planner

from .constants import SimConstants, load_constants
from .model import simulate

# a candidate replaces the default only when predicted faster by more than this share
DEFAULT_MARGIN = 0.02


@dataclass
class PackerChoice:
    """What :func:`choose_packer` decided.

    ``packer``: the chosen packer (a key of :data:`pat_core.PACKERS`); ``predicted_us``:
    ``{packer: predicted latency in us}`` for every candidate; ``plans``: ``{packer: Plan}``
    (the chosen one can be passed on as it is); ``default``: the packer kept unless beaten;
    ``margin``: the share by which a candidate had to be faster.
    """
    packer: str
    predicted_us: dict
    plans: dict = field(repr=False)
    default: str = "pat"
    margin: float = DEFAULT_MARGIN

    @property
    def plan(self):
        """The chosen packer's :class:`pat_core.Plan`."""
        return self.plans[self.packer]


def choose_packer(block_tables, seq_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                  page_size: int, *, gpu: str = "h100", candidates=("pat", "query"),
                  default: str = "pat", margin: float = DEFAULT_MARGIN,
                  constants: SimConstants | str | None = None, timing: str = "graph",
                  kv_data_type: str = "float16") -> PackerChoice:
    """Plan the batch with each packer of ``candidates``, simulate each plan, and return the
    ``default`` packer unless a candidate is predicted faster than it by more than ``margin``
    (then the fastest predicted).

    ``block_tables``/``seq_lens``/heads/``head_dim``/``page_size``: as for
    :meth:`pat_core.Planner.plan`.  ``gpu``: the GPU to plan and simulate for (its constants,
    ``sim/data/<gpu>.json``, unless ``constants`` names a file or gives them).  ``timing``:
    ``"graph"`` (default) or ``"eager"``, as :func:`sim.simulate`.
    """
    cands = tuple(candidates)
    if not cands or any(c not in PACKERS for c in cands):
        raise ValueError(f"candidates must be packers of {PACKERS}, got {candidates!r}")
    if default not in cands:
        raise ValueError(f"default must be one of candidates {cands}, got {default!r}")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or \
            not math.isfinite(margin) or not 0 <= margin < 1:
        raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
    if isinstance(constants, str) and not os.path.isfile(constants):
        raise ValueError(f"constants: no such file {constants!r}")
    if constants is None or isinstance(constants, str):
        constants = load_constants(gpu, constants)
    plans, pred = {}, {}
    for c in dict.fromkeys(cands):
        plans[c] = Planner(c, gpu).plan(block_tables, seq_lens, num_qo_heads, num_kv_heads,
                                        head_dim, page_size, kv_data_type=kv_data_type)
        pred[c] = simulate(plans[c], gpu, constants, timing=timing).latency_us
    return PackerChoice(packer=pick(pred, default, margin), predicted_us=pred, plans=plans,
                        default=default, margin=float(margin))


def pick(predicted_us: dict, default: str = "pat", margin: float = DEFAULT_MARGIN) -> str:
    """The rule of :func:`choose_packer` on predictions already made: ``default`` unless the
    fastest entry of ``predicted_us`` (``{name: us}``, holding ``default``) is faster than it by
    more than ``margin``; ties go to ``default``."""
    best = min(predicted_us, key=lambda c: (predicted_us[c], c != default))
    return best if predicted_us[best] < predicted_us[default] * (1.0 - margin) else default
