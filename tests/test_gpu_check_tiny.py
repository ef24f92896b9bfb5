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
    record = main(["--tiny", "--device", "cpu", "--num-requests", "4", "--hf-runs", "9x4,2x2",
                   "--timing-batch", "4", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == record
    v = record["vllmini"]
    assert v["requests"] == 4 and v["output_tok_s"] > 0 and v["attention_backend"] == "cpu" and not v["cuda_graphs"]
    whole, subset = record["hf_static"]
    assert (whole["requests"], whole["batch_size"], whole["note"]) == (4, 4, "the whole workload")  # 9 capped at 4
    assert (subset["requests"], subset["batch_size"], subset["note"]) == (2, 2, "first 2 of the 4 requests")
    assert record["ratio"] == min(whole["ratio"], subset["ratio"]) > 0
    assert record["decode_step"]["batch"] == 4 and "static_padded_eager_ms" in record["decode_step"]
    assert record["vllmini_async_scheduling"]["output_tok_s"] > 0  # the same workload, async scheduling on


def test_hf_runs_argument_is_checked(capsys):
    import pytest

    for bad in ("64", "64x0", "ax2", "64x64,"):
        with pytest.raises(SystemExit):
            main(["--tiny", "--device", "cpu", "--hf-runs", bad])
        assert "expected REQUESTSxBATCH" in capsys.readouterr().err


def test_a_failing_hf_run_is_recorded_and_the_next_still_runs(tmp_path, monkeypatch):
    import bench.gpu_offline as gpu_offline

    real = gpu_offline.run_hf_static

    def run_hf_static(model_dir, dtype, device, prompts, outs, batch_size):
        if batch_size == 4:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(model_dir, dtype, device, prompts, outs, batch_size)

    monkeypatch.setattr(gpu_offline, "run_hf_static", run_hf_static)
    out = tmp_path / "r.json"
    record = main(["--tiny", "--device", "cpu", "--num-requests", "4", "--hf-runs", "4x4,2x2",
                   "--timing-batch", "4", "--out", str(out)])  # fmt: skip
    failed, ok = record["hf_static"]
    assert (failed["batch_size"], failed["error"]) == (4, "RuntimeError: CUDA out of memory (simulated)")
    assert "ratio" not in failed and ok["batch_size"] == 2 and record["ratio"] == ok["ratio"] > 0
    assert json.loads(out.read_text()) == record


def test_a_failing_engine_is_recorded_and_hf_still_runs(tmp_path):
    """On the GPU machine a failure of the vllmini phase (e.g. at engine start) must still leave a
    record with its traceback and the HF baseline's numbers (the run is too scarce to lose)."""
    out = tmp_path / "r.json"
    record = main(["--tiny", "--device", "cpu", "--num-requests", "4", "--hf-runs", "2x2",
                   "--attention-backend", "triton", "--out", str(out)])  # fmt: skip  (triton needs CUDA)
    assert "attention_backend='triton' cannot be used" in record["vllmini_error"]
    assert "vllmini" not in record and "ratio" not in record
    (hf,) = record["hf_static"]
    assert hf["output_tok_s"] > 0 and "ratio" not in hf
    assert json.loads(out.read_text()) == record
