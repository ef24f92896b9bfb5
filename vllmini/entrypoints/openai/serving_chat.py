"""``POST /v1/chat/completions``: the messages go through the chat template (the server's
``--chat-template``, else the tokenizer's; a request may name its own), n completions answered
whole or streamed as ``chat.completion.chunk`` events.

With ``--reasoning-parser`` the reasoning comes apart from the content; with
``--enable-auto-tool-choice --tool-call-parser NAME``, ``tool_choice="auto"`` reads tool calls out
of the content; a named or "required" tool choice is made with structured outputs (as vLLM:
tool_choice.py, output_parser.py and the parsers)."""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Iterator, NamedTuple

from vllmini.engine.async_engine import AsyncLLMEngine
from vllmini.engine.beam_search import BeamSearchParams
from vllmini.engine.chat import message_text, render_chat, resolve_chat_template
from vllmini.engine.errors import VLLMValidationError
from vllmini.engine.outputs import CompletionOutput, LogprobsEntry
from vllmini.engine.sampling_params import SamplingParams, StructuredOutputsParams
from vllmini.entrypoints.openai.output_parser import ChatOutputParser
from vllmini.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from vllmini.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from vllmini.entrypoints.openai.serving_engine import (
    MESSAGE_NULLS, RESPONSE_NULLS, EventStream, OpenAIServing, RequestGroup, Usage, json_logprob, off_loop, sse,
)  # fmt: skip
from vllmini.entrypoints.openai.serving_models import OpenAIServingModels
from vllmini.entrypoints.openai.tool_choice import ToolChoice, tool_schema
from vllmini.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from vllmini.entrypoints.openai.tool_parsers.forced_tool_parser import NamedToolParser, RequiredToolParser
from vllmini.lora.request import LoRARequest

MakeParser = Callable[[], ChatOutputParser]


