"""Serving-benchmark metrics with vLLM's names and definitions (``vllm bench serve``).

Per request, from client-side timestamps (seconds, one clock):
- TTFT: arrival of the first non-empty chunk minus the time the request was sent;
- ITL: every gap between successive non-empty chunks (a chunk carrying k tokens is one gap,
  as in vLLM, where a streamed delta is one chunk);
- TPOT: (E2E - TTFT) / (output_len - 1), only for requests with output_len > 1;
- E2E (vLLM's "E2EL"): arrival of the last chunk minus the send time.
Aggregates: mean, median (p50), p90, p99 (numpy's linear-interpolation percentile, as vLLM),
and any other percentiles asked for (``--metric-percentiles``); ITLs are pooled over all
requests before aggregating, as vLLM does. Throughputs divide by the benchmark duration (first
send to last completion, measured by the driver). Goodput (vLLM's ``--goodput``): the rate of
completed requests that met every given service-level objective (TTFT, TPOT, E2EL in ms; a
one-token request's TPOT counts as 0, as vLLM's).

``compute_metrics`` is a pure function of these records, so it is tested against timestamps
computed by hand.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may bound (vLLM's names)


class RequestRecord(msgspec.Struct):
    """One request as the client saw it."""

    send_time: float
    chunk_times: list[float]  # arrival of each non-empty delta
    prompt_len: int
    output_len: int  # tokens received
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float:
        return self.chunk_times[-1] - self.send_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.output_len <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)


class Stat(msgspec.Struct):
    """Seconds or tokens, as the field name says (the summary keeps seconds; tables show ms)."""

    mean: float
    median: float
    p90: float
    p99: float
    percentiles: dict[str, float] = {}  # the ones asked for (--metric-percentiles), by their number ("99.9")

    @classmethod
    def of(cls, values: list[float], extra: Sequence[float] = ()) -> Stat:
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0, {f"{q:g}": 0.0 for q in extra})
        a = np.asarray(values, dtype=np.float64)
        return cls(float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 90)),
                   float(np.percentile(a, 99)), {f"{q:g}": float(np.percentile(a, q)) for q in extra})  # fmt: skip


class ServingMetrics(msgspec.Struct):
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    ttft_s: Stat
    tpot_s: Stat
    itl_s: Stat
    e2el_s: Stat
    # engine-side figures, filled by the driver (not derivable from client timestamps)
    peak_rss_bytes: int = 0
    peak_cuda_bytes: int = 0
    peak_kv_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    first_error: str | None = None  # why the first failed request failed (None: none failed)
    # --goodput: the objectives (ms, by SLO_METRICS name) and the rate of requests that met them all
    goodput_slos_ms: dict[str, float] = {}
    request_goodput: float | None = None


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """vLLM's ``--goodput ttft:500 tpot:50``: objectives in ms, by metric; a ValueError naming the flag."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = str(item).partition(":")
        try:
            ms = float(value) if sep else math.nan
        except ValueError:
            ms = math.nan
        if key not in SLO_METRICS or not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput takes KEY:MS pairs, KEY one of {list(SLO_METRICS)} and MS > 0, got {item!r}")
        slos[key] = ms
    return slos


def parse_percentiles(text: str | None) -> list[float]:
    """``--metric-percentiles 25,50,99.9``: each in (0, 100]; a ValueError naming the flag."""
    if not text:
        return []
    try:
        qs = [float(v) for v in str(text).split(",")]
    except ValueError:
        qs = [math.nan]
    if not all(0 < q <= 100 for q in qs):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in (0, 100], got {text!r}")
    return qs


def meets(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a completed request met every objective."""
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}
    return all(got[k] * 1e3 <= ms for k, ms in slos_ms.items())


def compute_metrics(
    records: list[RequestRecord], duration_s: float, slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = (),
) -> ServingMetrics:  # fmt: skip
    """Aggregate per-request records over a run that lasted ``duration_s`` seconds; with
    ``slos_ms``, the goodput; ``percentiles``: more of them in every latency Stat."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    inp = sum(r.prompt_len for r in done)
    out = sum(r.output_len for r in done)
    q = percentiles
    return ServingMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=inp,
        total_output_tokens=out,
        request_throughput=len(done) / duration_s,
        output_throughput=out / duration_s,
        total_token_throughput=(inp + out) / duration_s,
        ttft_s=Stat.of([r.ttft for r in done], q),
        tpot_s=Stat.of([t for r in done if (t := r.tpot) is not None], q),
        itl_s=Stat.of([g for r in done for g in r.itls], q),
        e2el_s=Stat.of([r.e2e for r in done], q),
        first_error=(failed[0].error or "no token received") if failed else None,
        goodput_slos_ms=dict(slos_ms or {}),
        request_goodput=sum(meets(r, slos_ms) for r in done) / duration_s if slos_ms else None,
    )


class Baseline(msgspec.Struct):
    """Another engine on the same prompts and output lengths, in the same run."""

    name: str  # hf-single | hf-static-B | vllm-eager | vllm-compile
    duration_s: float
    output_throughput: float
    # vllmini output tok/s / baseline output tok/s; None where the baseline did not run this
    # point's arrival pattern (HF runs all requests at t=0 or one at a time, once for every point)
    ratio: float | None
    metrics: ServingMetrics | None = None  # full latency metrics where the baseline streams (hf-single, vllm-*)
    startup_s: float | None = None  # vLLM's engine start-up (load, profile, compile), not in duration_s
    note: str = ""  # why there is no ratio, when there is none
    error: str | None = None  # the baseline could not be run: what went wrong (no figures)


