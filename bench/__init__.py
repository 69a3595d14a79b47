"""Benchmarks that produce the README's numbers (see bench/README.md).

Each module is a script run from the repository root (``python bench/devset.py ...``) and
importable as ``bench.<name>`` for the tests.  The library (``pat_core``, ``sim``) never
imports this package; ``bench.lab`` holds probes and profilers that the mainline imports only
on request.
"""
