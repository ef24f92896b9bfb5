"""The vLLM baseline: runs inside vLLM's own virtualenv, as a subprocess of bench.serving.

    <vllm-venv>/bin/python bench/vllm_driver.py JOB.json RESULT.json

It imports only the standard library, vllm and its sibling send_schedule.py (never vllmini
or the bench package), so it runs where vllmini is not installed. JOB.json (written by bench.baselines.run_vllm) holds the engine
settings, warm-up requests and one or more runs: token-id prompts, output lengths, send
offsets and an optional concurrency cap. Each run drives vLLM's AsyncLLMEngine exactly as
bench.serving drives ours (greedy, ignore_eos, delta outputs), timestamping every streamed
chunk with time.perf_counter(). RESULT.json gets one entry per run with per-request
records in bench.serving_metrics.RequestRecord's schema, so both engines are scored by the
same compute_metrics. vLLM spawns processes, hence the ``__main__`` guard.
"""
from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time

from send_schedule import send_on_schedule, span_s  # bench/ is on sys.path: run as a script


_LORA_IDS: dict[str, int] = {}  # adapter path -> its lora_int_id, for every run of the job


async def _one(engine, rid: str, prompt: list[int], max_tokens: int, rec: dict, structured_json: str | None,
               lora_path: str | None = None) -> None:  # fmt: skip
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    extra = {}
    if structured_json is not None:  # (imported only then: a vLLM without it still runs the plain workloads)
        from vllm.sampling_params import StructuredOutputsParams

        extra["structured_outputs"] = StructuredOutputsParams(json=structured_json)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not extra, detokenize=True,
                            output_kind=RequestOutputKind.DELTA, **extra)  # fmt: skip
    if lora_path is not None:  # (imported only then, as StructuredOutputsParams above)
        from vllm.lora.request import LoRARequest

        extra_args = {"lora_request": LoRARequest(lora_path, _LORA_IDS.setdefault(lora_path, len(_LORA_IDS) + 1), lora_path)}
    else:
        extra_args = {}
    rec["send_time"] = time.perf_counter()
    try:
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=rid, **extra_args):
            n = len(out.outputs[0].token_ids)
            if n:
                rec["chunk_times"].append(time.perf_counter())
                rec["output_len"] += n
    except Exception as e:  # counted as failed; the run goes on
        rec["error"] = f"{type(e).__name__}: {e}"


async def _drive(engine, run: dict, tag: str, structured_json: str | None = None) -> dict:
    prompts, outs = run["prompts"], run["output_lens"]
    records: list[dict] = []

    async def request(i: int) -> None:
        rec = {"send_time": 0.0, "chunk_times": [], "prompt_len": len(prompts[i]), "output_len": 0, "error": None}
        records.append(rec)
        lora = run["lora_paths"][i] if run.get("lora_paths") else None
        await _one(engine, f"{tag}-{i}", prompts[i], outs[i], rec, structured_json, lora)

    start = time.perf_counter()
    await send_on_schedule(run["offsets"], run.get("concurrency"), request)
    return {"label": run["label"], "duration_s": span_s(start, (r["chunk_times"] for r in records)), "records": records}


async def _main(job: dict, result_path: str) -> None:
    from vllm import AsyncLLMEngine
    from vllm.engine.arg_utils import AsyncEngineArgs

    t0 = time.perf_counter()
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=job["model"], dtype=job["dtype"], enforce_eager=job["enforce_eager"], seed=job.get("seed", 0),
        max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
        max_model_len=job["max_model_len"], enable_prefix_caching=job.get("enable_prefix_caching", True),
        disable_log_stats=True, **job.get("lora", {}), **job.get("engine_extra", {})))  # fmt: skip
    startup = time.perf_counter() - t0
    results = {"vllm_version": __import__("vllm").__version__, "startup_s": startup, "runs": []}
    try:
        warm = job.get("warmup")
        if warm and warm["prompts"]:
            await _drive(engine, {**warm, "label": "warmup"}, "warmup", job.get("structured_json"))
        for k, run in enumerate(job["runs"]):
            if job.get("reset_prefix_cache", True):  # off with bench.serving's --keep-prefix-cache, as for vllmini
                await engine.reset_prefix_cache()
            res = await _drive(engine, run, f"r{k}", job.get("structured_json"))
            res["peak_rss_bytes"] = _peak_rss()
            results["runs"].append(res)
            with open(result_path, "w") as f:  # after every run, so an interrupted job keeps what it measured
                json.dump(results, f)
    finally:
        engine.shutdown()


def _peak_rss() -> int:
    """This process and its (finished or live) children: vLLM's engine core is a child."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    try:  # the live engine-core child is not in RUSAGE_CHILDREN until it exits
        import psutil

        kids = max(kids, *(c.memory_info().rss // 1024 for c in psutil.Process().children(recursive=True)), 0)
    except Exception:
        pass
    return (own + kids) * 1024


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: vllm_driver.py JOB.json RESULT.json")
    with open(sys.argv[1]) as f:
        job_spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job_spec.get("kv_cache_gib", 1)))
    asyncio.run(_main(job_spec, sys.argv[2]))
