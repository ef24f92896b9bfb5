"""``GET /metrics``: Prometheus metrics under vLLM's names (``vllm:...``, label ``model_name``),
so that a dashboard made for vLLM's server reads this one.

The engine's state and counters (requests running and waiting, KV-cache usage, tokens,
preemptions, prefix-cache queries and hits; with LoRA, the adapters of the running and waiting
requests; with speculative decoding, its draft and acceptance counts) are read when the metrics are scraped; per-request
latencies and lengths are observed as each request finishes. The registry belongs to the app
(no process-wide state), so several servers or test apps do not share counts.
"""
from __future__ import annotations

import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vllmini.engine.async_engine import AsyncLLMEngine
from vllmini.engine.outputs import RequestOutput
from vllmini.spec_decode.stats import SpecDecodingStats

# vLLM's buckets for the request latencies and lengths
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_TOKEN_TIME = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LENGTHS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))


class _EngineCollector:
    """The engine's gauges and counters, read at scrape time (plain reads of ints and floats)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        core = self.engine.engine
        sched, bm = core.scheduler, core.block_manager

        def one(family: type, name: str, doc: str, value: float) -> Metric:
            metric = family(name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            return metric

        yield one(GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", len(sched.running))
        yield one(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(sched.waiting))
        yield one(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", bm.usage)
        yield one(CounterMetricFamily, "vllm:generation_tokens", "Tokens generated.", core.num_generated_tokens)
        prompt = sched.stats.num_prefill_tokens + sched.stats.num_cached_prompt_tokens
        yield one(CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens prefilled (computed or cached).", prompt)
        yield one(CounterMetricFamily, "vllm:num_preemptions", "Sequences preempted.", sched.stats.num_preemptions)
        yield one(CounterMetricFamily, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                  bm.prefix_cache_queries)  # fmt: skip
        yield one(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                  bm.prefix_cache_hits)  # fmt: skip
        if core.lora_manager is not None:
            yield self._lora_info(core.args.max_loras, list(sched.running), list(sched.waiting))
        if core.proposer is not None:
            yield from self._spec_decode(core.spec_stats)

    def _spec_decode(self, stats: SpecDecodingStats) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (acceptance rate = accepted / draft tokens)."""
        def one(name: str, doc: str, value: float) -> Metric:
            metric = CounterMetricFamily(name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            return metric

        yield one("vllm:spec_decode_num_drafts", "Drafts verified (one per sequence per step).", stats.num_drafts)
        yield one("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", stats.num_draft_tokens)
        yield one("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                                      labels=["model_name", "position"])  # fmt: skip
        for pos, count in enumerate(list(stats.num_accepted_tokens_per_pos)):
            per_pos.add_metric([self.model_name, str(pos)], count)
        yield per_pos

    @staticmethod
    def _lora_info(max_loras: int, running: list, waiting: list) -> Metric:
        """vLLM's ``vllm:lora_requests_info``: the adapters (names, comma-joined) of the running
        and waiting requests in labels, the time as its value (the latest sample is the state).
        The queues are copied first (``list()`` of a list or deque runs without letting the
        engine's thread in), so a step taken meanwhile cannot break the iteration."""
        def names(seqs: list) -> str:
            return ",".join(sorted({s.lora.request.lora_name for s in seqs if s.lora is not None}))

        metric = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of the running and waiting requests.",
                                   labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])  # fmt: skip
        metric.add_metric([str(max_loras), names(running), names(waiting)], time.time())
        return metric


class ServerMetrics:
    """The app's registry: the engine's collector plus per-request histograms."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)  # fmt: skip
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Mean time between output tokens, one per request.", _TOKEN_TIME)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", _LENGTHS)
        self.output_len = histogram("vllm:request_generation_tokens", "Tokens generated per request.", _LENGTHS)

    def observe(self, out: RequestOutput, generated: dict[int, int], finish_reason: str) -> None:
        """A finished request: its last output, the tokens of each of its n sequences, and the
        finish reason of its last sequence to end (one count per request; vLLM's V1 counts each of
        n samples, its child requests). The time per output token is over its longest sequence:
        the n sequences are decoded side by side."""
        name, m = self.model_name, out.metrics
        num_generated, longest = sum(generated.values()), max(generated.values(), default=0)
        self.success.labels(name, finish_reason).inc()
        self.prompt_len.labels(name).observe(len(out.prompt_token_ids))
        self.output_len.labels(name).observe(num_generated)
        if m is None or m.finished_time is None:
            return
        self.e2e.labels(name).observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is not None:
            self.queue.labels(name).observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.labels(name).observe(m.first_token_time - m.arrival_time)
            if longest > 1:
                self.tpot.labels(name).observe((m.finished_time - m.first_token_time) / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
