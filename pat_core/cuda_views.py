"""Device arrays as the CUDA launcher sees them, and the checks made on them before a launch.

:class:`_Dev` reads a torch CUDA tensor, a CuPy array or any ``__cuda_array_interface__``
object without copying: pointer, shape, element strides, dtype name and device.  The checks
refuse what the kernels cannot address (a cache whose offsets pass 32 bits, misaligned rows, a
cache of another page size or head count) with an error naming the argument.
"""
from __future__ import annotations

import numpy as np

from .inputs import byte_extent
from .plan import DTYPE_BYTES, dtype_name


class _Dev:
    """What the launcher needs from a device array: pointer, shape, element strides, dtype."""

    __slots__ = ("obj", "kind", "ptr", "shape", "strides", "dtype", "device")

    def __init__(self, obj, name: str):
        self.obj = obj
        mod = type(obj).__module__
        if mod.startswith("torch"):
            if not obj.is_cuda:
                raise TypeError(f"{name} must be a CUDA tensor for backend='cuda', got a tensor "
                                f"on {obj.device}")
            self.kind = "torch"
            self.ptr = obj.data_ptr()
            self.shape = tuple(obj.shape)
            self.strides = obj.stride()
            dt = obj.dtype
            name_ = _TORCH_DTYPES.get(dt)
            if name_ is None:
                name_ = _TORCH_DTYPES.setdefault(dt, _safe_dtype_name(dt))
            self.dtype = name_
            self.device = obj.get_device()
        elif mod.startswith("cupy"):
            self.kind = "cupy"
            self.ptr = int(obj.data.ptr)
            self.shape = tuple(int(s) for s in obj.shape)
            item = obj.dtype.itemsize
            self.strides = tuple(int(s) // item for s in obj.strides)
            self.dtype = _np_dtype_name(obj.dtype)
            self.device = int(obj.device.id)
        elif hasattr(obj, "__cuda_array_interface__"):
            cai = obj.__cuda_array_interface__
            self.kind = "cai"
            self.ptr = int(cai["data"][0])
            self.shape = tuple(int(s) for s in cai["shape"])
            dt = np.dtype(cai["typestr"])
            if cai.get("strides") is None:
                st, acc = [], 1
                for s in reversed(self.shape):
                    st.append(acc)
                    acc *= s
                self.strides = tuple(reversed(st))
            else:
                self.strides = tuple(int(s) // dt.itemsize for s in cai["strides"])
            self.dtype = _np_dtype_name(dt)
            self.device = None
        else:
            raise TypeError(f"{name} must be a torch CUDA tensor or a CuPy array, got "
                            f"{type(obj).__name__}")

    def ndim(self):
        return len(self.shape)

    def sig(self) -> tuple:
        return (self.kind, self.ptr, self.shape, self.strides, self.dtype, self.device)

    def sig_any_rows(self) -> tuple:
        """:meth:`sig` without the leading dimension's extent beyond one or more than one (the
        checks read a dimension's stride only where it has several entries): a decode loop's
        query buffer keeps its pointer and strides while the batch it holds grows and shrinks."""
        return (self.kind, self.ptr, min(self.shape[0], 2) if self.shape else 0,
                self.shape[1:], self.strides, self.dtype, self.device)


_TORCH_DTYPES: dict = {}   # torch dtype -> canonical name (filled on first sight)


def _data_ptr(a) -> int:
    """Device address of a torch tensor or CuPy array that run() allocated."""
    ptr = getattr(a, "data_ptr", None)
    return int(ptr()) if ptr is not None else int(a.data.ptr)


def _safe_dtype_name(dt) -> str:
    try:
        return dtype_name(dt)
    except TypeError:
        return str(dt).replace("torch.", "")


def _np_dtype_name(dt) -> str:
    s = str(dt)
    if s in ("bfloat16", "|V2") or "bfloat16" in s:
        return "bfloat16"
    if s == "uint8":        # CuPy has no fp8 dtype: an fp8 cache comes as its bytes
        return "uint8"
    return dtype_name(np.dtype(dt).name)


def _check_rows(t: _Dev, name: str, ndim: int):
    if t.ndim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {t.shape}")
    if t.shape[-1] > 1 and t.strides[-1] != 1:
        raise ValueError(f"{name}: the last (head_dim) dimension must be contiguous, got element "
                         f"strides {t.strides}")


def _check_cache(qd: _Dev, kd: _Dev, vd: _Dev, kv_layout: str, page_size: int, Hk: int,
                 D: int) -> tuple:
    """Check the paged KV cache against the plan's page size, KV heads and head_dim, and the
    16-byte alignment and 32-bit offsets of q and both caches.  Returns ``(num_pages, (page,
    token, head) axes)``."""
    _check_rows(kd, "k_cache", 4)
    _check_rows(vd, "v_cache", 4)
    if kd.shape != vd.shape:
        raise ValueError(f"paged_kv_cache: k_cache {kd.shape} and v_cache {vd.shape} differ")
    if kv_layout == "NHD":
        num_pages, ps, hk, d = kd.shape
        axes = (0, 1, 2)
    else:
        num_pages, hk, ps, d = kd.shape
        axes = (0, 2, 1)
    if ps != page_size or hk != Hk or d != D:
        raise ValueError(f"paged_kv_cache has page_size {ps}, {hk} KV heads of dim {d}; the "
                         f"plan expects {page_size}, {Hk}, {D} (kv_layout={kv_layout!r})")
    _check_aligned(qd, "q", (0, 1))
    _check_aligned(kd, "k_cache", (0, 1, 2))
    _check_aligned(vd, "v_cache", (0, 1, 2))
    _check_offsets_32bit(qd, "q", outer=0, inner=(1, 2))
    _check_offsets_32bit(kd, "k_cache", outer=axes[0], inner=(axes[1], axes[2], 3))
    _check_offsets_32bit(vd, "v_cache", outer=axes[0], inner=(axes[1], axes[2], 3))
    return int(num_pages), axes


_INT32_MAX = 2**31 - 1


def _check_offsets_32bit(t: _Dev, name: str, outer: int, inner: tuple):
    """The forward kernel's gather forms an address as (outer index) x (outer stride), one
    32x32 -> 64-bit multiply, plus a 32-bit offset inside the outer slice (a page of the cache, a
    row of q): both must fit in int32.  True of any cache a GPU can hold in the usual layouts
    (a page of 16 tokens x 8 heads x 128 is 16,384 elements); a strided view that breaks it is
    rejected here rather than read out of bounds."""
    inner_span = sum((t.shape[a] - 1) * abs(t.strides[a]) for a in inner)
    if abs(t.strides[outer]) > _INT32_MAX or inner_span > _INT32_MAX:
        raise ValueError(f"{name}: element strides {t.strides} (shape {t.shape}) are too large: "
                         f"the kernels need the stride of axis {outer} and the span of one slice "
                         f"along it within 2**31 - 1 elements")


def _check_aligned(t: _Dev, name: str, axes):
    """cp.async moves 16-byte chunks: row starts must be 16-byte aligned (8 fp16/bf16, 16 fp8
    elements)."""
    per = 16 // _itemsize(t)
    if t.ptr % 16 != 0 or any(t.strides[a] % per != 0 for a in axes if t.shape[a] > 1):
        raise ValueError(f"{name}: the kernels need 16-byte aligned rows (data pointer and the "
                         f"strides of the non-head_dim axes multiples of {per} elements); got "
                         f"pointer {t.ptr:#x}, element strides {t.strides}")


def _itemsize(t: _Dev) -> int:
    """Bytes of one element (uint8: an fp8 cache's bytes); 8 for anything unknown (the
    overlap check then errs on the wide side)."""
    return 1 if t.dtype == "uint8" else DTYPE_BYTES.get(t.dtype, 8)


def _extent(t: _Dev) -> tuple:
    """Byte range of a device array (:func:`pat_core.inputs.byte_extent`)."""
    return byte_extent(t.ptr, t.shape, t.strides, _itemsize(t))
