"""``kv_cache_dtype``: what an fp8 (or bfloat16) KV cache costs and buys, each row on the same
chat requests in the same run.

Per cache dtype and per ``--kv-cache-memory`` budget: output tok/s (best of ``--repeats`` runs
on one engine: the first pays oneDNN's warm-up), the blocks the budget buys, the preemptions the
run took, and how far each request's greedy tokens follow the ``auto`` (model dtype) cache's on
the same budget (the fraction of tokens before the first divergence, averaged over requests:
1.0 = identical). A small budget shows the point of a narrower cache: more sequences fit, so
fewer are preempted and recomputed. Each row runs in its own process (an engine's OpenMP pool
belongs to its thread: see bench/run_batch.py).

    python -m bench.kv_cache_dtype                                   # default model, 64 x 64 tokens
    python -m bench.kv_cache_dtype --kv-cache-memory 1073741824,50331648
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from bench.offline import HERE, write_record

DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2")


def _conversations(n: int) -> list[list[dict]]:
    questions = [q for q in (HERE / "data" / "chat_prompts.txt").read_text().splitlines() if q.strip()]
    return [[{"role": "user", "content": questions[i % len(questions)]}] for i in range(n)]


def run_row(model: str, kv_cache_dtype: str, budget: int, n: int, output_len: int, repeats: int) -> dict:
    """One engine: best seconds over ``repeats`` runs, its blocks and preemptions, its tokens."""
    from vllmini import LLM, SamplingParams

    llm = LLM(model=model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=budget)
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    stats = llm.llm_engine.scheduler.stats
    times, preemptions = [], []
    for _ in range(repeats):
        before = stats.num_preemptions
        t0 = time.perf_counter()
        outs = llm.chat(_conversations(n), params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        preemptions.append(stats.num_preemptions - before)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    best = min(range(repeats), key=times.__getitem__)
    return {"seconds": round(times[best], 3), "tok_per_s": round(sum(map(len, tokens)) / times[best], 1),
            "blocks": llm.llm_engine.num_blocks, "preemptions": preemptions[best], "tokens": tokens}  # fmt: skip


def agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """Mean fraction of each request's tokens before its first divergence from the reference."""
    fractions = []
    for a, b in zip(ours, reference):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        fractions.append(same / max(len(b), 1))
    return sum(fractions) / len(fractions)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--kv-cache-memory", default=f"{2**30},{48 * 2**20}", help="budgets in bytes, comma-separated")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--repeats", type=int, default=2, help="runs per engine, the best kept")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--row", help=argparse.SUPPRESS)  # "dtype,budget": one row in this process, JSON out
    args = ap.parse_args(argv)
    if args.row is not None:
        dtype, budget = args.row.split(",")
        row = run_row(args.model, dtype, int(budget), args.num_requests, args.output_len, args.repeats)
        print("ROW " + json.dumps(row))
        return {}
    rows = []
    for budget in [int(x) for x in args.kv_cache_memory.split(",")]:
        reference = None
        for dtype in args.dtypes.split(","):
            flags = ["--model", args.model, "--num-requests", str(args.num_requests), "--output-len",
                     str(args.output_len), "--repeats", str(args.repeats), "--row", f"{dtype},{budget}"]  # fmt: skip
            done = subprocess.run([sys.executable, "-m", "bench.kv_cache_dtype", *flags], cwd=HERE.parent, check=True,
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
            row = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("ROW "))[4:])
            tokens = row.pop("tokens")
            reference = reference if reference is not None else tokens  # (the first dtype, "auto" by default)
            rows.append({"kv_cache_dtype": dtype, "kv_cache_memory": budget, **row,
                         "agreement": round(agreement(tokens, reference), 3)})  # fmt: skip
            r = rows[-1]
            print(f"{budget / 2**20:>7.0f} MiB {dtype:<9} {r['tok_per_s']:>7} tok/s {r['blocks']:>6} blocks "
                  f"{r['preemptions']:>4} preemptions  agreement {r['agreement']:.3f}", flush=True)  # fmt: skip
    return write_record("kv_cache_dtype", args.out_dir, model=args.model, num_requests=args.num_requests,
                        output_len=args.output_len, repeats=args.repeats, rows=rows)  # fmt: skip


if __name__ == "__main__":
    main()
