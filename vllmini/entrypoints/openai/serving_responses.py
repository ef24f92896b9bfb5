"""``POST /v1/responses`` (OpenAI's Responses API, as vLLM's server serves it): the input items
become chat messages (responses_protocol.py) and run through the chat route's own steps
(``OpenAIServingChat.prepare``: the chat template, structured outputs, the tool and reasoning
parsers); the output is a ``reasoning`` item, a ``message`` item and ``function_call`` items,
whole or streamed as the Responses events (``response.created`` ... ``response.completed``,
each with its ``sequence_number``).

With ``store`` (the default) a finished response is kept in memory, on this object, for
``GET /v1/responses/{id}`` and for ``previous_response_id``, which continues its conversation (its
input and output; not its ``instructions``, as OpenAI's); past ``max_stored`` responses the
oldest is dropped (vLLM's store keeps every response).
"""
from __future__ import annotations

import copy
import itertools
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

import msgspec

from vllmini.engine.outputs import CompletionOutput, RequestOutput
from vllmini.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage
from vllmini.entrypoints.openai.responses_protocol import ResponsesRequest, add_item
from vllmini.entrypoints.openai.serving_chat import OpenAIServingChat, PreparedChat
from vllmini.entrypoints.openai.serving_engine import EventStream, RequestGroup
from vllmini.entrypoints.openai.serving_models import ModelNotFoundError

Event = Callable[..., str]


