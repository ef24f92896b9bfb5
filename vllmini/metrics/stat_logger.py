"""One engine's Prometheus metrics under vLLM's names (``vllm:...``, label ``model_name``), so
that a dashboard made for vLLM reads them: the server's ``GET /metrics`` renders this registry and
``LLM.get_metrics()`` reads it (``metrics/reader.py``).

The engine's state and counters (requests running and waiting, KV-cache usage, tokens,
preemptions, prefix-cache queries and hits; with LoRA, the adapters of the running and waiting
requests; with speculative decoding, its draft and acceptance counts) are read when the metrics
are collected. The engine records the rest as it goes: the tokens of each step, the time to first
token and the gaps between tokens after each step, a request's latencies and lengths when it
finishes. ``vllm:cache_config_info`` (value 1) carries the KV cache's settings in its labels. The
registry belongs to the engine (no process-wide state), so two engines never share counts.
"""
from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from vllmini.engine.outputs import RequestMetrics
from vllmini.scheduler.scheduler import SchedulerStats
from vllmini.scheduler.sequence import Sequence
from vllmini.spec_decode.stats import SpecDecodingStats

if TYPE_CHECKING:
    from vllmini.engine.llm_engine import LLMEngine

# vLLM's buckets
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
            80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_TOKEN_TIME = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_LENGTHS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
_N = (1, 2, 5, 10, 20)
_STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def prompt_tokens(stats: SchedulerStats) -> int:
    """``vllm:prompt_tokens``: prompt tokens prefilled, computed or found in the prefix cache."""
    return stats.num_prefill_tokens + stats.num_cached_prompt_tokens


def cache_config_info(engine: LLMEngine) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: vLLM's CacheConfig field names for the settings
    vllmini has, each value as ``str()`` writes it (as vLLM's; cache_dtype is kv_cache_dtype as given);
    there is no CPU swap space (num_cpu_blocks None)."""
    args = engine.args
    info = {"block_size": engine.block_manager.block_size, "cache_dtype": args.kv_cache_dtype,
            "enable_prefix_caching": args.enable_prefix_caching, "gpu_memory_utilization": args.gpu_memory_utilization,
            "kv_cache_memory_bytes": args.kv_cache_memory, "num_cpu_blocks": None, "num_gpu_blocks": engine.num_blocks,
            "sliding_window": getattr(engine.model, "sliding_window", None)}  # fmt: skip
    return {name: str(value) for name, value in info.items()}


class StatLogger:
    """The engine's registry: its gauges and counters (collected on read) and the histograms
    the engine fills through ``record_tokens`` and ``record_finished``."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name
        info = cache_config_info(engine)
        Gauge("vllm:cache_config_info", "The engine's KV-cache settings (in the labels).", list(info),
              registry=self.registry).labels(**info).set(1)  # fmt: skip
        self._step_total = 0  # prompt and generated tokens counted until the last step

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.success = Counter("vllm:request_success", "Finished requests, by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)  # fmt: skip
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between a sequence's steps that gave it tokens.",
                             _TOKEN_TIME)  # fmt: skip
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Mean time between output tokens, one per request.", _TOKEN_TIME)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY)
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY)
        self.inference = histogram("vllm:request_inference_time_seconds", "First scheduled to last token.", _LATENCY)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "First scheduled to first token.", _LATENCY)
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to last token.", _LATENCY)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", _LENGTHS)
        self.output_len = histogram("vllm:request_generation_tokens", "Tokens generated per request.", _LENGTHS)
        self.max_output_len = histogram("vllm:request_max_num_generation_tokens",
                                        "Tokens of a request's longest sequence.", _LENGTHS)  # fmt: skip
        self.param_n = histogram("vllm:request_params_n", "The n of each request.", _N)
        self.param_max_tokens = histogram("vllm:request_params_max_tokens", "The max_tokens of each request.", _LENGTHS)
        self.step_tokens = histogram("vllm:iteration_tokens_total", "Tokens per engine step (prompt and generated).",
                                     _STEP_TOKENS)  # fmt: skip

    def record_step(self, stats: SchedulerStats, num_generated_tokens: int) -> None:
        """After a step: the tokens it added to ``vllm:prompt_tokens`` and ``vllm:generation_tokens``
        (as vLLM's, so the histogram's sum is theirs); a step that ran nothing is not observed."""
        total = prompt_tokens(stats) + num_generated_tokens
        if total != self._step_total:
            self.step_tokens.observe(total - self._step_total)
            self._step_total = total

    def record_tokens(self, seq: Sequence, before: float | None) -> None:
        """After a step gave ``seq`` tokens (``before``: its last token's time until then): the
        request's time to first token (counted once, from its first sequence), else the gap
        since its last token (one per step, however many tokens a speculative step gave)."""
        now = seq.last_token_time
        if now is None or now == before:
            return
        if before is not None:
            self.itl.observe(now - before)
        elif seq.index == 0:
            self.ttft.observe(now - seq.arrival_time)

    def record_finished(self, seqs: list[Sequence], prompt_len: int, params: Any) -> None:
        """A request left the engine (finished, stopped or aborted): one count per request, its
        finish reason the last of its sequences to end; the time per output token is over its
        longest sequence (the n sequences are decoded side by side)."""
        last = max(seqs, key=lambda s: s.finished_time or 0.0)
        self.success.labels(self.model_name, last.status.value).inc()
        generated = [s.num_output_tokens for s in seqs]
        longest = max(generated)
        self.prompt_len.observe(prompt_len)
        self.output_len.observe(sum(generated))
        self.max_output_len.observe(longest)
        self.param_n.observe(len(seqs))
        if (max_tokens := getattr(params, "max_tokens", None)) is not None:
            self.param_max_tokens.observe(max_tokens)
        m = RequestMetrics.of(seqs, seqs[0].arrival_time, finished=True)
        arrival, finished = m.arrival_time, m.finished_time or time.monotonic()
        self.e2e.observe(finished - arrival)
        scheduled, first = m.first_scheduled_time, m.first_token_time
        if scheduled is None:  # aborted while waiting
            return
        self.queue.observe(scheduled - arrival)
        self.inference.observe(finished - scheduled)
        if first is None:  # no token (a pooling request, or aborted in its prefill)
            return
        self.prefill.observe(first - scheduled)
        self.decode.observe(finished - first)
        if longest > 1:
            self.tpot.observe((finished - first) / (longest - 1))


