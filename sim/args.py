"""Argument types shared by the simulator's subcommands (``python -m sim ...``): each turns a
command-line string into a checked value or raises ``argparse.ArgumentTypeError`` naming what
is wrong."""
from __future__ import annotations

import argparse
import math
import os

from .methods import METHODS


def _heads(s: str):
    try:
        a, b = (int(x) for x in s.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads must look like 32:8, got {s!r}") from None
    if a < 1 or b < 1 or a % b:
        raise argparse.ArgumentTypeError(f"--heads {s}: query heads must be a multiple of KV heads")
    return a, b


def _methods(s: str):
    out = [m.strip() for m in s.split(",") if m.strip()]
    bad = [m for m in out if m not in METHODS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown method(s) {bad}; known: {list(METHODS)}")
    return out


def _ints(s: str):
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _finite(s: str, low: float | None = None, low_open: bool = False) -> float:
    """A finite float (``nan``/``inf`` refused: NaN compares false with every bound and would
    pass any later check), at least ``low`` (above it when ``low_open``)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    if low is not None and (v <= low if low_open else v < low):
        raise argparse.ArgumentTypeError(f"expected a number {'>' if low_open else '>='} "
                                         f"{low:g}, got {s!r}")
    return v


def _nonneg_number(s: str) -> float:
    return _finite(s, 0.0)


def _positive_number(s: str) -> float:
    return _finite(s, 0.0, low_open=True)


def out_prefix(out: str) -> str:
    """``--out`` of the subcommands that write ``OUT.json`` and ``OUT.png``: a file prefix.
    One that names a directory (ends in a separator, or is an existing folder) is refused,
    instead of writing the hidden files ``DIR/.json`` and ``DIR/.png``; a missing parent folder
    is created, and one that is a file in the way is reported."""
    if not out or out.endswith(("/", os.sep)) or os.path.isdir(out):
        hint = os.path.join(out or ".", "result")
        raise ValueError(f"--out {out!r} names a directory; --out is a file prefix (it writes "
                         f"OUT.json and OUT.png), e.g. --out {hint}")
    parent = os.path.dirname(os.path.abspath(out))
    try:
        os.makedirs(parent, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"--out {out}: cannot create the folder {parent}: a file is in the "
                         f"way") from None
    return out
