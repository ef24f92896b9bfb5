"""Gemma 2's attention softcap: decode throughput of a Gemma-2-shaped random model (hidden 512, 12
layers, cap 50, float32) on the cpu vs the torch attention backend, decode steps only (the README's
Gemma paragraph quotes it).

    python -m bench.softcap --backends torch cpu [--no-cap]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

MODEL = Path(tempfile.gettempdir()) / "vllmini-bench" / "gemma2-softcap"


def make_model(path: Path, cap: float | None) -> Path:
    """The random model's directory (made once: safetensors and a word-level tokenizer)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from bench.random_model import save_word_level_tokenizer

    if (path / "config.json").exists():
        return path
    cfg = Gemma2Config(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128,
                       sliding_window=4096, attn_logit_softcapping=cap, final_logit_softcapping=30.0,
                       max_position_embeddings=2048, tie_word_embeddings=True, initializer_range=0.02,
                       pad_token_id=0, bos_token_id=2, eos_token_id=1)
    torch.manual_seed(0)
    hf = Gemma2ForCausalLM(cfg).eval()
    hf.save_pretrained(path)  # safetensors
    save_word_level_tokenizer(cfg.vocab_size, path)
    return path


def timed_run(engine, prompts, params, r):
    """Prefill until every request has its first token, then time the decode-only steps."""
    ids = [engine.add_request(f"r{r}-{i}", p, params) for i, p in enumerate(prompts)]
    got = {}
    t0 = time.perf_counter()
    while len(got) < len(ids):
        for out in engine.step():
            if out.outputs[0].token_ids:
                got[out.request_id] = out
    t1 = time.perf_counter()
    done = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            done[out.request_id] = out
    t2 = time.perf_counter()
    n = sum(len(done[i].outputs[0].token_ids) - len(got[i].outputs[0].token_ids) for i in ids)
    return dict(prefill_s=t1 - t0, decode_s=t2 - t1, decode_steps=steps, decode_tok_s=n / (t2 - t1),
                tokens=done[ids[0]].outputs[0].token_ids)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["torch", "cpu"])
    ap.add_argument("--no-cap", action="store_true", help="the same model with attn_logit_softcapping=None")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from vllmini import LLM, SamplingParams

    path = make_model(MODEL.with_name(MODEL.name + ("-nocap" if args.no_cap else "")), None if args.no_cap else 50.0)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8192) for _ in range(rng.randint(64, 512))]}
               for _ in range(args.requests)]
    results = {}
    for backend in args.backends:
        llm = LLM(model=str(path), attention_backend=backend, max_num_seqs=args.requests,
                  max_num_batched_tokens=2048, kv_cache_memory=2**30, enable_prefix_caching=False)
        assert llm.llm_engine.attention_backend == backend
        full = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], full, use_tqdm=False)  # warm
        best = None
        for r in range(args.repeats):
            run = timed_run(llm.llm_engine, prompts, full, r)
            print("  run", {k: round(v, 2) for k, v in run.items() if k != "tokens"}, flush=True)
            best = run if best is None or run["decode_tok_s"] > best["decode_tok_s"] else best
        outs_first = best.pop("tokens")
        results[backend] = {k: round(v, 2) for k, v in best.items()}
        results[backend]["first_tokens"] = outs_first[:8]
        print(backend, results[backend], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
