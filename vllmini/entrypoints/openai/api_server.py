"""The OpenAI-compatible HTTP server (``vllmini serve``): a Starlette app over one
``AsyncLLMEngine``, served by uvicorn (with uvloop when installed).

Routes, as vLLM's: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``
(with ``GET /v1/responses/{id}`` and its ``/cancel``), ``POST /v1/embeddings``, ``/score``,
``/rerank`` and ``/classify`` (each also under ``/v1``; ``/v2/rerank`` too), ``/pooling`` (with ``--runner
pooling``, which answers the generating routes 404), ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``GET /metrics`` (Prometheus), ``GET /health``,
``GET /version``, SageMaker's ``GET``/``POST /ping`` and ``POST /invocations`` (invocations.py); with
``VLLMINI_ALLOW_RUNTIME_LORA_UPDATING`` set, ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``; with ``VLLMINI_SERVER_DEV_MODE=1``, vLLM's development routes
(``/pause``, ``/sleep``, ``/collective_rpc``, ...: dev_routes.py). A request's ``model`` may name a LoRA adapter
(serving_models.py). A bad request is a 400 in OpenAI's error shape naming the field; a client that
hangs up (streaming or not) has its requests aborted, so their KV blocks are freed at the next
step. With ``api_key``, the /v1 routes need ``Authorization: Bearer KEY``. A request body over
``max_request_body_size`` bytes (32 MiB unless told) is answered 413 without being read whole.
The served model name is the engine's (``EngineArgs.served_model_name``, else its model), the name
its metrics carry too. The engine request behind a generating or pooling request is named as vLLM
names it, ``cmpl-<base>`` (``chatcmpl-``, ``embd-``, ...; the response's ``id``), its base the
request's ``X-Request-Id`` header, else its ``request_id`` field, else a fresh uuid; an id still in
use is a 400 naming it. With ``enable_request_id_headers`` every response carries ``X-Request-Id``.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from typing import Any, Awaitable, Callable

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import vllmini
from vllmini.entrypoints.openai import DEFAULT_MAX_REQUEST_BODY_SIZE
from vllmini.engine.async_engine import AsyncLLMEngine, EngineDeadError
from vllmini.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest,
                                                 decode_request)  # fmt: skip
from vllmini.entrypoints.openai.responses_protocol import ResponsesRequest
from vllmini.entrypoints.openai.cors import CorsOptions
from vllmini.entrypoints.openai.dev_routes import dev_routes
from vllmini.entrypoints.openai.invocations import sagemaker_routes
from vllmini.entrypoints.openai.serving_chat import OpenAIServingChat
from vllmini.entrypoints.openai.serving_classification import OpenAIServingClassification
from vllmini.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllmini.entrypoints.openai.serving_embedding import (EmbeddingRequest, OpenAIServingEmbedding,
                                                          refuse_generation_routes)  # fmt: skip
from vllmini.entrypoints.openai.serving_engine import error_body
from vllmini.entrypoints.openai.serving_models import (LoRAModulePath, ModelNotFoundError, OpenAIServingModels,
                                                       runtime_lora_updating)  # fmt: skip
from vllmini.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllmini.entrypoints.openai.serving_pooling import OpenAIServingPoolingRoute
from vllmini.entrypoints.openai.serving_score import OpenAIServingScores
from vllmini.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllmini.entrypoints.openai.skip_tokenizer import refuse_tokenizer_routes

logger = logging.getLogger("vllmini")


def json_response(body: dict[str, Any], status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


class EventStreamResponse(StreamingResponse):
    """A streamed result's events; its ``close()`` (which aborts what is unfinished) runs however the
    response ends: after the last event, once the client has hung up (even before the first event),
    and when ``send`` raises, as a server on ASGI spec 2.4 reports a client gone, where Starlette
    skips a background task (the requests ran on to max_tokens, their streams left to the GC)."""

    def __init__(self, result: Any) -> None:
        super().__init__(result.events, media_type="text/event-stream")
        self.result = result

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.result.close()


def error_response(status: int, message: str, param: str | None = None) -> Response:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            413: "RequestTooLargeError"}.get(status, "InternalServerError")  # fmt: skip
    return json_response(error_body(message, kind, status, param), status)


class RequireApiKey:
    """With ``--api-key``, every /v1 route needs ``Authorization: Bearer KEY`` (as vLLM's)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # the path the routes match: under a root path (a proxy's prefix) scope["path"] includes it
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if scope["type"] == "http" and path.startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = "Unauthorized: a valid 'Authorization: Bearer <api key>' header is needed"
                await error_response(401, message)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    """Raised by LimitRequestBody's receive into the handler reading the body, caught above it."""


