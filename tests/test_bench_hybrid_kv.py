"""bench/hybrid_kv.py: both engines on the same KV memory, their blocks, groups and tokens."""
from __future__ import annotations

import json

from bench.hybrid_kv import main


def test_grouped_and_one_table_engines_are_compared_on_the_same_memory(tmp_path):
    out = tmp_path / "r.json"
    summary = main(["--model-dir", str(tmp_path / "model"), "--requests", "3", "--min-prompt", "300", "--max-prompt",
                    "400", "--tokens", "6", "--kv-mib", "24", "--out", str(out)])  # fmt: skip
    hybrid, one = summary["results"]["hybrid"], summary["results"]["one_table"]
    assert (hybrid["kv_groups"], one["kv_groups"]) == (6, 1)  # 2 full layers of 12: groups of 2 layers
    assert hybrid["kv_blocks"] == 6 * one["kv_blocks"]  # a block id holds 2 layers, not 12
    assert summary["same_tokens"] == "3/3" and hybrid["output_tok_s"] > 0 and one["output_tok_s"] > 0
    assert hybrid["preemptions"] <= one["preemptions"] and hybrid["most_running"] >= one["most_running"]
    assert json.loads(out.read_text()) == summary


def test_a_vllm_row_needs_whole_gib_of_kv_memory(tmp_path):
    import pytest

    with pytest.raises(SystemExit):  # (vLLM's CPU KV space is whole GiB: the rows would not share a budget)
        main(["--model-dir", str(tmp_path / "model"), "--kv-mib", "24", "--vllm-python", "python"])
