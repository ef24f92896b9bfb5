"""The engine's Prometheus metrics (metrics/stat_logger.py) read through LLM.get_metrics()
(metrics/reader.py): what each counts, against what the requests did."""
from __future__ import annotations

import pytest

from vllmini import LLM, EngineArgs, LLMEngine, SamplingParams
from vllmini.metrics.reader import Counter, Gauge, Histogram, Metric, Vector

KV = 64 << 20


def by_name(metrics: list[Metric], **labels: str) -> dict[str, Metric]:
    found = {}
    for m in metrics:
        if all(m.labels.get(k) == v for k, v in labels.items()):
            assert m.name not in found, m.name  # one per name under these labels
            found[m.name] = m
    return found


def test_get_metrics_counts_what_the_requests_did(tiny_dir):
    llm = LLM(model=str(tiny_dir), kv_cache_memory=KV, disable_log_stats=False, served_model_name="tiny")
    params = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True, n=2,
              temperature=0.8, seed=3), SamplingParams(max_tokens=1, ignore_eos=True)]  # fmt: skip
    outs = llm.generate(["Hello there", "The sky is", "One"], params, use_tqdm=False)
    lengths = [len(c.token_ids) for o in outs for c in o.outputs]
    assert lengths == [6, 4, 4, 1]
    m = by_name(llm.get_metrics(), model_name="tiny")
    assert isinstance(m["vllm:generation_tokens"], Counter) and m["vllm:generation_tokens"].value == sum(lengths)
    assert m["vllm:prompt_tokens"].value == sum(len(o.prompt_token_ids) for o in outs)
    assert isinstance(m["vllm:num_requests_running"], Gauge) and m["vllm:num_requests_running"].value == 0
    assert m["vllm:request_success"].labels["finished_reason"] == "length" and m["vllm:request_success"].value == 3

    def hist(name: str) -> Histogram:
        h = m[name]
        assert isinstance(h, Histogram) and h.buckets["+Inf"] == h.count  # cumulative, as Prometheus's
        assert list(h.buckets.values()) == sorted(h.buckets.values())
        return h

    assert hist("vllm:time_to_first_token_seconds").count == 3  # one per request, n=2 included
    assert hist("vllm:inter_token_latency_seconds").count == sum(n - 1 for n in lengths)  # a gap per step after the first
    assert hist("vllm:request_time_per_output_token_seconds").count == 2  # requests of more than one token
    assert hist("vllm:request_generation_tokens").sum == sum(lengths)
    assert hist("vllm:request_max_num_generation_tokens").sum == 6 + 4 + 1
    assert hist("vllm:request_prompt_tokens").sum == sum(len(o.prompt_token_ids) for o in outs)
    assert hist("vllm:request_params_n").sum == 1 + 2 + 1 and hist("vllm:request_params_max_tokens").sum == 6 + 4 + 1
    e2e, queue, inference = (hist(f"vllm:{n}").sum for n in ("e2e_request_latency_seconds",
                             "request_queue_time_seconds", "request_inference_time_seconds"))  # fmt: skip
    assert e2e == pytest.approx(queue + inference) and inference > 0
    prefill, decode = hist("vllm:request_prefill_time_seconds").sum, hist("vllm:request_decode_time_seconds").sum
    assert inference == pytest.approx(prefill + decode) and decode > 0
    # every token after a request's first came in some gap: the decode time covers the gaps of its longest sequence
    assert m["vllm:inter_token_latency_seconds"].sum >= decode * 0.99


