"""Serving benchmark: metrics against hand-computed timestamps, arrival schedules, the JSON
record, and a short smoke run of each workload on a tiny random model."""
from __future__ import annotations

import math

import msgspec
import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from bench.offline import mixed_workload
from bench.serving import main
from bench.serving_metrics import (RequestRecord, RunRecord, compute_metrics, decode, encode, format_table, parse_goodput,
                                   parse_percentiles)  # fmt: skip
from bench.workloads import arrival_offsets, parse_range, random_workload
from helpers import save_tiny_model, tiny_llama_config


def test_metrics_against_hand_computed_timestamps():
    # request A: sent at 0, chunks at 1.0, 1.5, 2.5 carrying 1, 1, 2 tokens (4 tokens)
    a = RequestRecord(send_time=0.0, chunk_times=[1.0, 1.5, 2.5], prompt_len=10, output_len=4)
    # request B: sent at 1.0, chunks at 3.0, 3.25 (2 tokens)
    b = RequestRecord(send_time=1.0, chunk_times=[3.0, 3.25], prompt_len=6, output_len=2)
    # request C: one token only (no TPOT), sent at 2.0, chunk at 2.5
    c = RequestRecord(send_time=2.0, chunk_times=[2.5], prompt_len=4, output_len=1)
    failed = RequestRecord(send_time=0.0, chunk_times=[], prompt_len=3, output_len=0, error="boom")
    m = compute_metrics([a, b, c, failed], duration_s=4.0)
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (20, 7)
    assert m.request_throughput == pytest.approx(3 / 4)
    assert m.output_throughput == pytest.approx(7 / 4)
    assert m.total_token_throughput == pytest.approx(27 / 4)
    # TTFT: 1.0, 2.0, 0.5
    assert m.ttft_s.mean == pytest.approx(3.5 / 3) and m.ttft_s.median == pytest.approx(1.0)
    assert m.ttft_s.p90 == pytest.approx(1.0 + 0.8 * 1.0)  # numpy linear: rank 0.9 * 2 = 1.8
    # E2E: 2.5, 2.25, 0.5
    assert m.e2el_s.mean == pytest.approx(5.25 / 3) and m.e2el_s.median == pytest.approx(2.25)
    # TPOT: A (2.5 - 1.0) / 3 = 0.5, B (2.25 - 2.0) / 1 = 0.25; C excluded
    assert m.tpot_s.mean == pytest.approx(0.375) and m.tpot_s.median == pytest.approx(0.375)
    # ITL pooled over requests: 0.5, 1.0 (A), 0.25 (B)
    assert m.itl_s.mean == pytest.approx(1.75 / 3) and m.itl_s.median == pytest.approx(0.5)
    assert m.itl_s.p99 == pytest.approx(0.5 + 0.98 * 0.5)  # rank 0.99 * 2 = 1.98 between 0.5 and 1.0
    with pytest.raises(ValueError):
        compute_metrics([a], 0.0)


