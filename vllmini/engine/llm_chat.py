"""The offline ``LLM``'s chat calls: ``chat`` (run to completion) and vLLM 0.32's ``enqueue_chat``
(queued for ``wait_for_completion``), the conversations through the chat template first."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from tqdm.auto import tqdm

from vllmini.engine.chat import render_chat
from vllmini.engine.outputs import RequestOutput
from vllmini.engine.sampling_params import SamplingParams
from vllmini.lora.request import LoRARequest

Messages = list[dict[str, Any]]


class ChatMixin:
    llm_engine: Any
    generate: Callable[..., list[RequestOutput]]
    enqueue: Callable[..., list[str]]

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
        prompts = self._chat_prompts(messages, chat_template, chat_template_content_format, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs)  # fmt: skip
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request, priority=priority,
                             tokenization_kwargs=tokenization_kwargs)  # fmt: skip

    def enqueue_chat(
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
    ) -> list[str]:
        """vLLM 0.32's: ``chat``'s conversations (its arguments, in its order) queued as ``enqueue``
        queues prompts, without running them; their request ids. ``wait_for_completion`` runs them
        (with those ``enqueue`` queued), its outputs in request id order."""
        if self.llm_engine.runner_type != "generate":
            raise ValueError("LLM.enqueue_chat() is only supported for generative models: this LLM runs the pooling "
                             "runner (runner='generate' to generate)")  # fmt: skip
        prompts = self._chat_prompts(messages, chat_template, chat_template_content_format, add_generation_prompt,
                                     continue_final_message, tools, chat_template_kwargs)  # fmt: skip
        return self.enqueue(prompts, sampling_params, lora_request=lora_request, priority=priority, use_tqdm=use_tqdm,
                            tokenization_kwargs=tokenization_kwargs)  # fmt: skip

    def _chat_prompts(
        self, messages: Messages | Sequence[Messages], chat_template: str | None, content_format: str,
        add_generation_prompt: bool, continue_final_message: bool, tools: list[dict[str, Any]] | None,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> list[dict[str, Any]]:  # fmt: skip
        """Each conversation (or the one) through the chat template; a ValueError names the one at fault."""
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
                prompts.append(render_chat(tok, conv, content_format=content_format, **options))
            except ValueError as exc:  # which conversation of a batch is at fault
                raise ValueError(f"conversation {i}: {exc}" if len(conversations) > 1 else str(exc)) from exc
        return prompts
