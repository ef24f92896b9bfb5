"""bench.http_serving: both servers started, driven over HTTP with the same client and stopped;
the vLLM row comes from a stand-in `vllm` package (vLLM lives in its own virtualenv) that serves
with vllmini, so the whole subprocess and streaming path runs here."""
from __future__ import annotations

import sys

import msgspec

from bench.http_serving import main
from bench.serving_metrics import RunRecord

FAKE_SERVER = '''
import argparse
from vllmini.cli import main
ap = argparse.ArgumentParser()
for flag in ("--model", "--port", "--served-model-name", "--max-num-seqs", "--max-num-batched-tokens"):
    ap.add_argument(flag)
args, _ = ap.parse_known_args()
raise SystemExit(main(["serve", args.model, "--port", args.port, "--served-model-name", args.served_model_name,
                       "--max-num-seqs", args.max_num_seqs, "--kv-cache-memory", str(2**20)]))
'''


def test_both_servers_run_the_same_workload_over_http(tmp_path, tiny_dir):
    site = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    site.mkdir(parents=True)
    for pkg in (site.parent.parent, site.parent, site):
        (pkg / "__init__.py").write_text("")
    (site / "api_server.py").write_text(FAKE_SERVER)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "site"}" exec "{sys.executable}" "$@"\n')
    exe.chmod(0o755)
    record = main(["--model", str(tiny_dir), "--workload", "concurrency", "--concurrency", "2", "--num-requests", "4",
                   "--output-len", "5", "--num-warmup", "1", "--kv-cache-memory", str(2**20), "--vllm-python", str(exe),
                   "--out", str(tmp_path / "out")])  # fmt: skip
    m = record.metrics
    assert m.completed == 4 and m.failed == 0 and m.total_output_tokens == 20
    assert m.ttft_s.median > 0 and m.itl_s.median > 0 and m.output_throughput > 0
    assert m.peak_rss_bytes > 100 << 20  # the server's, read from /proc before it stops
    (vllm,) = record.baselines
    assert vllm.name == "vllm-eager" and vllm.error is None and vllm.ratio > 0 and vllm.startup_s > 0
    assert vllm.metrics.completed == 4 and vllm.metrics.total_output_tokens == 20 and vllm.metrics.peak_rss_bytes > 0
    (path,) = (tmp_path / "out").glob("http-serving-*.json")
    assert msgspec.json.decode(path.read_bytes(), type=RunRecord) == record
