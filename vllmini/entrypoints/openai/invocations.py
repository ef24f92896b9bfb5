"""SageMaker's routes, as vLLM's server has them: ``GET`` / ``POST /ping`` answers as ``/health``
does, and ``POST /invocations`` hands a JSON body to the first route, in vLLM's order, whose request
it is: chat completions (``messages``), completions (``prompt``), then on a pooling model embeddings
(``input`` or ``messages``), classify (``input``), rerank (``query`` with ``documents``), score (a
pair: ``text_1`` / ``text_2``, ``queries`` / ``documents`` or ``data_1`` / ``data_2``) and pooling
(``input`` or ``messages``), each only where the model has its task. The route chosen answers as it
would itself (a stream too, its 400s naming a bad field); a body none takes is a 400 naming what
was expected (vLLM tries to validate the body as each request in turn; here the fields a request
cannot do without decide, so that a bad value is reported by its own route)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from vllmini.entrypoints.openai.protocol import decode_json

_POOLING_TASKS = ("embed", "token_embed", "classify", "score", "token_classify")


@dataclass(frozen=True)
class Invocation:
    request: str  # vLLM's name of the request type, which the refusal lists
    path: str  # the route that answers it
    needs: tuple[tuple[str, ...], ...]  # the body has every field of one of these
    tasks: tuple[str, ...]  # served when the model has one of these tasks

    def accepts(self, body: dict[str, Any]) -> bool:
        return any(all(name in body for name in fields) for fields in self.needs)

    def expected(self) -> str:
        return f"{self.request} ({' | '.join(' + '.join(fields) for fields in self.needs)})"


# earlier ones first, as vLLM's INVOCATION_TYPES
INVOCATIONS = (
    Invocation("ChatCompletionRequest", "/v1/chat/completions", (("messages",),), ("generate",)),
    Invocation("CompletionRequest", "/v1/completions", (("prompt",),), ("generate",)),
    Invocation("EmbeddingRequest", "/v1/embeddings", (("input",), ("messages",)), ("embed",)),
    Invocation("ClassificationRequest", "/classify", (("input",),), ("classify",)),
    Invocation("RerankRequest", "/rerank", (("query", "documents"),), ("score", "embed")),
    Invocation("ScoreRequest", "/score", (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2")),
               ("score", "embed")),  # fmt: skip
    Invocation("PoolingRequest", "/pooling", (("input",), ("messages",)), _POOLING_TASKS),
)


def sagemaker_routes(routes: list[BaseRoute], tasks: tuple[str, ...], health: Callable, refuse: Callable) -> list[Route]:
    """``/ping`` (``health``'s answer) and ``/invocations`` over ``routes`` (the app's, whose
    endpoints answer); ``refuse(status, message)`` is the server's error response."""
    endpoints = {route.path: route.endpoint for route in routes if isinstance(route, Route)}
    served = [inv for inv in INVOCATIONS if set(inv.tasks) & set(tasks) and inv.path in endpoints]

    async def invocations(request: Request) -> Response:
        try:
            body = decode_json(await request.body())
        except ValueError as exc:
            return refuse(400, str(exc))
        if not isinstance(body, dict):
            return refuse(400, "the request body must be a JSON object")
        for inv in served:
            if inv.accepts(body):
                return await endpoints[inv.path](request)  # (it reads the body again: Starlette keeps it)
        expected = ", ".join(inv.expected() for inv in served)
        return refuse(400, f"Cannot find suitable handler for request. Expected one of: {expected}")

    return [Route("/ping", health, methods=["GET", "POST"]), Route("/invocations", invocations, methods=["POST"])]
