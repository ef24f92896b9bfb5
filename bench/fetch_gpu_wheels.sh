#!/usr/bin/env bash
# Fill the wheel folder that bench/gpu_check.sh installs from on the GPU machine, which has no
# network. Run here (where pip reaches PyPI), from the repo root; then carry the folder.
#   bash bench/fetch_gpu_wheels.sh            # -> .gpu-wheels/
# The GPU image (see the device notes) has python 3.12, torch, transformers, safetensors,
# tokenizers, tqdm, numpy, pytest, hypothesis, uvloop; vllmini also imports msgspec at module
# level (gguf only when converting a GGUF file, which the check never does).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${WHEELS:-.gpu-wheels}"
PY_VERSION="${GPU_PYTHON_VERSION:-3.12}"
PACKAGES=("msgspec==${MSGSPEC_VERSION:-0.23.0}")
mkdir -p "$WHEELS"
# keep the folder out of git status (in a worktree too, where .git is a file)
if exclude=$(git rev-parse --git-path info/exclude 2>/dev/null); then
    mkdir -p "$(dirname "$exclude")"
    grep -qxF "/$WHEELS/" "$exclude" 2>/dev/null || echo "/$WHEELS/" >> "$exclude"
fi
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$WHEELS" "${PACKAGES[@]}"
ls -la "$WHEELS"
