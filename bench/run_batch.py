"""``vllmini run-batch`` vs ``LLM.chat`` on the same chat requests, in the same run: what the batch
file path (JSONL in, the server's app per line in-process, JSONL out) costs over the offline API.

The workload is ``--num-requests`` chat prompts (bench/data/chat_prompts.txt, cycled) x
``--output-len`` tokens, greedy, EOS ignored. Both rows run on one engine configuration
(``--max-num-seqs``), one after the other, each in a process of its own (torch's OpenMP pool
belongs to the thread that ran it: a second engine stepping on another thread of the same process
shares the cores with the first one's idle-spinning pool, measured here at 0.6-0.75x) and
``--repeats`` times on its engine, the best run kept (an engine's first run pays its warm-up:
oneDNN's first primitives for each shape); each reports output tok/s and wall time, and the run
also checks that the answers are equal.

    python -m bench.run_batch                        # default model, 64 x 64 tokens
    python -m bench.run_batch --num-requests 256 --output-len 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.offline import HERE, write_record


def _requests(n: int, output_len: int) -> list[dict]:
    questions = [q for q in (HERE / "data" / "chat_prompts.txt").read_text().splitlines() if q.strip()]
    return [{"messages": [{"role": "user", "content": questions[i % len(questions)]}], "max_completion_tokens": output_len,
             "temperature": 0, "ignore_eos": True} for i in range(n)]  # fmt: skip


def run_batch_row(model: str, bodies: list[dict], max_num_seqs: int, repeats: int) -> tuple[float, int, list[str]]:
    """(best seconds, output tokens, answers) of ``vllmini run-batch`` (engine start-up excluded:
    the clock starts when the file is handed over)."""
    from vllmini import AsyncLLMEngine, EngineArgs
    from vllmini.entrypoints.openai.api_server import build_app
    from vllmini.entrypoints.openai.run_batch import run_batch

    lines = [json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/chat/completions", "body": b})
             for i, b in enumerate(bodies)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        src.write_text("\n".join(lines) + "\n")

        async def go() -> float:
            engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model, max_num_seqs=max_num_seqs))
            try:
                app = build_app(engine)
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    await run_batch(app, src, dst, 2 * max_num_seqs)
                    times.append(time.perf_counter() - t0)
                return min(times)
            finally:
                await engine.shutdown()

        seconds = asyncio.run(go())
        answers = [json.loads(x)["response"]["body"] for x in dst.read_text().splitlines()]
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    return seconds, tokens, [a["choices"][0]["message"]["content"] for a in answers]


def chat_row(model: str, bodies: list[dict], max_num_seqs: int, repeats: int) -> tuple[float, int, list[str]]:
    """(best seconds, output tokens, answers) of ``LLM.chat`` on the same conversations."""
    from vllmini import LLM, SamplingParams

    llm = LLM(model=model, max_num_seqs=max_num_seqs)
    params = SamplingParams(max_tokens=bodies[0]["max_completion_tokens"], temperature=0, ignore_eos=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.chat([b["messages"] for b in bodies], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return min(times), sum(len(o.outputs[0].token_ids) for o in outs), [o.outputs[0].text for o in outs]


ROWS = {"LLM.chat": chat_row, "run-batch": run_batch_row}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs per engine, the best kept")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # (one row, in this process: JSON out)
    args = ap.parse_args(argv)
    bodies = _requests(args.num_requests, args.output_len)
    if args.row is not None:
        seconds, tokens, answers = ROWS[args.row](args.model, bodies, args.max_num_seqs, args.repeats)
        print("ROW " + json.dumps({"seconds": round(seconds, 3), "output_tokens": tokens,
                                   "tok_per_s": round(tokens / seconds, 1), "answers": answers}))  # fmt: skip
        return {}
    rows = {}
    for name in ROWS:
        flags = ["--model", args.model, "--num-requests", str(args.num_requests), "--output-len", str(args.output_len),
                 "--max-num-seqs", str(args.max_num_seqs), "--repeats", str(args.repeats), "--row", name]  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "bench.run_batch", *flags], cwd=HERE.parent, check=True,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
        rows[name] = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("ROW "))[4:])
    same = rows["run-batch"].pop("answers") == rows["LLM.chat"].pop("answers")
    ratio = rows["run-batch"]["tok_per_s"] / rows["LLM.chat"]["tok_per_s"]
    print(f"{'engine':<12} {'tok/s':>8} {'seconds':>8} {'tokens':>7}")
    for name, row in rows.items():
        print(f"{name:<12} {row['tok_per_s']:>8} {row['seconds']:>8} {row['output_tokens']:>7}")
    print(f"run-batch / LLM.chat: {ratio:.2f}x; same answers: {same}")
    return write_record("run_batch", args.out_dir, model=args.model, num_requests=args.num_requests,
                        output_len=args.output_len, max_num_seqs=args.max_num_seqs, repeats=args.repeats, rows=rows,
                        ratio=round(ratio, 3), same_answers=same)  # fmt: skip


if __name__ == "__main__":
    main()
