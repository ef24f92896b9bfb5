"""``POST /v1/embeddings``, as vLLM's embeddings route with OpenAI's request and response shapes, on a
server started with ``--runner pooling`` (``vllmini serve MODEL --runner pooling``).

``input`` is a string, a list of strings, a token-id list or a list of them (each its own engine
request); vLLM's chat form, ``messages``, goes through the chat template instead. The embeddings
come back as floats or, with ``encoding_format="base64"`` (what OpenAI's client asks for unless
told otherwise), as the base64 of their little-endian float32 bytes. On a generating server this
route answers 404, and on a pooling server the completion routes do (vLLM registers only the
routes of its runner's tasks).
"""
from __future__ import annotations

import base64
from typing import Any, Callable, Literal

import msgspec
import torch
from starlette.routing import BaseRoute, Route

from vllmini.engine.async_engine import AsyncLLMEngine, EngineDeadError
from vllmini.engine.outputs import PoolingRequestOutput
from vllmini.engine.pooling_params import PoolingParams
from vllmini.engine.sampling_params import is_int
from vllmini.entrypoints.openai.protocol import check_chat_options
from vllmini.entrypoints.openai.serving_chat import OpenAIServingChat
from vllmini.entrypoints.openai.serving_engine import OpenAIServing, RequestGroup, off_loop, refusal_endpoint
from vllmini.entrypoints.openai.serving_models import ModelNotFoundError, OpenAIServingModels
from vllmini.lora.request import LoRARequest

# the routes a pooling server refuses, and the API each belongs to (in vLLM's error words)
_GENERATION_ROUTES = {"/v1/completions": "Completions API", "/v1/chat/completions": "Chat Completions API",
                      "/v1/responses": "Responses API"}


class APINotSupportedError(ModelNotFoundError):
    """A route of the other runner: a 404, as from vLLM's server, which does not register it."""


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI's embeddings request, then vLLM's extras (its ``EmbeddingCompletionRequest`` and, with
    ``messages`` instead of ``input``, its ``EmbeddingChatRequest``)."""

    model: str | None = None
    input: str | list | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None  # vLLM 0.32's: "right" (left out: the first tokens kept) or "left"
    normalize: bool | None = None
    use_activation: bool | None = None
    add_special_tokens: bool | None = None  # default: True for input, False for messages (the template writes them)
    priority: int = 0
    request_id: str | None = None
    # the chat form
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, truncation_side=self.truncation_side,
                             dimensions=self.dimensions, normalize=self.normalize, use_activation=self.use_activation,
                             task="embed")  # fmt: skip

    def inputs(self, vocab_size: int) -> list[str | list[int]]:
        """``input`` as a list of prompts (strings or token-id lists), each checked, naming it."""
        if (self.input is None) == (self.messages is None):
            raise ValueError("set exactly one of input and messages")
        return check_inputs(self.input, vocab_size)


def check_inputs(given: Any, vocab_size: int, field: str = "input") -> list[str | list[int]]:
    """A pooling request's ``input`` (a string, a list of strings, a token-id list or a list of
    them) as a list of prompts, each checked, naming it (``input[1]``)."""
    one = isinstance(given, str) or (isinstance(given, list) and given and all(map(is_int, given)))
    items = [given] if one else given
    if not isinstance(items, list) or not items:
        raise ValueError(f"{field} must be a string, a list of strings, a list of token ids or a list of "
                         "token-id lists, and not empty")  # fmt: skip
    for i, item in enumerate(items):
        where = field if one else f"{field}[{i}]"
        if isinstance(item, str):
            if not item:
                raise ValueError(f"{where} is an empty string")
        elif not isinstance(item, list) or not item or not all(map(is_int, item)):
            raise ValueError(f"{where} must be a non-empty string or a non-empty list of token ids")
        elif bad := [t for t in item if not 0 <= t < vocab_size]:
            raise ValueError(f"{where} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return items


def encode_embedding(data: torch.Tensor, encoding_format: str) -> list[float] | str:
    """An embedding as the API writes it: floats, or the base64 of its little-endian float32 bytes
    (what OpenAI's client decodes with ``np.frombuffer(..., dtype="float32")``)."""
    vector = data.to(torch.float32).numpy()
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


def pooling_usage(outs: list[PoolingRequestOutput]) -> dict[str, Any]:
    """A pooling response's usage: the prompt tokens, nothing generated."""
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None}  # fmt: skip


