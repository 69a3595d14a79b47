"""Model constants of the simulator, one JSON file per GPU under ``sim/data/``.

The timing model (see :mod:`sim.model`) has sixteen constants.  They are data, not code, so that a
calibration run on a real GPU can replace the estimates without touching the model:

=====================  ==========  ==================================================================
name                   unit        meaning
=====================  ==========  ==================================================================
``hbm_bandwidth``      bytes/ns    achieved DRAM bandwidth of the whole GPU (copy-kernel bandwidth)
``sm_bandwidth``       bytes/ns    most one SM can pull from memory, however many blocks it holds
``l2_bandwidth``       bytes/ns    L2 hits served to all SMs together (see :mod:`sim.l2`)
``block_ns``           ns          per thread block latency not hidden by the KV pipeline (query
                                   load, first tile in flight, partial write)
``tile_ns``            ns          fixed cost per KV tile (barriers, softmax bookkeeping)
``tile_lat_ns``        ns          latency chain of one KV tile (page ids, K/V loads, MMAs, softmax
                                   in series) run by one warp; a block of ``w`` warps cannot end
                                   before ``block_ns + tiles * tile_lat_ns / w`` (0: off)
``sm_flops``           flop/ns     tensor-core throughput of one SM on the ``Q K^T`` / ``P V`` tiles
``wg_flops``           flop/ns     the same for the Hopper warpgroup (``wgmma``) tiles of 64 and 128
                                   rows (0: they take ``sm_flops`` too)
``merge_slot_ns``      ns          merge kernel: time per partial slot of one (request, head) pair
``start_ns``           ns          eager timing: fixed latency before the first launch is issued
``launch_ns``          ns          eager timing: host cost per kernel launch (issue interval)
``gap_ns``             ns          eager timing: device gap between a kernel and one that waits for it
``graph_start_ns``     ns          graph timing: fixed latency of a graph replay before its first
                                   kernel node is issued (the same for one launch or twelve)
``graph_launch_ns``    ns          graph timing: issue interval of the launches of a replayed graph
``graph_gap_ns``       ns          graph timing: gap between a kernel node and one that depends on it
``graph_join_ns``      ns          graph timing: extra wait of a kernel node that depends on two or
                                   more concurrent launches (measured by ``bench/calibrate.py``;
                                   the one launch path forks none, so the model prices nothing
                                   with it)
=====================  ==========  ==================================================================

Two timing modes (:data:`TIMINGS`) share the kernel constants and differ in the launch costs:
``graph`` (the default) is a CUDA-graph replay of the decode step, as a serving loop that captures
decode runs it; ``eager`` is ``run()`` called from Python, each launch paying the host's cost.

(``1 bytes/ns == 1 GB/s``.)  A file holds ``{"gpu": ..., "source": ..., "constants": {...}}``;
``source`` is ``"default estimate"`` until :func:`sim.calibration.fit` writes measured values, and
then names the measurement file, device and date.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace

from pat_core.gpus import GPUS, GPUSpec, get_gpu

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


@dataclass(frozen=True)
class SimConstants:
    """The timing model's constants (units in the module docstring)."""

    hbm_bandwidth: float
    sm_bandwidth: float
    block_ns: float
    tile_ns: float
    sm_flops: float
    launch_ns: float
    gap_ns: float
    merge_slot_ns: float
    l2_bandwidth: float = 6000.0
    graph_launch_ns: float = 1500.0
    graph_gap_ns: float = 1500.0
    start_ns: float = 0.0
    graph_start_ns: float = 0.0
    graph_join_ns: float = 0.0
    tile_lat_ns: float = 0.0
    wg_flops: float = 0.0
    source: str = "default estimate"

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("source")
        return d

    def with_values(self, **kw) -> "SimConstants":
        return replace(self, **kw)

    @classmethod
    def names(cls) -> tuple:
        return tuple(f.name for f in fields(cls) if f.name != "source")

    def launch_costs(self, timing: str = "graph") -> tuple:
        """``(launch_ns, gap_ns)`` of timing mode ``timing`` (``"graph"`` or ``"eager"``)."""
        check_timing(timing)
        if timing == "eager":
            return float(self.launch_ns), float(self.gap_ns)
        return float(self.graph_launch_ns), float(self.graph_gap_ns)

    def start_cost(self, timing: str = "graph") -> float:
        """Fixed latency (ns) before the first launch of timing mode ``timing`` is issued."""
        check_timing(timing)
        return float(self.start_ns if timing == "eager" else self.graph_start_ns)


TIMINGS = ("graph", "eager")


