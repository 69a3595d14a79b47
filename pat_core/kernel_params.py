"""Host mirror of the kernels' parameter structs (``cuda_src/pat_params.cuh``).

Every forward and merge launch takes one struct by value; these ``ctypes`` structures have the
same fields in the same order, so ``ctypes`` lays them out exactly as nvcc does (pointers and
64-bit integers 8-byte aligned, 32-bit fields 4-byte aligned).  ``tests/test_kernel_params.py``
parses the header and checks the two spellings agree field by field.

Pure Python (no CuPy): pointers are plain integers (device addresses).
"""
from __future__ import annotations

import ctypes
import re

_P = ctypes.c_uint64      # a device pointer
_I32 = ctypes.c_int32
_I64 = ctypes.c_int64


class MergeArgs(ctypes.Structure):
    """``pat::MergeArgs``: where a forward item writes a single-slot request's output."""

    _fields_ = [("req_slot_indptr", _P), ("out", _P), ("lse_out", _P),
                ("out_sb", _I64), ("out_sh", _I64), ("lse_sb", _I64), ("lse_sh", _I64)]


class FwdParams(ctypes.Structure):
    """``pat::FwdParams``: one forward launch (see the header for every field)."""

    _fields_ = [("q", _P), ("k_cache", _P), ("v_cache", _P), ("o_partial", _P),
                ("lse_partial", _P), ("cta_req_indptr", _P), ("cta_req", _P), ("cta_slot", _P),
                ("cta_kv_start", _P), ("cta_kv_len", _P), ("cta_page_indptr", _P),
                ("cta_pages", _P), ("live", _P), ("work_counter", _P), ("chain", _P),
                ("q_sb", _I64), ("q_sh", _I64), ("k_sp", _I64), ("k_st", _I64), ("k_sh", _I64),
                ("v_sp", _I64), ("v_st", _I64), ("v_sh", _I64),
                ("num_kv_heads", _I32), ("group", _I32), ("num_qo_heads", _I32),
                ("page_size", _I32), ("scale_log2", ctypes.c_float),
                ("v_scale", ctypes.c_float), ("merge", MergeArgs),
                ("cta_kv_limit", _P), ("cta_causal", _P)]


class MergeParams(ctypes.Structure):
    """``pat::MergeParams``: one merge launch."""

    _fields_ = [("o_partial", _P), ("lse_partial", _P), ("req_slot_indptr", _P), ("out", _P),
                ("lse_out", _P), ("live_batch", _P), ("reset", _P),
                ("out_sb", _I64), ("out_sh", _I64), ("lse_sb", _I64), ("lse_sh", _I64),
                ("batch", _I32), ("num_qo_heads", _I32), ("reset_n", _I32), ("block_per_pair", _I32),
                ("direct_single", _I32)]


STRUCTS = {"MergeArgs": MergeArgs, "FwdParams": FwdParams, "MergeParams": MergeParams}

# C spelling of a field's type -> the ctypes type it must have on the host
_C_TYPES = {"long long": _I64, "int": _I32, "float": ctypes.c_float}


def header_fields(text: str, name: str) -> list:
    """``[(field, c_type), ...]`` of ``struct name { ... };`` in C++ header ``text``.

    Pointer fields give ``"ptr"``; a field of struct type gives the struct's name.  Comments are
    dropped; declarations may list several names (``long long a, b;``).
    """
    m = re.search(r"struct\s+" + re.escape(name) + r"\s*\{(.*?)\n\};", text, re.S)
    if m is None:
        raise ValueError(f"struct {name} not found")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    out = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        dm = re.match(r"(?:const\s+)?(long long|unsigned|int|float|void|\w+)\s*(\*?)\s*(\S.*)$",
                      decl)
        if dm is None:
            raise ValueError(f"struct {name}: cannot read declaration {decl!r}")
        base, star, names = dm.group(1), dm.group(2), dm.group(3)
        for nm in names.split(","):
            nm = nm.strip()
            is_ptr = bool(star) or nm.startswith("*")
            out.append((nm.lstrip("*").strip(), "ptr" if is_ptr else base))
    return out


def header_sizes(text: str) -> dict:
    """``{struct name: bytes}`` from the header's ``static_assert(sizeof(X) == N, ...)`` lines."""
    return {m.group(1): int(m.group(2))
            for m in re.finditer(r"static_assert\(sizeof\((\w+)\)\s*==\s*(\d+)", text)}


def check_against_header(text: str) -> list:
    """Differences between the header's structs and :data:`STRUCTS` (empty when they agree):
    field names and types in order, and each struct's size against the header's
    ``static_assert`` (which nvcc checks on every compile)."""
    bad = []
    sizes = header_sizes(text)
    for name, cls in STRUCTS.items():
        if sizes.get(name) != ctypes.sizeof(cls):
            bad.append(f"{name}: {sizes.get(name)} bytes in the header, {ctypes.sizeof(cls)} on "
                       "the host")
        want = header_fields(text, name)
        have = [(f, t) for f, t in cls._fields_]
        if [f for f, _ in want] != [f for f, _ in have]:
            bad.append(f"{name}: fields {[f for f, _ in want]} in the header, "
                       f"{[f for f, _ in have]} on the host")
            continue
        for (f, ct), (_, ht) in zip(want, have):
            if ct == "ptr":
                ok = ht is _P
            elif ct in STRUCTS:
                ok = ht is STRUCTS[ct]
            else:
                ok = _C_TYPES.get(ct) is ht
            if not ok:
                bad.append(f"{name}.{f}: {ct} in the header, {ht.__name__} on the host")
    return bad


__all__ = ["FwdParams", "MergeArgs", "MergeParams", "check_against_header", "header_fields"]
