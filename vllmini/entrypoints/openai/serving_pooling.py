"""``POST /pooling``, vLLM's route for any pooling task, on a server started with ``--runner pooling``.

The request is the embeddings route's (``input``, or ``messages`` through the chat template;
``encoding_format``, ``dimensions``, ``normalize``, ...) with vLLM's ``task``: one of the model's
pooling tasks but ``score`` (pairs go to ``/score``); left out, the model's token task
(``token_embed`` for an embedding model, ``token_classify`` for a classifier), as vLLM's. Each
answer's ``data`` is what ``LLM.encode`` pools: a list for a sequence task, a list per prompt token
for a token task (or the base64 of their float32 bytes, row after row). A generating server
answers 404, as vLLM registers no such route.
"""
from __future__ import annotations

from typing import Any, Callable

from starlette.routing import Route

from vllmini.engine.pooling_params import PoolingParams
from vllmini.entrypoints.openai.serving_classification import PoolingRequestFields
from vllmini.entrypoints.openai.serving_embedding import (EmbeddingRequest, OpenAIServingEmbedding, encode_embedding,
                                                          pooling_usage)  # fmt: skip
from vllmini.entrypoints.openai.serving_engine import off_loop

# the task /pooling runs when none is given: the model's token task, as vLLM's route picks it
_DEFAULT_TASKS = ("token_embed", "token_classify")


class PoolingRequest(EmbeddingRequest, kw_only=True):
    """vLLM's ``PoolingCompletionRequest`` / ``PoolingChatRequest``: the embeddings request with
    ``task``, and the classifier's ``use_activation`` (older names ``activation``, ``softmax``)."""

    task: str | None = None
    activation: bool | None = None
    softmax: bool | None = None

    def pooling_params(self) -> PoolingParams:
        activate = PoolingRequestFields.activation_flag(self)  # type: ignore[arg-type]
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, truncation_side=self.truncation_side,
                             dimensions=self.dimensions, normalize=self.normalize, use_activation=activate,
                             task=self.task)  # fmt: skip


class OpenAIServingPoolingRoute(OpenAIServingEmbedding):
    def routes(self, handler: Callable) -> list[Route]:
        """vLLM's path, through the server's request handler (api_server.build_app)."""
        return [Route("/pooling", handler(PoolingRequest, self.create_pooling), methods=["POST"])]

    async def create_pooling(self, request: PoolingRequest) -> dict[str, Any]:
        """The whole response; a bad request raises ValueError (400) before anything is computed."""
        self.require_pooling("Pooling API", "pooling models")
        lora_request = self.check_model(request.model)
        if request.task is None:
            request.task = next((t for t in _DEFAULT_TASKS if t in self.tasks), self.tasks[0])
        if request.task == "score" or request.task not in self.tasks:
            raise ValueError(f"task={request.task!r} is not supported by /pooling for this model; supported: "
                             f"{[t for t in self.tasks if t != 'score']} (pairs are scored by /score)")  # fmt: skip
        params = request.pooling_params()
        prompts = await off_loop(self._prompts, request, params)
        request_id = self.new_id("pool", request.request_id)
        outs = await self.pool(request_id, prompts, params, request.priority, lora_request)
        data = [{"index": i, "object": "pooling", "data": encode_embedding(out.outputs.data, request.encoding_format)}
                for i, out in enumerate(outs)]  # fmt: skip
        return {**self.header(request_id, "list", request.model), "data": data, "usage": pooling_usage(outs)}
