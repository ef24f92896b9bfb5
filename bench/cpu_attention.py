"""Decode attention alone on the CPU: the torch backend (gather + SDPA per length group) vs the
cpu backend's C kernel (models/cpu_attention.py), side by side on the same inputs.

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64), block size 16, and fresh
blocks scattered over a cache far larger than the last-level cache on every call, so keys and
values come from DRAM as they do in serving (there a layer's cache is read again only after
the 29 other layers' have been). Every timed call's output is checked against the other backend's.

    python -m bench.cpu_attention [--dtype bfloat16] [--out bench/results/cpu-attention.json]

With ``--dtype bfloat16`` the cache, q, k and v are bfloat16 (the kernel reads half the bytes
and computes in float32; the torch backend's SDPA computes in bfloat16), and the outputs are
compared to bfloat16's precision.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from vllmini.models.attention import torch_attention
from vllmini.models.base import AttentionMetadata
from vllmini.models.cpu_attention import cpu_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [(1, 2048, 2048), (8, 100, 800), (32, 100, 800), (64, 300, 700)]  # rows, context range


def _step(cache_blocks: int, rows: int, lo: int, hi: int, rng: random.Random, dtype: torch.dtype) -> tuple:
    """Metadata and inputs for one decode step over fresh, scattered blocks."""
    lens = [rng.randint(lo, hi) for _ in range(rows)]
    free = rng.sample(range(cache_blocks), sum(-(-n // BLOCK) for n in lens))
    tables = []
    for n in lens:
        tables.append(free[: -(-n // BLOCK)])
        free = free[-(-n // BLOCK) :]
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens)]
    meta = AttentionMetadata.paged([1] * rows, lens, slots, tables)
    q = torch.randn(rows, HEADS, HEAD_DIM, dtype=dtype)
    k, v = torch.randn(rows, KV_HEADS, HEAD_DIM, dtype=dtype), torch.randn(rows, KV_HEADS, HEAD_DIM, dtype=dtype)
    return meta, q, k, v, sum(lens)


def run_case(cache, rows: int, lo: int, hi: int, iters: int, seed: int) -> dict:
    """Each timed call gets its own fresh step, so neither backend reads blocks the other has
    just brought into cache; the other backend then runs on that step, untimed, to check it.
    A call includes its backend's planning of the step (the engine plans once per step and
    shares the plan across the layers)."""
    rng = random.Random(seed)
    backends = {"torch": torch_attention, "cpu": cpu_attention}
    times: dict[str, list[float]] = {name: [] for name in backends}
    cpu_tokens, dtype = 0, cache[0].dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for it in range(iters + 2):  # two warm-up rounds
        for name, fn in backends.items():
            meta, q, k, v, tokens = _step(cache[0].shape[0], rows, lo, hi, rng, dtype)
            t0 = time.perf_counter()
            out = fn(q, k, v, meta, cache, HEAD_DIM**-0.5)
            elapsed = time.perf_counter() - t0
            meta.backend_plan = None  # the other backend plans the step its own way
            other = next(f for n, f in backends.items() if n != name)
            torch.testing.assert_close(out, other(q, k, v, meta, cache, HEAD_DIM**-0.5), atol=tol, rtol=tol)
            if it >= 2:
                times[name].append(elapsed)
                cpu_tokens += tokens if name == "cpu" else 0
    med = {name: statistics.median(ts) for name, ts in times.items()}
    kv_bytes = cpu_tokens * KV_HEADS * HEAD_DIM * dtype.itemsize * 2
    return {
        "rows": rows, "context": [lo, hi], "torch_ms": med["torch"] * 1e3, "cpu_ms": med["cpu"] * 1e3,
        "speedup": med["torch"] / med["cpu"], "cpu_kv_gb_s": kv_bytes / sum(times["cpu"]) / 1e9,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-mib", type=int, default=256, help="size of the K cache (and of the V cache)")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    block_bytes = BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    blocks = args.cache_mib * 2**20 // block_bytes
    needed = max(rows * -(-hi // BLOCK) for rows, _, hi in CASES)  # the largest step's blocks, all distinct
    if blocks < needed:
        ap.error(f"--cache-mib {args.cache_mib} holds {blocks} blocks; the largest case needs {needed} "
                 f"(--cache-mib {-(-needed * block_bytes // 2**20)} or more)")  # fmt: skip
    cache = tuple(torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2))
    results = []
    print(f"{'rows':>5} {'context':>10} {'torch ms':>9} {'cpu ms':>8} {'speedup':>8} {'cpu K/V GB/s':>13}")
    with torch.inference_mode():
        for rows, lo, hi in CASES:
            r = run_case(cache, rows, lo, hi, args.iters, seed=rows)
            results.append(r)
            ctx = f"{lo}..{hi}" if lo != hi else str(lo)
            print(f"{rows:>5} {ctx:>10} {r['torch_ms']:>9.2f} {r['cpu_ms']:>8.2f} {r['speedup']:>7.2f}x {r['cpu_kv_gb_s']:>13.1f}")
    if args.out:
        record = {"threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": args.dtype, "cases": results}
        Path(args.out).write_text(json.dumps(record, indent=1))
    return results


if __name__ == "__main__":
    main()
