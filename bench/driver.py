"""Drives an in-process AsyncLLMEngine with a workload and timestamps every streamed chunk.

Requests are greedy with ignore_eos and ``output_kind="delta"``, so each streamed output is
one chunk and every gap between chunks is one ITL sample (vLLM's definition). With a
``structured_json`` schema, each request's output follows it and ends at its EOS instead. Peak KV-cache
usage is read at every chunk and sampled every 20 ms.
"""
from __future__ import annotations

import asyncio
import contextlib
import resource
import sys
import time

from bench.offline import Workload
from bench.send_schedule import send_on_schedule, span_s
from bench.serving_metrics import RequestRecord


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


async def _one(engine, rid: str, prompt: list[int], max_tokens: int, rec: RequestRecord, peak: dict,
               structured_json: str | None = None) -> None:  # fmt: skip
    from vllmini import SamplingParams, StructuredOutputsParams

    structured = None if structured_json is None else StructuredOutputsParams(json=structured_json)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=structured is None, output_kind="delta",
                            structured_outputs=structured)  # fmt: skip
    rec.send_time = time.perf_counter()
    try:
        async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=rid):
            n = len(out.outputs[0].token_ids)
            peak["kv_usage"] = max(peak["kv_usage"], engine.engine.block_manager.usage)  # one float, no lock
            if n:
                rec.chunk_times.append(time.perf_counter())
                rec.output_len += n
            if out.finished and out.metrics is not None:
                rec.num_preemptions = out.metrics.num_preemptions
                rec.num_cached_tokens = out.metrics.num_cached_tokens
    except asyncio.CancelledError:
        rec.error = "cancelled"
        raise
    except Exception as e:  # one failed request is counted as failed, the run goes on
        rec.error = f"{type(e).__name__}: {e}"


async def drive(engine, wl: Workload, offsets: list[float], concurrency: int | None, records: list[RequestRecord],
                progress: bool = True, tag: str = "req", peak: dict | None = None,
                structured_json: str | None = None) -> float:  # fmt: skip
    """Send ``wl`` at ``offsets`` (at most ``concurrency`` in flight); fill ``records`` as requests
    are sent and ``peak["kv_usage"]`` as it is sampled. Returns the duration in seconds.
    Cancelling stops sending; finished records stay, unfinished ones are marked "cancelled"."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(wl.prompts), desc=f"vllmini {tag}", disable=not progress, leave=False)
    peak = {} if peak is None else peak
    peak["kv_usage"] = 0.0
    stop = asyncio.Event()

    async def sample_kv() -> None:
        while not stop.is_set():
            peak["kv_usage"] = max(peak["kv_usage"], engine.get_stats().kv_usage)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.02)

    async def request(i: int) -> None:
        rec = RequestRecord(send_time=0.0, chunk_times=[], prompt_len=len(wl.prompts[i]), output_len=0)
        records.append(rec)
        await _one(engine, f"{tag}-{i}", wl.prompts[i], wl.output_lens[i], rec, peak, structured_json)
        bar.update(1)

    sampler = asyncio.create_task(sample_kv())
    start = time.perf_counter()
    try:
        await send_on_schedule(offsets, concurrency, request)
    finally:
        stop.set()
        await sampler
        bar.close()
    return span_s(start, (r.chunk_times for r in records))
