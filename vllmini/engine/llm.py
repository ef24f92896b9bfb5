"""Offline batch API (``LLM.generate`` / ``LLM.chat`` / ``LLM.beam_search``; with the pooling
runner ``LLM.embed`` / ``classify`` / ``score`` / ``encode`` / ``reward``), as in vLLM."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import msgspec
from tqdm.auto import tqdm

from vllmini.config import EngineArgs
from vllmini.engine import beam_search, scoring
from vllmini.engine.beam_search import BeamSearchOutput, BeamSearchParams
from vllmini.engine.chat import render_chat
from vllmini.engine.input_processor import as_prompt_list, per_prompt_loras
from vllmini.engine.llm_engine import LLMEngine, PromptType
from vllmini.engine.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingRequestOutput,
                                    RequestOutput, ScoringRequestOutput)  # fmt: skip
from vllmini.engine.pooling_params import PoolingParams
from vllmini.engine.sampling_params import SamplingParams
from vllmini.lora.request import LoRARequest
from vllmini.metrics.reader import Metric

Messages = list[dict[str, Any]]


class LLM:
    """``LLM(model="default", **engine_args)``; every EngineArgs field is a keyword argument."""

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s) {sorted(unknown)}; accepted: {sorted(EngineArgs.field_names())}")
        kwargs.setdefault("disable_log_stats", True)  # (vLLM's default offline: get_metrics() needs False)
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._enqueued: list[str] = []  # (enqueue's requests, until wait_for_completion)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """("generate",), or the pooling model's tasks: ("embed", "token_embed"), a sequence
        classifier's ("classify", "score", "token_classify") or a token classifier's ("token_classify",)."""
        return self.llm_engine.supported_tasks

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix; False (nothing done) while requests are unfinished, unless
        ``reset_running_requests`` (vLLM's: they are preempted, recomputed later)."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
        """vLLM's: ``method`` (the name of a method of the worker, engine/worker.py, or a callable
        taking the worker first) run on the one worker; a list of its one result."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """vLLM's: ``[func(model)]``. ``llm.apply_model(lambda m: m.load_weights(weights))`` updates
        the weights in place (HF names; call ``reset_prefix_cache()`` after, as with vLLM)."""
        return self.llm_engine.apply_model(func)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``enable_sleep_mode=True``): the KV cache's memory is given back and
        the prefix cache forgotten; level 1 keeps the weights, level 2 discards them."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``"weights"``, ``"kv_cache"`` or both (None)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: record the engine's steps with the torch profiler until ``stop_profile``
        (needs ``profiler_config``; engine/profiler.py)."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        """Stop recording and write the trace and the ops table into the profiler's folder."""
        self.llm_engine.stop_profile()

    def get_metrics(self) -> list[Metric]:
        """The engine's Prometheus metrics as objects (vLLM's Counter, Gauge, Histogram, Vector
        of ``vllmini.metrics.reader``); needs ``LLM(..., disable_log_stats=False)``."""
        return self.llm_engine.get_metrics()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate/chat use when given no SamplingParams: the model's generation config
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as in vLLM."""
        return self.llm_engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: int | Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. ``use_tqdm``: show a
        progress bar, or (as vLLM) the tqdm-like factory that makes it. ``priority``: one for
        every prompt or one per prompt (lower first), with ``scheduling_policy="priority"``.
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt (needs
        ``enable_lora``). ``tokenization_kwargs``: vLLM 0.32's, of which vllmini takes
        ``truncate_prompt_tokens`` (as SamplingParams' field, for every prompt)."""
        if self.llm_engine.runner_type != "generate":
            raise ValueError("LLM.generate() is only supported for generative models: this LLM runs the pooling "
                             "runner (use embed / encode, or runner='generate' to generate)")  # fmt: skip
        return self._run(*self._generate_requests(prompts, sampling_params, priority, tokenization_kwargs),
                         lora_request, use_tqdm)  # fmt: skip

    def _generate_requests(
        self, prompts: PromptType | Sequence[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: int | Sequence[int] | None, tokenization_kwargs: dict[str, Any] | None,
    ) -> tuple[list[PromptType], list[SamplingParams | None], list[int]]:  # fmt: skip
        """generate's arguments as one (prompt, params, priority) per request."""
        prompts = as_prompt_list(prompts)
        priority = 0 if priority is None else priority
        priorities = [priority] * len(prompts) if isinstance(priority, int) else list(priority)  # (a bool: refused later)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries but there are {len(prompts)} prompts")
        params_list = _per_prompt(sampling_params, SamplingParams, "sampling_params", len(prompts))
        # generate() returns whole completions, whatever output_kind asks for streaming
        changes = {"output_kind": "final", **_tokenization_changes(tokenization_kwargs)}
        if len(changes) > 1:  # (the defaults, truncated too)
            params_list = [self.get_default_sampling_params() if p is None else p for p in params_list]
        params_list = [msgspec.structs.replace(p, **changes) if isinstance(p, SamplingParams) else p
                       for p in params_list]  # fmt: skip
        return prompts, params_list, priorities

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.encode``: each prompt's pooled hidden state (``.outputs.data``, a float32
        tensor), in input order, on an LLM with ``runner="pooling"``. ``pooling_task`` must be given,
        as in vLLM: one of ``supported_tasks`` ("embed"; a classifier's "classify" and "score": the
        head's probabilities; the token tasks "token_embed" and "token_classify": one row per prompt
        token, ``data`` [num_tokens, hidden or num_labels]). ``pooling_params``: one for every prompt
        or one per prompt (None: the engine's PoolerConfig); ``truncate_prompt_tokens`` sets theirs."""
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
        prompts = as_prompt_list(prompts)
        params_list = _per_prompt(pooling_params, PoolingParams, "pooling_params", len(prompts))
        params_list = [(PoolingParams() if p is None else p).clone(task=pooling_task) for p in params_list]
        if truncate_prompt_tokens is not None:
            params_list = [p.clone(truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        return self._run(prompts, params_list, [0] * len(prompts), lora_request, use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: one ``EmbeddingRequestOutput`` per prompt (``.outputs.embedding``,
        a list of floats), in input order."""
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed",
                           truncate_prompt_tokens=truncate_prompt_tokens)  # fmt: skip
        return [EmbeddingRequestOutput.from_base(out) for out in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify``, on a ``*ForSequenceClassification`` model: one
        ``ClassificationRequestOutput`` per prompt (``.outputs.probs``: softmax over the labels, a
        sigmoid for one label; the logits with ``PoolingParams(use_activation=False)``)."""
        self._require_task("classify", "Classification API", "a *ForSequenceClassification checkpoint")
        outs = self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="classify")  # fmt: skip
        return [ClassificationRequestOutput.from_base(out) for out in outs]

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's ``LLM.reward``, deprecated there as here: ``encode(..., pooling_task="token_classify")``
        (each token's reward); a sequence reward is ``pooling_task="classify"``."""
        warnings.warn('LLM.reward is deprecated (as in vLLM): use LLM.encode(..., pooling_task="token_classify") '
                      'or pooling_task="classify"', DeprecationWarning, stacklevel=2)  # fmt: skip
        return self.encode(prompts, pooling_params, use_tqdm=use_tqdm, lora_request=lora_request,
                           pooling_task="token_classify", truncate_prompt_tokens=truncate_prompt_tokens)  # fmt: skip

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
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
                           truncate_prompt_tokens=truncate_prompt_tokens)  # fmt: skip
        pairs = scoring.pair_scores(outs, task, len(texts_1), tok.pad_token_id)
        return [ScoringRequestOutput.from_base(out) for out in pairs]

    def _require_task(self, task: str, api: str, needs: str) -> None:
        if self.llm_engine.runner_type != "pooling" or task not in self.supported_tasks:
            raise ValueError(f"{api} is not supported by this model (its tasks: {list(self.supported_tasks)}); it "
                             f"needs {needs} with runner='pooling'")  # fmt: skip

    def _run(
        self, prompts: list[PromptType], params_list: list[Any], priorities: list[int],
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None, use_tqdm: bool | Callable[..., tqdm],
    ) -> list[Any]:  # fmt: skip
        """Add every request, then step the engine until all are finished; their final outputs in
        input order."""
        ids = self._add(prompts, params_list, priorities, lora_request)
        finals = self._wait(ids, use_tqdm)
        return [finals[i] for i in ids]

    def _add(
        self, prompts: list[PromptType], params_list: list[Any], priorities: list[int],
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
    ) -> list[str]:  # fmt: skip
        """Add every request (none stays queued if one is refused); their ids."""
        loras = per_prompt_loras(lora_request, len(prompts))
        engine = self.llm_engine
        if engine.is_sleeping():
            raise RuntimeError("the LLM is sleeping: call wake_up() (and, after sleep(level=2), load the weights) first")
        ids: list[str] = []
        try:
            for prompt, params, prio, lora in zip(prompts, params_list, priorities, loras):
                ids.append(engine.add_request(None, prompt, params, default_output_kind="final", priority=prio,
                                              lora_request=lora))  # fmt: skip
        except Exception:
            engine.abort_request(ids)  # nothing half-submitted stays queued
            raise
        return ids

    def _wait(self, ids: list[str], use_tqdm: bool | Callable[..., tqdm]) -> dict[str, Any]:
        """Step the engine until no request is left: the final output of each that finished, by id
        (a failure, or Ctrl-C, aborts ``ids``)."""
        engine, finals = self.llm_engine, {}
        bar_args: dict[str, Any] = {"total": len(ids), "desc": "Processed prompts"}
        with use_tqdm(**bar_args) if callable(use_tqdm) else tqdm(**bar_args, disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    outputs = engine.step()
                    if engine.failed:  # a request failed alone (e.g. its detokenizer): report it
                        raise engine.failed.popitem()[1]
                    for out in outputs:
                        if out.finished:
                            finals[out.request_id] = out
                            bar.update(1)
            except BaseException:  # a failed step or request, or Ctrl-C: free everything of this call
                engine.abort_request(ids)
                raise
        return finals

    def enqueue(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """vLLM 0.32's: add the prompts' requests (checked as ``generate`` checks them) without
        running them; their ids. ``wait_for_completion`` runs them (a ``generate`` call before it
        runs them too, and keeps only its own outputs)."""
        ids = self._add(*self._generate_requests(prompts, sampling_params, priority, tokenization_kwargs), lora_request)
        self._enqueued += ids
        return ids

    def wait_for_completion(self, output_type: Any = None, *, use_tqdm: bool | Callable[..., tqdm] = True) -> list[Any]:
        """vLLM 0.32's: step until every request is finished; the final outputs, in request id order
        (``output_type`` is taken for vLLM's signature)."""
        ids, self._enqueued = self._enqueued, []
        return sorted(self._wait(ids, use_tqdm).values(), key=lambda out: int(out.request_id))

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search, built on ``generate`` (engine/beam_search.py): one
        ``BeamSearchOutput`` per prompt, its ``sequences`` best first (vLLM's argument order).
        ``lora_request``: one adapter for every prompt, or one (or None) per prompt."""
        return beam_search.beam_search(self, prompts, params, use_tqdm, concurrency_limit, lora_request)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: int | Sequence[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, or ``chat_template``: Jinja text or a file's path)
        to each conversation, then generate (``priority``, ``tokenization_kwargs``: as ``generate``
        takes them); vLLM 0.32's argument order. As in vLLM: ``continue_final_message`` leaves the last
        (assistant) message open for the model to continue, ``tools`` and ``chat_template_kwargs``
        reach the template (e.g. Qwen3's ``enable_thinking``), an empty list is an empty batch, and
        ``chat_template_content_format="openai"`` hands the template content as a list of text
        parts ("auto" is "string" here: the supported models' templates take strings)."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        # as vLLM 0.32 (its merge_kwargs): the named options win over chat_template_kwargs, unless left None
        named = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                 "chat_template": chat_template, "tools": tools}  # fmt: skip
        options = {**(chat_template_kwargs or {}), **{k: v for k, v in named.items() if v is not None}}
        if options["continue_final_message"] and options["add_generation_prompt"]:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"messages must be a conversation (a list of dicts) or a list of them, got {messages!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.llm_engine.tokenizer  # (None with skip_tokenizer_init: render_chat names it)
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                prompts.append(render_chat(tok, conv, content_format=chat_template_content_format, **options))
            except ValueError as exc:  # which conversation of a batch is at fault
                raise ValueError(f"conversation {i}: {exc}" if len(conversations) > 1 else str(exc)) from exc
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request, priority=priority,
                             tokenization_kwargs=tokenization_kwargs)  # fmt: skip


def _tokenization_changes(tokenization_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM 0.32's ``tokenization_kwargs`` as SamplingParams changes: ``truncate_prompt_tokens``
    (its way to truncate offline prompts); the rest of vLLM's (a tokenizer's options) are refused."""
    if tokenization_kwargs is None:
        return {}
    if not isinstance(tokenization_kwargs, dict):
        raise ValueError(f"tokenization_kwargs must be a dict or None, got {type(tokenization_kwargs).__name__}")
    if other := sorted(set(tokenization_kwargs) - {"truncate_prompt_tokens"}):
        raise ValueError(f"tokenization_kwargs: {other} not supported (vllmini takes truncate_prompt_tokens)")
    return dict(tokenization_kwargs)


def _per_prompt(params: Any, kind: type, name: str, num_prompts: int) -> list[Any]:
    """``params`` as generate / encode take it (one, or None, for every prompt; or one per prompt)."""
    if params is None or isinstance(params, kind):
        return [params] * num_prompts
    params = list(params)
    if len(params) != num_prompts:
        raise ValueError(f"{name} has {len(params)} entries but there are {num_prompts} prompts")
    return params
