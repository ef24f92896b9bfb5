"""Speculative decoding (ngram prompt lookup): output tok/s with and without it, on a workload
that quotes its prompt and on plain chat, side by side with transformers' prompt lookup and
vLLM's ngram speculation in the same run.

Workloads (chat-templated, greedy, EOS ignored, ``--output-len`` tokens each):
- quote: "Repeat/rewrite the following text: <four questions of bench/data/chat_prompts.txt>"
  (the case prompt lookup is made for: quoting, editing, extraction);
- chat: bench/data/chat_prompts.txt's questions (free text: few drafts hit).
Each is run one request at a time (latency: ``--num-requests`` in turn) and as one batch.
Rows per workload and mode: vllmini plain, vllmini ngram, vllmini draft (with ``--draft-model``:
a draft model of the same tokenizer, e.g. one made by ``python -m bench.truncated_draft``),
transformers plain and with
``prompt_lookup_num_tokens`` (one request at a time only: transformers' prompt lookup takes
batch size 1), vLLM CPU eager plain and ngram (with ``--vllm-python``).

    python -m bench.spec_decode
    python -m bench.spec_decode --vllm-python .venv-vllm-cpu/bin/python
    python -m bench.truncated_draft --layers 8 /tmp/draft8 && python -m bench.spec_decode --draft-model /tmp/draft8
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.offline import HERE, Workload, write_record

SPEC_ENGINES = ("vllmini ngram", "vllmini draft")  # rows that report their acceptance rate
INSTRUCTIONS = ["Repeat the following text word for word:", "Rewrite the following text, numbering each question:"]


def workloads(tokenizer, n: int, output_len: int) -> list[Workload]:
    questions = (HERE / "data" / "chat_prompts.txt").read_text().splitlines()

    def chat(text: str) -> list[int]:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))  # fmt: skip

    quote = [chat(INSTRUCTIONS[i % 2] + "\n\n" + " ".join(questions[(4 * i + j) % len(questions)] for j in range(4)))
             for i in range(n)]  # fmt: skip
    plain = [chat(questions[i % len(questions)]) for i in range(n)]
    return [Workload("quote", quote, [output_len] * n), Workload("chat", plain, [output_len] * n)]


def spec_dict(args: argparse.Namespace, draft_model: str | None = None) -> dict:
    """The ngram speculative_config, or with ``draft_model`` the draft model's."""
    if draft_model is not None:
        spec = {"model": draft_model, "num_speculative_tokens": args.num_speculative_tokens}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}  # fmt: skip
    return spec if args.disable_by_batch_size is None else {**spec, "disable_by_batch_size": args.disable_by_batch_size}


def run_vllmini(llm, wl: Workload, one_at_a_time: bool) -> float:
    from vllmini import SamplingParams

    params = SamplingParams(max_tokens=wl.output_lens[0], temperature=0, ignore_eos=True)
    groups = [[p] for p in wl.prompts] if one_at_a_time else [wl.prompts]
    start, tokens = time.perf_counter(), 0
    for group in groups:
        outs = llm.generate([{"prompt_token_ids": p} for p in group], params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    elapsed = time.perf_counter() - start
    assert tokens == wl.requested_tokens
    return elapsed


def run_hf(model, wl: Workload, lookup: int | None) -> float:
    """One request at a time, ``generate`` greedy to ``output_len`` tokens (with prompt lookup)."""
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    start = time.perf_counter()
    for p in wl.prompts:
        with torch.inference_mode():
            res = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=wl.output_lens[0], eos_token_id=None, do_sample=False,
                                 pad_token_id=0, **extra)  # fmt: skip
        assert res.shape[1] == len(p) + wl.output_lens[0]
    return time.perf_counter() - start