class OpenAIServingPooling(OpenAIServing):
    """What the pooling routes share (embeddings, score / rerank, classify): the runner check (a
    generating server answers 404, as vLLM's has no such route), the model's tasks, and running a
    request's prompts to their pooled outputs."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, models: OpenAIServingModels | None = None) -> None:
        super().__init__(engine, model_name, models)
        self.runner_type = engine.engine.runner_type
        self.tasks = engine.engine.supported_tasks
        self.vocab_size = engine.engine.vocab_size
        self.hf_config = engine.engine.hf_config

    def require_pooling(self, api: str, what: str) -> None:
        if self.runner_type != "pooling":
            raise APINotSupportedError(f"The model does not support the {api}: this server generates; start it "
                                       f"with --runner pooling to serve {what}")  # fmt: skip

    def engine_prompts(self, prompts: list[Any], params: PoolingParams, add_special_tokens: bool = True) -> list[Any]:
        """(On the tokenizer thread.) The text prompts as the engine's ids (without the tokenizer's
        BOS/EOS unless ``add_special_tokens``), truncated as the engine would truncate them;
        token-id prompts pass through."""
        if not add_special_tokens:
            prompts = [self.tokenizer(p, add_special_tokens=False).input_ids if isinstance(p, str) else p for p in prompts]
        return [self.engine.engine.input_processor.pretokenize(p, params) for p in prompts]

    async def pool(self, request_id: str, prompts: list[Any], params: PoolingParams, priority: int,
                   lora_request: LoRARequest | None) -> list[PoolingRequestOutput]:  # fmt: skip
        """Every prompt's final output, in prompt order (a bad prompt: ValueError before any runs)."""
        group = await RequestGroup.start(self.engine, request_id, prompts, params, priority, lora_request)
        finals = {}
        async for i, out in group:
            if out.outputs is None:  # aborted: only a shutdown does that to a request still being read
                raise EngineDeadError("the request was aborted: the engine is shutting down")
            finals[i] = out
        return [finals[i] for i in sorted(finals)]


class OpenAIServingEmbedding(OpenAIServingPooling):
    def __init__(
        self, engine: AsyncLLMEngine, model_name: str, chat: OpenAIServingChat, models: OpenAIServingModels | None = None
    ) -> None:  # fmt: skip
        super().__init__(engine, model_name, models)
        self.chat = chat  # (its chat template and rendering, for the messages form)

    async def create_embedding(self, request: EmbeddingRequest) -> dict[str, Any]:
        """The whole response; a bad request raises ValueError (400) before anything is computed."""
        self.require_pooling("Embeddings API", "embeddings")
        lora_request = self.check_model(request.model)
        params = request.pooling_params()
        prompts = await off_loop(self._prompts, request, params)  # (a long input: seconds, which held every stream)
        request_id = self.new_id("embd", request.request_id)
        outs = await self.pool(request_id, prompts, params, request.priority, lora_request)
        data = [{"object": "embedding", "embedding": encode_embedding(out.outputs.data, request.encoding_format),
                 "index": i} for i, out in enumerate(outs)]  # fmt: skip
        return {**self.header(request_id, "list", request.model), "data": data, "usage": pooling_usage(outs)}

    def _prompts(self, request: EmbeddingRequest, params: PoolingParams) -> list[Any]:
        """(On the tokenizer thread.) The engine prompts, tokenized: each input, or the messages
        through the chat template."""
        if request.messages is not None and request.input is None:
            check_chat_options(request)
            rendered = self.chat.render(request)
            if request.add_special_tokens:  # (as vLLM: off unless asked, the template wrote them)
                return [self.tokenizer(rendered["prompt"], add_special_tokens=True).input_ids]
            return [rendered]
        return self.engine_prompts(request.inputs(self.vocab_size), params, request.add_special_tokens is not False)


def refuse_generation_routes(routes: list[BaseRoute]) -> list[BaseRoute]:
    """A pooling server's routes: the completion routes answer 404 naming the runner (OpenAI's error
    shape), as vLLM's pooling server has no such routes."""

    def refusal(api: str) -> Callable:
        message = (f"The model does not support the {api}: this server runs --runner pooling "
                   "(embeddings: POST /v1/embeddings)")  # fmt: skip
        return refusal_endpoint(message, "NotFoundError", 404)

    return [Route(r.path, refusal(_GENERATION_ROUTES[r.path]), methods=["POST"])
            if isinstance(r, Route) and r.path in _GENERATION_ROUTES else r for r in routes]  # fmt: skip
