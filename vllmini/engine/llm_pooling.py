"""The offline ``LLM``'s pooling calls (``encode``, ``embed``, ``classify``, ``score``, and the
deprecated ``reward``), on an LLM with ``runner="pooling"``: vLLM 0.32's ``PoolingOfflineMixin``."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from vllmini.engine import scoring
from vllmini.engine.input_processor import as_prompt_list
from vllmini.engine.llm_args import per_prompt, tokenization_changes
from vllmini.engine.llm_engine import PromptType
from vllmini.engine.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                                    ScoringRequestOutput)  # fmt: skip
from vllmini.engine.pooling_params import PoolingParams
from vllmini.lora.request import LoRARequest

Loras = LoRARequest | Sequence[LoRARequest | None] | None
TQDM = bool | Callable[..., tqdm]


class PoolingMixin:
    """``tokenization_kwargs`` (vLLM 0.32's, on every call): ``truncate_prompt_tokens`` keeps a
    prompt's first k tokens (-1: max_model_len; vLLM's side for pooling) or, with
    ``"truncation_side": "left"``, its last k. ``truncate_prompt_tokens=`` (vllmini's keyword,
    which vLLM 0.32 no longer takes) does the same."""

    llm_engine: Any
    supported_tasks: tuple[str, ...]
    get_tokenizer: Callable[[], Any]
    _run: Callable[..., list[Any]]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: TQDM = True,
        lora_request: Loras = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: each prompt's pooled hidden state (``.outputs.data``, a float32
        tensor), in input order, on an LLM with ``runner="pooling"``. ``pooling_task`` must be given,
        as in vLLM: one of ``supported_tasks`` ("embed"; a classifier's "classify" and "score": the
        head's probabilities; the token tasks "token_embed" and "token_classify": one row per prompt
        token, ``data`` [num_tokens, hidden or num_labels]). ``pooling_params``: one for every prompt
        or one per prompt (None: the engine's PoolerConfig); ``tokenization_kwargs`` set their truncation."""
        if self.llm_engine.runner_type != "pooling":
            raise ValueError("LLM.encode() is only supported for pooling models; start the LLM with "
                             "runner='pooling' (vLLM: --runner pooling)")  # fmt: skip
        if pooling_task is None:
            raise ValueError("pooling_task is required for LLM.encode: use LLM.embed(...) / LLM.classify(...) / "
                             'LLM.score(...), or pooling_task="embed" / "classify" / "score" / "token_embed" / '
                             '"token_classify"')  # fmt: skip
        if pooling_task not in self.supported_tasks:
            raise ValueError(f"pooling_task={pooling_task!r} is not supported by this model; supported: "
                             f"{list(self.supported_tasks)}")  # fmt: skip
        changes = _truncation(tokenization_kwargs, truncate_prompt_tokens)
        prompts = as_prompt_list(prompts)
        params_list = per_prompt(pooling_params, PoolingParams, "pooling_params", len(prompts))
        params_list = [(PoolingParams() if p is None else p).clone(task=pooling_task, **changes) for p in params_list]
        return self._run(prompts, params_list, [0] * len(prompts), lora_request, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: TQDM = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: Loras = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: one ``EmbeddingRequestOutput`` per prompt (``.outputs.embedding``,
        a list of floats), in input order."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed",
                           tokenization_kwargs=tokenization_kwargs, truncate_prompt_tokens=truncate_prompt_tokens)  # fmt: skip
        return [EmbeddingRequestOutput.from_base(out) for out in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: TQDM = True,
        lora_request: Loras = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify``, on a ``*ForSequenceClassification`` model: one
        ``ClassificationRequestOutput`` per prompt (``.outputs.probs``: softmax over the labels, a
        sigmoid for one label; the logits with ``PoolingParams(use_activation=False)``)."""
        self._require_task("classify", "Classification API", "a *ForSequenceClassification checkpoint")
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="classify", tokenization_kwargs=tokenization_kwargs)  # fmt: skip
        return [ClassificationRequestOutput.from_base(out) for out in outs]

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: TQDM = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: Loras = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's former ``LLM.reward`` (deprecated, gone from 0.32): ``encode(...,
        pooling_task="token_classify")`` (each token's reward); a sequence reward is ``pooling_task="classify"``."""
        warnings.warn('LLM.reward is deprecated (as in vLLM): use LLM.encode(..., pooling_task="token_classify") '
                      'or pooling_task="classify"', DeprecationWarning, stacklevel=2)  # fmt: skip
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="token_classify", tokenization_kwargs=tokenization_kwargs,
                           truncate_prompt_tokens=truncate_prompt_tokens)  # fmt: skip

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        use_tqdm: TQDM = True,
        pooling_params: PoolingParams | None = None,
        lora_request: Loras = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: one ``ScoringRequestOutput`` (``.outputs.score``) per pair, 1:1, 1:N
        or N:N: an embedding model's cosine similarity, or a one-label classifier's (cross-encoder)
        relevance of the pair read as one input (engine/scoring.py)."""
        if self.llm_engine.runner_type != "pooling":
            raise ValueError("LLM.score() is only supported for pooling models; start the LLM with "
                             "runner='pooling' (vLLM: --runner pooling)")  # fmt: skip
        tok, hf_config = self.get_tokenizer(), self.llm_engine.hf_config
        texts_1, texts_2 = scoring.score_texts(data_1, "data_1", tok), scoring.score_texts(data_2, "data_2", tok)
        fields = ("data_1", "data_2")
        prompts, task = scoring.score_prompts(self.supported_tasks, tok, hf_config, texts_1, texts_2, fields)
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task=task,
                           tokenization_kwargs=tokenization_kwargs, truncate_prompt_tokens=truncate_prompt_tokens)  # fmt: skip
        pairs = scoring.pair_scores(outs, task, len(texts_1), tok.pad_token_id)
        return [ScoringRequestOutput.from_base(out) for out in pairs]

    def _require_task(self, task: str, api: str, needs: str) -> None:
        if self.llm_engine.runner_type != "pooling" or task not in self.supported_tasks:
            raise ValueError(f"{api} is not supported by this model (its tasks: {list(self.supported_tasks)}); it "
                             f"needs {needs} with runner='pooling'")  # fmt: skip


def _truncation(tokenization_kwargs: dict[str, Any] | None, truncate_prompt_tokens: int | None) -> dict[str, Any]:
    """The PoolingParams changes of a call's ``tokenization_kwargs`` or ``truncate_prompt_tokens``."""
    changes = tokenization_changes(tokenization_kwargs, ("truncate_prompt_tokens", "truncation_side"))
    if truncate_prompt_tokens is not None:
        if "truncate_prompt_tokens" in changes:
            raise ValueError("truncate_prompt_tokens is given twice: as an argument and in tokenization_kwargs")
        changes["truncate_prompt_tokens"] = truncate_prompt_tokens
    return changes
