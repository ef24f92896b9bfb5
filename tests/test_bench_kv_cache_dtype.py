"""bench/kv_cache_dtype.py: its rows (each in its own process) and its agreement measure."""
from __future__ import annotations

import json

from bench.kv_cache_dtype import agreement, main


def test_agreement_is_the_shared_prefix_fraction():
    assert agreement([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert agreement([[1, 2, 9, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [0, 6, 7, 8]]) == (0.5 + 0.0) / 2


def test_rows_record_blocks_preemptions_and_agreement(tmp_path, tiny_dir):
    record = main(["--model", str(tiny_dir), "--num-requests", "6", "--output-len", "24", "--repeats", "1",
                   "--kv-cache-memory", str(1 << 15), "--dtypes", "auto,fp8", "--out-dir", str(tmp_path)])  # fmt: skip
    rows = {(r["kv_cache_dtype"], r["kv_cache_memory"]): r for r in record["rows"]}
    auto, fp8 = rows["auto", 1 << 15], rows["fp8", 1 << 15]
    assert len(rows) == 2 and auto["agreement"] == 1.0 and 0 <= fp8["agreement"] <= 1
    assert fp8["blocks"] // 4 == auto["blocks"] and fp8["tok_per_s"] > 0
    assert auto["preemptions"] > fp8["preemptions"]  # 5 blocks for 6 sequences, against 21
    (path,) = tmp_path.glob("kv_cache_dtype-*.json")
    assert json.loads(path.read_text())["rows"] == record["rows"]
