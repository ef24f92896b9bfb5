"""``python -m bench.host_overhead``: the engine's host work per decode step, forward stubbed."""
from __future__ import annotations

import json

from bench import host_overhead


def test_host_overhead_benchmark_runs_and_writes_its_record(tmp_path):
    out = tmp_path / "host.json"
    record = host_overhead.main(["--batch", "4", "--steps", "3", "--repeats", "2", "--out", str(out)])
    assert record["batch"] == 4 and len(record["runs_ms"]) == 2
    assert 0 < record["step_ms"] == min(record["runs_ms"]) and record["us_per_row"] == record["step_ms"] * 1e3 / 4
    assert json.loads(out.read_text())["step_ms"] == record["step_ms"]
