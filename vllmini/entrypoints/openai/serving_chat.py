"""``POST /v1/chat/completions``: the messages go through the chat template (the server's
``--chat-template``, else the tokenizer's; a request may name its own), n completions answered
whole or streamed as ``chat.completion.chunk`` events."""
from __future__ import annotations

from typing import Any, AsyncIterator

from vllmini.engine.async_engine import AsyncLLMEngine
from vllmini.engine.chat import render_chat, resolve_chat_template
from vllmini.engine.outputs import CompletionOutput, LogprobsEntry
from vllmini.entrypoints.openai.metrics import ServerMetrics
from vllmini.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from vllmini.entrypoints.openai.serving_engine import (
    EventStream, OpenAIServing, RequestGroup, Usage, json_logprob, sse,
)  # fmt: skip
from vllmini.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self, engine: AsyncLLMEngine, model_name: str, chat_template: str | None = None,
        metrics: ServerMetrics | None = None, models: OpenAIServingModels | None = None,
    ) -> None:  # fmt: skip
        super().__init__(engine, model_name, metrics, models)
        # checked at start-up: a bad --chat-template stops the server before it listens (without
        # one, a tokenizer with no template of its own fails each chat request, naming it)
        self.chat_template = None if chat_template is None else resolve_chat_template(self.tokenizer, chat_template)

    async def create_chat_completion(self, request: ChatCompletionRequest) -> dict[str, Any] | EventStream:
        """The whole response, or (``stream``) its events; raises ValueError for a bad request
        before anything is generated."""
        lora_request = self.check_model(request.model)
        request.check()
        prompt = self.render(request)
        # (``is None``, not ``or``: 0 is refused by SamplingParams, not taken for "not given")
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if max_tokens is None:
            max_tokens = self.model_max_tokens
        params = request.sampling_params(self.defaults, max_tokens, request.num_logprobs)
        request_id = self.new_id("chatcmpl", request.request_id)
        group = await RequestGroup.start(self.engine, request_id, [prompt], params, request.priority, self.metrics,
                                         lora_request)  # fmt: skip
        if request.stream:
            return EventStream(self._stream(request, request_id, group, len(prompt["prompt_token_ids"])), group)
        return await self._whole(request, request_id, group)

    def render(self, request: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
        """``{"prompt", "prompt_token_ids"}`` of the request's messages through the chat template."""
        named = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, dict) else {}
        if request.chat_template and "{" not in request.chat_template and request.chat_template not in named:
            # render_chat would read it as a path: a client must not make the server open its files
            raise ValueError("chat_template: a request's template must be Jinja text or the name of one of the "
                             "tokenizer's templates, not a file path")  # fmt: skip
        options = {"add_generation_prompt": request.add_generation_prompt, "tools": request.tools,
                   "continue_final_message": request.continue_final_message,
                   "chat_template": request.chat_template or self.chat_template,
                   **(request.chat_template_kwargs or {})}  # fmt: skip
        return render_chat(self.tokenizer, request.messages, **options)

    def _echo(self, request: ChatCompletionRequest) -> str:
        """With ``echo``, the last message's content when it is the assistant's (being continued)."""
        last = request.messages[-1]
        if not request.echo or last.get("role") != "assistant" or not isinstance(last.get("content"), str):
            return ""
        return last["content"]

    async def _whole(self, request: ChatCompletionRequest, request_id: str, group: RequestGroup) -> dict[str, Any]:
        usage, choices, prompt_logprobs = Usage(), [], None
        async for i, out in group:
            usage.add(i, out)
            prompt_logprobs = self.prompt_logprobs(out.prompt_logprobs)
            for c in sorted(out.outputs, key=lambda c: c.index):
                message = {"role": "assistant", "content": self._echo(request) + c.text, "tool_calls": []}
                choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(request, c),
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})  # fmt: skip
        body = {**self.header(request_id, "chat.completion", request.model), "choices": choices,
                "usage": usage.body()}  # fmt: skip
        return {**body, "prompt_logprobs": prompt_logprobs} if request.prompt_logprobs is not None else body

    def _stream(
        self, request: ChatCompletionRequest, request_id: str, group: RequestGroup, num_prompt_tokens: int
    ) -> AsyncIterator[str]:
        usage = Usage()
        usage.prompt_tokens[0] = num_prompt_tokens  # (known before the first output: the role chunk's usage has it)
        return self.events(self._chunks(request, request_id, group, usage), request_id, "chat.completion.chunk",
                           usage, request.stream_options, request.model)  # fmt: skip

    async def _chunks(
        self, request: ChatCompletionRequest, request_id: str, group: RequestGroup, usage: Usage
    ) -> AsyncIterator[str]:
        """First a chunk per choice with the role (and any echo), then the text as it comes."""
        continuous = request.stream_options is not None and request.stream_options.continuous_usage_stats

        def chunk(choices: list[dict[str, Any]]) -> str:
            body = {**self.header(request_id, "chat.completion.chunk", request.model), "choices": choices}
            if continuous:
                body["usage"] = usage.body()
            return sse(body)

        role = {"role": "assistant", "content": self._echo(request)}
        yield chunk([{"index": j, "delta": role, "logprobs": None, "finish_reason": None} for j in range(request.n)])
        async for i, out in group:
            usage.add(i, out)
            choices = [
                {"index": c.index, "delta": {"content": c.text} if c.text else {},
                 "logprobs": self._logprobs(request, c), "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason}  # fmt: skip
                for c in out.outputs
            ]
            yield chunk(choices)

    def _logprobs(self, request: ChatCompletionRequest, c: CompletionOutput) -> dict[str, Any] | None:
        """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and the
        ``top_logprobs`` most likely tokens there."""
        if request.num_logprobs is None:
            return None
        return {"content": [self._token(token, entry, request.num_logprobs) for token, entry in
                            zip(c.token_ids, c.logprobs or [])]}  # fmt: skip

    def _token(self, token: int, entry: LogprobsEntry, num: int) -> dict[str, Any]:
        def item(t: int, lp: float) -> dict[str, Any]:
            text = self.token_text(t, entry)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        top = [item(t, lp) for t, lp in self.top(entry, num)]  # (clamped there)
        return {**item(token, json_logprob(entry[token])), "top_logprobs": top}
