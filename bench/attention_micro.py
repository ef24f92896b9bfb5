"""Decode attention alone, on the paged cache: the Triton kernel's time and achieved KV
bandwidth, side by side with the torch backend (gather + SDPA) on the same inputs, and a
small sweep of the kernel's tile size / warps / pipeline stages, each checked against the
torch backend's output. It tells a GPU session what the kernel reaches and which settings
to keep, in about a minute.

Decode attention reads every cached K/V byte once per step and computes little, so GB/s
of K/V read is its figure of merit (an H200's HBM peak is ~4.8 TB/s).

    python -m bench.attention_micro                        # CUDA, Qwen3-0.6B shapes
    python -m bench.attention_micro --tiny --device cpu    # CPU check of the script (interpreter)
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from vllmini.models.backend_select import triton_interpreter_problem

# (batch, context): one long single stream, the GPU check's timing batch, the full batch of
# the offline workload at its mean decode context
CASES = ((1, 2048), (64, 562), (256, 843))
TINY_CASES = ((2, 40), (3, 17))
SWEEP = {"BLOCK_N": (32, 64, 128), "num_warps": (4, 8), "num_stages": (2, 3, 4)}
TINY_SWEEP = {"BLOCK_N": (16, 32), "num_warps": (4,), "num_stages": (2,)}


def build_case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
               dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict:  # fmt: skip
    """A cache holding ``batch`` sequences of ``context`` tokens in shuffled blocks (as a
    long-running cache is), and one decode step's q / new k, v / metadata."""
    from vllmini.models.base import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    cache = tuple(torch.randn(shape, generator=gen).to(device, dtype) for _ in range(2))
    pos = context - 1
    slots = [t[pos // block_size] * block_size + pos % block_size for t in tables]
    meta = AttentionMetadata.paged([1] * batch, [context] * batch, slots, tables, device=device)

    def rand(h: int) -> torch.Tensor:
        return torch.randn(batch, h, head_dim, generator=gen).to(device, dtype)

    return {"q": rand(heads), "k": rand(kv_heads), "v": rand(kv_heads), "meta": meta, "cache": cache,
            "kv_bytes": 2 * batch * context * kv_heads * head_dim * dtype.itemsize}  # fmt: skip


def timer(device: torch.device, iters: int):
    """``time(fn) -> ms``: CUDA events through Triton's do_bench (L2 flushed between runs),
    else wall time of a few calls (the CPU run checks the script, not speed)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=5, rep=iters, return_mode="median")

    def wall(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - t0) / 2 * 1e3

    return wall


def run(args: argparse.Namespace, save=lambda record: None) -> dict:
    """The cases, one after the other; ``save(record)`` after each, so a run cut short keeps them."""
    from vllmini.models.attention import torch_attention
    from vllmini.models.triton_attention import _plan, kernel_constants, run_launch

    device = torch.device(args.device)
    tiny = args.tiny
    heads, kv_heads, head_dim, block_size = (4, 2, 16, 16) if tiny else (16, 8, 128, 256)
    dtype = torch.float32 if tiny else torch.bfloat16
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    sweep = TINY_SWEEP if tiny else SWEEP
    time_ms = timer(device, iters=args.rep_ms)
    scale = head_dim**-0.5
    default = kernel_constants(dtype, head_dim, heads // kv_heads, 1, block_size, tile_is_seq=True, paged=True)
    record: dict = {"benchmark": "attention_micro", "device": str(device), "dtype": str(dtype), "torch": torch.__version__,
                    "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "block_size": block_size},
                    "default": {"BLOCK_N": default["BLOCK_N"], "num_warps": 4, "num_stages": "triton's default"},
                    "cases": []}  # fmt: skip
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
        import triton

        record["triton"] = triton.__version__
    for batch, context in TINY_CASES if tiny else CASES:
        c = build_case(batch, context, heads, kv_heads, head_dim, block_size, dtype, device)
        q, meta, (keys, vals) = c["q"], c["meta"], c["cache"]
        ref = torch_attention(q, c["k"], c["v"], meta, c["cache"], scale)  # also writes the new K/V
        (launch,) = _plan(meta, dtype, head_dim, heads // kv_heads, kv_heads, block_size, paged=True)
        out = torch.empty_like(q)

        def kernel(plan=launch, **overrides) -> None:
            run_launch(plan, out, q, keys, vals, meta.block_tables, meta, scale, **overrides)

        def gbps(ms: float) -> float:
            return round(c["kv_bytes"] / (ms * 1e-3) / 1e9, 1)

        row: dict = {"batch": batch, "context": context, "kv_mib": round(c["kv_bytes"] / 2**20, 1),
                     "num_splits": launch.num_splits}  # fmt: skip
        torch_ms = time_ms(lambda: torch_attention(q, c["k"], c["v"], meta, c["cache"], scale))
        kernel()
        row["triton_default"] = {"ms": round(time_ms(kernel), 4), "max_err": (out - ref).abs().max().item()}
        row["triton_default"]["gb_s"] = gbps(row["triton_default"]["ms"])
        row["torch"] = {"ms": round(torch_ms, 4), "gb_s": gbps(torch_ms)}
        if launch.num_splits > 1:  # what split-KV buys: the same launch with one share per row
            whole = dataclasses.replace(launch, num_splits=1, constants={**launch.constants, "SPLIT": False})
            out.zero_()
            kernel(whole)
            ms = time_ms(lambda: kernel(whole))
            row["triton_no_split"] = {"ms": round(ms, 4), "gb_s": gbps(ms), "max_err": (out - ref).abs().max().item()}
        configs = []
        for values in itertools.product(*sweep.values()):
            cfg = dict(zip(sweep, values))
            try:
                out.zero_()
                kernel(**cfg)
                err = (out - ref).abs().max().item()
                ms = time_ms(lambda: kernel(**cfg))
                configs.append({**cfg, "ms": round(ms, 4), "gb_s": gbps(ms), "max_err": err, "ok": err <= tol})
            except Exception as exc:  # e.g. out of shared memory for a large tile: a finding, go on
                configs.append({**cfg, "error": f"{type(exc).__name__}: {exc}"[:300]})
        row["sweep"] = configs
        good = [x for x in configs if x.get("ok")]
        row["best"] = min(good, key=lambda x: x["ms"]) if good else None
        # a config that cannot launch (too much shared memory) is a limit; one that runs and is wrong is a bug
        row["all_configs_correct"] = all(x["ok"] for x in configs if "error" not in x)
        row["triton_default"]["ok"] = row["triton_default"]["max_err"] <= tol
        record["cases"].append(row)
        save(record)
        best = row["best"] or {}
        print(f"batch {batch:>4} context {context:>5} ({row['kv_mib']} MiB K/V): "
              f"torch {row['torch']['ms']:.3f} ms ({row['torch']['gb_s']} GB/s), "
              f"triton {row['triton_default']['ms']:.3f} ms ({row['triton_default']['gb_s']} GB/s, "
              f"err {row['triton_default']['max_err']:.1e}, {launch.num_splits} split(s)), best {best.get('ms')} ms "
              f"({best.get('gb_s')} GB/s) with {({k: best.get(k) for k in sweep})}; "
              f"{len(good)}/{len(configs)} configs ran correctly", flush=True)  # fmt: skip
    return record


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="small shapes and sweep (CPU: Triton's interpreter)")
    ap.add_argument("--rep-ms", type=int, default=40, help="CUDA: milliseconds of repeats per timing")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/attention_micro.json, else bench/results/)")
    args = ap.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        if not args.tiny:
            ap.error("on CPU the kernel runs in Triton's interpreter: use --tiny")
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel module is first imported
        if (problem := triton_interpreter_problem()) is not None:
            ap.error(f"on CPU the kernel runs in Triton's interpreter, and {problem}: use triton >= 3.7 here "
                     "(on a GPU the kernel compiles instead)")  # fmt: skip
    if args.out:
        path = Path(args.out)
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "attention_micro.json"
    else:
        path = Path(__file__).resolve().parent / "results" / f"attention-micro-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(record: dict) -> None:
        record["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        path.write_text(json.dumps(record, indent=2))

    record = run(args, save)
    save(record)
    print(f"wrote {path}")
    return record


if __name__ == "__main__":
    record = main()
    ok = all(c["triton_default"]["ok"] and c["all_configs_correct"] for c in record["cases"])
    sys.exit(0 if ok else 1)
