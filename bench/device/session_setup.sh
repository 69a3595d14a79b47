# Sourced by the device session scripts, from the repository root, with `out` set: the output
# folder, a scratch folder `work`, the log `out/session.log`, the environment, `install DIR
# WHEEL...`, and FlashInfer 0.2.5 from .whl/ (when carried) on PYTHONPATH after `base`, the
# path without it.
mkdir -p "$out"
work="$(mktemp -d)"
exec > >(tee "$out/session.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
# CUDA 13's nvcc needs this for FlashInfer 0.2.5's decode module to link
export NVCC_APPEND_FLAGS="-static-global-template-stub=false"
shopt -s nullglob
install() {   # install() DIR WHEEL...: unpack wheels into DIR without dependencies
    local dir="$1"; shift
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$dir" "$@"
}
base="$PYTHONPATH"
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
    install "$work/fi025" "${wheels[@]}"
    export PYTHONPATH="$base:$work/fi025"
fi
