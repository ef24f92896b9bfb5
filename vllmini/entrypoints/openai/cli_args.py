"""``vllmini serve``'s own flags (the engine's come from EngineArgs): where it listens, who may
call it, and how chat responses are parsed, with vLLM's names (as vLLM's entrypoints/openai/cli_args.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

from vllmini.entrypoints.openai import DEFAULT_MAX_REQUEST_BODY_SIZE


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """How answers are made, shared by ``serve`` and ``run-batch`` (entrypoints/openai/run_batch.py)."""
    from vllmini.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

    p.add_argument("--chat-template", default=None, help="a Jinja chat template or its file's path (default: the tokenizer's)")
    p.add_argument("--response-role", default="assistant", help="a chat answer's role after a generation prompt")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request bring its own chat template (chat_template, chat_template_kwargs): "
                        "refused by default, as a template can hold the server busy")  # fmt: skip
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache")
    p.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="<think>...</think> ([THINK]...[/THINK]: mistral; harmony's analysis channel: openai_gptoss) "
                        "goes to message.reasoning (and reasoning_content)")  # fmt: skip


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from vllmini.entrypoints.openai.tool_parsers import TOOL_PARSERS

    p.add_argument("--host", default="127.0.0.1", help="(default: 127.0.0.1, this machine only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    add_chat_args(p)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (default: $VLLMINI_API_KEY, else none)")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=None, metavar="NAME=PATH",
                   help='LoRA adapters served under their own names (needs --enable-lora): NAME=PATH or '
                        '\'{"name": ..., "path": ..., "base_model_name": ...}\'')  # fmt: skip
    p.add_argument("--max-request-body-size", type=int, default=DEFAULT_MAX_REQUEST_BODY_SIZE, metavar="BYTES",
                   help="larger request bodies are answered 413 (default: 32 MiB; 0: no limit)")
    p.add_argument("--allowed-origins", default=None, metavar="JSON",
                   help='answer cross-origin (CORS) requests from these origins: \'["http://localhost:3000"]\' '
                        "(default: no CORS headers)")  # fmt: skip
    p.add_argument("--allowed-methods", default=None, metavar="JSON", help='CORS methods (default: ["*"])')
    p.add_argument("--allowed-headers", default=None, metavar="JSON", help='CORS request headers (default: ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS requests may carry credentials")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name tokens "token_id:<id>" unless a request says otherwise')
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, as if stream_options.include_usage were set")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the request's own, else a fresh uuid hex")
    # uvicorn's own settings, under vLLM's flags
    p.add_argument("--root-path", default="", help="the path prefix a proxy serves the server under (ASGI root_path)")
    p.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (with --ssl-keyfile)")
    # how chat responses are parsed: tool calls and reasoning
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice="auto": tool calls are read out of the output (needs --tool-call-parser)')
    p.add_argument("--tool-call-parser", choices=list(TOOL_PARSERS), default=None,
                   help="the model's tool-call format: hermes (Hermes, Qwen2.5/Qwen3), llama3_json (Llama 3.x), "
                        "xlam (xLAM-2), openai (gpt-oss's harmony)...")  # fmt: skip


def app_options(ns: argparse.Namespace) -> dict:
    """``build_app``'s keywords from the flags above (the ones checked or parsed in cli.py aside)."""
    names = ("enable_auto_tool_choice", "tool_call_parser", "reasoning_parser", "max_request_body_size",
             "enable_prompt_tokens_details", "response_role", "return_tokens_as_token_ids",
             "enable_request_id_headers", "enable_force_include_usage", "trust_request_chat_template")  # fmt: skip
    return {name: getattr(ns, name) for name in names}


def uvicorn_options(ns: argparse.Namespace) -> dict:
    """``uvicorn.run``'s keywords from the flags above, checked before the model loads."""
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    for flag, path in (("--ssl-keyfile", ns.ssl_keyfile), ("--ssl-certfile", ns.ssl_certfile)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path!r} is not a file")
    if ns.root_path and (not ns.root_path.startswith("/") or ns.root_path.endswith("/")):
        raise ValueError(f"--root-path must start with '/' and not end with one, got {ns.root_path!r}")
    return {"root_path": ns.root_path, "log_level": ns.uvicorn_log_level, "access_log": not ns.disable_uvicorn_access_log,
            "ssl_keyfile": ns.ssl_keyfile, "ssl_certfile": ns.ssl_certfile}  # fmt: skip
