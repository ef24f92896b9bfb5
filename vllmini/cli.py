"""The vllmini command line: generate (the default), chat, serve and bench.

``vllmini`` with no arguments submits a few prompts concurrently to the async engine on
the default model and streams all of them live (one line each, redrawn in place on a
terminal), then prints a one-line summary (requests, tokens, tok/s, TTFT p50).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import sys
import time
from pathlib import Path

from vllmini.cli_args import (  # noqa: F401  (tests import these from vllmini.cli)
    _add_engine_args, _add_sampling_args, _engine_args, _given_sampling_flags, _sampling_params,
    _serve_engine_args, _structured_outputs,
)


DEMO_PROMPTS = [
    "The three most important ideas in computer science are",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue.",
    "def quicksort(arr):",
]


class LiveLines:
    """One line per request, redrawn in place on a terminal; plain output when piped."""

    def __init__(self, n: int) -> None:
        self.tty = sys.stdout.isatty()
        self.texts = [""] * n
        self.done = [False] * n
        self.drawn = False

    def update(self, i: int, text: str, finished: bool) -> None:
        self.texts[i], self.done[i] = text, finished
        if self.tty:
            self._redraw()
        elif finished:
            print(f"[{i}] {text}\n", flush=True)

    def _redraw(self) -> None:
        width = shutil.get_terminal_size().columns - 8
        if self.drawn:
            sys.stdout.write(f"\x1b[{len(self.texts)}F")
        for i, (text, done) in enumerate(zip(self.texts, self.done)):
            flat = text.replace("\n", " ")
            shown = flat if len(flat) <= width else "…" + flat[-width + 1 :]
            sys.stdout.write(f"\x1b[2K[{i}]{'✓' if done else ' '} {shown}\n")
        sys.stdout.flush()
        self.drawn = True

    def close(self) -> None:
        if self.tty:  # the full texts, once, after the live view
            print()
            for i, text in enumerate(self.texts):
                print(f"[{i}] {text}\n")


def _run(coro) -> int:
    """uvloop when installed (faster event loop), the standard loop otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _render(engine, messages_or_text: list[dict[str, str]] | str) -> dict:
    """The prompt as ``{"prompt", "prompt_token_ids"}``: chat messages through the chat template,
    raw text tokenized as the engine would."""
    from vllmini.engine.chat import render_chat

    if isinstance(messages_or_text, str):
        text, ids = engine.engine.input_processor.tokenize(messages_or_text)
        return {"prompt": text, "prompt_token_ids": ids}
    return render_chat(engine.engine.tokenizer, messages_or_text, add_generation_prompt=True)


def _need_chat_template(engine, instead: str) -> None:
    """Stop at once (a ValueError naming what to do ``instead``) when the model's tokenizer has no
    chat template, rather than failing every prompt or turn alike."""
    tokenizer = engine.engine.tokenizer
    if tokenizer is None:
        from vllmini.engine.skip_tokenizer import no_tokenizer

        raise no_tokenizer("a chat template")
    if tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer of {tokenizer.name_or_path!r} has no chat template; {instead}")


def _fit(engine, prompt: dict, params, ns: argparse.Namespace):
    """``params`` for this prompt: a default length (no --max-tokens) is cut to what
    max_model_len and the KV cache leave, as vLLM stops such a request there instead of
    refusing it; an explicit --max-tokens is kept (too long is an error naming it)."""
    room = engine.engine.input_processor.room(len(prompt["prompt_token_ids"]))
    if ns.max_tokens is None and room > 0 and (params.max_tokens or room) > room:
        return params.clone(max_tokens=room)
    return params