class LimitRequestBody:
    """Bodies over ``max_size`` bytes are answered 413 (OpenAI's error shape, naming the limit):
    at once when the Content-Length says so, else (chunked, or a short Content-Length) when the
    chunks received pass it, so at most the limit and one chunk are ever held. The server goes on
    (uvicorn reads and drops the rest of a refused body)."""

    def __init__(self, app: ASGIApp, max_size: int) -> None:
        self.app, self.max_size = app, max_size

    def _refusal(self) -> Response:
        message = (f"the request body is larger than the server's limit of {self.max_size} bytes "
                   "(max_request_body_size, `vllmini serve --max-request-body-size`)")  # fmt: skip
        return error_response(413, message)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_size:
            await self._refusal()(scope, receive, send)
            return
        received, started = 0, False

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_size:
                    raise _BodyTooLarge
            return message

        async def watching_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except _BodyTooLarge:
            if started:  # (no route reads its body after answering)
                raise
            await self._refusal()(scope, receive, send)


class RequestIdHeader:
    """vLLM's ``--enable-request-id-headers``: every response, streamed or refused, carries
    ``X-Request-Id``: the request's own when it sent one, else a fresh uuid hex."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"x-request-id" and value), None)
        header = (b"x-request-id", given or uuid.uuid4().hex.encode())

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


def _check_body_limit(value: int | None) -> int | None:
    """``max_request_body_size``: bytes, 0 or None for no limit."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"max_request_body_size must be a number of bytes >= 0 (0: no limit), got {value!r}")
    return value or None


def _served_name(engine: AsyncLLMEngine, given: str | None) -> str:
    """The engine's served name (its metrics' model_name label too); build_app's argument, kept
    for callers that pass it, must be the same."""
    name = engine.engine.args.get_served_model_name()
    if given is not None and given != name:
        raise ValueError(f"served_model_name {given!r} differs from the engine's {name!r}, which its metrics carry: "
                         f"build the engine with EngineArgs(served_model_name={given!r}) and leave build_app's out")
    return name


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, or None once the client has hung up (``work`` is cancelled then,
    which aborts its engine requests)."""

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals, a path no route has (404) or a method its route does not take (405,
    with ``Allow``), as vLLM's FastAPI app answers them: JSON ``{"detail": "Not Found"}`` (it was
    Starlette's plain text, which a client reading JSON errors could not parse)."""
    return Response(msgspec.json.encode({"detail": exc.detail}), status_code=exc.status_code, headers=exc.headers,
                    media_type="application/json")  # fmt: skip


async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
    """A client that hung up while sending its body (a route was reading it): nothing to answer or
    abort; without this handler each one was logged as the server's own error, with a traceback."""
    return Response(status_code=499)


