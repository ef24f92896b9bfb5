"""Offline throughput: vllmini's LLM.generate vs HF transformers static batches, same run.

Workloads (as in the models/KV issue):
- uniform: 64 chat prompts (chat template applied) x 64 output tokens, EOS ignored;
- mixed (nano-vllm style): 64 requests, prompt lengths uniform in [16, 512] (random token
  ids, fixed seed), output lengths uniform in [16, 256], EOS ignored.
The baseline is what a transformers user writes: left-padded static batches of 16, each
batch generated greedily to its longest requested output. Only the tokens each request
asked for are counted, for both engines.

    python -m bench.offline                       # both workloads, default model, fp32, CPU
    python -m bench.offline --workload mixed --num-requests 16 --model PATH
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def requested_tokens(self) -> int:
        return sum(self.output_lens)


def uniform_workload(tokenizer, n: int, output_len: int = 64) -> Workload:
    questions = (HERE / "data" / "chat_prompts.txt").read_text().splitlines()
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False))
        for i in range(n)
    ]  # fmt: skip
    return Workload("uniform", prompts, [output_len] * n)


def mixed_workload(vocab_size: int, n: int, seed: int = 0, max_in: int = 512, max_out: int = 256) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(16, max_in))] for _ in range(n)]
    outs = [rng.randint(16, max_out) for _ in range(n)]
    return Workload("mixed", prompts, outs)


def run_vllmini(llm, wl: Workload) -> float:
    from vllmini import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in wl.output_lens]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    got = sum(len(o.outputs[0].token_ids) for o in outs)
    assert got == wl.requested_tokens, f"vllmini produced {got} tokens, expected {wl.requested_tokens}"
    return elapsed


def run_hf_static(model, pad_id: int, wl: Workload, batch_size: int) -> float:
    """Left-padded static batches, each run greedily to its longest requested output."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    for b in tqdm(range(0, len(wl.prompts), batch_size), desc=f"HF static-{batch_size}"):
        prompts, outs = wl.prompts[b : b + batch_size], wl.output_lens[b : b + batch_size]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            res = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(outs),
                                 do_sample=False, eos_token_id=None, pad_token_id=pad_id)  # fmt: skip
        assert res.shape[1] == width + max(outs)
    return time.perf_counter() - start


def git_revision() -> str:
    """HEAD's short hash, with "-dirty" when tracked vllmini/ or bench/ files differ from it (the
    record then did not run the code that hash names)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=HERE, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "vllmini", "bench"],
                               capture_output=True, text=True, cwd=HERE.parent, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{rev}-dirty" if dirty else rev


def write_record(benchmark: str, out_dir: str, **fields) -> dict:
    """``bench/results/<benchmark>-<time>.json``: ``fields`` plus where and on what it ran."""
    record = {"benchmark": benchmark, **fields, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "git": git_revision(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{benchmark}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"wrote {path}")
    return record


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--workload", choices=["uniform", "mixed", "both"], default="both")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true", help="vllmini only (no baseline)")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON record")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from vllmini import LLM

    llm = LLM(model=args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    hf = None if args.skip_hf else AutoModelForCausalLM.from_pretrained(eng.model_dir, dtype=eng.dtype).eval()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    names = ["uniform", "mixed"] if args.workload == "both" else [args.workload]
    rows = []
    for name in names:
        wl = (uniform_workload(tok, args.num_requests) if name == "uniform"
              else mixed_workload(eng.vocab_size, args.num_requests))  # fmt: skip
        run_vllmini(llm, Workload(wl.name, wl.prompts[:2], [4, 4]))  # warm-up, not counted
        # the warm-up cached its prompts' prefixes: forget them, so that the measured run prefills
        # every prompt itself, as HF does (prefix hits between the measured requests still count)
        if not llm.reset_prefix_cache():
            raise RuntimeError("requests left over from the warm-up hold KV blocks")
        bm, p0 = eng.block_manager, eng.scheduler.stats.num_preemptions
        q0, h0 = bm.prefix_cache_queries, bm.prefix_cache_hits
        ours = run_vllmini(llm, wl)
        theirs = run_hf_static(hf, pad_id, wl, args.hf_batch_size) if hf is not None else None
        row = {
            "workload": name,
            "requests": len(wl.prompts),
            "prompt_tokens": sum(map(len, wl.prompts)),
            "output_tokens": wl.requested_tokens,
            "vllmini_s": round(ours, 2),
            "vllmini_tok_s": round(wl.requested_tokens / ours, 1),
            "hf_static_s": round(theirs, 2) if theirs else None,
            "hf_static_tok_s": round(wl.requested_tokens / theirs, 1) if theirs else None,
            "ratio": round(theirs / ours, 2) if theirs else None,
            "preemptions": eng.scheduler.stats.num_preemptions - p0,  # this workload's run only
            "prefix_cache_hits": bm.prefix_cache_hits - h0,
            "prefix_cache_queries": bm.prefix_cache_queries - q0,
        }
        rows.append(row)
        print(json.dumps(row))
    print(f"\n{'workload':<10}{'vllmini tok/s':>15}{f'HF static-{args.hf_batch_size} tok/s':>22}{'ratio':>8}")
    for r in rows:
        print(f"{r['workload']:<10}{r['vllmini_tok_s']:>15}{str(r['hf_static_tok_s']):>22}{str(r['ratio']):>8}")
    return write_record("offline", args.out, model=args.model, dtype=str(eng.dtype), device=str(eng.device),
                        args=vars(args), results=rows)

if __name__ == "__main__":
    main()