class _EngineCollector:
    """The engine's gauges and counters, read at collection time (plain reads of ints and floats:
    the server collects from its event loop while the engine steps in its own thread). It holds
    the engine weakly: the engine holds its registry, and a cycle would outlive the engine's last
    user (``LLMEngine.from_engine_args`` freezes what is alive, so no collection would free it)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self._engine, self.model_name = weakref.ref(engine), model_name

    def _one(self, family: type, name: str, doc: str, value: float) -> Metric:
        metric = family(name, doc, labels=["model_name"])
        metric.add_metric([self.model_name], value)
        return metric

    def collect(self) -> Iterator[Metric]:
        core, gauge, counter = self._engine(), GaugeMetricFamily, CounterMetricFamily
        if core is None:
            return
        sched, bm = core.scheduler, core.block_manager
        yield self._one(gauge, "vllm:num_requests_running", "Requests in the running batch.", len(sched.running))
        yield self._one(gauge, "vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(sched.waiting))
        yield self._one(gauge, "vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", bm.usage)
        yield self._one(counter, "vllm:generation_tokens", "Tokens generated.", core.num_generated_tokens)
        yield self._one(counter, "vllm:prompt_tokens", "Prompt tokens prefilled (computed or cached).",
                        prompt_tokens(sched.stats))  # fmt: skip
        yield self._one(counter, "vllm:num_preemptions", "Sequences preempted.", sched.stats.num_preemptions)
        yield self._one(counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                        bm.prefix_cache_queries)  # fmt: skip
        yield self._one(counter, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                        bm.prefix_cache_hits)  # fmt: skip
        if core.lora_manager is not None:
            yield self._lora_info(core.args.max_loras, list(sched.running), list(sched.waiting))
        if core.spec_config is not None:  # (n-gram or draft model)
            yield from self._spec_decode(core.spec_stats)

    def _spec_decode(self, stats: SpecDecodingStats) -> Iterator[Metric]:
        """vLLM's speculative-decoding counters (acceptance rate = accepted / draft tokens)."""
        counter = CounterMetricFamily
        yield self._one(counter, "vllm:spec_decode_num_drafts", "Drafts verified (one per sequence per step).",
                        stats.num_drafts)  # fmt: skip
        yield self._one(counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", stats.num_draft_tokens)
        yield self._one(counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                        stats.num_accepted_tokens)  # fmt: skip
        per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position.",
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
