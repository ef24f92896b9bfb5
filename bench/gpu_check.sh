#!/usr/bin/env bash
# The GPU check of issue 7, in one script (one H200, no network, under 5 minutes):
#   (i)   CUDA tests: every attention backend vs the torch reference path and HF transformers
#         (tiny random Llama and Qwen3, bf16), CUDA-graph replay == eager, decode-step timing; then
#         engine features on CUDA vs the CPU path (tests/test_cuda_features.py: speculative decoding,
#         a custom logits processor, logprobs, preemption, the async engine, embeddings, thinking budgets,
#         prompt embeddings, YaRN, fp8 KV caches);
#   (ii)  nano-vllm's offline workload on Qwen3-0.6B-shaped random weights: vllmini output tok/s
#         and HF transformers static batches in the same run, with the ratio;
#   (iii) peak GPU memory and KV blocks;
#   (iv)  only with MICRO=1 (about a minute more): decode attention alone, the Triton kernel vs
#         the torch backend, and a sweep of its tile settings (bench/attention_micro.py).
# Results: $OUT (else bench/results/): gpu_check.json (summary), gpu_offline.json/.log, gpu_tests.log/.xml,
# attention_micro.json (MICRO=1). Each part writes what it measured as it goes, so a part cut short by
# its time limit (180 + 240 + 90 s) still reports: the tests get SIGINT, on which pytest still writes
# its junit report of the tests run so far (-rA lists each outcome in the log as well).
# Wheels the machine lacks (msgspec) come from a local folder only: fill it here with
# bench/fetch_gpu_wheels.sh, carry it (default .gpu-wheels, or $WHEELS).
#   bash bench/gpu_check.sh                 # from the repo root
#   bash bench/gpu_check.sh --tiny          # CPU smoke run of the benchmark part (tests skip without CUDA)
#   MICRO=1 bash bench/gpu_check.sh         # plus the attention micro-benchmark
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${WHEELS:-.gpu-wheels}"
RESULTS="${OUT:-bench/results}"
PY="${PYTHON:-python3}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if ! "$PY" -c "import msgspec" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "msgspec is missing and $WHEELS holds no wheels: run bench/fetch_gpu_wheels.sh and carry $WHEELS" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/vllmini-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH="/tmp/vllmini-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$PY" - <<'PYEOF'
import torch
from vllmini.models.attention import torch_varlen_backend
from vllmini.models.backend_select import _flash_attn_importable, _triton_importable
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
triton = __import__("triton").__version__ if _triton_importable() else "not importable"
print(f"torch {torch.__version__}, {gpu}; torch varlen_attn with block_table: {torch_varlen_backend() is not None}; "
      f"flash-attn: {_flash_attn_importable()}; triton: {triton}")
PYEOF

start=$(date +%s)
timeout -s INT -k 10 180 "$PY" -m pytest -q -rA -s -p no:cacheprovider tests/test_cuda.py tests/test_triton_attention.py tests/test_cuda_path.py tests/test_attention.py tests/test_cuda_features.py \
    --junitxml "$RESULTS/gpu_tests.xml" 2>&1 | tee "$RESULTS/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
echo "tests: rc=$tests_rc in $(( $(date +%s) - start ))s"

start=$(date +%s)
timeout -k 5 240 "$PY" -m bench.gpu_offline --out "$RESULTS/gpu_offline.json" "$@" 2>&1 | tee "$RESULTS/gpu_offline.log"
bench_rc=${PIPESTATUS[0]}
echo "benchmark: rc=$bench_rc in $(( $(date +%s) - start ))s"

micro_rc=""
if [ "${MICRO:-0}" = 1 ]; then
    start=$(date +%s)
    tiny=""; for a in "$@"; do [ "$a" = --tiny ] && tiny="--tiny"; done
    timeout -k 5 90 "$PY" -m bench.attention_micro $tiny --out "$RESULTS/attention_micro.json"
    micro_rc=$?
    echo "attention micro-benchmark: rc=$micro_rc in $(( $(date +%s) - start ))s"
fi

"$PY" - "$RESULTS" "$tests_rc" "$bench_rc" "$micro_rc" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
results, tests_rc, bench_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
summary = {"tests_rc": tests_rc, "benchmark_rc": bench_rc}
if sys.argv[4]:  # MICRO=1; rc 1: some kernel setting computed a wrong result (see its JSON)
    summary["attention_micro_rc"] = int(sys.argv[4])
try:
    suite = ET.parse(results / "gpu_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    summary["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError, AttributeError) as exc:
    summary["tests"] = f"no junit report: {exc}"
try:
    summary["gpu_offline"] = json.loads((results / "gpu_offline.json").read_text())
except (OSError, ValueError) as exc:
    summary["gpu_offline"] = f"no benchmark record: {exc}"
if sys.argv[4]:
    try:
        summary["attention_micro"] = json.loads((results / "attention_micro.json").read_text())
    except (OSError, ValueError) as exc:
        summary["attention_micro"] = f"no micro-benchmark record: {exc}"
(results / "gpu_check.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({k: v for k, v in summary.items() if k not in ("gpu_offline", "attention_micro")}))
print(f"wrote {results / 'gpu_check.json'}")
PYEOF
exit $(( tests_rc != 0 || bench_rc != 0 ))
