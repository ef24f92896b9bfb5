"""``POST /classify`` (and ``/v1/classify``), as vLLM's classification route, on a server started
with ``--runner pooling`` for a ``*ForSequenceClassification`` model.

``input`` is a string, a list of strings, a token-id list or a list of them (each its own engine
request). Each answer is the label the model's ``id2label`` names for its most likely class, the
probabilities (softmax over the labels, a sigmoid for one label; the logits with vLLM's
``use_activation: false``) and their count. A model that does not classify answers 400 naming it;
a generating server answers 404 (vLLM registers no such route).
"""
from __future__ import annotations

from typing import Any, Callable

import msgspec
from starlette.routing import Route

from vllmini.engine.pooling_params import PoolingParams
from vllmini.entrypoints.openai.serving_embedding import OpenAIServingPooling, check_inputs, pooling_usage
from vllmini.entrypoints.openai.serving_engine import off_loop


class PoolingRequestFields(msgspec.Struct, kw_only=True):
    """The fields vLLM's classify, score and rerank requests share. ``use_activation`` (vLLM's older
    ``activation`` / ``softmax``): False reports the head's logits."""

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None  # vLLM 0.32's: "right" (left out: the first tokens kept) or "left"
    use_activation: bool | None = None
    activation: bool | None = None  # (vLLM's deprecated names for use_activation)
    softmax: bool | None = None
    priority: int = 0
    request_id: str | None = None
    user: str | None = None

    def activation_flag(self) -> bool | None:
        given = [v for v in (self.use_activation, self.activation, self.softmax) if v is not None]
        if len(set(given)) > 1:
            raise ValueError("use_activation, activation and softmax (its older names) disagree")
        return given[0] if given else None


class ClassificationRequest(PoolingRequestFields, kw_only=True):
    input: str | list | None = None
    add_special_tokens: bool = True


class OpenAIServingClassification(OpenAIServingPooling):
    def routes(self, handler: Callable) -> list[Route]:
        """vLLM's paths, through the server's request handler (api_server.build_app)."""
        endpoint = handler(ClassificationRequest, self.create_classify)
        return [Route(path, endpoint, methods=["POST"]) for path in ("/classify", "/v1/classify")]

    async def create_classify(self, request: ClassificationRequest) -> dict[str, Any]:
        """The whole response; a bad request raises ValueError (400) before anything is computed."""
        self.require_pooling("Classification API", "a *ForSequenceClassification model")
        lora_request = self.check_model(request.model)
        if "classify" not in self.tasks:
            raise ValueError(f"The model does not support the Classification API (its pooling tasks: {list(self.tasks)}); "
                             "it needs a *ForSequenceClassification checkpoint")  # fmt: skip
        if request.input is None:
            raise ValueError("input is required")
        params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens,
                               truncation_side=request.truncation_side, use_activation=request.activation_flag(),
                               task="classify")  # fmt: skip
        prompts = await off_loop(self._prompts, request, params)  # (a long input: seconds, which held every stream)
        request_id = self.new_id("classify", request.request_id)
        outs = await self.pool(request_id, prompts, params, request.priority, lora_request)
        id2label = getattr(self.hf_config, "id2label", None) or {}
        data = []
        for i, out in enumerate(outs):
            probs = out.outputs.data.tolist()
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": i, "label": id2label.get(best, f"LABEL_{best}"), "probs": probs,
                         "num_classes": len(probs)})  # fmt: skip
        return {**self.header(request_id, "list", request.model), "data": data, "usage": pooling_usage(outs)}

    def _prompts(self, request: ClassificationRequest, params: PoolingParams) -> list[Any]:
        """(On the tokenizer thread.) The inputs checked and tokenized (without special tokens
        unless ``add_special_tokens``)."""
        return self.engine_prompts(check_inputs(request.input, self.vocab_size), params, request.add_special_tokens)