def run_vllm(python: str, model_dir: Path, wls: list[Workload], spec: dict | None) -> dict[tuple[str, str], float]:
    """vLLM's AsyncLLMEngine (eager, fp32): every workload one at a time (concurrency 1) and as
    one batch, in one process; seconds per (workload, mode)."""
    from bench.baselines import VllmPoint, run_vllm as run

    cfg = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "max_model_len": 2048,
           "engine_extra": {} if spec is None else {"speculative_config": spec}}  # fmt: skip
    points = []
    for wl in wls:
        n = len(wl.prompts)
        points += [VllmPoint(f"{wl.name}/one at a time", wl, [0.0] * n, 1), VllmPoint(f"{wl.name}/batch", wl, [0.0] * n, None)]
    warm = Workload("warm", wls[0].prompts[:2], [8, 8])
    results, _, _ = run(python, "eager", str(model_dir), "float32", cfg, warm, points)
    out = {}
    for point, res in zip(points, results):
        tokens = sum(r.output_len for r in res.records)
        assert tokens == point.wl.requested_tokens and not any(r.error for r in res.records), f"vLLM {point.label} failed"
        wl_name, mode = point.label.split("/")
        out[(wl_name, mode)] = res.duration_s
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--disable-by-batch-size", type=int, default=None, help="speculative_config's (both engines)")
    ap.add_argument("--draft-model", default=None,
                    help="adds vllmini with this draft model (e.g. made by python -m bench.truncated_draft)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="vLLM's interpreter (bench/setup_vllm_cpu.sh) for its rows")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON record")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllmini import LLM
    from vllmini.models.weight_loader import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    wls = workloads(AutoTokenizer.from_pretrained(model_dir), args.num_requests, args.output_len)
    seconds: dict[tuple[str, str, str], float] = {}  # (workload, mode, engine) -> s
    acceptance = {}  # (workload, mode, engine) -> accepted / draft tokens
    engines = [("vllmini", {}), ("vllmini ngram", {"speculative_config": spec_dict(args)})]
    if args.draft_model is not None:
        engines.append(("vllmini draft", {"speculative_config": spec_dict(args, args.draft_model)}))
    for name, extra in engines:
        llm = LLM(model=str(model_dir), **extra)
        run_vllmini(llm, Workload("warm", wls[0].prompts[:2], [8, 8]), False)
        for wl in wls:
            for mode in ("one at a time", "batch"):
                llm.reset_prefix_cache()
                before = (llm.llm_engine.spec_stats.num_draft_tokens, llm.llm_engine.spec_stats.num_accepted_tokens)
                seconds[(wl.name, mode, name)] = run_vllmini(llm, wl, mode == "one at a time")
                st = llm.llm_engine.spec_stats
                if extra and st.num_draft_tokens > before[0]:
                    acceptance[(wl.name, mode, name)] = round((st.num_accepted_tokens - before[1]) / (st.num_draft_tokens - before[0]), 3)
        del llm
    if not args.skip_hf:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        for wl in wls:
            seconds[(wl.name, "one at a time", "transformers")] = run_hf(hf, wl, None)
            seconds[(wl.name, "one at a time", "transformers prompt lookup")] = run_hf(hf, wl, args.num_speculative_tokens)
        del hf
    if args.vllm_python:
        for name, spec in (("vLLM CPU eager", None), ("vLLM CPU eager ngram", spec_dict(args))):
            for (wl_name, mode), s in run_vllm(args.vllm_python, model_dir, wls, spec).items():
                seconds[(wl_name, mode, name)] = s
    rows = []
    for (wl_name, mode, engine), s in seconds.items():
        wl = next(w for w in wls if w.name == wl_name)
        rows.append({"workload": wl_name, "mode": mode, "engine": engine, "seconds": round(s, 2),
                     "tok_s": round(wl.requested_tokens / s, 1)}  # fmt: skip
                    | ({"acceptance_rate": acceptance.get((wl_name, mode, engine))} if engine in SPEC_ENGINES else {}))
    for row in rows:
        ref = next(r for r in rows if (r["workload"], r["mode"], r["engine"]) == (row["workload"], row["mode"], "vllmini ngram"))
        row["vllmini_ngram_speedup"] = round(ref["tok_s"] / row["tok_s"], 2)
        print(json.dumps(row))
    print(f"\n{args.num_requests} requests x {args.output_len} tokens, ngram k={args.num_speculative_tokens} "
          f"lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}")  # fmt: skip
    print(f"{'workload':<8}{'mode':<15}{'engine':<30}{'tok/s':>8}{'vllmini ngram is':>18}")
    for r in rows:
        print(f"{r['workload']:<8}{r['mode']:<15}{r['engine']:<30}{r['tok_s']:>8}{str(r['vllmini_ngram_speedup']) + 'x':>18}")
    return write_record("spec_decode", args.out, model=args.model, dtype="torch.float32", args=vars(args), results=rows)


if __name__ == "__main__":
    main()
