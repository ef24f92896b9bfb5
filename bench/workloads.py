"""Prompt sets and arrival schedules for the serving benchmark.

Prompts: ``chat`` (bench/data/chat_prompts.txt through the chat template, bench.offline's
uniform workload) or ``random`` (random token ids with input/output lengths uniform in given
ranges; with the default 16..512 / 16..256 ranges it is exactly bench.offline's mixed
workload) or ``file`` (a JSONL file of prompts, see load_workload_file). Arrivals as in vLLM's serving benchmark: inter-arrival times drawn from a gamma
distribution with shape = burstiness and scale = 1 / (rate * burstiness), so the mean rate is
``rate`` for any burstiness (1 = Poisson; < 1 burstier; > 1 more uniform); rate = inf sends
everything at t = 0.
"""
from __future__ import annotations

import argparse
import math
import random

import numpy as np

from bench.offline import Workload, mixed_workload, uniform_workload


def parse_range(text: str) -> tuple[int, int]:
    """``"16:512"`` or ``"64"`` -> (lo, hi), validated."""
    parts = str(text).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (None, None)
    except ValueError:
        lo = hi = None
    if lo is None or lo < 1 or hi < lo:
        raise ValueError(f"bad length range {text!r}: expected LO:HI with 1 <= LO <= HI (or a single N)")
    return lo, hi


def random_workload(vocab_size: int, n: int, input_range: tuple[int, int] = (16, 512),
                    output_range: tuple[int, int] = (16, 256), seed: int = 0) -> Workload:  # fmt: skip
    """Random token ids; the same draws as bench.offline.mixed_workload for its ranges."""
    if (input_range[0], output_range[0]) == (16, 16):
        wl = mixed_workload(vocab_size, n, seed=seed, max_in=input_range[1], max_out=output_range[1])
        return Workload("random", wl.prompts, wl.output_lens)
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_range))] for _ in range(n)]
    outs = [rng.randint(*output_range) for _ in range(n)]
    return Workload("random", prompts, outs)


def chat_workload(tokenizer, n: int, output_range: tuple[int, int] = (64, 64), seed: int = 0) -> Workload:
    """Chat prompts (template applied), cycled; output lengths fixed or uniform in the range."""
    wl = uniform_workload(tokenizer, n, output_len=output_range[0])
    if output_range[0] != output_range[1]:
        rng = random.Random(seed)
        wl.output_lens = [rng.randint(*output_range) for _ in range(n)]
    return Workload("chat", wl.prompts, wl.output_lens)


def arrival_offsets(n: int, rate: float = math.inf, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests; the first is sent at 0."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (inf for all at once), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def load_workload_file(path: str) -> list[dict]:
    """Rows of a JSONL workload file, validated before any model is loaded.

    Each line is an object with exactly one of ``prompt`` (raw text), ``messages`` (chat
    messages, the template is applied) or ``prompt_token_ids`` (ints >= 0), and optionally
    ``output_len`` (int >= 1; else --output-len decides). Blank lines are skipped. A bad row
    raises ValueError naming the file, the line and the field."""
    import json

    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as e:
        raise ValueError(f"workload file {path!r} cannot be read: {e}") from e
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"workload file {path!r} line {n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        kinds = [k for k in ("prompt", "messages", "prompt_token_ids") if k in row]
        if len(kinds) != 1:
            raise ValueError(f"{where}: needs exactly one of 'prompt', 'messages', 'prompt_token_ids' (got {kinds or 'none'})")
        unknown = set(row) - {"prompt", "messages", "prompt_token_ids", "output_len"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
        v = row[kinds[0]]
        if kinds[0] == "prompt" and not (isinstance(v, str) and v):
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        if kinds[0] == "prompt_token_ids" and not (
            isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v)
        ):
            raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of ints >= 0")
        if kinds[0] == "messages" and not (
            isinstance(v, list) and v and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              and isinstance(m.get("content"), str) for m in v)  # fmt: skip
        ):
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
        out = row.get("output_len")
        if out is not None and not (isinstance(out, int) and not isinstance(out, bool) and out >= 1):
            raise ValueError(f"{where}: 'output_len' must be an int >= 1, got {out!r}")
        rows.append(row)
    if not rows:
        raise ValueError(f"workload file {path!r} has no rows")
    return rows


def file_workload(rows: list[dict], tokenizer, vocab_size: int, n: int, output_range: tuple[int, int],
                  seed: int = 0) -> Workload:  # fmt: skip
    """The first ``n`` rows (cycled when fewer), tokenized; missing output lengths drawn from the range."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for i in range(n):
        row = rows[i % len(rows)]
        if "prompt_token_ids" in row:
            ids = list(row["prompt_token_ids"])
            if max(ids) >= vocab_size:
                raise ValueError(f"workload row {i % len(rows) + 1}: token id {max(ids)} >= the model's vocab_size {vocab_size}")
        elif "messages" in row:
            ids = list(tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))  # fmt: skip
        else:
            ids = tokenizer.encode(row["prompt"])
        prompts.append(ids)
        outs.append(row.get("output_len") or rng.randint(*output_range))
    return Workload("file", prompts, outs)


def add_workload_args(ap: argparse.ArgumentParser, datasets: tuple[str, ...] = ("chat", "random", "file")) -> None:
    """The workload flags bench.serving and bench.http_serving share: what is sent, and when."""
    ap.add_argument("--workload", choices=["offline", "poisson", "concurrency"], default="poisson")
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s for --workload poisson")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight for --workload concurrency")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dataset", choices=list(datasets), default="chat")
    ap.add_argument("--input-len", default="16:512", help="random prompt length range LO:HI")
    others = "/".join(d for d in datasets if d != "chat")
    ap.add_argument("--output-len", default=None, help=f"output length N or LO:HI (chat: 64, {others}: 16:256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-warmup", type=int, default=2, help="requests sent first and not counted")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="vLLM's: at most this many requests in flight for --workload offline/poisson (default: no cap)")
    ap.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                    help="vLLM's service-level objectives, e.g. ttft:500 tpot:50 e2el:5000 (ms): reports the rate of "
                         "requests that met them all")  # fmt: skip
    ap.add_argument("--metric-percentiles", default=None,
                    help="more latency percentiles to report, comma-separated (e.g. 25,75,99.9)")


def in_flight_cap(args: argparse.Namespace) -> int | None:
    """The cap on requests in flight: --concurrency for the closed loop, else --max-concurrency
    (None: none); a ValueError naming the flag."""
    if args.workload == "concurrency":
        if args.max_concurrency is not None:
            raise ValueError("--max-concurrency is for --workload offline/poisson; the closed loop takes --concurrency")
        return args.concurrency
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    return args.max_concurrency


def metric_options(args: argparse.Namespace) -> dict:
    """compute_metrics' keywords from --goodput and --metric-percentiles (checked: ValueError)."""
    from bench.serving_metrics import parse_goodput, parse_percentiles

    return {"slos_ms": parse_goodput(args.goodput), "percentiles": parse_percentiles(args.metric_percentiles)}
