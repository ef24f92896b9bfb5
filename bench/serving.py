"""Serving benchmark: an in-process AsyncLLMEngine under concurrent load, vLLM's metrics.

Workloads: ``offline`` (every request sent at t=0), ``poisson`` (arrivals at --rate req/s,
gamma inter-arrivals with --burstiness, 1 = Poisson), ``concurrency`` (closed loop: at most
--concurrency requests in flight, the next sent as soon as one finishes). Prompts come from
bench/data/chat_prompts.txt (--dataset chat) or are random token ids with length ranges
(--dataset random). Warm-up requests run first and are not counted. The baseline, HF
transformers static left-padded batches (bench.offline.run_hf_static), runs on the same prompts
and output lengths in the same process; its output tok/s is shown beside ours with the ratio.

    python -m bench.serving --workload poisson --rate 4 --num-requests 64
    python -m bench.serving --workload concurrency --sweep 1,4,16,64 --dataset random
    python -m bench.serving --workload offline --dataset random --input-len 16:512 --output-len 16:256

One JSON record per run (per sweep point) goes to bench/results/serving-*.json
(bench.serving_metrics.RunRecord, msgspec). Ctrl-C stops sending and still writes what was
measured so far (marked ``interrupted``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import platform
import resource
import sys
import time
from pathlib import Path

import torch

from bench.offline import Workload, git_revision, run_hf_static
from bench.serving_metrics import Baseline, RequestRecord, RunRecord, compute_metrics, encode, format_table
from bench.workloads import arrival_offsets, chat_workload, parse_range, random_workload

HERE = Path(__file__).resolve().parent


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB


async def _one(engine, rid: str, prompt: list[int], max_tokens: int, rec: RequestRecord, peak: dict) -> None:
    from vllmini import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind="delta")
    rec.send_time = time.perf_counter()
    try:
        async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id=rid):
            n = len(out.outputs[0].token_ids)
            peak["kv_usage"] = max(peak["kv_usage"], engine.get_stats().kv_usage)  # also sampled every 20 ms
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
                progress: bool = True, tag: str = "req", peak: dict | None = None) -> tuple[float, float]:  # fmt: skip
    """Send ``wl`` at ``offsets`` (at most ``concurrency`` in flight); fill ``records`` as requests
    are sent and ``peak["kv_usage"]`` as it is sampled. Returns (duration_s, peak KV usage).
    Cancelling stops sending; finished records stay, unfinished ones are marked "cancelled"."""
    from tqdm.auto import tqdm

    sem = asyncio.Semaphore(concurrency) if concurrency else None
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
        if sem is not None:
            async with sem:
                records.append(rec)
                await _one(engine, f"{tag}-{i}", wl.prompts[i], wl.output_lens[i], rec, peak)
        else:
            records.append(rec)
            await _one(engine, f"{tag}-{i}", wl.prompts[i], wl.output_lens[i], rec, peak)
        bar.update(1)

    sampler = asyncio.create_task(sample_kv())
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()
    try:
        for i, t in enumerate(offsets):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(request(i)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop.set()
        await sampler
        bar.close()
    ends = [r.chunk_times[-1] for r in records if r.chunk_times]
    duration = (max(ends) if ends else time.perf_counter()) - start
    return max(duration, 1e-9), peak["kv_usage"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workload", choices=["offline", "poisson", "concurrency"], default="poisson")
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s for --workload poisson")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight for --workload concurrency")
    ap.add_argument("--sweep", default=None,
                    help="comma-separated rates (poisson) or concurrencies (concurrency); one record per point")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dataset", choices=["chat", "random"], default="chat")
    ap.add_argument("--input-len", default="16:512", help="random prompt length range LO:HI")
    ap.add_argument("--output-len", default=None, help="output length N or LO:HI (chat: 64, random: 16:256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-warmup", type=int, default=2, help="requests sent first and not counted")
    ap.add_argument("--hf-batch-size", default="16", help="HF static batch sizes, comma-separated; 0 = no baseline")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (CPU)")
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="do not reset the prefix cache before each run / sweep point (default: reset)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--save-requests", action="store_true", help="keep per-request timestamps in the record")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON records")
    return ap


def _points(args) -> list[tuple[float, int | None]]:
    """(rate, concurrency) per run, validated before any model is loaded."""
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    if args.workload == "offline":
        if args.sweep:
            raise ValueError("--sweep needs --workload poisson or concurrency")
        return [(math.inf, None)]
    vals = [v.strip() for v in args.sweep.split(",")] if args.sweep else None
    if args.workload == "poisson":
        rates = [float(v) for v in vals] if vals else [args.rate]
        for r in rates:
            arrival_offsets(1, r, args.burstiness)  # raises on an impossible rate / burstiness
        return [(r, None) for r in rates]
    concs = [int(v) for v in vals] if vals else [args.concurrency]
    if any(c < 1 for c in concs):
        raise ValueError(f"concurrency must be >= 1, got {concs}")
    return [(math.inf, c) for c in concs]


def main(argv: list[str] | None = None) -> list[RunRecord]:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        points = _points(args)
        in_range = parse_range(args.input_len)
        out_range = parse_range(args.output_len or ("64" if args.dataset == "chat" else "16:256"))
        hf_sizes = [int(b) for b in str(args.hf_batch_size).split(",") if int(b) > 0]
    except ValueError as e:
        ap.error(str(e))

    from vllmini import AsyncLLMEngine, EngineArgs

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory))  # fmt: skip
    eng = engine.engine
    if args.dataset == "chat":
        wl = chat_workload(eng.tokenizer, args.num_requests, out_range, seed=args.seed)
    else:
        wl = random_workload(eng.vocab_size, args.num_requests, in_range, out_range, seed=args.seed)
    warm = random_workload(eng.vocab_size, args.num_warmup, (16, 64), (4, 4), seed=args.seed + 1_000_003)

    baselines: list[tuple[str, float]] = []
    if hf_sizes:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(eng.model_dir, dtype=eng.dtype).to(eng.device).eval()
        pad_id = eng.tokenizer.pad_token_id if eng.tokenizer.pad_token_id is not None else 0
        if warm.prompts:
            run_hf_static(hf, pad_id, Workload("warm", warm.prompts[:1], [2]), 1)
        for b in hf_sizes:
            baselines.append((f"hf-static-{b}", run_hf_static(hf, pad_id, wl, b)))
        del hf

    meta = dict(model=args.model, dtype=str(eng.dtype).removeprefix("torch."), device=str(eng.device),
                torch=str(torch.__version__), threads=torch.get_num_threads(),
                machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                git=git_revision())  # fmt: skip
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: list[RunRecord] = []

    async def run_all() -> None:
        async with engine:
            if warm.prompts:
                await drive(engine, warm, [0.0] * len(warm.prompts), None, [], progress=False, tag="warmup")
            for k, (rate, conc) in enumerate(points):
                bm, sched = eng.block_manager, eng.scheduler
                if not args.keep_prefix_cache:  # each point starts cold (nothing is in flight here)
                    bm.reset_prefix_cache()
                q0, h0, p0 = bm.prefix_cache_queries, bm.prefix_cache_hits, sched.stats.num_preemptions
                if eng.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(eng.device)
                records: list[RequestRecord] = []
                offsets = arrival_offsets(len(wl.prompts), rate, args.burstiness, seed=args.seed)
                interrupted = False
                start, peak = time.perf_counter(), {}
                try:
                    duration, peak_kv = await drive(engine, wl, offsets, conc, records,
                                                    progress=not args.no_progress, tag=f"p{k}", peak=peak)  # fmt: skip
                except asyncio.CancelledError:
                    interrupted, peak_kv = True, peak.get("kv_usage", 0.0)
                    ends = [r.chunk_times[-1] for r in records if r.chunk_times]
                    duration = max((max(ends) if ends else time.perf_counter()) - start, 1e-9)
                m = compute_metrics(records, duration)
                m.peak_rss_bytes = peak_rss_bytes()
                m.peak_cuda_bytes = torch.cuda.max_memory_allocated(eng.device) if eng.device.type == "cuda" else 0
                m.peak_kv_usage = peak_kv
                m.num_preemptions = sched.stats.num_preemptions - p0
                q, h = bm.prefix_cache_queries - q0, bm.prefix_cache_hits - h0
                m.prefix_cache_hit_rate = h / q if q else 0.0
                req_tokens = sum(wl.output_lens)
                ours_tok_s = req_tokens / duration  # same token count as the baseline is credited with
                rec = RunRecord(
                    benchmark="serving", workload=args.workload, dataset=args.dataset,
                    num_requests=len(wl.prompts), request_rate=None if math.isinf(rate) else rate,
                    burstiness=args.burstiness, max_concurrency=conc, seed=args.seed,
                    time=time.strftime("%Y-%m-%dT%H:%M:%S"), metrics=m, interrupted=interrupted,
                    baselines=[Baseline(name, s, req_tokens / s, ours_tok_s / (req_tokens / s)) for name, s in baselines],
                    args=vars(args), requests=records if args.save_requests else [], **meta,
                )  # fmt: skip
                label = (f"rate={rate:g}" if args.workload == "poisson"
                         else f"concurrency={conc}" if conc else "offline")  # fmt: skip
                print(f"\n{args.workload} {args.dataset} {label}")
                print(format_table(m, rec.baselines if not interrupted else []))
                suffix = f"-{label.replace('=', '')}" if len(points) > 1 else ""
                path = out_dir / f"serving-{args.workload}-{stamp}{suffix}.json"
                path.write_bytes(encode(rec))
                print(f"wrote {path}")
                results.append(rec)
                if interrupted:
                    raise asyncio.CancelledError

    try:
        asyncio.run(run_all())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: records written for what was measured", file=sys.stderr)
    if len(results) > 1:
        plot_sweep(results, out_dir / f"serving-{args.workload}-{stamp}-sweep.png")
    return results


def plot_sweep(results: list[RunRecord], path: Path) -> None:
    """Output tok/s vs median TTFT / ITL over a sweep (skipped when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: sweep plot skipped (pip install matplotlib)")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    tput = [r.metrics.output_throughput for r in results]
    for ax, key, title in ((a, "ttft_s", "TTFT"), (b, "itl_s", "ITL")):
        for q in ("median", "p99"):
            ax.plot(tput, [getattr(getattr(r.metrics, key), q) * 1e3 for r in results], "o-", label=q)
        ax.set_xlabel("output tok/s")
        ax.set_ylabel(f"{title} (ms)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