def test_metrics_are_off_by_default_offline_and_each_engine_counts_its_own(tiny_dir):
    off = LLM(model=str(tiny_dir), kv_cache_memory=KV)
    assert off.llm_engine.stat_logger is None
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        off.get_metrics()
    a = LLM(model=str(tiny_dir), kv_cache_memory=KV, disable_log_stats=False)
    b = LLM(model=str(tiny_dir), kv_cache_memory=KV, disable_log_stats=False)
    a.generate(["Hi"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert by_name(a.get_metrics())["vllm:generation_tokens"].value == 3
    assert by_name(b.get_metrics())["vllm:generation_tokens"].value == 0
    assert "vllm:request_success" not in by_name(b.get_metrics())  # (no label set observed yet)
    # the label is the model unless a served name is given, as in vLLM
    assert by_name(a.get_metrics())["vllm:generation_tokens"].labels == {"model_name": str(tiny_dir)}


def test_an_aborted_request_counts_as_abort(tiny_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV))  # (on by default)
    engine.add_request("waiting", "Hello", SamplingParams(max_tokens=5))
    engine.add_request("running", "Hello there", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.abort_request("waiting")  # before any step: never scheduled
    for _ in range(3):
        engine.step()
    engine.abort_request("running")
    engine.abort_request("running")  # (an id already gone counts nothing)
    m = by_name(engine.get_metrics())
    assert m["vllm:request_success"].labels["finished_reason"] == "abort" and m["vllm:request_success"].value == 2
    assert m["vllm:e2e_request_latency_seconds"].count == 2
    assert m["vllm:request_queue_time_seconds"].count == 1  # only the one that ran was ever scheduled
    assert m["vllm:time_to_first_token_seconds"].count == 1 and m["vllm:inter_token_latency_seconds"].count == 2
    assert m["vllm:request_generation_tokens"].sum == 3
    assert not engine.has_unfinished_requests()


def test_each_step_observes_its_tokens_and_the_cache_config_is_a_labelled_gauge(tiny_dir):
    """vllm:iteration_tokens_total: one observation per step that ran (a prefill chunk, with the
    first token of the last chunk; one token per decode), its sum the prompt and generation
    counters' (as vLLM's). vllm:cache_config_info: value 1, the cache's settings in its labels."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV, max_num_batched_tokens=8,
                                                   enable_prefix_caching=False, served_model_name="tiny"))  # fmt: skip
    ids = list(range(10, 23))  # 13 prompt tokens: two chunks of at most 8
    engine.step()  # (nothing to run: not observed)
    engine.add_request("a", {"prompt_token_ids": ids}, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    m = by_name(engine.get_metrics(), model_name="tiny")
    steps = m["vllm:iteration_tokens_total"]  # observed: 8, 5 + 1, 1, 1
    assert isinstance(steps, Histogram) and steps.count == 4 and steps.sum == 13 + 3
    assert steps.sum == m["vllm:prompt_tokens"].value + m["vllm:generation_tokens"].value
    assert steps.buckets["1.0"] == 2 and steps.buckets["8.0"] == 4 and list(steps.buckets)[:3] == ["1.0", "8.0", "16.0"]
    assert list(steps.buckets)[-2:] == ["16384.0", "+Inf"]  # vLLM's buckets
    info = by_name(engine.get_metrics())["vllm:cache_config_info"]
    assert isinstance(info, Gauge) and info.value == 1
    assert info.labels == {"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "False",
                           "gpu_memory_utilization": "0.9", "kv_cache_memory_bytes": str(KV), "num_cpu_blocks": "None",
                           "num_gpu_blocks": str(engine.num_blocks), "sliding_window": "None"}  # fmt: skip


def test_speculative_decoding_reports_acceptance_by_position(default_model_dir):
    llm = LLM(model=str(default_model_dir), disable_log_stats=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                  "prompt_lookup_min": 1})  # fmt: skip
    prompt = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,"
    out = llm.generate([prompt], SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    stats = llm.llm_engine.spec_stats
    m = by_name(llm.get_metrics())
    vector = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(vector, Vector) and vector.values == list(stats.num_accepted_tokens_per_pos) and vector.values[0] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens > 0
    # one gap per step, however many tokens it gave: fewer gaps than tokens after the first
    assert m["vllm:inter_token_latency_seconds"].count == len(out.outputs[0].token_ids) - 1 - stats.num_accepted_tokens


def test_pooling_requests_count_with_their_prompts(tiny_dir):
    llm = LLM(model=str(tiny_dir), kv_cache_memory=KV, runner="pooling", disable_log_stats=False)
    outs = llm.embed(["Hello there", "One two three four"], use_tqdm=False)
    m = by_name(llm.get_metrics())
    assert m["vllm:request_success"].labels["finished_reason"] == "stop" and m["vllm:request_success"].value == 2
    assert m["vllm:request_prompt_tokens"].sum == sum(len(o.prompt_token_ids) for o in outs)
    assert m["vllm:request_generation_tokens"].sum == 0 and m["vllm:time_to_first_token_seconds"].count == 0
    assert m["vllm:request_inference_time_seconds"].count == 2 and m["vllm:request_prefill_time_seconds"].count == 0


def test_an_engine_with_metrics_is_freed_when_dropped(tiny_dir):
    """Its registry must not hold it: from_engine_args freezes what is alive (gc.freeze), so an
    engine in a reference cycle would never be freed, and each one holds its KV cache."""
    import weakref

    llm = LLM(model=str(tiny_dir), kv_cache_memory=KV, disable_log_stats=False)
    llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    registry, ref = llm.llm_engine.stat_logger.registry, weakref.ref(llm.llm_engine)
    del llm
    assert ref() is None  # by reference counting alone
    assert not [m for m in registry.collect() if m.name == "vllm:num_requests_running"]  # (read after: nothing)
