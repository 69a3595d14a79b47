"""Probes, A/B arms, rule checks and profilers (see bench/lab/README.md): scripts run from
the repository root (``python bench/lab/kernel_lab.py ...``), importable as ``bench.lab.<name>``
for the tests.  Neither the library nor the benchmarks at ``bench/`` import it at import time.
"""
