"""bench/gpu_offline.py's tiny mode on CPU: every part of the GPU check runs (random model,
nano-vllm workload, vllmini run, decode-step timing, HF baseline, JSON record)."""
from __future__ import annotations

import json

from bench.gpu_offline import main, nano_vllm_workload


def test_nano_vllm_workload_is_seeded_and_in_range():
    prompts, outs = nano_vllm_workload(16, 100, 1024, 151936, seed=0)
    assert (prompts, outs) == nano_vllm_workload(16, 100, 1024, 151936, seed=0)
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= o <= 1024 for o in outs)
    assert max(t for p in prompts for t in p) <= 9999


def test_gpu_offline_tiny_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    record = main(["--tiny", "--device", "cpu", "--num-requests", "4", "--hf-requests", "2",
                   "--timing-batch", "4", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == record
    v = record["vllmini"]
    assert v["requests"] == 4 and v["output_tok_s"] > 0 and v["attention_backend"] == "torch" and not v["cuda_graphs"]
    assert record["hf_static"]["requests"] == 2 and record["ratio"] > 0
    assert record["decode_step"]["batch"] == 4 and "static_padded_eager_ms" in record["decode_step"]
