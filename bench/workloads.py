"""Prompt sets and arrival schedules for the serving benchmark.

Prompts: ``chat`` (bench/data/chat_prompts.txt through the chat template, bench.offline's
uniform workload) or ``random`` (random token ids with input/output lengths uniform in given
ranges; with the default 16..512 / 16..256 ranges it is exactly bench.offline's mixed
workload). Arrivals as in vLLM's serving benchmark: inter-arrival times drawn from a gamma
distribution with shape = burstiness and scale = 1 / (rate * burstiness), so the mean rate is
``rate`` for any burstiness (1 = Poisson; < 1 burstier; > 1 more uniform); rate = inf sends
everything at t = 0.
"""
from __future__ import annotations

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
