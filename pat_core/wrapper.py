"""``PrefixAttentionWrapper``: the public plan()/run() API (FlashInfer-style).

Example (CPU)::

    import numpy as np, pat_core
    from pat_core.workloads import build_tree_batch, random_kv_cache
    batch = build_tree_batch("1,4,16_128,256,1024", page_size=16)
    k, v = random_kv_cache(batch.num_pages, 16, num_kv_heads=8, head_dim=128)
    q = np.random.default_rng(0).standard_normal((batch.batch_size, 32, 128)).astype(np.float32)
    w = pat_core.PrefixAttentionWrapper(backend="cpu", packer="pat")
    w.plan(batch.block_tables, batch.seq_lens, 32, 8, 128, 16, kv_data_type="float32")
    out, lse = w.run(q, (k, v), return_lse=True)      # [16, 32, 128], [16, 32]
"""
from __future__ import annotations

import numpy as np

from .inputs import BlockTable
from .packers import PACKERS
from .plan import Plan, dtype_name
from .planner import Planner
from .reference import split_kv_cache

BACKENDS = ("cpu", "cuda")


class PrefixAttentionWrapper:
    """Prefix-aware paged decode attention.

    Parameters
    ----------
    backend : ``"cpu"`` (tile-faithful Numba executor, NumPy / CPU tensors) or ``"cuda"``
        (hand-written kernels through CuPy; torch CUDA tensors or CuPy arrays).
    packer : ``"pat"`` (default), ``"query"``, ``"node"``, ``"compute"`` or ``"cascade"``.
    kv_layout : ``"NHD"`` (``[num_pages, page_size, num_kv_heads, head_dim]``) or ``"HND"``
        (``[num_pages, num_kv_heads, page_size, head_dim]``).
    gpu : GPU model the tile solver plans for (``"h100"``, ``"h200"``, ``"a100"``).  With the
        CUDA backend, the default is the device's own model.
    """

    def __init__(self, backend: str = "cuda", packer: str = "pat", kv_layout: str = "NHD",
                 gpu: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if packer not in PACKERS:
            raise ValueError(f"packer must be one of {PACKERS}, got {packer!r}")
        if kv_layout not in ("NHD", "HND"):
            raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
        self.backend = backend
        self.packer = packer
        self.kv_layout = kv_layout
        self._gpu_backend = None
        if backend == "cuda":
            from .cuda_backend import CudaBackend
            self._gpu_backend = CudaBackend()
            if gpu is None:
                gpu = getattr(self._gpu_backend, "gpu_name", None) or "h100"
        self.planner = Planner(packer, gpu or "h100")
        self._plan: Plan | None = None

    # ------------------------------------------------------------------ plan
    def plan(self, block_tables, seq_lens, num_qo_heads: int, num_kv_heads: int, head_dim: int,
             page_size: int, *, sm_scale: float | None = None, kv_data_type="float16",
             q_data_type=None, tile=None, serial: bool = False, split=True) -> Plan:
        """Pack the batch into CTAs and pick tiles.  Host arrays only; no device copies back.

        Parameters
        ----------
        block_tables : int ``[batch, max_blocks]`` (padding past ``ceil(seq_len/page_size)``
            ignored), a list of page lists, or a :class:`~pat_core.inputs.BlockTable` (for
            FlashInfer's CSR form use ``BlockTable.from_csr`` and pass ``seq_lens=None``).
        seq_lens : int ``[batch]``, every entry ``>= 1``.
        num_qo_heads, num_kv_heads : head counts; ``num_qo_heads % num_kv_heads == 0``.
        head_dim, page_size : ints.
        sm_scale : softmax scale, default ``1 / sqrt(head_dim)``.
        kv_data_type : dtype of the KV cache (``"float16"``, ``"bfloat16"``, ``"float32"``),
            used by the byte accounting and the tile solver.
        q_data_type : dtype of the queries and output when it differs (byte accounting).
        tile : force one ``(m, n)`` for every CTA (the fixed-tile ablation).
        serial : launch tile groups one after another on one stream (ablation).
        split : long-KV split: ``True``/``"sm"`` (default: split CTAs longer than an SM's
            share of the work), ``"mean"`` (the PAT paper's mean rule) or ``False``.

        Returns the :class:`~pat_core.plan.Plan` (also kept for :meth:`run`).
        """
        plan = self.planner.plan(block_tables, seq_lens, num_qo_heads, num_kv_heads, head_dim,
                                 page_size, sm_scale=sm_scale, kv_data_type=kv_data_type,
                                 q_data_type=q_data_type, tile=tile, serial=serial, split=split)
        if self._gpu_backend is not None:
            self._gpu_backend.upload(plan)
        self._plan = plan
        return plan

    def plan_csr(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
                 head_dim: int, page_size: int, **kwargs) -> Plan:
        """:meth:`plan` from FlashInfer's CSR form (``indptr``, ``indices``, ``last_page_len``)."""
        bt = BlockTable.from_csr(indptr, indices, last_page_len, page_size)
        return self.plan(bt, None, num_qo_heads, num_kv_heads, head_dim, page_size, **kwargs)

    @property
    def current_plan(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("call plan() before run() or stats()")
        return self._plan

    def stats(self) -> dict:
        """Byte accounting and tile histogram of the current plan (:meth:`Plan.stats`)."""
        return self.current_plan.stats()

    # ------------------------------------------------------------------ run
    def run(self, q, paged_kv_cache, return_lse: bool = False):
        """Attention of every request's query against its paged KV cache.

        Parameters
        ----------
        q : ``[batch, num_qo_heads, head_dim]``.
        paged_kv_cache : ``(k_cache, v_cache)`` 4-D in ``kv_layout``, or the 5-D single tensor
            ``[num_pages, 2, ...]``.

        Returns ``out [batch, num_qo_heads, head_dim]`` in q's dtype (float32 on the CPU backend
        for float32 inputs) and, with ``return_lse``, float32 ``lse [batch, num_qo_heads]``
        (natural log of the sum of exponentials of the scaled scores).
        """
        plan = self.current_plan
        k_cache, v_cache = split_kv_cache(paged_kv_cache, self.kv_layout)
        if self._gpu_backend is not None:
            plan.check_inputs(q, k_cache, v_cache, self.kv_layout)
            return self._gpu_backend.run(plan, q, k_cache, v_cache, kv_layout=self.kv_layout,
                                         return_lse=return_lse)
        from .executor import execute             # checks its inputs against the plan
        qdt = _dtype_of(q)
        out_dtype = np.float16 if qdt == "float16" else np.float32
        out, lse = execute(plan, q, k_cache, v_cache, kv_layout=self.kv_layout,
                           return_lse=True, input_dtype=qdt, out_dtype=out_dtype)
        if hasattr(q, "detach"):               # CPU torch in, CPU torch out (q's dtype)
            import torch
            out = torch.from_numpy(out).to(q.dtype)
            lse = torch.from_numpy(lse)
        return (out, lse) if return_lse else out


def _dtype_of(x, name: str = "q") -> str:
    return dtype_name(getattr(x, "dtype", None), name)
