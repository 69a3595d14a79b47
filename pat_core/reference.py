"""Dense attention references on the CPU: the ground truth every executor is checked against.

* :func:`dense_attention`: float64, one request at a time over its gathered KV; with
  ``qo_indptr``, several query tokens per request, causal among themselves.
* :func:`lowp_attention`: the same computation carried out entirely in the input's low
  precision (fp16 products, sums and softmax), the "plain same-dtype implementation" whose
  error sets the tolerance for fp16 kernels (a kernel may be at most twice as wrong).
"""
from __future__ import annotations

import numpy as np

from .fp8 import as_scale, decode_e4m3fn, is_fp8
from .inputs import as_block_table


def to_numpy_f32(x, name: str = "array") -> np.ndarray:
    """Host float32 copy of a NumPy array or CPU torch tensor (bf16 and ``float8_e4m3fn``
    included, exactly: fp8 bytes go through :func:`pat_core.fp8.decode_e4m3fn`)."""
    if is_fp8(x):
        return decode_e4m3fn(x)
    if hasattr(x, "detach") and hasattr(x, "float"):
        if str(x.device) != "cpu":
            x = x.cpu()
        return x.detach().float().numpy()
    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":        # ml_dtypes: exact widening
        return arr.astype(np.float32)
    if not np.issubdtype(arr.dtype, np.floating):
        raise TypeError(f"{name} must be a floating-point array, got {arr.dtype}")
    return arr.astype(np.float32, copy=False)


