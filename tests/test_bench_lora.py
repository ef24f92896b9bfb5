"""bench.lora end to end on a tiny model: every row runs the requested tokens, and the vLLM row
hands each request's adapter and the LoRA engine settings to the driver (a stand-in here)."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from helpers import fake_python, save_tiny_model, tiny_llama_config

pytest.importorskip("peft")

FAKE_DRIVER = textwrap.dedent(
    """
    import json, sys
    if sys.argv[1] == "-c":
        sys.exit(0)
    job = json.load(open(sys.argv[2]))
    assert job["lora"] == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 4}, job["lora"]
    runs = []
    for run in job["runs"]:
        assert len(run["lora_paths"]) == len(run["prompts"]) and len(set(run["lora_paths"])) == 2, run["lora_paths"]
        recs = [{"send_time": 0.0, "chunk_times": [0.1] * n, "prompt_len": len(p), "output_len": n, "error": None}
                for p, n in zip(run["prompts"], run["output_lens"])]
        runs.append({"label": run["label"], "duration_s": 2.0, "records": recs, "peak_rss_bytes": 1})
    json.dump({"startup_s": 1.0, "runs": runs}, open(sys.argv[3], "w"))
    """
)


def test_bench_lora_rows(tmp_path, monkeypatch, default_model_dir):
    from transformers import LlamaForCausalLM

    from bench.lora import main

    torch.manual_seed(0)
    model = save_tiny_model(LlamaForCausalLM(tiny_llama_config(vocab_size=49152)).eval(), tmp_path / "m", default_model_dir)
    exe = fake_python(tmp_path, FAKE_DRIVER)
    monkeypatch.setenv("VLLMINI_CACHE", str(tmp_path / "cache"))  # where the adapters are made
    record = main(["--model", str(model), "--num-adapters", "2", "--rank", "4", "--num-requests", "4", "--output-len", "3",
                   "--hf-batch-size", "2", "--vllm-python", str(exe), "--out", str(tmp_path / "res")])  # fmt: skip
    rows = record["results"]
    assert [r["engine"].split(" ")[0] for r in rows] == ["vllmini", "vllmini", "vllmini", "transformers", "vLLM"]
    assert all(r["tok_s"] > 0 for r in rows) and rows[-1]["tok_s"] == pytest.approx(12 / 2.0)
    assert len(list((tmp_path / "cache" / "bench-lora").glob("*/adapter_model.safetensors"))) == 2
    (path,) = (tmp_path / "res").glob("lora-*.json")
    assert json.loads(path.read_text())["results"] == rows
