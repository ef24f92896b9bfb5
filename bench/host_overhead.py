"""The engine's host work per decode step, with the forward taken out: what caps the step rate
on a GPU, where a small model's forward takes a few milliseconds.

A tiny random Qwen3-shaped model serves ``--batch`` requests on the CPU (greedy,
``output_kind="final"``, as ``LLM.generate`` runs them); once every request decodes, the model
is replaced by a stub that returns fixed logits, so a step is only what the host does around
the forward: scheduling, block allocation, flattening the batch and building its tensors and
attention metadata, the sampler's inputs and a greedy argmax, stop checks, detokenization and
outputs (on a GPU the inputs' copies and the graph's buffers add to it). Reported per step and per row, the best of ``--repeats`` runs of
``--steps`` steps (the machine's noise only ever adds time).

    python -m bench.host_overhead [--batch 256] [--steps 30] [--repeats 6] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.random_model import save_random_model, tiny_qwen3_bench_config
from vllmini import EngineArgs, LLMEngine, SamplingParams


def measure(batch: int, steps: int, repeats: int, prompt_len: int = 100) -> dict:
    """Milliseconds of host work per decode step at ``batch`` rows (best of ``repeats``)."""
    with tempfile.TemporaryDirectory(prefix="vllmini-host-") as tmp:
        save_random_model(tiny_qwen3_bench_config(), Path(tmp), dtype=torch.float32)
        engine = LLMEngine(EngineArgs(model=tmp, device="cpu", max_num_seqs=batch, kv_cache_memory=1 << 29,
                                      max_num_batched_tokens=max(batch * prompt_len, 2048)))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=steps * (repeats + 1) + 8, temperature=0, ignore_eos=True, output_kind="final")
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": torch.randint(2, 512, (prompt_len,), generator=g).tolist()}, params)
    engine.step()  # every prompt in one step
    logits = torch.randn(batch, engine.vocab_size, generator=g)
    engine.runner.model = lambda ids, positions, meta, kv_caches=None: logits[: meta.logits_indices.shape[0]]
    for _ in range(steps):  # warm
        engine.step()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        runs.append((time.perf_counter() - t0) / steps * 1e3)
    assert len(engine.scheduler.running) == batch, "every request must still be decoding"
    best = min(runs)
    return {"batch": batch, "steps": steps, "step_ms": best, "us_per_row": best * 1e3 / batch, "runs_ms": runs}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=None, help="write the record as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # host work is single-threaded Python; keep the stubbed step alike
    record = {"torch": torch.__version__, **measure(args.batch, args.steps, args.repeats)}
    print(f"host work per decode step at batch {record['batch']}: {record['step_ms']:.2f} ms "
          f"({record['us_per_row']:.1f} us per row; runs {' '.join(f'{r:.2f}' for r in record['runs_ms'])})")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