class RunRecord(msgspec.Struct):
    """One JSON record per run (or sweep point) under bench/results/."""

    benchmark: str  # "serving"
    workload: str  # offline | poisson | concurrency
    dataset: str  # chat | random
    num_requests: int
    request_rate: float | None  # None = all at t=0
    burstiness: float
    max_concurrency: int | None
    seed: int
    model: str
    dtype: str
    device: str
    torch: str
    threads: int
    machine: str
    git: str
    time: str
    metrics: ServingMetrics
    baselines: list[Baseline] = []
    # one bare decode forward of the model (1 token, median context of the workload) and
    # vllmini's ITL p50 divided by it: the engine's per-token overhead over the model itself
    bare_forward_s: float | None = None
    itl_over_forward: float | None = None
    interrupted: bool = False
    attention_backend: str = ""  # the one the engine took (auto unless --attention-backend)
    args: dict = {}
    requests: list[RequestRecord] = []


def encode(record: RunRecord) -> bytes:
    return msgspec.json.format(msgspec.json.encode(record), indent=2)


def decode(data: bytes | str) -> RunRecord:
    return msgspec.json.decode(data, type=RunRecord)


def format_table(m: ServingMetrics, baselines: list[Baseline] = (), engine_rows: bool = True) -> str:
    """A vLLM-style result block; ``engine_rows`` False leaves out what only an in-process run
    reads from the engine (KV usage, preemptions, prefix-cache hits)."""
    w = 44
    lines = [f"{' Serving Benchmark Result ':=^{w + 12}}"]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<{w}}{value:>12}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", f"{m.duration_s:.2f}")
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", f"{m.request_throughput:.2f}")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", f"{m.request_goodput:.2f}")
    row("Output token throughput (tok/s):", f"{m.output_throughput:.2f}")
    row("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}")
    for title, s in (("Time to First Token", m.ttft_s), ("Time per Output Token (excl. 1st token)", m.tpot_s),
                     ("Inter-token Latency", m.itl_s), ("End-to-end Latency", m.e2el_s)):  # fmt: skip
        short = {"Time to First Token": "TTFT", "Inter-token Latency": "ITL",
                 "End-to-end Latency": "E2EL"}.get(title, "TPOT")  # fmt: skip
        lines.append(f"{' ' + title + ' ':-^{w + 12}}")
        row(f"Mean {short} (ms):", f"{s.mean * 1e3:.2f}")
        row(f"Median {short} (ms):", f"{s.median * 1e3:.2f}")
        row(f"P90 {short} (ms):", f"{s.p90 * 1e3:.2f}")
        row(f"P99 {short} (ms):", f"{s.p99 * 1e3:.2f}")
        for name, value in s.percentiles.items():
            row(f"P{name} {short} (ms):", f"{value * 1e3:.2f}")
    lines.append(f"{' Engine ':-^{w + 12}}")
    row("Peak RSS (MiB):", f"{m.peak_rss_bytes / 2**20:.0f}")
    if m.peak_cuda_bytes:
        row("Peak CUDA allocated (MiB):", f"{m.peak_cuda_bytes / 2**20:.0f}")
    if engine_rows:
        row("Peak KV-cache usage (%):", f"{m.peak_kv_usage * 100:.1f}")
        row("Preemptions:", m.num_preemptions)
        row("Prefix-cache hit rate (%):", f"{m.prefix_cache_hit_rate * 100:.1f}")
    lines.append("=" * (w + 12))
    if baselines:
        lines.append(format_comparison(m, baselines))
    return "\n".join(lines)


def format_comparison(m: ServingMetrics, baselines: list[Baseline]) -> str:
    """vllmini beside each baseline: output tok/s, ratio (vllmini / baseline) and latencies
    where the baseline streams."""
    head = f"{'engine':<16}{'out tok/s':>11}{'vllmini x':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
    lines = [head + "   (latencies in ms)", "-" * len(head)]

    def row(name: str, tput: float, ratio: str, mm: ServingMetrics | None) -> None:  # mm None: no latencies
        lat = ("".join(f"{v * 1e3:>{w}.1f}" for v, w in ((mm.ttft_s.median, 10), (mm.ttft_s.p99, 10),
                                                       (mm.itl_s.median, 9), (mm.itl_s.p99, 9)))  # fmt: skip
               if mm is not None else f"{'-':>10}{'-':>10}{'-':>9}{'-':>9}")
        lines.append(f"{name:<16}{tput:>11.1f}{ratio:>11}{lat}")

    row("vllmini", m.output_throughput, "", m)
    warnings = []

    def check(name: str, mm: ServingMetrics) -> None:
        if mm.failed:
            warnings.append(f"! {name}: {mm.failed} of {mm.completed + mm.failed} request(s) failed ({mm.first_error});"
                            " its tok/s and latencies cover the others only")  # fmt: skip

    check("vllmini", m)
    for b in baselines:
        if b.error is not None:
            lines.append(f"{b.name:<16}{'failed':>11}")
            warnings.append(f"! {b.name} could not be run: {b.error.strip().splitlines()[-1] if b.error.strip() else b.error}")
            continue
        comparable = b.ratio is not None
        row(b.name, b.output_throughput, f"{b.ratio:.2f}x" if comparable else "n/a", b.metrics if comparable else None)
        if b.metrics is not None:
            check(b.name, b.metrics)
            if b.metrics.total_output_tokens != m.total_output_tokens:
                warnings.append(f"! {b.name} generated {b.metrics.total_output_tokens} tokens, vllmini "
                                f"{m.total_output_tokens}: not the same work")  # fmt: skip
    lines += [f"  {b.name}: {b.note}" for b in baselines if b.note] + warnings
    return "\n".join(lines)
