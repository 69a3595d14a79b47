"""Top warp-stall reasons per kernel from an Nsight Compute raw CSV report.

    ncu --csv --page raw --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed -k regex:pat_ python3 bench/lab/profile_case.py ... > report.csv
    python3 bench/lab/ncu_stalls.py report.csv [--top 6]

Per launch: duration, DRAM throughput, and the stall reasons with the most warps stalled per
issued instruction (what each warp waits on between its instructions, ncu's "per issue active").
"""
from __future__ import annotations

import argparse
import csv

PREFIX = "smsp__average_warps_issue_stalled_"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args(argv)
    with open(args.report, newline="") as fh:
        lines = [ln for ln in fh if ln.startswith('"')]   # ncu prints log lines before the CSV
    rows = list(csv.DictReader(lines))
    for r in rows[1:]:                                      # row 0 holds the units
        name = r.get("Kernel Name", "?")[:70]
        stalls = []
        for k, v in r.items():
            if k.startswith(PREFIX) and k.endswith("_per_issue_active.ratio"):
                try:
                    stalls.append((float(v.replace(",", "")), k[len(PREFIX):-len("_per_issue_active.ratio")]))
                except ValueError:
                    pass
        stalls.sort(reverse=True)
        top = "  ".join(f"{n}={x:.2f}" for x, n in stalls[:args.top])
        print(f"{name}  dur={r.get('gpu__time_duration.sum', '?')}ns  "
              f"dram%={r.get('dram__throughput.avg.pct_of_peak_sustained_elapsed', '?')}\n    {top}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