def test_goodput_and_extra_percentiles_against_hand_computed_timestamps():
    """vLLM's --goodput: completed requests meeting every objective, per second (a one-token
    request's TPOT counts as 0); --metric-percentiles: numpy's percentiles in every Stat."""
    a = RequestRecord(send_time=0.0, chunk_times=[1.0, 1.5, 2.5], prompt_len=10, output_len=4)  # TTFT 1.0, TPOT 0.5, E2E 2.5
    b = RequestRecord(send_time=1.0, chunk_times=[3.0, 3.25], prompt_len=6, output_len=2)  # 2.0, 0.25, 2.25
    c = RequestRecord(send_time=2.0, chunk_times=[2.5], prompt_len=4, output_len=1)  # 0.5, (0), 0.5
    failed = RequestRecord(send_time=0.0, chunk_times=[], prompt_len=3, output_len=0, error="boom")
    records = [a, b, c, failed]
    for slos, met in [({"ttft": 1500}, 2), ({"ttft": 1000}, 2), ({"tpot": 300}, 2), ({"tpot": 300, "e2el": 2000}, 1),
                      ({"e2el": 100}, 0), ({"ttft": 5000, "tpot": 5000, "e2el": 5000}, 3)]:  # fmt: skip
        m = compute_metrics(records, 4.0, slos_ms=slos)
        assert m.request_goodput == pytest.approx(met / 4.0), slos
        assert m.goodput_slos_ms == slos
    m = compute_metrics(records, 4.0, percentiles=[25, 99.9])
    assert m.request_goodput is None and m.goodput_slos_ms == {}
    assert m.ttft_s.percentiles == {"25": pytest.approx(0.75), "99.9": pytest.approx(1.0 + 0.998 * 1.0)}
    assert set(m.itl_s.percentiles) == set(m.e2el_s.percentiles) == set(m.tpot_s.percentiles) == {"25", "99.9"}
    table = format_table(compute_metrics(records, 4.0, slos_ms={"ttft": 1500}, percentiles=[99.9]))
    assert "Request goodput (req/s):" in table and "0.50" in table and "P99.9 TTFT (ms):" in table
    assert "goodput" not in format_table(compute_metrics(records, 4.0))
    assert decode(encode(RunRecord("serving", "offline", "random", 4, None, 1.0, None, 0, "m", "float32", "cpu", "2", 1,
                                   "x", "abc", "t", m))).metrics == m  # fmt: skip
    for bad in (["ttft"], ["ttft:-1"], ["itl:5"], ["ttft:x"], ["ttft:inf"]):
        with pytest.raises(ValueError, match="--goodput takes KEY:MS"):
            parse_goodput(bad)
    for bad in ("0", "101", "a,50", "50,"):
        with pytest.raises(ValueError, match="--metric-percentiles"):
            parse_percentiles(bad)


def test_empty_run_has_zero_metrics():
    m = compute_metrics([], 1.0)
    assert m.completed == 0 and m.ttft_s.mean == 0.0 and m.output_throughput == 0.0


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_arrivals_have_the_requested_mean_rate(burstiness):
    rate, n = 8.0, 4000
    offs = arrival_offsets(n, rate, burstiness, seed=0)
    assert offs[0] == 0.0 and all(b >= a for a, b in zip(offs, offs[1:]))
    measured = (n - 1) / offs[-1]
    # mean of n-1 gamma gaps: relative std = 1 / sqrt(shape * (n - 1)) <= 2.3% here; allow ~4 sigma
    assert measured == pytest.approx(rate, rel=0.07)
    assert arrival_offsets(n, rate, burstiness, seed=0) == offs  # seeded
    gaps = [b - a for a, b in zip(offs, offs[1:])]
    var = sum((g - 1 / rate) ** 2 for g in gaps) / len(gaps)
    # gamma(k, 1/(rate k)) has variance 1 / (k rate^2): burstier = larger spread
    assert var == pytest.approx(1 / (burstiness * rate**2), rel=0.2)


def test_arrivals_bad_input_and_offline():
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            arrival_offsets(3, bad)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, burstiness=0.0)


def test_random_workload_matches_offline_mixed_and_ranges():
    a = random_workload(100, 10, seed=3)
    b = mixed_workload(100, 10, seed=3)
    assert (a.prompts, a.output_lens) == (b.prompts, b.output_lens)
    c = random_workload(100, 30, (5, 9), (2, 3), seed=1)
    assert all(5 <= len(p) <= 9 for p in c.prompts) and all(2 <= n <= 3 for n in c.output_lens)
    assert parse_range("7") == (7, 7) and parse_range("3:9") == (3, 9)
    for bad in ("9:3", "0:4", "x", "1:2:3"):
        with pytest.raises(ValueError):
            parse_range(bad)


def test_bad_cli_input_fails_before_loading(capsys):
    for argv in (["--workload", "poisson", "--rate", "0"], ["--workload", "poisson", "--rate", "-2"],
                 ["--workload", "concurrency", "--sweep", "0,2"], ["--input-len", "9:3"],
                 ["--workload", "offline", "--sweep", "1,2"], ["--structured-json", "{not json"]):  # fmt: skip
        with pytest.raises(SystemExit):
            main(argv + ["--model", "/nonexistent/model"])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=49152)
    return save_tiny_model(HFLlama(cfg).eval(), tmp_path_factory.mktemp("tiny"), default_model_dir)