def check_timing(timing) -> str:
    """``timing`` if it names a timing mode, else ``ValueError``."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be one of {TIMINGS}, got {timing!r}")
    return timing


def gpu_key(gpu) -> str:
    """Short key (``"h100"``) of a GPU spec or name; a spec not in :data:`pat_core.GPUS` maps to
    the known GPU whose name it shares (``dataclasses.replace`` keeps the name)."""
    spec = get_gpu(gpu)
    for key, known in GPUS.items():
        if known == spec or known.name == spec.name:
            return key
    return spec.name.lower().split("-")[0]


def default_constants(gpu) -> SimConstants:
    """First-principles estimates for a GPU spec (used when no data file exists).

    * DRAM: the spec's datasheet bandwidth times its ``achieved_bw_fraction``.
    * one SM: about 2.5x its fair share of DRAM bandwidth (an SM with enough loads in flight
      pulls more than ``1 / num_sms`` of the total; it cannot pull all of it).
    * block latency: one global-memory round trip for Q plus one for the first KV tile.
    * tensor cores: half the dense fp16 peak (2048 flop/clk/SM on sm_80, 4096 on sm_90): the
      kernels issue ``mma.sync``, which does not reach the sm_90 ``wgmma`` peak, on small tiles.
    * L2: the spec's ``l2_bandwidth`` estimate.
    * launches: a few microseconds per eager launch, about a microsecond in a graph.
    * fixed start latencies (``start_ns``, ``graph_start_ns``): 0, so that a constants file
      without them predicts what it did before they existed; a fit starts them from
      :data:`sim.calibration.START_GUESS_NS`.  The graph join cost (``graph_join_ns``): 0 for
      the same reason (``bench/calibrate.py`` measures it).  The latency chain of a tile
      (``tile_lat_ns``): 0 for the same reason; a fit starts it from
      :data:`sim.calibration.START_GUESS_NS`.
    """
    spec = get_gpu(gpu)
    hbm = spec.hbm_bandwidth * spec.achieved_bw_fraction
    sm80 = spec.name.upper().startswith("A100")
    flop_clk = 2048 if sm80 else 4096
    return SimConstants(
        hbm_bandwidth=round(hbm, 1),
        sm_bandwidth=round(2.5 * hbm / spec.num_sms, 1),
        block_ns=round(2 * spec.mem_latency_ns, 1),
        tile_ns=150.0,
        sm_flops=round(0.5 * flop_clk * spec.sm_clock_ghz, 1),
        launch_ns=3000.0,
        gap_ns=1000.0,
        merge_slot_ns=300.0,
        l2_bandwidth=round(spec.l2_bandwidth or 2.0 * hbm, 1),
        graph_launch_ns=1500.0,
        graph_gap_ns=1500.0,
        start_ns=0.0,
        graph_start_ns=0.0,
        graph_join_ns=0.0,
        tile_lat_ns=0.0,
        source="default estimate",
    )


def constants_path(gpu) -> str:
    return os.path.join(DATA_DIR, f"{gpu_key(gpu)}.json")


def load_constants(gpu, path: str | None = None) -> SimConstants:
    """Constants for ``gpu``.

    Without ``path``: the packaged ``sim/data/<gpu>.json`` (constants it lacks keep the
    first-principles estimate of :func:`default_constants`, so older files predict what they
    did), else the estimate itself.  With ``path``: that file, strictly (see
    :func:`read_constants_file`): a mistyped path or a file missing a constant is an error,
    never a silent fall-back to uncalibrated estimates.
    """
    if path is not None:
        return read_constants_file(path)
    path = constants_path(gpu)
    if not os.path.exists(path):
        return default_constants(gpu)
    data = _read_json_object(path)
    base = default_constants(gpu).as_dict()
    vals = _constant_values(data, path)
    base.update(vals)
    return SimConstants(**base, source=str(data.get("source", "unknown")))


def read_constants_file(path: str) -> SimConstants:
    """A constants file named by the user: it must exist, be a JSON object whose
    ``"constants"`` hold every one of :meth:`SimConstants.names` as a finite number (what
    :func:`save_constants` and ``python -m sim fit`` write); ``ValueError`` naming the file
    and what is wrong otherwise."""
    data = _read_json_object(path)
    vals = _constant_values(data, path)
    missing = [n for n in SimConstants.names() if n not in vals]
    if missing:
        raise ValueError(f"constants file {path}: missing constants {missing}; a constants "
                         f"file must hold all {len(SimConstants.names())} (as "
                         f"'python -m sim fit' writes them)")
    return SimConstants(**vals, source=str(data.get("source", "unknown")))


def _read_json_object(path: str) -> dict:
    """The JSON object in file ``path``; ``ValueError`` naming the file when it does not exist,
    is not a regular file, or does not hold a JSON object."""
    if not os.path.exists(path):
        raise ValueError(f"constants file {path}: no such file")
    if not os.path.isfile(path):
        raise ValueError(f"constants file {path}: not a regular file")
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:          # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"constants file {path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"constants file {path}: expected a JSON object, got "
                         f"{type(data).__name__}")
    return data


def _finite(v) -> bool:
    """Whether number ``v`` is a finite float (an int too large for a float is not)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _constant_values(data: dict, path: str) -> dict:
    """``data["constants"]`` as ``{name: float}``; unknown names, booleans, strings and
    non-finite numbers are refused (a typo must not leave a constant at its estimate)."""
    vals = data.get("constants", {})
    if not isinstance(vals, dict):
        raise ValueError(f"constants file {path}: 'constants' must be an object")
    unknown = set(vals) - set(SimConstants.names())
    if unknown:
        raise ValueError(f"{path}: unknown constants {sorted(unknown)}")
    out = {}
    for k, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
            raise ValueError(f"constants file {path}: {k} must be a finite number, got {v!r}")
        out[k] = float(v)
    return out


def save_constants(consts: SimConstants, gpu, path: str | None = None, extra: dict | None = None
                   ) -> str:
    """Write ``consts`` as ``{"gpu", "source", "constants", ...extra}``; returns the path."""
    path = path or constants_path(gpu)
    spec: GPUSpec = get_gpu(gpu)
    data = {"gpu": spec.name, "source": consts.source, "constants": consts.as_dict()}
    if extra:
        data.update(extra)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
    return path
