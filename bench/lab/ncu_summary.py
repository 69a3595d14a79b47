"""Summarise an Nsight Compute CSV report (``ncu --csv --page details ...``) as one line per
kernel launch: name, grid, block, registers, duration, DRAM, memory and SM throughput, achieved
and theoretical occupancy, and warp cycles per issued instruction (with the WarpStateStats
section).

    python3 bench/lab/ncu_summary.py report.csv [more.csv ...]
"""
from __future__ import annotations

import csv
import sys
from collections import OrderedDict

KEEP = {
    "Duration": "dur",
    "DRAM Throughput": "dram%",
    "Achieved Occupancy": "occ%",
    "Theoretical Occupancy": "theo%",
    "Registers Per Thread": "regs",
    "Block Size": "block",
    "Grid Size": "grid",
    "Memory Throughput": "mem%",
    "Compute (SM) Throughput": "sm%",
    "Warp Cycles Per Issued Instruction": "cyc/issue",
}


def summarise(path: str) -> list:
    launches: "OrderedDict[str, dict]" = OrderedDict()
    with open(path, newline="") as fh:
        lines = [ln for ln in fh if ln.startswith('"')]   # ncu prints log lines before the CSV
    for row in csv.DictReader(lines):
        key = row.get("ID", "") + "|" + row.get("Kernel Name", "")
        rec = launches.setdefault(key, {"name": row.get("Kernel Name", "")[:60]})
        metric = row.get("Metric Name", "")
        if metric in KEEP:
            unit = row.get("Metric Unit", "")
            rec[KEEP[metric]] = f"{row.get('Metric Value', '')}{'' if unit in ('%', '') else unit}"
    return list(launches.values())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(__doc__)
        return 2
    cols = ["name"] + list(KEEP.values())
    for path in argv:
        print(f"== {path}")
        for rec in summarise(path):
            print("  " + "  ".join(f"{c}={rec[c]}" for c in cols if c in rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
