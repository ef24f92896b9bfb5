"""Answers as vLLM 0.32's OpenAI server gives them, where a differential run against it (the same
requests to both, the default model, fp32) found vllmini's different: ``error.param``. The expected
values are vLLM's, written out: these tests need neither vLLM nor the network."""
from __future__ import annotations

import httpx
import pytest

from test_openai_server import wait_idle
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.entrypoints.openai.api_server import build_app

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=32 << 20,
                                                     served_model_name=NAME))  # fmt: skip
    yield eng
    eng.shutdown()


@pytest.fixture
def http(engine):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME)), base_url="http://test")


# (route, body, vLLM's error.param); None: vLLM names no field there
PARAMS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -2}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 5000}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": "x " * 2000}, "input_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "a"}, "body.max_tokens"),  # (vLLM's pydantic loc)
    ("/v1/completions", {"prompt": "x", "seed": "x"}, "body.seed"),
    ("/v1/completions", {"prompt": "x", "model": "zz"}, "model"),
    ("/v1/chat/completions", {"messages": "hi"}, "body.messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": []}, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "bogus",
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": {"type": "function", "function": {"name": "g"}},
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}}, "body.response_format.type"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "zz"}, "model"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 0, "n": 2}, None),
]


@pytest.mark.parametrize("path, body, param", PARAMS, ids=[f"{p[0][4:]}-{p[2]}-{i}" for i, p in enumerate(PARAMS)])
async def test_an_error_names_its_field_in_param_as_vllm(http, engine, path, body, param):
    r = await http.post(path, json={"max_tokens": 2, **body})
    error = r.json()["error"]
    assert r.status_code == (404 if param == "model" else 400) and error["param"] == param, r.text
    if param == "model":
        assert error["message"] == f"The model `zz` does not exist. Valid aliases: {NAME}."
    await wait_idle(engine)