class ResponseNotFoundError(ModelNotFoundError):
    """An id no stored response has (a 404, as vLLM's)."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- output items (the same builders for the whole response and the stream)


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A text part; ``logprobs``: its tokens' (with ``include``), as the chat route writes them."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, text: str | None, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation (reasoning left out)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(output):
        add_item(messages, item, f"output[{i}]")
    return messages


class ResponseStore:
    """Stored responses with their conversations, the oldest dropped past ``max_size``."""

    def __init__(self, max_size: int = 1000) -> None:
        if max_size < 1:
            raise ValueError(f"the response store's size must be at least 1, got {max_size}")
        self.max_size = max_size
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._items[response["id"]] = (response, conversation)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The response and its conversation (a copy: a request may add to it); ResponseNotFoundError."""
        if response_id not in self._items:
            raise ResponseNotFoundError(f"Response with id '{response_id}' not found.")
        response, conversation = self._items[response_id]
        return response, copy.deepcopy(conversation)


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, max_stored: int = 1000) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored)

    async def create_response(self, request: ResponsesRequest) -> dict[str, Any] | EventStream:
        """The whole response, or (``stream``) its events; ValueError for a bad request (404 for an
        unknown ``previous_response_id``) before anything is generated."""
        request.check()
        history = [] if request.previous_response_id is None else self.store.get(request.previous_response_id)[1]
        conversation = history + request.input_messages()
        system = [{"role": "system", "content": request.instructions}] if request.instructions else []
        chat_request = request.to_chat(system + conversation)
        prepared = await self.chat.prepare(chat_request, "max_output_tokens")
        response_id = request.request_id or new_id("resp")
        group = await RequestGroup.start(self.chat.engine, response_id, [prepared.prompt], prepared.params,
                                         request.priority, prepared.lora_request)  # fmt: skip
        base = self._header(request, response_id, prepared)
        if request.stream:
            return EventStream(self._events(request, chat_request, base, group, prepared, conversation), group)
        final: RequestOutput | None = None
        async for _, out in group:
            final = out
        assert final is not None
        c = final.outputs[0]
        items = self._items(prepared, c, self._logprobs(chat_request, c))
        response = self._finish(base, items, c.finish_reason, final, len(c.token_ids))
        self._keep(request, response, conversation)
        return response

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        """``GET /v1/responses/{id}``: a stored response."""
        return self.store.get(response_id)[0]

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """``POST /v1/responses/{id}/cancel``: only background responses can be cancelled (vLLM's
        rule), and this server has none, so a stored response is a 400, an unknown one a 404."""
        self.store.get(response_id)
        raise ValueError("Cannot cancel a synchronous response.")

    def _keep(self, request: ResponsesRequest, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if request.store:
            self.store.put(response, conversation + output_messages(response["output"]))

    def _header(self, request: ResponsesRequest, response_id: str, prepared: PreparedChat) -> dict[str, Any]:
        """The response's fields before its output (its request's settings, as vLLM echoes them)."""
        params = prepared.params
        max_tokens = params.max_tokens
        if max_tokens is None:  # (to the end of the context)
            max_tokens = self.chat.max_model_len - len(prepared.prompt["prompt_token_ids"])
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": max_tokens, "max_tool_calls": None, "metadata": request.metadata,
            "model": request.model or self.chat.model_name, "output": [],
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": request.previous_response_id,
            "reasoning": request.reasoning, "service_tier": request.service_tier, "store": request.store,
            "background": False, "temperature": params.temperature, "top_p": params.top_p,
            "text": request.text or {"format": {"type": "text"}}, "tool_choice": request.tool_choice or "auto",
            "tools": request.tools, "top_logprobs": request.top_logprobs, "truncation": request.truncation, "usage": None,
            "user": request.user,
        }  # fmt: skip

    @staticmethod
    def _finish(base: dict[str, Any], output: list[dict[str, Any]], finish_reason: str | None, final: RequestOutput,
                num_output_tokens: int) -> dict[str, Any]:  # fmt: skip
        """The finished response: its output items, status and usage."""
        incomplete = finish_reason == "length"
        num_input_tokens = len(final.prompt_token_ids)
        usage = {"input_tokens": num_input_tokens, "input_tokens_details": {"cached_tokens": final.num_cached_tokens or 0},
                 "output_tokens": num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": num_input_tokens + num_output_tokens}  # fmt: skip
        return {**base, "status": "incomplete" if incomplete else "completed", "output": output, "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None}  # fmt: skip

    def _logprobs(self, chat_request: ChatCompletionRequest, c: CompletionOutput) -> list[dict[str, Any]] | None:
        """The tokens' logprobs (None unless asked for), the chat route's entries: each token's text,
        logprob, bytes and top_logprobs."""
        logprobs = self.chat.choice_logprobs(chat_request, c)
        return None if logprobs is None else logprobs["content"]

    @staticmethod
    def _items(prepared: PreparedChat, c: CompletionOutput, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """A whole output's items: its reasoning, its text (with every output token's logprobs, as
        vLLM), its calls (the chat parsers read them)."""
        reasoning, content, calls = (None, c.text, []) if prepared.make is None else prepared.make().parse(c.text)
        items = [reasoning_item(new_id("rs"), reasoning)] if reasoning else []
        if content:
            items.append(message_item(new_id("msg"), content, logprobs=logprobs))
        items += [function_call_item(new_id("fc"), new_id("call"), call.function.name, call.function.arguments)
                  for call in calls]  # fmt: skip
        return items

    async def _events(self, request: ResponsesRequest, chat_request: ChatCompletionRequest, base: dict[str, Any],
                      group: RequestGroup, prepared: PreparedChat, conversation: list[dict[str, Any]]
                      ) -> AsyncIterator[str]:  # fmt: skip
        """response.created and .in_progress, the items' events as the output is parsed, then
        response.completed with the whole response; a failed step ends it with an ``error`` event."""
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            data = msgspec.json.encode({"type": kind, "sequence_number": next(numbers), **fields}).decode()
            return f"event: {kind}\ndata: {data}\n\n"

        yield event("response.created", response=base)
        yield event("response.in_progress", response=base)
        items = StreamedItems(event, request.output_logprobs)
        parser = prepared.make() if prepared.make is not None else None
        final, finish_reason, num_output_tokens = None, None, 0
        try:
            async for _, out in group:
                final = out
                for c in out.outputs:
                    num_output_tokens += len(c.token_ids)
                    items.logprobs += self._logprobs(chat_request, c) or []
                    finish_reason = c.finish_reason or finish_reason
                    if parser is None:
                        delta = DeltaMessage(content=c.text) if c.text else None
                    else:
                        delta = parser.delta(c.text, final=c.finish_reason is not None)
                    for text in items.feed(delta) if delta is not None else []:
                        yield text
            for text in items.close():
                yield text
            assert final is not None
            response = self._finish(base, items.done, finish_reason, final, num_output_tokens)
            self._keep(request, response, conversation)
            yield event("response.completed", response=response)
        except Exception as exc:
            yield event("error", code=type(exc).__name__, message=str(exc), param=None)


class StreamedItems:
    """A stream's output items, each opened (``output_item.added``) as the parsed deltas reach it and
    closed (its ``.done`` events) when the next begins or the output ends; ``done``: the closed items."""

    def __init__(self, event: Event, with_logprobs: bool = False) -> None:
        self.event, self.with_logprobs = event, with_logprobs
        self.done: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None  # the open one
        self.text = ""  # its text (or a call's arguments) so far
        self.logprobs: list[dict[str, Any]] = []  # of the tokens read, not sent yet (the next text delta takes them)
        self.sent: list[dict[str, Any]] = []  # those the open message's deltas sent

    def feed(self, delta: DeltaMessage) -> list[str]:
        out = []
        if delta.reasoning:
            out += self._text("reasoning", delta.reasoning)
        if delta.content:
            out += self._text("message", delta.content)
        for call in delta.tool_calls:
            if call.function is not None and call.function.name is not None:  # (a call's first delta)
                out += self.close() + self._open(function_call_item(new_id("fc"), new_id("call"), call.function.name,
                                                                    "", "in_progress"))  # fmt: skip
            if call.function is not None and call.function.arguments:
                self.text += call.function.arguments
                out.append(self._event("response.function_call_arguments.delta", delta=call.function.arguments))
        return out

    def close(self) -> list[str]:
        """The open item's ``.done`` events."""
        item, text = self.item, self.text
        if item is None:
            return []
        if item["type"] == "function_call":
            done = {**item, "arguments": text, "status": "completed"}
            out = [self._event("response.function_call_arguments.done", arguments=text, name=item["name"])]
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            out = [self._event("response.reasoning_text.done", content_index=0, text=text),
                   self._event("response.content_part.done", content_index=0, part=done["content"][0])]  # fmt: skip
        else:  # (the tokens read since its last delta, e.g. the end of text's, are the message's too)
            self.sent, self.logprobs = self.sent + self.logprobs, []
            done = message_item(item["id"], text, logprobs=self.sent if self.with_logprobs else None)
            out = [self._event("response.output_text.done", content_index=0, text=text, logprobs=self.sent),
                   self._event("response.content_part.done", content_index=0, part=done["content"][0])]  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=len(self.done), item=done))
        self.done.append(done)
        self.item, self.text, self.sent = None, "", []
        return out

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.item is None or self.item["type"] != kind:
            make = reasoning_item if kind == "reasoning" else message_item
            out = self.close() + self._open(make(new_id("rs" if kind == "reasoning" else "msg"), None, "in_progress"))
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text("", [])
            out.append(self._event("response.content_part.added", content_index=0, part=part))
        self.text += text
        if kind == "reasoning":
            out.append(self._event("response.reasoning_text.delta", content_index=0, delta=text))
        else:
            logprobs, self.logprobs = self.logprobs, []
            self.sent += logprobs
            out.append(self._event("response.output_text.delta", content_index=0, delta=text, logprobs=logprobs))
        return out

    def _open(self, item: dict[str, Any]) -> list[str]:
        self.item = item
        return [self.event("response.output_item.added", output_index=len(self.done), item=item)]

    def _event(self, kind: str, **fields: Any) -> str:
        """An event of the open item."""
        assert self.item is not None
        return self.event(kind, item_id=self.item["id"], output_index=len(self.done), **fields)
