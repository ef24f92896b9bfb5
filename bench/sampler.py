"""Sampler micro-benchmark: time per step for a batch of 256 x vocab 49152, mixed
parameters vs greedy only (not a test; figures go in the issue note).

    python -m bench.sampler [--batch 256] [--vocab 49152] [--steps 20]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from vllmini.engine.sampler import Sampler, SamplingRow, SamplingTensors
from vllmini.engine.sampling_params import SamplingParams


def mixed_params(i: int) -> SamplingParams:
    """Every kind of row: greedy, plain, top-k/top-p/min-p, seeded, penalties, logprobs, min_tokens."""
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05, seed=i),
        SamplingParams(temperature=0.9, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(temperature=1.0, logprobs=5, min_tokens=8, stop_token_ids=[7, 9]),
    ]
    return kinds[i % len(kinds)]


def time_steps(rows: list[SamplingRow], vocab: int, steps: int, seed: int = 0) -> tuple[float, float]:
    """Median (build tensors, sample) seconds per step."""
    sampler = Sampler()
    g = torch.Generator().manual_seed(seed)
    build, sample = [], []
    for _ in range(steps):
        logits = torch.randn(len(rows), vocab, generator=g) * 4
        t0 = time.perf_counter()
        tensors = SamplingTensors.from_rows(rows, vocab)
        t1 = time.perf_counter()
        sampler(logits, tensors)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        sample.append(t2 - t1)
    return statistics.median(build), statistics.median(sample)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompts = [[rng.randrange(args.vocab) for _ in range(rng.randint(16, 512))] for _ in range(args.batch)]
    outputs = [[rng.randrange(args.vocab) for _ in range(rng.randint(0, 128))] for _ in range(args.batch)]
    cases = {
        "greedy only": [SamplingRow(SamplingParams(temperature=0), p, o, 2) for p, o in zip(prompts, outputs)],
        "mixed": [SamplingRow(mixed_params(i), p, o, 2) for i, (p, o) in enumerate(zip(prompts, outputs))],
    }
    print(f"batch {args.batch} x vocab {args.vocab}, {torch.get_num_threads()} threads, median of {args.steps} steps")
    for name, rows in cases.items():
        build, sample = time_steps(rows, args.vocab, args.steps)
        print(f"{name:<12} build tensors {build * 1e3:7.1f} ms   sample {sample * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
