"""Compiling and loading the CUDA backend's kernel modules.

Every variant but the warpgroup ones is a CuPy ``RawModule`` (NVRTC for the device's own
architecture, CuPy's on-disk cache).  The warpgroup (wgmma) variants need the sm_90a target:
they are compiled here with NVRTC and their cubins kept in the backend's ``cache_dir``
(:data:`DEFAULT_CACHE_DIR` unless the caller names one).
"""
from __future__ import annotations

import dataclasses
import logging
import os

from . import cuda_compile as cc

log = logging.getLogger("pat_core.cuda")


def _variant_from(v):
    if isinstance(v, (cc.FwdVariant, cc.MergeVariant, cc.FusedVariant)):
        return v
    if isinstance(v, str):
        # a multi-token variant's key is its one-token variant's plus "_mt"
        base, causal = (v[:-3], True) if v.endswith("_mt") else (v, False)
        for cand in (cc.all_fwd_variants() + cc.all_fwd_variants(kv_dtype="float8_e4m3fn")
                     + ([] if causal else cc.all_merge_variants())):
            if cand.key == base:
                return dataclasses.replace(cand, causal=True) if causal else cand
        raise ValueError(f"variants: unknown kernel variant {v!r}")
    raise TypeError(f"variants: expected FwdVariant, MergeVariant, FusedVariant "
                    f"or key, got {type(v).__name__}")


# Where the sm_90a cubins are kept when the backend names no folder (one file per variant,
# build options and source hash, so later runs and worker processes reuse them).
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "pat", "kernels")


def _sm90a_cubin_path(cache_dir, variant, opts) -> str:
    """Where the sm_90a cubin of ``variant`` built with ``opts`` is kept in ``cache_dir``
    (``None``: :data:`DEFAULT_CACHE_DIR`), named by the variant, the options and the source
    hash (part of the options)."""
    import hashlib
    root = os.path.expanduser(cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR)
    tag = hashlib.sha1("\0".join(opts).encode()).hexdigest()[:16]
    return os.path.join(root, f"pat_sm90a_{variant.key}_{tag}.cubin")


def _raw_module(cp, variant, defines: tuple = (), cache_dir=None):
    """``(RawModule, function name)`` of one variant, compiled with ``defines``
    (:func:`pat_core.cuda_compile.nvrtc_options`); sm_90a cubins kept in ``cache_dir``.

    Every variant but the warpgroup ones goes through CuPy's RawModule (NVRTC for the device's
    own architecture, CuPy's on-disk cache).  The warpgroup (wgmma) variants need the sm_90a
    target, which RawModule cannot be asked for (it adds ``-arch`` for the device itself):
    they are compiled here with NVRTC for sm_90a, the cubin kept in ``cache_dir``
    (:func:`_sm90a_cubin_path`) and the module loaded from it.
    """
    if not getattr(variant, "warpgroup", False):
        mod = cp.RawModule(code=cc.module_source(variant), options=cc.nvrtc_options(defines=defines),
                           name_expressions=[variant.name_expression])
        return mod, variant.name_expression
    from cupy_backends.cuda.libs import nvrtc
    opts = cc.nvrtc_options(defines=defines) + ("-arch=sm_90a", "--device-as-default-execution-space")
    cuda_path = cp.cuda.get_cuda_path()
    if cuda_path and os.path.isdir(os.path.join(cuda_path, "include")):
        opts += (f"-I{os.path.join(cuda_path, 'include')}",)
    path = _sm90a_cubin_path(cache_dir, variant, opts)
    if os.path.exists(path) and os.path.exists(path + ".name"):
        with open(path + ".name") as fh:
            return cp.RawModule(path=path), fh.read()
    prog = nvrtc.createProgram(cc.module_source(variant), variant.key + ".cu", (), ())
    try:
        nvrtc.addNameExpression(prog, variant.name_expression)
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC failed for {variant.key} (sm_90a):\n"
                               f"{nvrtc.getProgramLog(prog)}") from e
        name = nvrtc.getLoweredName(prog, variant.name_expression)
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # write then rename: a concurrent reader never sees half a file
    for dst, data in ((path, cubin), (path + ".name", name.encode())):
        tmp = f"{dst}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, dst)
    return cp.RawModule(path=path), name


def _compile_one(fields) -> str:
    """Worker-process body: compile one variant into the on-disk caches."""
    kind, args, defines, cache_dir = fields
    import cupy
    v = {"fwd": cc.FwdVariant, "merge": cc.MergeVariant}[kind](*args)
    mod, name = _raw_module(cupy, v, defines, cache_dir)
    mod.get_function(name)
    return v.key


def _compile_in_workers(variants, jobs: int, defines: tuple = (), cache_dir=None) -> None:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    def fields_of(v):
        if isinstance(v, cc.FwdVariant):
            return ("fwd", (v.head_dim, v.dtype, v.m, v.n, v.warps, v.stages, v.rows_per_warp,
                            v.kv_dtype, v.causal), defines, cache_dir)
        return "merge", (v.head_dim, v.dtype, v.warps, v.heads), defines, cache_dir
    fields = [fields_of(v) for v in variants]
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(fields)), mp_context=ctx) as ex:
        for key in ex.map(_compile_one, fields):
            log.debug("compiled %s in a worker", key)