class PreparedChat(NamedTuple):
    """A checked chat request, ready for the engine."""

    prompt: dict[str, Any]  # {"prompt", "prompt_token_ids"}: the messages through the chat template
    params: SamplingParams
    choice: ToolChoice
    make: MakeParser | None  # makes an output's parser (None: the text is content)
    lora_request: LoRARequest | None
    beam: BeamSearchParams | None = None  # use_beam_search: the search's (n beams) instead of sampling


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self, engine: AsyncLLMEngine, model_name: str, chat_template: str | None = None,
        models: OpenAIServingModels | None = None, *,
        enable_auto_tools: bool = False, tool_parser: str | None = None, reasoning_parser: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(engine, model_name, models)
        # checked at start-up: a bad --chat-template stops the server before it listens (without
        # one, a tokenizer with no template of its own fails each chat request, naming it)
        self.chat_template = None if chat_template is None else resolve_chat_template(self.tokenizer, chat_template)
        if enable_auto_tools and tool_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        self.enable_auto_tools = enable_auto_tools
        self.response_role = "assistant"  # vLLM's --response-role (build_app's)
        self.trust_request_chat_template = False  # vLLM's --trust-request-chat-template (build_app's)
        self.tool_parser = None if tool_parser is None else get_tool_parser(tool_parser)
        self.reasoning_parser = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
        # the engine's grammars wait out the reasoning (its reasoning_config, without enable_in_reasoning)
        self.grammar_after_reasoning = engine.engine.structured.reasoning is not None

    async def create_chat_completion(self, request: ChatCompletionRequest) -> dict[str, Any] | EventStream:
        """The whole response, or (``stream``) its events; raises ValueError for a bad request
        before anything is generated."""
        prepared = await self.prepare(request)
        request_id = self.new_id("chatcmpl", request.request_id)
        group = await RequestGroup.start(self.engine, request_id, [prepared.prompt], prepared.params, request.priority,
                                         prepared.lora_request, request.cache_salt, prepared.beam)  # fmt: skip
        choice, make = prepared.choice, prepared.make
        if request.stream:
            prompt_ids = prepared.prompt["prompt_token_ids"]
            return EventStream(self._stream(request, request_id, group, prompt_ids, choice, make), group)
        return await self._whole(request, request_id, group, choice, make)

    async def prepare(self, request: ChatCompletionRequest, max_tokens_name: str | None = None) -> PreparedChat:
        """The request checked and made ready for the engine (the Responses API runs its requests
        through here too; ``max_tokens_name``: its name for max_tokens in errors, else the field the
        request set). ValueError names a bad field, ModelNotFoundError an unknown model."""
        lora_request = self.check_model(request.model)
        request.check()
        if max_tokens_name is None:
            max_tokens_name = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        top, vocab = request.num_logprobs, self.engine.engine.input_processor.vocab_size
        if top is not None and (vocab if top == -1 else top) > self.max_logprobs:  # (the engine would name logprobs)
            raise VLLMValidationError(f"top_logprobs={top} asks for more than the server's max_logprobs="
                                      f"{self.max_logprobs}", parameter="top_logprobs", value=top)
        choice = request.resolved_tool_choice()
        if choice.mode == "auto" and not (self.enable_auto_tools and self.tool_parser):
            raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        prompt = await off_loop(self._rendered, request)
        # (``is None``, not ``or``: 0 is refused by SamplingParams, not taken for "not given")
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        if max_tokens is None:
            max_tokens = self.model_max_tokens
        params = request.sampling_params(self.defaults, max_tokens, request.num_logprobs)
        if max_tokens is not self.model_max_tokens:
            self.check_max_tokens(max_tokens, max_tokens_name)
        params, make = self._parsing(request, choice, prompt["prompt"], params)
        # (a beam also stops where the context ends)
        beam = request.beam_search_params(params.max_tokens or self.max_model_len, self.max_logprobs)
        return PreparedChat(prompt, params, choice, make, lora_request, beam)

    def _rendered(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """(On the tokenizer thread.) The prompt: the messages through the template, tokenized; with
        ``add_special_tokens`` (vLLM's) the tokenizer's own BOS/EOS too, besides the template's."""
        prompt = self.render(request)
        if request.add_special_tokens:
            prompt = {**prompt, "prompt_token_ids": self.tokenizer(prompt["prompt"]).input_ids}
        return prompt

    def _parsing(
        self, request: ChatCompletionRequest, choice: ToolChoice, prompt: str, params: SamplingParams
    ) -> tuple[SamplingParams, MakeParser | None]:
        """The sampling parameters the tool choice needs (a forced call's JSON schema, the tool
        parser's adjustments), and what makes each choice's output parser (None: the text is content)."""
        tools: ToolParser | None = None
        if choice.mode in ("named", "required"):
            params = params.clone(structured_outputs=StructuredOutputsParams(json=tool_schema(request.tools, choice)))
            named = choice.mode == "named"
            tools = NamedToolParser(self.tokenizer, choice.name) if named else RequiredToolParser(self.tokenizer)
        elif choice.mode == "auto" and self.tool_parser is not None:
            tools = self.tool_parser(self.tokenizer, request.tools)
            params = tools.adjust_request(params)
        # a forced call's output is the call, unless its grammar waits out the reasoning
        forced = choice.mode not in ("none", "auto") and not self.grammar_after_reasoning
        reasoning = None if forced else self.reasoning_parser
        if reasoning is not None:
            params = reasoning.adjust_request(params)
        if tools is None and reasoning is None:
            return params, None
        # a grammar bound from the first token: such an output is not in reasoning unless it opens <think>
        constrained = params.structured_outputs is not None and not self.grammar_after_reasoning
        thinking = reasoning is not None and not constrained and reasoning.starts_in_reasoning(prompt)
        parallel, include = request.parallel_tool_calls is not False, request.include_reasoning

        def make() -> ChatOutputParser:
            return ChatOutputParser(reasoning and reasoning(self.tokenizer, thinking), tools and tools.fresh(), parallel,
                                    include)  # fmt: skip

        return params, make

    def _message(
        self, request: ChatCompletionRequest, choice: ToolChoice, make: MakeParser | None, c: CompletionOutput
    ) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish reason."""
        echo, role = self._echo(request), self._role(request)
        if make is None:
            return {"role": role, "content": echo + c.text, **MESSAGE_NULLS, "reasoning": None}, c.finish_reason
        parser = make()
        reasoning, content, calls = parser.parse(c.text)
        if choice.mode in ("named", "required"):
            content = content or ""  # (as vLLM)
        content = echo + (content or "") if echo else content
        message: dict[str, Any] = {"role": role, "content": content, **MESSAGE_NULLS}
        if calls:  # (vLLM leaves out an empty list)
            message["tool_calls"] = calls
        message["reasoning"] = reasoning  # (None with include_reasoning=false)
        if self.reasoning_parser is not None:  # its older name too, which DeepSeek's API and its clients use
            message["reasoning_content"] = reasoning
        return message, self._finish_reason(choice, parser, c.finish_reason)

    @staticmethod
    def _finish_reason(choice: ToolChoice, parser: ChatOutputParser, reason: str | None) -> str | None:
        """As OpenAI and vLLM: "tool_calls" for the calls of an "auto" or "required" choice that
        stopped (a named one stays "stop")."""
        return "tool_calls" if reason == "stop" and parser.tools_called and choice.mode != "named" else reason

    def check_request_template(self, request: Any) -> None:
        """A request's own template (``chat_template``, or one in ``chat_template_kwargs``) only on a
        server that trusts them, as vLLM's ``--trust-request-chat-template``: Jinja's sandbox bounds
        no work, and one template of nested loops would hold the event loop, every stream with it."""
        if self.trust_request_chat_template:
            return
        for field, given in (("chat_template", request.chat_template),
                             ("chat_template_kwargs.chat_template", (request.chat_template_kwargs or {}).get("chat_template"))):  # fmt: skip
            if given is not None:
                raise ValueError(f"{field}: a request's own chat template is refused unless the server trusts them "
                                 "(`vllmini serve --trust-request-chat-template`, as vLLM's)")  # fmt: skip

    def render(self, request: ChatCompletionRequest | TokenizeRequest) -> dict[str, Any]:
        """``{"prompt", "prompt_token_ids"}`` of the request's messages through the chat template."""
        self.check_request_template(request)
        named = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, dict) else {}
        if request.chat_template and "{" not in request.chat_template and request.chat_template not in named:
            # render_chat would read it as a path: a client must not make the server open its files
            raise ValueError("chat_template: a request's template must be Jinja text or the name of one of the "
                             "tokenizer's templates, not a file path")  # fmt: skip
        # (the template's own switches win over chat_template_kwargs' same keys, as vLLM 0.32's merge_kwargs;
        # a chat_template or tools in chat_template_kwargs still replaces the request's, as there)
        options = {"tools": request.tools, "chat_template": request.chat_template or self.chat_template,
                   **(request.chat_template_kwargs or {}), "add_generation_prompt": request.add_generation_prompt,
                   "continue_final_message": request.continue_final_message}  # fmt: skip
        for name in ("documents", "reasoning_effort"):  # (chat requests' template variables, vLLM's)
            if (value := getattr(request, name, None)) is not None:
                options[name] = value
        return render_chat(self.tokenizer, request.messages, **options)

    def _role(self, request: ChatCompletionRequest) -> str:
        """The answer's role, as vLLM's: the server's response role after a generation prompt,
        else the last message's (the message being continued)."""
        return self.response_role if request.add_generation_prompt else str(request.messages[-1].get("role"))

    def _echo(self, request: ChatCompletionRequest) -> str:
        """With ``echo``, the last message's content when it has the answer's role (being continued),
        its text parts joined with newlines, as vLLM's."""
        last = request.messages[-1]
        if not request.echo or last.get("role") != self._role(request):
            return ""
        return message_text(last)

    async def _whole(
        self, request: ChatCompletionRequest, request_id: str, group: RequestGroup, choice: ToolChoice,
        make: MakeParser | None,
    ) -> dict[str, Any]:  # fmt: skip
        usage, choices, prompt_logprobs, prompt_ids = Usage(self.prompt_tokens_details), [], None, []
        async for i, out in group:
            usage.add(i, out)
            prompt_logprobs = self.prompt_logprobs(out.prompt_logprobs)
            prompt_ids = list(out.prompt_token_ids)
            for c in sorted(out.outputs, key=lambda c: c.index):
                message, finish_reason = self._message(request, choice, make, c)
                # (with return_token_ids, vLLM's: each choice's token ids, the prompt's on the response)
                choices.append({"index": c.index, "message": message, "logprobs": self.choice_logprobs(request, c),
                                "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                                "token_ids": list(c.token_ids) if request.return_token_ids else None,
                                "routed_experts": None})  # fmt: skip
        return {**self.header(request_id, "chat.completion", request.model), "choices": choices, "service_tier": None,
                "system_fingerprint": self.system_fingerprint, "usage": usage.body(),
                "prompt_logprobs": prompt_logprobs if request.prompt_logprobs is not None else None,
                "prompt_token_ids": prompt_ids if request.return_token_ids else None, "prompt_text": None,
                **RESPONSE_NULLS}  # fmt: skip

    def _stream(
        self, request: ChatCompletionRequest, request_id: str, group: RequestGroup, prompt_ids: list[int],
        choice: ToolChoice, make: MakeParser | None,
    ) -> AsyncIterator[str]:  # fmt: skip
        usage = Usage(self.prompt_tokens_details)
        usage.prompt_tokens[0] = len(prompt_ids)  # (the role and echo chunks go before the first output is counted)
        head = self.header(request_id, "chat.completion.chunk", request.model)
        return self.events(self._chunks(request, head, group, usage, choice, make, prompt_ids), head, usage,
                           request.stream_options)  # fmt: skip

    async def _chunks(
        self, request: ChatCompletionRequest, head: dict[str, Any], group: RequestGroup, usage: Usage,
        choice: ToolChoice, make: MakeParser | None, prompt_ids: list[int],
    ) -> AsyncIterator[str]:  # fmt: skip
        """As vLLM's: once the first output is in (a failed first step is then the stream's first
        event), each choice's role (content "", with ``return_token_ids`` the prompt's token ids),
        then with ``echo`` each choice's echoed text in a chunk of its own; then the text as it
        comes, ``{"content": ""}`` for a decode step that adds none (a step before any token, of a
        prefill, sends nothing). With parsers: their reasoning, content and tool-call deltas, a
        step with none (nor logprobs or new token ids to return) unsent but the last, ``{}``.
        ``stop_reason`` comes with the finish only, on the chunk of the last token (vLLM's: its
        delta ``{"content": ""}`` for an EOS), with the fingerprint. Each chunk holds one choice, in
        the engine's order (with ``continuous_usage_stats``, its own usage); the fields vLLM sends
        null are there as null (the role chunk's prompt_token_ids and prompt_text, each later
        choice's token_ids)."""
        continuous = self.stream_usage(request.stream_options)[1]
        parsers: dict[int, ChatOutputParser] = {}
        opened = False

        def chunks(choices: list[dict[str, Any]], **extra: Any) -> Iterator[str]:
            for c in choices:
                own = {**usage.choice(0, c["index"]), "completion_tokens_details": None}  # (chat's, vLLM's)
                counts = {"usage": own} if continuous else {}
                yield sse({**head, "choices": [c], **extra, **counts, **self.finishing(c, request.stream_options)})

        def opening(delta: dict[str, Any], **extra: Any) -> Iterator[str]:
            yield from chunks([{"index": j, "delta": delta, "logprobs": None, "finish_reason": None}
                               for j in range(request.n)], **extra)  # fmt: skip

        async for i, out in group:
            if not opened:
                opened = True
                ids = list(prompt_ids) if request.return_token_ids else None
                role = {"role": self._role(request), "content": ""}
                for event in opening(role, prompt_token_ids=ids, prompt_text=None):
                    yield event
                if echo := self._echo(request):
                    for event in opening({"content": echo}):
                        yield event
            usage.add(i, out)
            choices = []
            for c in out.outputs:
                if not c.text and not c.token_ids and not usage.choice_tokens.get((i, c.index)):
                    continue  # (no token yet: a prefill step)
                logprobs, finish_reason = self.choice_logprobs(request, c), c.finish_reason
                delta: Any = {"content": c.text}
                if make is not None:
                    parser = parsers[c.index] = parsers.get(c.index) or make()
                    message = parser.delta(c.text, final=finish_reason is not None)
                    finish_reason = self._finish_reason(choice, parser, finish_reason)
                    ids_due = request.return_token_ids and c.token_ids  # (the ids of held-back text still go out)
                    if message is None and finish_reason is None and logprobs is None and not ids_due:
                        continue
                    delta = {} if message is None else message
                choices.append({"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
                if finish_reason is not None:
                    choices[-1]["stop_reason"] = c.stop_reason
                choices[-1]["token_ids"] = list(c.token_ids) if request.return_token_ids else None
            for event in chunks(choices):
                yield event

    def choice_logprobs(self, request: ChatCompletionRequest, c: CompletionOutput) -> dict[str, Any] | None:
        """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and the
        ``top_logprobs`` most likely tokens there."""
        if request.num_logprobs is None and not request.logprob_token_ids:
            return None
        as_ids = self.tokens_as_ids(request)
        return {"content": [self._token(token, entry, request.num_logprobs or 0, request.logprob_token_ids, as_ids)
                            for token, entry in zip(c.token_ids, c.logprobs or [])]}  # fmt: skip

    def _token(
        self, token: int, entry: LogprobsEntry, num: int, listed: list[int] | None = None, as_ids: bool = False
    ) -> dict[str, Any]:  # fmt: skip
        def item(t: int, lp: float) -> dict[str, Any]:
            text = self.token_text(t, entry, as_ids)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        top = [item(t, lp) for t, lp in self.top(entry, num, listed)]  # (clamped there)
        return {**item(token, json_logprob(entry[token])), "top_logprobs": top}
