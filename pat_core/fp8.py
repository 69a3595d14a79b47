"""FP8 (``float8_e4m3fn``) KV caches on the host: decoding and the per-tensor scales.

An fp8 KV cache stores each K and V element in one byte, ``float8_e4m3fn`` (1 sign bit, 4
exponent bits of bias 7, 3 mantissa bits; no infinities, ``0x7F``/``0xFF`` are NaN; largest
finite value 448), with one float scale per tensor: attention reads ``k_scale * k`` and
``v_scale * v`` (FlashInfer's convention).  The library needs neither ml_dtypes nor torch for
it: a cache is recognised by its dtype's name and its bytes are decoded through
:data:`E4M3FN_TO_F32`, a 256-entry table built here.

Accepted host forms of an fp8 cache: a NumPy array of ``ml_dtypes.float8_e4m3fn`` and a CPU
torch ``float8_e4m3fn`` tensor.  Raw ``uint8`` arrays are refused (nothing says their bytes are
e4m3fn rather than another 8-bit format).
"""
from __future__ import annotations

import math

import numpy as np

FP8_DTYPE = "float8_e4m3fn"
E4M3FN_MAX = 448.0
# largest scale the kernels can take: they hold scales as float32, where a larger one is inf
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _e4m3fn_table() -> np.ndarray:
    """float32 ``[256]``: the value of every e4m3fn byte, exactly (all are float32 values)."""
    table = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exp = (code >> 3) & 0xF
        mant = code & 0x7
        if exp == 0xF and mant == 0x7:          # the only NaN pattern (no infinities)
            table[code] = np.nan
        elif exp == 0:                          # subnormal: mant/8 * 2**(1 - 7)
            table[code] = sign * math.ldexp(mant, -9)
        else:
            table[code] = sign * math.ldexp(8 + mant, exp - 10)
    return table


E4M3FN_TO_F32 = _e4m3fn_table()
E4M3FN_TO_F32.flags.writeable = False


def is_fp8(x) -> bool:
    """Whether ``x`` (an array, a tensor or a dtype) is ``float8_e4m3fn``, by the dtype's name."""
    dt = getattr(x, "dtype", x)
    return str(dt).replace("torch.", "") == FP8_DTYPE


def kv_cache_dtype(x, name: str = "paged_kv_cache") -> str:
    """Canonical dtype name of a KV cache array.  CuPy has no fp8 dtype, so a CuPy ``uint8``
    array counts as the bytes of a ``float8_e4m3fn`` cache (the CUDA backend reads them as
    such); every other array goes through :func:`pat_core.plan.dtype_name`."""
    if type(x).__module__.startswith("cupy") and str(getattr(x, "dtype", "")) == "uint8":
        return FP8_DTYPE
    from .plan import dtype_name
    return dtype_name(getattr(x, "dtype", None), name)


def fp8_bytes(x) -> np.ndarray:
    """The raw bytes of an fp8 host array as a ``uint8`` NumPy array of the same shape (a view
    where the input's memory allows: NumPy ml_dtypes arrays and CPU torch tensors)."""
    if hasattr(x, "detach") and hasattr(x, "view"):                 # torch tensor
        if str(x.device) != "cpu":
            x = x.cpu()
        import torch                                                # only for a torch input
        return x.detach().view(torch.uint8).numpy()
    arr = np.asarray(x)
    if not is_fp8(arr):
        raise TypeError(f"expected a float8_e4m3fn array, got {arr.dtype}")
    return arr.view(np.uint8)


def decode_e4m3fn(x) -> np.ndarray:
    """float32 values (same shape) of an fp8 array: a NumPy ``ml_dtypes.float8_e4m3fn`` array,
    a CPU torch ``float8_e4m3fn`` tensor, or ``uint8`` codes.  Exact: every e4m3fn value is a
    float32 value."""
    codes = x if isinstance(x, np.ndarray) and x.dtype == np.uint8 else fp8_bytes(x)
    return E4M3FN_TO_F32[codes]


def as_scale(value, name: str) -> float:
    """A per-tensor scale as a Python float, read once on the host.

    Accepted: a real number (int or float, not bool), a NumPy scalar, or an array or tensor of
    exactly one element (0-d or ``[1]``; a device tensor is copied to the host, which waits
    for it).  The value must be finite and positive, and finite as a float32 (the kernels'
    type).  ``None`` means 1.  Anything else raises
    ``TypeError``/``ValueError`` naming ``name``.
    """
    if value is None:
        return 1.0
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a number, got the bool {value!r}")
    if isinstance(value, (int, float, np.integer, np.floating)):
        try:
            v = float(value)
        except OverflowError:               # an int past the float range
            raise ValueError(f"{name} must be a positive finite number, got an int of "
                             f"{len(str(abs(value)))} digits") from None
    elif hasattr(value, "shape") and hasattr(value, "dtype"):
        size = int(np.prod(tuple(int(s) for s in value.shape)))
        if size != 1 or len(value.shape) > 1:
            raise ValueError(f"{name} must be a number or a one-element (0-d or [1]) array, "
                             f"got shape {tuple(value.shape)}")
        kind = str(value.dtype).replace("torch.", "")
        if not (kind.startswith("float") or kind.startswith("bfloat") or
                kind.startswith("int") or kind.startswith("uint")) or kind.startswith("float8"):
            raise TypeError(f"{name} must hold a real number, got dtype {value.dtype}")
        v = float(value.reshape(-1)[0].item())
    else:
        raise TypeError(f"{name} must be a float or a one-element array, got "
                        f"{type(value).__name__}")
    if not math.isfinite(v) or v <= 0.0 or v > FLOAT32_MAX:
        raise ValueError(f"{name} must be a positive finite number (at most the float32 "
                         f"maximum, 3.4e38), got {v}")
    return v