async def _generate(ns: argparse.Namespace, prompts: list[str]) -> int:
    from vllmini import AsyncLLMEngine

    async with AsyncLLMEngine.from_engine_args(_engine_args(ns)) as engine:
        if not ns.raw:
            _need_chat_template(engine, "pass --raw to send the prompts as plain text")
        params = _sampling_params(ns, engine.engine.get_default_sampling_params())
        live = LiveLines(len(prompts))
        texts = [""] * len(prompts)
        ttfts: list[float] = []
        tokens = 0
        start = time.perf_counter()

        errors: dict[int, str] = {}

        async def one(i: int) -> None:
            """One prompt's stream; a prompt the engine refuses is reported and the others go on."""
            nonlocal tokens
            try:
                prompt = _render(engine, prompts[i] if ns.raw else [{"role": "user", "content": prompts[i]}])
                async for out in engine.generate(prompt, _fit(engine, prompt, params, ns)):
                    texts[i] += out.outputs[0].text
                    tokens += len(out.outputs[0].token_ids)
                    live.update(i, texts[i], out.finished)
                    if out.finished and out.metrics and out.metrics.first_token_time:
                        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
            except ValueError as exc:
                errors[i] = str(exc)
                live.update(i, f"error: {exc}", True)

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        elapsed = time.perf_counter() - start
    live.close()
    for i, message in sorted(errors.items()):
        print(f"error: prompt {i}: {message}", file=sys.stderr)
    ttft = f"{statistics.median(ttfts) * 1e3:.0f} ms" if ttfts else "n/a"
    done = len(prompts) - len(errors)
    print(f"{done} requests, {tokens} tokens in {elapsed:.1f}s ({tokens / elapsed:.1f} tok/s), TTFT p50 {ttft}"
          + (f"; {len(errors)} refused" if errors else ""))  # fmt: skip
    return 1 if errors else 0


def cmd_generate(ns: argparse.Namespace) -> int:
    """All prompts are submitted at once to the async engine; their streams show live."""
    prompts = list(ns.prompts)
    if ns.file:
        prompts += [line for line in Path(ns.file).read_text().splitlines() if line.strip()]
    return _run(_generate(ns, prompts or DEMO_PROMPTS))


async def _chat(ns: argparse.Namespace) -> int:
    from vllmini import AsyncLLMEngine

    loop = asyncio.get_running_loop()
    history: list[dict[str, str]] = []
    async with AsyncLLMEngine.from_engine_args(_engine_args(ns)) as engine:
        _need_chat_template(engine, "chat needs one (`vllmini generate --raw` takes plain prompts)")
        params = _sampling_params(ns, engine.engine.get_default_sampling_params())
        print("chat with the model; /reset clears the history, /exit or Ctrl-D quits", flush=True)
        while True:
            try:
                line = (await loop.run_in_executor(None, input, "> ")).strip()
                line.encode()  # bytes that are not UTF-8 arrive as lone surrogates
            except EOFError:
                print()
                return 0
            except UnicodeError:  # that line only
                print("error: the input is not valid UTF-8 text", file=sys.stderr, flush=True)
                continue
            if line == "/exit":
                return 0
            if line == "/reset":
                history.clear()
                print("(history cleared)", flush=True)
                continue
            if not line:
                continue
            history.append({"role": "user", "content": line})
            reply = ""
            try:
                prompt = _render(engine, history)
                async for out in engine.generate(prompt, _fit(engine, prompt, params, ns)):
                    reply += out.outputs[0].text
                    print(out.outputs[0].text, end="", flush=True)  # tokens as they come
            except ValueError as exc:  # e.g. the history outgrew max_model_len: the session goes on
                history.pop()
                print(f"error: {exc}\n(/reset clears the history)", file=sys.stderr, flush=True)
                continue
            print(flush=True)
            history.append({"role": "assistant", "content": reply})


def cmd_chat(ns: argparse.Namespace) -> int:
    return _run(_chat(ns))


