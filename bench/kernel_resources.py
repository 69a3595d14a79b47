"""Compile every pat kernel variant with nvcc and record its resources as data.

Writes ``pat_core/data/kernel_resources.json`` (read by the tile solver and the simulator, so
neither needs a GPU or a compiler at run time)::

    python3 bench/kernel_resources.py            # all variants, sm_80 and sm_90
    python3 bench/kernel_resources.py --check    # recompile, compare with the file, exit 1 on drift

Per variant and architecture: registers per thread, static shared memory, the dynamic shared
memory the launcher requests (same formula as the backend: pat_core.cuda_compile), spill bytes.
Needs only nvcc (no GPU).  One nvcc process per (variant, arch), run in parallel.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pat_core import cuda_compile as cc  # noqa: E402

ARCHS = ("sm_80", "sm_90")
_RE_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_USED = re.compile(r"Used (\d+) registers(?:, used \d+ barriers)?(?:, (\d+) bytes smem)?")


def compile_variant(variant, arch: str, nvcc: str = "nvcc", src_dir=None) -> dict:
    """nvcc -cubin one variant for `arch`; return its ptxas resource report as a dict."""
    src_dir = Path(src_dir) if src_dir is not None else cc.cuda_src_dir()
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "v.cu"
        cu.write_text(cc.nvcc_source([variant]))
        # the warpgroup (wgmma) variants are built as sm_90a, as the backend does
        target = ("-gencode=arch=compute_90a,code=sm_90a" if getattr(variant, "warpgroup", False)
                  else f"-arch={arch}")
        cmd = [nvcc, "-std=c++17", target, "-cubin", "-use_fast_math", "-Xptxas", "-v",
               f"-I{src_dir}", "-o", str(Path(tmp) / "v.cubin"), str(cu)]
        res = subprocess.run(cmd, capture_output=True, text=True)
    log = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed for {variant.key} ({arch}):\n{log}")
    # one "Function properties" block per function: the kernel's, then any device function it
    # calls without inlining; spills and stack count over all of them
    props = _RE_PROPS.findall(log)
    used = _RE_USED.findall(log)
    if not props or len(used) != 1:
        raise RuntimeError(f"could not parse the ptxas report of {variant.key} ({arch}):\n{log}")
    stack = max(int(p[0]) for p in props)
    spill_st = sum(int(p[1]) for p in props)
    spill_ld = sum(int(p[2]) for p in props)
    regs, smem = int(used[0][0]), int(used[0][1] or 0)
    return {"registers": regs, "smem_static": smem, "smem_dynamic": variant.smem_bytes,
            "stack_frame": stack, "spill_stores": spill_st, "spill_loads": spill_ld}


def variant_record(v) -> dict:
    kind = "merge" if isinstance(v, cc.MergeVariant) else "forward"
    rec = {"kind": kind, "head_dim": v.head_dim, "dtype": v.dtype, "warps": v.warps,
           "threads": v.threads}
    if isinstance(v, cc.FwdVariant):
        rec = {"m": v.m, "n": v.n, **rec, "stages": v.stages, "rows_per_warp": v.rows_per_warp}
        if v.kv_dtype:                  # an fp8 cache's variant (dtype is q's)
            rec["kv_dtype"] = v.kv_dtype
    return rec


def collect(variants, archs=ARCHS, jobs=None, nvcc="nvcc") -> dict:
    jobs = jobs or max(1, os.cpu_count() or 1)
    tasks = [(v, a) for v in variants for a in archs if a in cc.variant_archs(v)]
    with ThreadPoolExecutor(max_workers=jobs) as ex:  # each task is an nvcc subprocess
        results = list(ex.map(lambda va: compile_variant(va[0], va[1], nvcc), tasks))
    out = {}
    for (v, a), r in zip(tasks, results):
        out.setdefault(v.key, variant_record(v))[a] = r
    return out


# The item loop costs the largest tiles a few registers; on sm_80 (not the primary target,
# Hopper is) ptxas spills up to 8 bytes of the 128x64 tile around it.
SM80_SPILL_BYTES = 16


def spill_allowed(rec: dict, arch: str, r: dict) -> bool:
    """Whether a spill of variant record ``rec`` on ``arch`` (report ``r``) is tolerated: only
    forward kernels on sm_80, up to :data:`SM80_SPILL_BYTES`."""
    return rec.get("kind") == "forward" and arch == "sm_80" and \
        max(r["spill_stores"], r["spill_loads"], r.get("stack_frame", 0)) <= SM80_SPILL_BYTES


def problems(data: dict) -> list:
    """Spills, local-memory stack frames or shared memory over the architecture's limit."""
    bad = []
    for key, rec in data["variants"].items():
        for arch in (("sm_90",) if rec.get("rows_per_warp") == cc.WG_ROWS else ARCHS):
            r = rec.get(arch)
            if r is None:
                bad.append(f"{key}: no {arch} report")
                continue
            if (r["spill_stores"] or r["spill_loads"]) and not spill_allowed(rec, arch, r):
                bad.append(f"{key} {arch}: spills {r['spill_stores']}/{r['spill_loads']} bytes")
            # sm_80 (A100, 163 KB) cannot launch the largest sm_90 rings: recorded as data, the
            # tile solver leaves them out there; only the primary target must fit
            if arch == "sm_90" and r["smem_static"] + r["smem_dynamic"] > cc.SMEM_LIMIT[arch]:
                bad.append(f"{key} {arch}: shared memory {r['smem_static'] + r['smem_dynamic']} "
                           f"> {cc.SMEM_LIMIT[arch]}")
            if r["registers"] > 255:
                bad.append(f"{key} {arch}: {r['registers']} registers")
    return bad


def build(jobs=None, nvcc="nvcc") -> dict:
    variants = cc.resource_variants()
    return {
        "generator": "bench/kernel_resources.py",
        "nvcc": cc.nvcc_version(nvcc),
        "source_hash": cc.source_hash(),
        "smem_limit": dict(cc.SMEM_LIMIT),
        "variants": collect(variants, jobs=jobs, nvcc=nvcc),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(cc.resources_path()))
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing")
    args = ap.parse_args(argv)
    data = build(args.jobs, args.nvcc)
    bad = problems(data)
    for b in bad:
        print("PROBLEM:", b)
    if args.check:
        old = json.loads(Path(args.out).read_text())
        stale = old.get("source_hash") != data["source_hash"] or old["variants"] != data["variants"]
        print("up to date" if not stale else f"STALE: {args.out} differs from a fresh compile")
        return 1 if (stale or bad) else 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    n = len(data["variants"])
    print(f"wrote {args.out}: {n} variants, nvcc {data['nvcc']}, source {data['source_hash']}")
    for key, rec in data["variants"].items():
        r80, r90 = rec.get("sm_80"), rec["sm_90"]   # warpgroup variants: sm_90 only
        regs80 = f"{r80['registers']:3d}" if r80 else "  -"
        spills = r90["spill_stores"] + (r80["spill_stores"] if r80 else 0)
        print(f"  {key:36s} regs sm80 {regs80} sm90 {r90['registers']:3d}  "
              f"smem {r90['smem_dynamic']:6d}  spills {spills}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
