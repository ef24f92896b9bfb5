"""GPU offline throughput: nano-vllm's workload on Qwen3-0.6B-shaped random weights,
vllmini vs HF transformers static batches in the same run, plus a decode-step timing
(eager vs CUDA graph) and the memory picture. Writes one JSON record.

Workload (nano-vllm's bench.py): 256 requests, prompt token ids random, prompt and output
lengths uniform in [100, 1024], EOS ignored, seed 0. Only requested output tokens count.
The HF baseline is left-padded static batches (greedy, each batch run to its longest
output), once per ``--hf-runs`` entry REQUESTSxBATCH: by default the first 64 requests in
one batch of 64 (quick: a ratio is on record even if the time limit cuts the next run), then
all 256 in one batch of 256 (the whole workload; static batching's cost is its number of
steps, so one large batch is its best case). Each entry's tok/s is over the requests it
ran; ``ratio`` is against the fastest entry.

    python -m bench.gpu_offline                      # on a GPU, ~2-3 minutes
    python -m bench.gpu_offline --tiny --device cpu  # smoke run of every part, seconds
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench.random_model import qwen3_06b_config, save_random_model, tiny_qwen3_bench_config

HERE = Path(__file__).resolve().parent


def nano_vllm_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    top = min(vocab, 10000) - 1  # nano-vllm draws ids in [0, 10000]
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outs


def run_vllmini(llm, prompts: list[list[int]], outs: list[int]) -> float:
    from vllmini import SamplingParams

    # token ids only, like the HF baseline, nano-vllm's bench.py and vLLM's --disable-detokenize
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, detokenize=False) for m in outs]
    sync(llm.llm_engine.device)
    start = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync(llm.llm_engine.device)
    elapsed = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in res)
    assert got == sum(outs), f"vllmini produced {got} tokens, expected {sum(outs)}"
    return elapsed


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step_timing(eng, batch: int, context: int, iters: int) -> dict:
    """Per-step time of one decode batch, eager forward vs the graph runner (on CPU: the padded
    static forward run eagerly, which is what a graph would replay). It writes K/V into the
    first blocks of the idle engine's cache (their prefix-cache contents are stale afterwards:
    run it last, on an engine that is thrown away)."""
    from vllmini.engine.cuda_graph import DecodeGraphRunner
    from vllmini.engine.model_runner import FlatBatch

    runner, bs = eng.runner, eng.block_manager.block_size
    batch = min(batch, eng.args.max_num_seqs)
    per_seq = -(-(context + 1) // bs)
    if batch * per_seq + 1 > eng.num_blocks:
        return {"skipped": f"needs {batch * per_seq + 1} blocks, the cache has {eng.num_blocks}"}
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]  # idle engine: all blocks free
    flat = FlatBatch(
        ids=[7] * batch, positions=[context] * batch, slots=[t[context // bs] * bs + context % bs for t in tables],
        query_lens=[1] * batch, seq_lens=[context + 1] * batch, block_tables=tables,
        logits_rows=list(range(batch)), sample_indices=list(range(batch)),
    )  # fmt: skip
    graphs = runner.decode_graphs or DecodeGraphRunner(
        eng.model, runner.kv_caches, bs, eng.args.max_num_seqs, eng.max_model_len, eng.num_blocks - 1,
        eng.device, use_graphs=False,
    )  # fmt: skip

    @torch.inference_mode()
    def eager() -> torch.Tensor:
        inp = flat.to_model_input(eng.device)
        return eng.model(inp.input_ids, inp.positions, inp.attn_metadata, runner.kv_caches)

    times = {}
    for name, step in (("eager", eager), ("graph" if graphs.use_graphs else "static_padded_eager", lambda: graphs.run(flat))):
        for _ in range(3):
            step()
        sync(eng.device)
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        sync(eng.device)
        times[name] = (time.perf_counter() - t0) / iters
    names = list(times)
    return {
        "batch": batch, "context": context,
        **{f"{k}_ms": round(v * 1e3, 3) for k, v in times.items()},
        "speedup": round(times[names[0]] / times[names[1]], 2),
    }  # fmt: skip


def run_hf_static(model_dir: Path, dtype: torch.dtype, device: torch.device, prompts: list[list[int]],
                  outs: list[int], batch_size: int) -> float:  # fmt: skip
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    pad = 0

    def generate(model, batch_prompts: list[list[int]], max_new: int) -> None:
        width = max(map(len, batch_prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=device)
        with torch.inference_mode():
            res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad)  # fmt: skip
        assert res.shape[1] == width + max_new

    generate(model, [p[:8] for p in prompts[:2]], 2)  # warm-up, not counted
    sync(device)
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        generate(model, prompts[b : b + batch_size], max(outs[b : b + batch_size]))
    sync(device)
    elapsed = time.perf_counter() - start
    del model
    return elapsed


def _hf_runs(text: str) -> list[list[int]]:
    """``256x256,64x64`` -> [[256, 256], [64, 64]] (requests x batch size, each >= 1; lists,
    so that the record's args survive a JSON round trip)."""
    try:
        runs = [[int(x) for x in item.split("x")] for item in text.split(",")]
    except ValueError:
        runs = []
    if not runs or any(len(r) != 2 or min(r) < 1 for r in runs):
        raise argparse.ArgumentTypeError(f"expected REQUESTSxBATCH[,...] with positive ints, got {text!r}")
    return runs


def run_vllmini_phases(record: dict, save, model_dir: Path, prompts: list[list[int]], outs: list[int],
                       args: argparse.Namespace, device: torch.device, lo: int, hi: int) -> None:
    """Engine start, the timed run (sync, then async scheduling), the decode-step timing; each
    phase's numbers go into ``record`` and are saved as soon as they exist."""
    from vllmini import LLM

    tiny = args.tiny
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), device=str(device), max_model_len=2 * hi, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=max(args.max_num_batched_tokens, 2 * hi),
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
              attention_backend=args.attention_backend, seed=args.seed,
              kv_cache_memory=2**24 if tiny and device.type == "cpu" else None)  # fmt: skip
    eng = llm.llm_engine
    record["engine_start_s"] = round(time.perf_counter() - t0, 1)
    run_vllmini(llm, prompts[:2], [4, 4])  # warm-up, not counted
    if not llm.reset_prefix_cache():  # the measured run starts cold: the warm-up's prompts are measured ones
        raise RuntimeError("requests left over from the warm-up hold KV blocks")
    ours = run_vllmini(llm, prompts, outs)
    record["vllmini"] = {
        "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outs), "detokenize": False,
        "seconds": round(ours, 2), "output_tok_s": round(sum(outs) / ours, 1),
        "attention_backend": eng.attention_backend, "cuda_graphs": eng.runner.decode_graphs is not None,
        "block_size": eng.block_manager.block_size, "kv_blocks": eng.num_blocks,
        "kv_tokens": eng.capacity_tokens, "preemptions": eng.scheduler.stats.num_preemptions,
        "kv_cache_gib": round(sum(t.numel() * t.element_size() for kv in eng.runner.kv_caches for t in kv) / 2**30, 2),
    }  # fmt: skip
    save()
    # the same engine and workload with async scheduling (the next step launched before this
    # one's tokens are read): what overlapping host and device work buys here; from a cold prefix
    # cache, as the first run had it
    if not llm.reset_prefix_cache():
        raise RuntimeError("requests left over from the first run hold KV blocks")
    eng.args.async_scheduling = True
    overlapped = run_vllmini(llm, prompts, outs)
    eng.args.async_scheduling = False
    record["vllmini_async_scheduling"] = {
        "seconds": round(overlapped, 2), "output_tok_s": round(sum(outs) / overlapped, 1),
        "speedup_vs_sync": round(ours / overlapped, 2),
    }  # fmt: skip
    save()
    record["decode_step"] = decode_step_timing(eng, args.timing_batch or (8 if tiny else 64), context=(lo + hi) // 2, iters=5 if tiny else 20)
    if device.type == "cuda":
        record["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        record["gpu_memory_total_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 2)
    save()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model and workload (CPU smoke run)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-requests", type=int, default=None, help="default 256 (tiny: 8)")
    ap.add_argument("--min-len", type=int, default=None, help="default 100 (tiny: 4)")
    ap.add_argument("--max-len", type=int, default=None, help="default 1024 (tiny: 24)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--hf-runs", type=_hf_runs, default=None,
                    help="HF baseline runs, REQUESTSxBATCH,... (default 64x64,256x256; tiny: 4x4)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--timing-batch", type=int, default=None, help="decode-step timing batch (default 64; tiny: 8)")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_offline.json, else bench/results/)")
    args = ap.parse_args(argv)

    from vllmini.config import resolve_device

    device = resolve_device(args.device)
    tiny = args.tiny
    n = args.num_requests or (8 if tiny else 256)
    lo, hi = args.min_len or (4 if tiny else 100), args.max_len or (24 if tiny else 1024)
    hf_runs = [(min(r, n), b) for r, b in (args.hf_runs or ([(4, 4)] if tiny else [(64, 64), (256, 256)]))]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = tiny_qwen3_bench_config() if tiny else qwen3_06b_config()
    record: dict = {"benchmark": "gpu_offline", "tiny": tiny, "device": str(device), "dtype": str(dtype),
                    "torch": torch.__version__, "args": vars(args)}  # fmt: skip
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)

    if args.out:
        path = Path(args.out)
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "gpu_offline.json"
    else:
        path = HERE / "results" / f"gpu-offline-{'tiny-' if tiny else ''}{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every phase, so that a run cut short by a time limit still reports
        record["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        path.write_text(json.dumps(record, indent=2))

    with tempfile.TemporaryDirectory(prefix="vllmini-gpu-offline-") as tmp:
        t0 = time.perf_counter()
        model_dir = save_random_model(config, Path(tmp), dtype, device)
        record["model_build_s"] = round(time.perf_counter() - t0, 1)
        prompts, outs = nano_vllm_workload(n, lo, hi, config.vocab_size, args.seed)

        try:
            run_vllmini_phases(record, save, model_dir, prompts, outs, args, device, lo, hi)
        except Exception:  # report it and still run the HF baseline (its numbers are still worth having)
            record["vllmini_error"] = traceback.format_exc()[-4000:]
            print(record["vllmini_error"], flush=True)
            save()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

        if device.type == "cuda":  # what the engine left behind (HF runs in the same process next)
            record["gpu_memory_after_engine_gib"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)

        for hf_n, batch in [] if args.skip_hf else hf_runs:
            hf_tokens = sum(outs[:hf_n])
            try:
                theirs = run_hf_static(model_dir, dtype, device, prompts[:hf_n], outs[:hf_n], batch)
            except Exception as exc:  # e.g. out of memory at a large batch: report it, run the next one
                record.setdefault("hf_static", []).append({
                    "requests": hf_n, "batch_size": batch, "error": f"{type(exc).__name__}: {exc}"[:500]})
                print(f"HF static {hf_n}x{batch} failed: {type(exc).__name__}: {exc}"[:500], flush=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                save()
                continue
            entry = {
                "requests": hf_n, "batch_size": batch, "output_tokens": hf_tokens,
                "seconds": round(theirs, 2), "output_tok_s": round(hf_tokens / theirs, 1),
                "note": f"first {hf_n} of the {n} requests" if hf_n < n else "the whole workload",
            }  # fmt: skip
            if "vllmini" in record:
                entry["ratio"] = round(record["vllmini"]["output_tok_s"] / (hf_tokens / theirs), 2)
            record.setdefault("hf_static", []).append(entry)
            if any("ratio" in h for h in record["hf_static"]):  # vs the fastest HF run
                record["ratio"] = min(h["ratio"] for h in record["hf_static"] if "ratio" in h)
            save()

    v, a = record.get("vllmini"), record.get("vllmini_async_scheduling")
    print(f"\n{'':<12}{'requests':>10}{'out tokens':>12}{'seconds':>10}{'tok/s':>12}")
    if v:
        print(f"{'vllmini':<12}{v['requests']:>10}{v['output_tokens']:>12}{v['seconds']:>10}{v['output_tok_s']:>12}")
    if v and a:
        print(f"{'  async':<12}{v['requests']:>10}{v['output_tokens']:>12}{a['seconds']:>10}{a['output_tok_s']:>12}"
              f"   async scheduling: {a['speedup_vs_sync']}x the synchronous run")  # fmt: skip
    if "vllmini_error" in record:
        print("vllmini failed (vllmini_error in the record, traceback above); the HF baseline ran anyway")
    for h in record.get("hf_static", []):
        name = f"HF static-{h['batch_size']}"
        if "error" in h:
            print(f"{name:<12}{h['requests']:>10}   failed: {h['error'][:200]}")
            continue
        print(f"{name:<12}{h['requests']:>10}{h['output_tokens']:>12}{h['seconds']:>10}{h['output_tok_s']:>12}"
              f"   vllmini is {h.get('ratio', 'n/a')}x ({h['note']})")  # fmt: skip
    if "ratio" in record:
        print(f"ratio vllmini / fastest HF run: {record['ratio']}x")
    if v:
        print(f"backend {v['attention_backend']}, CUDA graphs {v['cuda_graphs']}, KV blocks {v['kv_blocks']} "
              f"x {v['block_size']} tokens, peak GPU memory {record.get('peak_gpu_memory_gib', 'n/a')} GiB")  # fmt: skip
    if "decode_step" in record:
        print(f"decode step: {json.dumps(record['decode_step'])}")

    save()
    print(f"wrote {path}")
    return record


if __name__ == "__main__":
    raise SystemExit(1 if "vllmini_error" in main() else 0)
