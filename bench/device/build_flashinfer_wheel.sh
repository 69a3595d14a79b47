#!/usr/bin/env bash
# Build the FlashInfer 0.2.5 wheel (a JIT package: pure Python + CUDA headers) on a machine
# that reaches the package registry.  Usage: bench/device/build_flashinfer_wheel.sh [OUT_DIR]
# (default .whl/ of the repository, ignored by git).  The GPU machine installs it with
# bench/device/device_session.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-.whl}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q wheel setuptools
(cd "$work" && "$work/venv/bin/pip" download -q --no-deps --no-binary :all: \
    flashinfer-python==0.2.5)
"$work/venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$out" \
    "$work"/flashinfer_python-0.2.5.tar.gz
ls -l "$out"/flashinfer_python-0.2.5-*.whl