@pytest.mark.parametrize(
    "extra",
    [
        ["--workload", "offline", "--dataset", "chat", "--output-len", "4", "--hf-batch-size", "2"],
        ["--workload", "poisson", "--rate", "50", "--burstiness", "0.5", "--dataset", "random",
         "--input-len", "8:40", "--output-len", "2:6", "--hf-batch-size", "0", "--save-requests",
         "--kv-cache-dtype", "fp8"],
        ["--workload", "concurrency", "--sweep", "1,3", "--dataset", "random", "--input-len", "8:40",
         "--output-len", "3:5", "--hf-batch-size", "0"],
    ],
    ids=["offline", "poisson", "concurrency-sweep"],
)
def test_serving_smoke(tmp_path, tiny_model, extra):
    out = tmp_path / "res"
    records = main(["--model", str(tiny_model), "--num-requests", "5", "--num-warmup", "1", "--no-progress", "--kv-cache-memory", str(2**20),
                    "--out", str(out), *extra])  # fmt: skip
    files = sorted(out.glob("serving-*.json"))
    assert len(files) == len(records) == (2 if "--sweep" in extra else 1)
    for f, rec in zip(files, sorted(records, key=lambda r: r.max_concurrency or 0)):
        back = decode(f.read_bytes())
        assert back == rec  # the record round-trips through msgspec
        m = back.metrics
        assert m.completed == 5 and m.failed == 0
        assert m.total_output_tokens > 0
        assert m.ttft_s.median > 0 and m.e2el_s.p99 >= m.ttft_s.p99 and m.output_throughput > 0
        assert 0 < m.peak_kv_usage <= 1 and m.peak_rss_bytes > 0
        assert back.model == str(tiny_model) and back.torch == torch.__version__ and back.git
    if "offline" in extra:
        (b,) = records[0].baselines
        assert b.name == "hf-static-2" and b.output_throughput > 0 and b.ratio > 0
        assert records[0].metrics.total_output_tokens == 5 * 4
    if "--save-requests" in extra:
        reqs = records[0].requests
        assert len(reqs) == 5 and all(r.ok and 2 <= r.output_len <= 6 for r in reqs)
        assert records[0].request_rate == 50.0
    if "--sweep" in extra:
        assert sorted(r.max_concurrency for r in records) == [1, 3]


def test_record_schema_is_strict():
    with pytest.raises(msgspec.ValidationError):
        decode(b'{"benchmark": "serving"}')
    m = compute_metrics([RequestRecord(0.0, [0.1, 0.2], 3, 2)], 1.0)
    from bench.serving_metrics import RunRecord

    rec = RunRecord("serving", "offline", "random", 1, None, 1.0, None, 0, "m", "float32", "cpu", "2", 1, "x",
                    "abc", "t", m, requests=[RequestRecord(0.0, [0.1, 0.2], 3, 2)])  # fmt: skip
    assert decode(encode(rec)) == rec


def test_cancelled_drive_keeps_what_it_measured(tiny_model):
    """Ctrl-C path: cancelling the driver keeps finished records and marks in-flight ones."""
    import asyncio

    from bench.serving import drive
    from vllmini import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_model), kv_cache_memory=2**20))
    wl = random_workload(engine.engine.vocab_size, 4, (8, 16), (3, 3), seed=0)
    records, peak = [], {}

    async def go() -> None:
        async with engine:
            task = asyncio.create_task(drive(engine, wl, [0.0, 0.0, 30.0, 60.0], None, records,
                                             progress=False, peak=peak))  # fmt: skip
            while sum(r.ok and r.output_len == 3 for r in records) < 2:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(go(), 60))
    assert len(records) == 2 and all(r.ok for r in records)  # the two later requests were never sent
    assert peak["kv_usage"] > 0
    m = compute_metrics(records, 1.0)
    assert m.completed == 2 and m.total_output_tokens == 6


