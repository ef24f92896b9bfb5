"""Offline batch API (``LLM.generate`` / ``LLM.chat`` / ``LLM.beam_search``), as in vLLM."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import msgspec
from tqdm.auto import tqdm

from vllmini.config import EngineArgs
from vllmini.engine import beam_search
from vllmini.engine.beam_search import BeamSearchOutput, BeamSearchParams
from vllmini.engine.chat import render_chat
from vllmini.engine.input_processor import as_prompt_list, per_prompt_loras
from vllmini.engine.llm_engine import LLMEngine, PromptType
from vllmini.engine.outputs import RequestOutput
from vllmini.engine.sampling_params import SamplingParams
from vllmini.lora.request import LoRARequest

Messages = list[dict[str, Any]]


class LLM:
    """``LLM(model="default", **engine_args)``; every EngineArgs field is a keyword argument."""

    def __init__(self, model: str = "default", **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s) {sorted(unknown)}; accepted: {sorted(EngineArgs.field_names())}")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests are unfinished."""
        return self.llm_engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate/chat use when given no SamplingParams: the model's generation config
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as in vLLM."""
        return self.llm_engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. ``use_tqdm``: show a
        progress bar, or (as vLLM) the tqdm-like factory that makes it. ``priority``: one per
        prompt (lower first), with ``scheduling_policy="priority"``. ``lora_request``: one
        adapter for every prompt, or one (or None) per prompt (needs ``enable_lora``)."""
        prompts = as_prompt_list(prompts)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority has {len(priorities)} entries but there are {len(prompts)} prompts")
        loras = per_prompt_loras(lora_request, len(prompts))
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)  # None: the engine's defaults
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries but there are {len(prompts)} prompts"
                )
        # generate() returns whole completions, whatever output_kind asks for streaming
        params_list = [msgspec.structs.replace(p, output_kind="final") if isinstance(p, SamplingParams) else p
                       for p in params_list]  # fmt: skip
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params, prio, lora in zip(prompts, params_list, priorities, loras):
                ids.append(engine.add_request(None, prompt, params, default_output_kind="final", priority=prio,
                                              lora_request=lora))  # fmt: skip
        except Exception:
            engine.abort_request(ids)  # nothing half-submitted stays queued
            raise
        finals: dict[str, RequestOutput] = {}
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
        return [finals[i] for i in ids]

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
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_content_format: str = "auto",
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, or ``chat_template``: Jinja text or a file's path)
        to each conversation, then generate. As in vLLM: ``continue_final_message`` leaves the last
        (assistant) message open for the model to continue, ``tools`` and ``chat_template_kwargs``
        reach the template (e.g. Qwen3's ``enable_thinking``), an empty list is an empty batch, and
        ``chat_template_content_format="openai"`` hands the template content as a list of text
        parts ("auto" is "string" here: the supported models' templates take strings)."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        # as vLLM: the template kwargs may override the named options
        options = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                   "chat_template": chat_template, "tools": tools, **(chat_template_kwargs or {})}  # fmt: skip
        if options["continue_final_message"] and options["add_generation_prompt"]:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be True")
        if not isinstance(messages, (list, tuple)):
            raise ValueError(f"messages must be a conversation (a list of dicts) or a list of them, got {messages!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = []
        for i, conv in enumerate(conversations):
            try:
                prompts.append(render_chat(tok, conv, content_format=chat_template_content_format, **options))
            except ValueError as exc:  # which conversation of a batch is at fault
                raise ValueError(f"conversation {i}: {exc}" if len(conversations) > 1 else str(exc)) from exc
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
