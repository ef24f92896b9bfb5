"""``POST /score`` (and ``/v1/score``) and ``POST /rerank`` (``/v1/rerank``, ``/v2/rerank``, Jina's
and Cohere's shape), as vLLM's score routes, on a server started with ``--runner pooling``.

Both score (text_1, text_2) pairs as ``LLM.score`` does (engine/scoring.py): an embedding model by
the cosine similarity of the two embeddings, a one-label classifier (cross-encoder / reranker) by
its head's relevance of the pair read as one input. ``/score`` takes ``text_1`` and ``text_2``
(or vLLM's newer ``queries`` / ``documents`` and ``data_1`` / ``data_2``), each a string or a list
of strings, 1:1, 1:N or N:N; ``/rerank`` takes a ``query`` and its ``documents`` and answers them
sorted by relevance, best first, each with its index in the request (``top_n``: only the best n;
0, the default: all). ``return_documents: false`` (Cohere's field; vLLM always returns them)
leaves each result's document out. A generating server answers these routes 404.
"""
from __future__ import annotations

from typing import Any, Callable

from starlette.routing import Route

from vllmini.engine import scoring
from vllmini.engine.outputs import PoolingRequestOutput
from vllmini.engine.pooling_params import PoolingParams
from vllmini.entrypoints.openai.serving_classification import PoolingRequestFields
from vllmini.entrypoints.openai.serving_embedding import OpenAIServingPooling, pooling_usage
from vllmini.entrypoints.openai.serving_engine import off_loop
from vllmini.lora.request import LoRARequest

_PAIR_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))


class ScoreRequest(PoolingRequestFields, kw_only=True):
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None

    def pairs(self) -> tuple[tuple[str, Any], tuple[str, Any]]:
        """The one pair of fields given, (name, value) each."""
        given = [(a, b) for a, b in _PAIR_FIELDS if getattr(self, a) is not None or getattr(self, b) is not None]
        if len(given) != 1:
            raise ValueError("set exactly one pair of text_1 and text_2, queries and documents, or data_1 and data_2")
        (a, b), = given
        if missing := [name for name in (a, b) if getattr(self, name) is None]:
            raise ValueError(f"{missing[0]} is required (with {b if missing[0] == a else a})")
        return (a, getattr(self, a)), (b, getattr(self, b))


class RerankRequest(PoolingRequestFields, kw_only=True):
    query: str
    documents: list[str]
    top_n: int = 0
    return_documents: bool = True


class OpenAIServingScores(OpenAIServingPooling):
    def routes(self, handler: Callable) -> list[Route]:
        """vLLM's paths, through the server's request handler (api_server.build_app)."""
        score, rerank = handler(ScoreRequest, self.create_score), handler(RerankRequest, self.create_rerank)
        return [*(Route(path, score, methods=["POST"]) for path in ("/score", "/v1/score")),
                *(Route(path, rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank"))]  # fmt: skip

    async def create_score(self, request: ScoreRequest) -> dict[str, Any]:
        """The whole response: one score per pair, in pair order."""
        self.require_pooling("Score API", "scores")
        lora_request = self.check_model(request.model)
        (name_1, data_1), (name_2, data_2) = request.pairs()
        request_id = self.new_id("score", request.request_id)
        outs = await self._scores(request, request_id, (data_1, data_2), (name_1, name_2), lora_request)
        data = [{"index": i, "object": "score", "score": out.outputs.data.item()} for i, out in enumerate(outs)]
        return {**self.header(request_id, "list", request.model), "data": data, "usage": pooling_usage(outs)}

    async def create_rerank(self, request: RerankRequest) -> dict[str, Any]:
        """The whole response: the documents by relevance to the query, best first."""
        self.require_pooling("Rerank API", "reranking")
        lora_request = self.check_model(request.model)
        if request.top_n < 0:
            raise ValueError(f"top_n must be >= 0 (0: every document), got {request.top_n}")
        request_id = self.new_id("rerank", request.request_id)
        outs = await self._scores(request, request_id, (request.query, request.documents), ("query", "documents"),
                                  lora_request)  # fmt: skip
        results = []
        for i, out in enumerate(outs):
            document = {"document": {"text": request.documents[i]}} if request.return_documents else {}
            results.append({"index": i, **document, "relevance_score": out.outputs.data.item()})
        results.sort(key=lambda r: r["relevance_score"], reverse=True)  # (stable: ties keep the request's order)
        usage = pooling_usage(outs)
        return {"id": request_id, "model": request.model or self.model_name,
                "usage": {"prompt_tokens": usage["prompt_tokens"], "total_tokens": usage["total_tokens"]},
                "results": results[: request.top_n or None]}  # fmt: skip

    async def _scores(self, request: PoolingRequestFields, request_id: str, data: tuple[Any, Any],
                      fields: tuple[str, str], lora_request: LoRARequest | None) -> list[PoolingRequestOutput]:  # fmt: skip
        """One output per pair, its data the score (engine/scoring.py: a cross-encoder's, or cosine)."""
        # (a long text: seconds to tokenize, which held every stream)
        prompts, params, num_texts_1 = await off_loop(self._inputs, request, data, fields)
        outs = await self.pool(request_id, prompts, params, request.priority, lora_request)
        return scoring.pair_scores(outs, params.task, num_texts_1, self.tokenizer.pad_token_id)

    def _inputs(self, request: PoolingRequestFields, data: tuple[Any, Any], fields: tuple[str, str]
                ) -> tuple[list[Any], PoolingParams, int]:  # fmt: skip
        """(On the tokenizer thread.) What to pool for the pairs, tokenized, its params, and how many
        texts the first side has."""
        texts_1, texts_2 = (scoring.score_texts(side, field, self.tokenizer) for side, field in zip(data, fields))
        prompts, task = scoring.score_prompts(self.tasks, self.tokenizer, self.hf_config, texts_1, texts_2, fields)
        activation = request.activation_flag() if task == "score" else None  # (an embedder's cosine takes none)
        params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens,
                               truncation_side=request.truncation_side, use_activation=activation, task=task)
        return self.engine_prompts(prompts, params), params, len(texts_1)