def cmd_serve(ns: argparse.Namespace) -> int:
    """The OpenAI-compatible server, until Ctrl-C."""
    import os

    from vllmini import AsyncLLMEngine
    from vllmini.entrypoints.openai.api_server import run_server
    from vllmini.entrypoints.openai.cli_args import app_options, uvicorn_options
    from vllmini.entrypoints.openai.cors import cors_from_flags
    from vllmini.entrypoints.openai.serving_models import check_lora_modules, parse_lora_module

    served_name = _engine_args(ns).get_served_model_name()
    lora_modules = [parse_lora_module(item) for item in ns.lora_modules or []]
    check_lora_modules(lora_modules, ns.enable_lora, served_name)  # (before the model loads)
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    if ns.max_request_body_size < 0:
        raise ValueError(f"--max-request-body-size must be >= 0 bytes (0: no limit), got {ns.max_request_body_size}")
    cors = cors_from_flags(ns.allowed_origins, ns.allowed_methods, ns.allowed_headers, ns.allow_credentials)
    server = uvicorn_options(ns)
    engine = AsyncLLMEngine.from_engine_args(_serve_engine_args(ns))
    api_key = ns.api_key or os.environ.get("VLLMINI_API_KEY") or None
    run_server(engine, served_name, ns.host, ns.port, ns.chat_template, api_key, lora_modules, uvicorn_options=server,
               cors=cors, **app_options(ns))  # fmt: skip
    return 0


def cmd_run_batch(ns: argparse.Namespace) -> int:
    """Answer an OpenAI batch file (entrypoints/openai/run_batch.py)."""
    from vllmini.entrypoints.openai.run_batch import main as run_batch

    return _run(run_batch(ns, _serve_engine_args(ns)))


def build_parser() -> argparse.ArgumentParser:
    from vllmini.entrypoints.openai.cli_args import add_serve_args
    from vllmini.entrypoints.openai.run_batch import add_run_batch_args

    parser = argparse.ArgumentParser(prog="vllmini", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="generate for prompts (arguments or --file), streamed live")
    gen.add_argument("prompts", nargs="*", help="prompts (default: a few demo prompts)")
    gen.add_argument("--file", help="a text file with one prompt per line")
    gen.add_argument("--raw", action="store_true", help="do not wrap prompts in the chat template")
    _add_engine_args(gen)
    _add_sampling_args(gen, max_tokens=64)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="multi-turn chat with the chat template")
    _add_engine_args(chat)
    _add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/responses, "
                           "/v1/embeddings and the other pooling routes, /tokenize, /metrics...)")
    serve.add_argument("model_tag", nargs="?", default=None, help="the model (as --model; default: the bundled one)")
    add_serve_args(serve)
    _add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    batch = sub.add_parser("run-batch", help="OpenAI batch file (JSONL) in, one response per line out, as vLLM's")
    add_run_batch_args(batch)
    _add_engine_args(batch)
    batch.set_defaults(func=cmd_run_batch)
    sub.add_parser("bench", add_help=False, help="the serving benchmark (bench/ of a source checkout; see --help)")
    return parser


def cmd_bench(argv: list[str]) -> int:
    """``vllmini bench ...`` runs bench.serving, which lives beside the package in a source
    checkout (it is not installed: it drives baselines from other virtualenvs)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "serving.py").is_file():
        print("error: vllmini bench needs a source checkout (bench/ beside vllmini/); "
              "install with `pip install -e .` from a clone", file=sys.stderr)  # fmt: skip
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from bench.serving import main as bench_main

    bench_main(argv, prog="vllmini bench")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    if not argv or argv[0] not in ("generate", "chat", "serve", "run-batch", "-h", "--help"):
        argv = ["generate", *argv]  # the default job
    ns = parser.parse_args(argv)
    if getattr(ns, "model_tag", None) is not None:  # `vllmini serve MODEL`, as `vllm serve MODEL`
        ns.model = ns.model_tag
    if ns.log_level is not None:
        logging.getLogger("vllmini").setLevel(ns.log_level)
    try:
        _engine_args(ns).validate()  # bad flags fail before the model loads
        if ns.command not in ("serve", "run-batch"):
            _given_sampling_flags(ns)
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
