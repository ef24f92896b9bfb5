"""The Triton attention kernel compiled for real (sm_90, as on an H100/H200) on this CPU-only
machine: Triton's interpreter (tests/test_triton_attention.py) checks what the kernel computes
but not that the compiler accepts it, nor what it makes of it. Every launch the backend makes
for the default model's, a Qwen3-0.6B's, Gemma's (head_dim 256) and gpt-oss's (attention sinks) shapes
must compile without register spills, within shared memory, with asynchronous vector K/V loads and
tensor-core dots."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def test_every_launch_compiles_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compile now, not from an earlier run's cache
    out = tmp_path / "report.json"
    # (+ smollm2-bf16-fp8e5m2kv, gemma3-1b-bf16 and gpt-oss-20b-fp32-sinks by hand)
    shapes = ("qwen3-0.6b-bf16,smollm2-bf16,qwen3-0.6b-fp32,qwen3-0.6b-bf16-fp8kv,gemma2-2b-bf16-softcap,"
              "gemma3-1b-fp32,gpt-oss-20b-bf16-sinks")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.triton_compile_check", "--shapes", shapes, "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["arch"] == 90 and len(report["results"]) == 42
    for key, row in report["results"].items():
        assert row["within_limits"] and row["spill_bytes"] == 0, (key, row)
        if key.endswith("/merge-splits"):  # split-KV merge: a weighted sum of a few rows, no dot, no K/V
            continue
        assert row["async_vector_loads"], (key, row)  # K/V streamed by cp.async, not scalar loads
        assert row["tensor_cores"] == ("fp32" not in key), (key, row)  # exact fp32 dots run on FMA units
    assert {key.split("/")[1] for key in report["results"]} >= {"decode", "decode-split", "merge-splits"}


def test_compile_check_refuses_unknown_shapes():
    proc = subprocess.run([sys.executable, "-m", "bench.triton_compile_check", "--shapes", "nope"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and "--shapes: unknown ['nope']" in proc.stderr
