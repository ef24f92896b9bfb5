"""The server of an engine started with ``skip_tokenizer_init`` (``vllmini serve
--skip-tokenizer-init``): ``POST /v1/completions`` with token-id prompts, answered with text ""
and, with ``return_token_ids``, the token ids (logprobs name tokens ``token_id:<id>``); the routes
that need a tokenizer (chat, responses, tokenize/detokenize, the pooling routes) answer a 400
naming the option, as does a completion with a text prompt or ``echo``."""
from __future__ import annotations

from typing import Any, Callable

from starlette.routing import BaseRoute, Route

from vllmini.engine.skip_tokenizer import SKIPPED, no_tokenizer, text_prompt_error
from vllmini.entrypoints.openai.serving_engine import refusal_endpoint

# the routes kept: token-id completions, and those that read no request text
KEPT = ("/v1/completions", "/v1/models", "/health", "/version", "/metrics", "/start_profile", "/stop_profile")


def check_completion(request: Any, prompts: list[str | list[int]]) -> None:
    """A completion request that needs the tokenizer, refused by name (a 400)."""
    if any(isinstance(p, str) for p in prompts):
        raise text_prompt_error()
    if request.echo:
        raise no_tokenizer("echo (the prompt's text comes back)")


def refuse_tokenizer_routes(routes: list[BaseRoute]) -> list[BaseRoute]:
    """``routes`` with every one outside ``KEPT`` answering 400 (OpenAI's error shape)."""

    def refusal(path: str) -> Callable:
        message = (f"{path} needs a tokenizer, but {SKIPPED} (vllmini serve --skip-tokenizer-init): "
                   "use POST /v1/completions with token-id prompts")  # fmt: skip
        return refusal_endpoint(message, "BadRequestError", 400)

    return [r if not isinstance(r, Route) or r.path in KEPT else Route(r.path, refusal(r.path), methods=r.methods)
            for r in routes]  # fmt: skip
