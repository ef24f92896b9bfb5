"""Streamed chunks have vLLM's shapes. A chat's: the role chunk (content ""), then with ``echo``
a chunk of its own per choice carrying the continued message; a decode step without new text
sends ``{"content": ""}`` (``{}`` only for a parser's silent last step), a prefill step nothing;
``stop_reason`` only with the finish; the role chunk waits for the first output, so a failed
first step is the stream's first event. A completion's: a prefill step sends nothing (unless
the prompt is echoed then)."""
from __future__ import annotations

import pytest

import test_openai_stream_choices
from test_openai_server import NAME, events, wait_idle
from test_openai_stream_choices import http
from vllmini.engine.outputs import CompletionOutput, RequestOutput
from vllmini.entrypoints.openai import serving_chat, serving_completion

HI = [{"role": "user", "content": "hi"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
engine = test_openai_stream_choices.engine  # (its module's engine fixture, one for this module too)


def choices(chunks: list[dict]) -> list[dict]:
    """Each chunk's one choice."""
    assert all(len(chunk["choices"]) == 1 for chunk in chunks)
    return [chunk["choices"][0] for chunk in chunks]


@pytest.mark.parametrize("said", ["Well,", [{"type": "text", "text": "Well,"}, {"type": "text", "text": "so"}]])
async def test_a_streamed_echo_comes_after_the_role_a_chunk_per_choice(engine, said):
    """(Content parts echo as vLLM's: their texts joined with newlines, whole and streamed.)"""
    echoed = said if isinstance(said, str) else "Well,\nso"
    body = {"model": NAME, "messages": [*HI, {"role": "assistant", "content": said}], **CONTINUE, "echo": True,
            "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 5, "ignore_eos": True}  # fmt: skip
    async with http(engine) as h:
        whole = (await h.post("/v1/chat/completions", json=body)).json()
        got = choices(events((await h.post("/v1/chat/completions", json={**body, "stream": True})).text))
    assert got[:4] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None},
        {"index": 1, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None},
    ]
    for choice in whole["choices"]:
        streamed = "".join(c["delta"].get("content", "") for c in got if c["index"] == choice["index"])
        assert streamed == choice["message"]["content"] and streamed.startswith(echoed)  # seeded: the same samples
    await wait_idle(engine)


async def test_no_echo_chunk_unless_the_last_message_has_the_answers_role(engine):
    body = {"model": NAME, "messages": HI, "echo": True, "max_tokens": 3, "ignore_eos": True, "stream": True}
    async with http(engine) as h:
        got = choices(events((await h.post("/v1/chat/completions", json=body)).text))
    assert got[0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["delta"] and c["delta"].get("content") != "hi" for c in got[1:])
    await wait_idle(engine)


def out(text: str, token_ids: list[int], finish_reason: str | None = None, stop_reason: str | None = None):
    return RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(0, text, token_ids, None, None, finish_reason,
                                                                       stop_reason)], finish_reason is not None)  # fmt: skip


class FakeGroup:
    """The engine's outputs for one chat request, as given (an exception: a failed step)."""

    def __init__(self, outputs: list) -> None:
        self.outputs = outputs

    async def __aiter__(self):
        for item in self.outputs:
            if isinstance(item, Exception):
                raise item
            yield 0, item

    async def close(self) -> None:
        pass


async def streamed(engine, monkeypatch, outputs: list, route: str = "chat/completions", body: dict | None = None,
                   **options) -> list[dict]:  # fmt: skip
    """The events of a streamed request whose engine outputs are ``outputs``."""
    async def start(*args, **kwargs):
        return FakeGroup(outputs)

    for module in (serving_chat, serving_completion):
        monkeypatch.setattr(module.RequestGroup, "start", start)
    body = {"model": NAME, "max_tokens": 8, "stream": True, **(body or {"messages": HI})}
    async with http(engine, **options) as h:
        return events((await h.post(f"/v1/{route}", json=body)).text)


PREFILL, SILENT, HI_THERE = out("", []), out("", [5]), out("Hi", [6])


async def test_a_step_without_text_sends_an_empty_content_and_a_prefill_step_nothing(engine, monkeypatch):
    got = choices(await streamed(engine, monkeypatch, [PREFILL, SILENT, HI_THERE, out("", [7], "stop", "\n")]))
    assert got == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None, "token_ids": None},
        {"index": 0, "delta": {"content": "Hi"}, "logprobs": None, "finish_reason": None, "token_ids": None},
        {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": "stop", "stop_reason": "\n",
         "token_ids": None},
    ]


async def test_with_a_parser_a_silent_step_is_unsent_and_a_silent_finish_is_an_empty_delta(engine, monkeypatch):
    got = choices(await streamed(engine, monkeypatch, [PREFILL, SILENT, HI_THERE, out("", [7], "length")],
                                 reasoning_parser="qwen3"))  # fmt: skip
    assert [c["delta"] for c in got[1:]] == [{"content": "Hi"}, {}]
    assert got[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "stop_reason": None,
                       "token_ids": None}


async def test_a_failed_first_step_is_the_streams_first_event(engine, monkeypatch):
    (error,) = await streamed(engine, monkeypatch, [RuntimeError("the step failed")])
    assert error["error"]["message"] == "the step failed"


@pytest.mark.parametrize("echo", [False, True])
async def test_a_completions_prefill_step_sends_nothing_unless_echoed(engine, monkeypatch, echo):
    prompt = {"prompt": [1, 2, 3], "echo": echo}
    got = choices(await streamed(engine, monkeypatch, [PREFILL, HI_THERE, out("", [7], "length")], "completions", prompt))
    texts = [(c["text"], c["finish_reason"]) for c in got]
    assert texts[-2:] == [("Hi", None), ("", "length")] and len(texts) == 2 + echo
    if echo:  # (the prompt's text comes with its first output)
        assert texts[0][0] != "" and "Hi" not in texts[0][0]