def split_kv_cache(paged_kv_cache, kv_layout: str = "NHD"):
    """``(k_cache, v_cache)`` from a tuple or the 5-D single tensor form.

    5-D form: ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD) or
    ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND), K at index 0 of axis 1.
    """
    if kv_layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError("paged_kv_cache tuple must be (k_cache, v_cache)")
        k, v = paged_kv_cache
        for t in (k, v):
            if not (hasattr(t, "shape") and hasattr(t, "dtype")):
                raise TypeError("paged_kv_cache must hold arrays (NumPy, torch or CuPy), got "
                                f"{type(t).__name__}; wrap nested lists with np.asarray")
    else:
        if not hasattr(paged_kv_cache, "shape"):
            raise TypeError("paged_kv_cache must be a (k_cache, v_cache) tuple or a 5-D array, "
                            f"got {type(paged_kv_cache).__name__}")
        if len(paged_kv_cache.shape) != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError("paged_kv_cache must be a (k_cache, v_cache) tuple or a 5-D tensor "
                             f"[num_pages, 2, ...]; got shape {tuple(paged_kv_cache.shape)}")
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if len(k.shape) != 4 or tuple(k.shape) != tuple(v.shape):
        raise ValueError("paged_kv_cache: k_cache and v_cache must be 4-D with equal shapes, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    return k, v


def gather_kv(cache: np.ndarray, pages: np.ndarray, seq_len: int, kv_layout: str) -> np.ndarray:
    """One request's tokens ``[seq_len, num_kv_heads, head_dim]`` from a 4-D paged cache."""
    blocks = cache[pages]                                # [P, ps, H, d] or [P, H, ps, d]
    if kv_layout == "HND":
        blocks = blocks.transpose(0, 2, 1, 3)
    return blocks.reshape(-1, blocks.shape[2], blocks.shape[3])[:seq_len]


def _attend(q, k, v, scale, dtype):
    """Attention of one request: q ``[Hq, d]``, k/v ``[L, Hk, d]`` in ``dtype`` arithmetic."""
    hq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    qg = q.reshape(hk, g, d).astype(dtype)
    kk = k.transpose(1, 0, 2).astype(dtype)             # [Hk, L, d]
    vv = v.transpose(1, 0, 2).astype(dtype)
    s = np.matmul(qg, kk.transpose(0, 2, 1)) * dtype(scale)   # [Hk, g, L]
    mx = s.max(axis=-1, keepdims=True)
    p = np.exp(s - mx)
    den = p.sum(axis=-1, keepdims=True)
    o = np.matmul(p, vv) / den                           # [Hk, g, d]
    lse = (np.log(den.astype(np.float64)) + mx.astype(np.float64))[..., 0]
    return o.reshape(hq, d), lse.reshape(hq)


def _run_reference(q, paged_kv_cache, block_tables, seq_lens, page_size, kv_layout, sm_scale,
                   dtype, k_scale=1.0, v_scale=1.0, qo_indptr=None):
    k_cache, v_cache = split_kv_cache(paged_kv_cache, kv_layout)
    kc = to_numpy_f32(k_cache, "k_cache") if dtype is not np.float16 else np.asarray(k_cache)
    vc = to_numpy_f32(v_cache, "v_cache") if dtype is not np.float16 else np.asarray(v_cache)
    if k_scale != 1.0 or v_scale != 1.0:     # FlashInfer's per-tensor scales, in float64
        kc = kc.astype(np.float64) * k_scale
        vc = vc.astype(np.float64) * v_scale
    qq = to_numpy_f32(q, "q") if dtype is not np.float16 else np.asarray(q)
    bt = as_block_table(block_tables, seq_lens, page_size)
    if qo_indptr is None:
        qo = np.arange(bt.batch_size + 1, dtype=np.int64)
    else:
        from .inputs import check_qo_indptr
        qo = check_qo_indptr(qo_indptr, bt.seq_lens).astype(np.int64)
    if qq.ndim != 3 or qq.shape[0] != qo[-1]:
        raise ValueError(f"q must be [qo_indptr[-1]={int(qo[-1])}, num_qo_heads, head_dim], got "
                         f"{tuple(qq.shape)}")
    from .inputs import check_heads
    check_heads(int(qq.shape[1]), int(kc.shape[2] if kv_layout == "NHD" else kc.shape[1]),
                int(qq.shape[2]))
    d = qq.shape[-1]
    scale = 1.0 / np.sqrt(d) if sm_scale is None else sm_scale
    out = np.empty(qq.shape, dtype=np.float64)
    lse = np.empty(qq.shape[:2], dtype=np.float64)
    for r in range(bt.batch_size):
        pages = bt.pages_of(r)
        L = int(bt.seq_lens[r])
        k = gather_kv(kc, pages, L, kv_layout)
        v = gather_kv(vc, pages, L, kv_layout)
        n = int(qo[r + 1] - qo[r])
        for j in range(n):
            # causal: token j of n sees the positions before it and itself, the last n - 1 - j
            # new tokens not (seq_lens include the new tokens)
            lim = L - n + 1 + j
            o, l = _attend(qq[qo[r] + j], k[:lim], v[:lim], scale, dtype)
            out[qo[r] + j] = o
            lse[qo[r] + j] = l
    return out, lse


def dense_attention(q, paged_kv_cache, block_tables, seq_lens, page_size: int,
                    kv_layout: str = "NHD", sm_scale: float | None = None,
                    return_lse: bool = False, k_scale=None, v_scale=None, qo_indptr=None):
    """Float64 decode attention, the ground truth.

    Parameters
    ----------
    q : ``[N, num_qo_heads, head_dim]`` NumPy array or CPU tensor (any float dtype), ``N`` the
        batch size, or ``qo_indptr[-1]`` with ``qo_indptr``.
    paged_kv_cache : ``(k_cache, v_cache)``, each ``[num_pages, page_size, num_kv_heads,
        head_dim]`` (NHD) or ``[num_pages, num_kv_heads, page_size, head_dim]`` (HND); any
        float dtype, ``float8_e4m3fn`` included (NumPy ml_dtypes array or CPU torch tensor,
        decoded exactly).
    block_tables, seq_lens : any form :func:`~pat_core.inputs.as_block_table` accepts.
    k_scale, v_scale : per-tensor scales (:func:`pat_core.fp8.as_scale`; ``None`` is 1): the
        scores are ``sm_scale * q . (k_scale * k)`` and the output ``softmax @ (v_scale * v)``,
        in float64.
    qo_indptr : optional int ``[batch + 1]`` (FlashInfer's ragged queries): request ``r`` owns
        query rows ``qo_indptr[r]:qo_indptr[r + 1]`` (``n`` tokens, 1..16), its
        ``seq_len`` includes them, and its token ``j`` sees the positions
        ``< seq_len - n + 1 + j`` (causal).  ``None``: one token per request.

    Returns float64 ``[N, num_qo_heads, head_dim]`` (and float64 ``[N, num_qo_heads]``
    natural-log LSE of the scaled scores when ``return_lse``).
    """
    out, lse = _run_reference(q, paged_kv_cache, block_tables, seq_lens, page_size, kv_layout,
                              sm_scale, np.float64, as_scale(k_scale, "k_scale"),
                              as_scale(v_scale, "v_scale"), qo_indptr)
    return (out, lse) if return_lse else out


def lowp_attention(q, paged_kv_cache, block_tables, seq_lens, page_size: int,
                   kv_layout: str = "NHD", sm_scale: float | None = None, qo_indptr=None):
    """Decode attention computed in float16 throughout (NumPy), returned as float64
    (``qo_indptr`` as :func:`dense_attention`'s)."""
    q16 = np.asarray(to_numpy_f32(q, "q")).astype(np.float16)
    k, v = split_kv_cache(paged_kv_cache, kv_layout)
    kv16 = (to_numpy_f32(k, "k_cache").astype(np.float16),
            to_numpy_f32(v, "v_cache").astype(np.float16))
    out, _ = _run_reference(q16, kv16, block_tables, seq_lens, page_size, kv_layout, sm_scale,
                            np.float16, qo_indptr=qo_indptr)
    return out


def relative_error(x, ref) -> float:
    """Norm-wise relative error ``||x - ref|| / ||ref||`` in float64."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = float(np.linalg.norm(ref))
    return float(np.linalg.norm(x - ref)) / (den if den > 0 else 1.0)
