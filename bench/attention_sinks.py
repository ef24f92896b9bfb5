"""gpt-oss's attention sinks in the torch backend's prefill on the CPU: SDPA's fused kernel with the sink
as one more key (``eager_attention.sink_prefill``, what the torch and cpu backends run) against eager math
a tile of query rows at a time (``capped_prefill`` without a cap), with plain SDPA without sinks as the
floor and, for reference only, SDPA's private CPU op that also returns the log-sum-exp (the output times
sigmoid(lse - sink) is the sinks' output; a private op's signature may change, so the backend does not
use it). Whole prompts at gpt-oss-20b's attention shapes (64 query heads over 8 KV heads, head_dim 64);
each variant's error against float64 eager math is printed next to its time.

    python -m bench.attention_sinks [--tokens 512 1024 2048] [--dtypes float32 bfloat16] [--out x.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from vllmini.models.eager_attention import capped_prefill, sink_prefill

HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss eager math on a whole prompt, in float64."""
    n, group = q.shape[2], HEADS // KV_HEADS
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = torch.matmul(q.double(), k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    sink = sinks.double().view(1, -1, 1, 1).expand(1, -1, n, 1)
    return torch.matmul(torch.cat([scores, sink], -1).softmax(-1)[..., :-1], v)


def variants(scale: float) -> dict[str, Callable[..., torch.Tensor]]:
    def lse_private(q, k, v, sinks):
        group = HEADS // KV_HEADS
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), 0.0, True, scale=scale
        )
        return (out.float() * torch.sigmoid(lse - sinks.float().view(1, -1, 1))[..., None]).to(q.dtype)

    found = {
        "sdpa_no_sinks": lambda q, k, v, sinks: F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                                                enable_gqa=True),  # fmt: skip
        "sdpa_sink_key": lambda q, k, v, sinks: sink_prefill(q, k, v, scale, sinks, 0, 0, None),
        "eager_tiles": lambda q, k, v, sinks: capped_prefill(q, k, v, scale, None, 0, 0, None, sinks),
    }
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):  # (private: may go)
        found["sdpa_lse_private_op"] = lse_private
    return found


def run(tokens: int, dtype: torch.dtype, repeats: int) -> dict:
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(1, HEADS, tokens, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    sinks = (torch.randn(HEADS, generator=g) + 2).to(dtype)
    scale = HEAD_DIM**-0.5
    row: dict = {"tokens": tokens, "dtype": str(dtype).removeprefix("torch.")}
    outs, times = {}, {name: [] for name in variants(scale)}
    for r in range(repeats + 1):  # the variants in turn, so that a slow spell of the machine hits them all
        for name, fn in variants(scale).items():
            t0 = time.perf_counter()
            outs[name] = fn(q, k, v, sinks)
            if r:  # (round 0: warm-up)
                times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        row[f"{name}_ms"] = statistics.median(ts) * 1e3
    if tokens <= 1024:  # (float64 scores: 2 GiB at 2048)
        want = reference(q, k, v, scale, sinks)
        for name, out in outs.items():
            if name != "sdpa_no_sinks":
                row[f"{name}_err"] = (out.double() - want).abs().max().item()
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    names = list(variants(1.0))
    print(f"{'dtype':>9} {'tokens':>6} " + " ".join(f"{n + ' ms':>21}" for n in names))
    with torch.inference_mode():
        for dtype in args.dtypes:
            for tokens in args.tokens:
                row = run(tokens, getattr(torch, dtype), args.repeats)
                rows.append(row)
                print(f"{dtype:>9} {tokens:>6} " + " ".join(f"{row[n + '_ms']:>21.1f}" for n in names), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__,
                                              "rows": rows}, indent=1))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