def test_hf_rows_have_no_ratio_at_points_they_did_not_run(tmp_path, tiny_model, capsys):
    """HF runs once, all requests at t=0 (static) or one after another (single): beside a Poisson
    point (throughput bound by the arrival rate) its tok/s is another workload's, so no ratio."""
    (rec,) = main(["--model", str(tiny_model), "--workload", "poisson", "--rate", "20", "--dataset", "random",
                   "--input-len", "8:20", "--output-len", "3", "--num-requests", "3", "--num-warmup", "0",
                   "--hf-batch-size", "2", "--hf-single", "--no-progress", "--kv-cache-memory", str(2**20),
                   "--out", str(tmp_path)])  # fmt: skip
    assert [b.name for b in rec.baselines] == ["hf-static-2", "hf-single"]
    assert all(b.ratio is None and "not this point's arrivals" in b.note for b in rec.baselines)
    assert all(b.output_throughput > 0 for b in rec.baselines)  # still measured and recorded
    assert "n/a" in capsys.readouterr().out
    recs = main(["--model", str(tiny_model), "--workload", "concurrency", "--sweep", "1,3", "--dataset", "random",
                 "--input-len", "8:20", "--output-len", "3", "--num-requests", "3", "--num-warmup", "0",
                 "--hf-batch-size", "2", "--hf-single", "--no-progress", "--kv-cache-memory", str(2**20),
                 "--out", str(tmp_path / "sweep")])  # fmt: skip
    ratios = {(r.max_concurrency, b.name): b.ratio for r in recs for b in r.baselines}
    assert ratios[(1, "hf-static-2")] is None and ratios[(1, "hf-single")] is not None  # closed loop of one
    assert ratios[(3, "hf-static-2")] is not None and ratios[(3, "hf-single")] is not None  # all in flight at t=0


def test_max_concurrency_caps_poisson_arrivals_and_goodput_is_recorded(tmp_path, tiny_model, capsys):
    """vLLM's --max-concurrency under Poisson arrivals: never more than 2 requests in flight
    (the saved requests' send-to-last-chunk spans); --goodput and --metric-percentiles reach
    the record and the table; the closed loop refuses the flag."""
    argv = ["--model", str(tiny_model), "--workload", "poisson", "--rate", "1000", "--max-concurrency", "2",
            "--dataset", "random", "--input-len", "8:20", "--output-len", "4", "--num-requests", "6", "--num-warmup", "0",
            "--hf-batch-size", "0", "--no-progress", "--kv-cache-memory", str(2**20), "--save-requests",
            "--goodput", "ttft:600000", "e2el:600000", "--metric-percentiles", "75", "--out", str(tmp_path)]  # fmt: skip
    (rec,) = main(argv)
    spans = [(r.send_time, r.chunk_times[-1]) for r in rec.requests]
    assert len(spans) == 6 and rec.max_concurrency == 2
    assert max(sum(s <= t < e for s, e in spans) for t, _ in spans) <= 2
    m = rec.metrics
    assert m.request_goodput == pytest.approx(m.request_throughput) and m.goodput_slos_ms == {"ttft": 600000, "e2el": 600000}
    assert set(m.ttft_s.percentiles) == {"75"}
    out = capsys.readouterr().out
    assert "Request goodput (req/s):" in out and "P75 TTFT (ms):" in out and "max_concurrency=2" in out
    with pytest.raises(SystemExit):
        main(["--workload", "concurrency", "--max-concurrency", "2", "--model", str(tiny_model)])
    assert "--max-concurrency is for --workload offline/poisson" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--goodput", "ttft", "--model", str(tiny_model)])
    assert "--goodput takes KEY:MS" in capsys.readouterr().err


def test_serving_structured_json_constrains_every_request(tmp_path, tiny_model, capsys):
    """--structured-json: vllmini's requests carry the schema (no ignore_eos), HF rows are skipped."""
    pytest.importorskip("xgrammar")
    schema = '{"enum": ["yes", "no"]}'
    (rec,) = main(["--model", str(tiny_model), "--num-requests", "4", "--num-warmup", "1", "--no-progress",
                   "--kv-cache-memory", str(2**20), "--out", str(tmp_path), "--workload", "offline",
                   "--output-len", "12", "--hf-batch-size", "2", "--structured-json", schema])  # fmt: skip
    assert "HF transformers has no structured outputs" in capsys.readouterr().err
    assert rec.baselines == [] and rec.args["structured_json"] == schema
    assert rec.metrics.completed == 4 and rec.metrics.failed == 0
    # "yes" or "no" in quotes, then EOS, whatever the random weights say: none runs to 12 tokens
    assert 0 < rec.metrics.total_output_tokens <= 4 * 5
