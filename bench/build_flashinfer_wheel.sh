#!/usr/bin/env bash
# Build the FlashInfer 0.2.5 wheel (a JIT package: pure Python + CUDA headers) on a machine
# that reaches the package registry, into .whl/ (ignored by git).  The GPU machine installs it
# with bench/gpu_compare.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q wheel setuptools
(cd "$work" && "$work/venv/bin/pip" download -q --no-deps flashinfer-python==0.2.5)
mkdir -p .whl
"$work/venv/bin/pip" wheel -q --no-deps --no-build-isolation -w .whl \
    "$work"/flashinfer_python-0.2.5.tar.gz
ls -l .whl/flashinfer_python-0.2.5-*.whl
