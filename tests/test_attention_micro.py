"""bench/attention_micro.py at test size: the kernel's sweep configs are each checked against
the torch backend's output, and a config that computes something else is reported as such."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import triton_skip_reason

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(triton_skip_reason(cpu_tensors=DEVICE == "cpu") is not None,
                                reason=str(triton_skip_reason(cpu_tensors=DEVICE == "cpu")))  # fmt: skip


def test_tiny_micro_benchmark_checks_every_config(tmp_path):
    from bench.attention_micro import TINY_CASES, TINY_SWEEP, main

    out = tmp_path / "micro.json"
    record = main(["--tiny", "--device", DEVICE, "--out", str(out)])
    assert json.loads(out.read_text()) == record
    assert [(c["batch"], c["context"]) for c in record["cases"]] == list(TINY_CASES)
    for case in record["cases"]:
        assert case["triton_default"]["ok"] and case["all_configs_correct"]
        assert len(case["sweep"]) == len(TINY_SWEEP["BLOCK_N"]) and all(c["ok"] for c in case["sweep"])
        assert case["best"] in case["sweep"] and case["torch"]["ms"] > 0


def test_a_config_with_wrong_output_is_flagged(tmp_path, monkeypatch):
    import bench.attention_micro  # noqa: F401  (sets up the interpreter on CPU first)
    import vllmini.models.triton_attention as ta

    real = ta.run_launch

    def run_launch(launch, out, *args, **overrides):
        real(launch, out, *args, **overrides)
        if overrides.get("BLOCK_N") == 16:  # this config "computes" something else
            out.add_(1.0)

    monkeypatch.setattr(ta, "run_launch", run_launch)
    from bench.attention_micro import main

    record = main(["--tiny", "--device", DEVICE, "--out", str(tmp_path / "m.json")])
    for case in record["cases"]:
        bad = [c for c in case["sweep"] if c["BLOCK_N"] == 16]
        assert bad and not any(c["ok"] for c in bad) and not case["all_configs_correct"]
        assert case["best"]["BLOCK_N"] == 32 and case["triton_default"]["ok"]


def test_split_decode_is_timed_with_and_without_its_split(tmp_path, monkeypatch):
    import bench.attention_micro  # noqa: F401  (sets up the interpreter on CPU first)
    import vllmini.models.triton_attention as ta

    monkeypatch.setattr(ta, "_num_sms", lambda device: 64)  # rows x KV heads leave "SMs" idle
    monkeypatch.setattr(ta, "SPLIT_MIN_KEYS", 8)
    from bench.attention_micro import main

    record = main(["--tiny", "--device", DEVICE, "--out", str(tmp_path / "m.json")])
    for case in record["cases"]:
        assert case["num_splits"] > 1 and case["triton_default"]["ok"] and case["all_configs_correct"]
        assert case["triton_no_split"]["max_err"] <= 1e-4 and case["triton_no_split"]["ms"] > 0