def build_app(engine: AsyncLLMEngine, served_model_name: str | None = None, chat_template: str | None = None,
              api_key: str | None = None, lora_modules: list[LoRAModulePath] | None = None, *,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None,
              max_request_body_size: int | None = DEFAULT_MAX_REQUEST_BODY_SIZE,
              enable_prompt_tokens_details: bool = False, cors: CorsOptions | None = None,
              response_role: str = "assistant", return_tokens_as_token_ids: bool = False,
              enable_request_id_headers: bool = False, enable_force_include_usage: bool = False,
              trust_request_chat_template: bool = False) -> Starlette:  # fmt: skip
    """The app; its lifespan shuts the engine down when the server stops. ``lora_modules`` are
    loaded now: a bad one raises ValueError (naming it) before the server listens, as does a bad
    parser name or ``enable_auto_tool_choice`` without ``tool_call_parser`` (vLLM's flags), a
    ``served_model_name`` other than the engine's, or a bad ``max_request_body_size``. ``cors``:
    answer browsers' cross-origin requests from those origins (None: no CORS headers at all).
    ``response_role``: a chat answer's role after a generation prompt; ``return_tokens_as_token_ids``:
    the default of requests that do not say; ``enable_request_id_headers``: every response carries
    ``X-Request-Id``; ``enable_force_include_usage``: every stream ends with its usage;
    ``trust_request_chat_template``: a request may bring its own chat template (vLLM's server flags)."""
    served_model_name = _served_name(engine, served_model_name)
    body_limit = _check_body_limit(max_request_body_size)
    models = OpenAIServingModels(engine, served_model_name)
    models.load_static(lora_modules or [])
    completion = OpenAIServingCompletion(engine, served_model_name, models)
    chat = OpenAIServingChat(engine, served_model_name, chat_template, models,
                             enable_auto_tools=enable_auto_tool_choice, tool_parser=tool_call_parser,
                             reasoning_parser=reasoning_parser)  # fmt: skip

    completion.prompt_tokens_details = chat.prompt_tokens_details = enable_prompt_tokens_details
    completion.return_tokens_as_token_ids = chat.return_tokens_as_token_ids = return_tokens_as_token_ids
    completion.force_include_usage = chat.force_include_usage = enable_force_include_usage
    if not isinstance(response_role, str) or not response_role:
        raise ValueError(f"response_role must be a non-empty role name, got {response_role!r}")
    chat.response_role = response_role
    chat.trust_request_chat_template = trust_request_chat_template
    tokenization = OpenAIServingTokenization(chat)
    embedding = OpenAIServingEmbedding(engine, served_model_name, chat, models)
    responses = OpenAIServingResponses(chat)

    def handler(kind: type[msgspec.Struct] | None, create: Callable[[Any], Awaitable[Any]]) -> Callable:
        """``kind`` None: ``create`` takes the path's id (``/v1/responses/{id}``) instead of a body.
        A request with a ``request_id`` takes the ``X-Request-Id`` header's over its own, as vLLM's
        (not /v1/responses, whose id is the stored response's, as vLLM's)."""
        takes_header = kind not in (None, ResponsesRequest) and "request_id" in kind.__struct_fields__

        async def endpoint(request: Request) -> Response:
            try:
                if kind is None:
                    body, ignored = request.path_params["id"], []
                else:
                    body, ignored = decode_request(await request.body(), kind)
                    if takes_header and (given := request.headers.get("x-request-id")):
                        body.request_id = given
                if ignored:
                    logger.warning("fields of the request ignored (not supported): %s", ", ".join(ignored))
                result = await _until_disconnect(request, create(body))
            except ModelNotFoundError as exc:
                return error_response(404, str(exc), getattr(exc, "parameter", None))
            except ValueError as exc:  # (a VLLMValidationError names the field, as vLLM's error.param)
                return error_response(400, str(exc), getattr(exc, "parameter", None))
            except EngineDeadError as exc:
                return error_response(503, str(exc))
            if result is None:  # the client hung up
                return Response(status_code=499)
            if isinstance(result, dict):
                return json_response(result)
            if isinstance(result, str):  # (vLLM answers the adapter routes in plain text)
                return Response(result, media_type="text/plain")
            return EventStreamResponse(result)

        return endpoint

    async def list_models(request: Request) -> Response:
        return json_response(models.cards(completion.max_model_len))

    async def health(request: Request) -> Response:
        return Response(status_code=503 if engine.errored else 200)

    async def prometheus(request: Request) -> Response:
        stat_logger = engine.engine.stat_logger  # (None: the engine runs with disable_log_stats)
        body = b"" if stat_logger is None else generate_latest(stat_logger.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def start_profile(request: Request) -> Response:
        await engine.start_profile()
        return Response(status_code=200)

    async def stop_profile(request: Request) -> Response:
        await engine.stop_profile()
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return json_response({"version": vllmini.__version__})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await engine.shutdown()

    routes = [
        Route("/v1/completions", handler(CompletionRequest, completion.create_completion), methods=["POST"]),
        Route("/v1/chat/completions", handler(ChatCompletionRequest, chat.create_chat_completion), methods=["POST"]),
        Route("/v1/responses", handler(ResponsesRequest, responses.create_response), methods=["POST"]),
        Route("/v1/responses/{id}", handler(None, responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{id}/cancel", handler(None, responses.cancel), methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/tokenize", handler(TokenizeRequest, tokenization.tokenize), methods=["POST"]),
        Route("/detokenize", handler(DetokenizeRequest, tokenization.detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    routes.append(Route("/v1/embeddings", handler(EmbeddingRequest, embedding.create_embedding), methods=["POST"]))
    routes += [*OpenAIServingScores(engine, served_model_name, models).routes(handler),  # score, rerank
               *OpenAIServingClassification(engine, served_model_name, models).routes(handler),
               *OpenAIServingPoolingRoute(engine, served_model_name, chat, models).routes(handler)]
    if engine.engine.runner_type == "pooling":
        routes = refuse_generation_routes(routes)
    if engine.tokenizer is None:  # skip_tokenizer_init: token-id completions only
        routes = refuse_tokenizer_routes(routes)
    routes += sagemaker_routes(routes, engine.engine.supported_tasks, health, error_response)
    if engine.engine.profiler.config.profiler:  # (vLLM's: only when profiling is configured)
        routes += [Route("/start_profile", start_profile, methods=["POST"]), Route("/stop_profile", stop_profile, methods=["POST"])]
    if runtime_lora_updating():
        logger.warning("LoRA adapters may be loaded and unloaded at run time (/v1/load_lora_adapter): any "
                       "client can make the server read a folder; for local development only")  # fmt: skip
        routes += [Route("/v1/load_lora_adapter", handler(LoadLoRAAdapterRequest, models.load), methods=["POST"]),
                   Route("/v1/unload_lora_adapter", handler(UnloadLoRAAdapterRequest, models.unload), methods=["POST"])]
    routes += dev_routes(engine, json_response, error_response)
    # outermost first: CORS answers a browser's preflight before any check, and its headers reach
    # the checks' own refusals (401, 413), which a page must be able to read
    # (the request id header outermost of all: every answer carries it)
    middleware = [Middleware(RequestIdHeader)] if enable_request_id_headers else []
    middleware += [] if cors is None else [cors.middleware()]
    middleware += [] if body_limit is None else [Middleware(LimitRequestBody, max_size=body_limit)]
    middleware += [] if api_key is None else [Middleware(RequireApiKey, api_key=api_key)]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers={ClientDisconnect: _client_gone, HTTPException: _http_error})


def run_server(engine: AsyncLLMEngine, served_model_name: str | None, host: str, port: int,
               chat_template: str | None = None, api_key: str | None = None,
               lora_modules: list[LoRAModulePath] | None = None, uvicorn_options: dict | None = None,
               **options: Any) -> None:  # fmt: skip
    """Serve until interrupted (Ctrl-C), then shut the engine down. ``options``: build_app's
    keywords (enable_auto_tool_choice, tool_call_parser, reasoning_parser, max_request_body_size,
    enable_prompt_tokens_details, cors, response_role, return_tokens_as_token_ids,
    enable_request_id_headers, enable_force_include_usage, trust_request_chat_template);
    ``uvicorn_options``: uvicorn.run's (root_path, log_level, access_log, ssl_keyfile, ssl_certfile)."""
    import uvicorn

    try:
        app = build_app(engine, served_model_name, chat_template, api_key, lora_modules, **options)
        served_model_name = engine.engine.args.get_served_model_name()
    except BaseException:  # (a bad --chat-template or adapter): stop the engine's thread before exiting
        engine.shutdown()
        raise
    settings = {"log_level": "info", "timeout_graceful_shutdown": 5, **(uvicorn_options or {})}
    scheme = "https" if settings.get("ssl_certfile") else "http"
    logger.info("serving %s on %s://%s:%d%s/v1", served_model_name, scheme, host, port, settings.get("root_path", ""))
    uvicorn.run(app, host=host, port=port, **settings)
