"""vLLM's stream interval: streamed outputs every N new tokens (``EngineArgs.stream_interval``,
raised per request by ``SamplingParams.stream_interval``), the first and the last at once."""
from __future__ import annotations

import json

import httpx
import pytest

from test_engine import assert_no_leaks
from vllmini import AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.cli import build_parser
from vllmini.entrypoints.openai.api_server import build_app

PROMPT = {"prompt_token_ids": [5, 17, 99, 342, 7]}


@pytest.fixture(scope="module")
def tiny_engine_args(tiny_dir):
    return lambda **kw: EngineArgs(model=str(tiny_dir), served_model_name="tiny", **kw)


async def stream(engine: AsyncLLMEngine, params: SamplingParams, prompt=PROMPT, request_id=None) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def test_outputs_come_every_n_tokens_first_and_last_at_once(tiny_engine_args):
    engine = AsyncLLMEngine.from_engine_args(tiny_engine_args(stream_interval=4))
    plain_engine = AsyncLLMEngine.from_engine_args(tiny_engine_args())
    try:
        want = (await stream(plain_engine, greedy(10)))[-1].outputs[0]
        delta = await stream(engine, greedy(10, output_kind="delta"))
        assert [len(o.outputs[0].token_ids) for o in delta] == [1, 4, 4, 1]
        assert [t for o in delta for t in o.outputs[0].token_ids] == list(want.token_ids)
        assert "".join(o.outputs[0].text for o in delta) == want.text and delta[-1].finished
        cumulative = await stream(engine, greedy(10))
        assert [len(o.outputs[0].token_ids) for o in cumulative] == [1, 5, 9, 10]
        # a request raises the engine's interval; one below it is clamped up to it
        assert [len(o.outputs[0].token_ids) for o in await stream(engine, greedy(12, stream_interval=5, output_kind="delta"))] == [1, 5, 5, 1]
        assert [len(o.outputs[0].token_ids) for o in await stream(engine, greedy(10, stream_interval=2, output_kind="delta"))] == [1, 4, 4, 1]
        # the one that stops comes at once, with the tokens since the last
        stop = want.token_ids[5]
        cut = want.token_ids[: want.token_ids.index(stop) + 1]
        stopped = await stream(engine, greedy(10, output_kind="delta", stop_token_ids=[stop]))
        assert [t for o in stopped for t in o.outputs[0].token_ids] == list(cut) and stopped[-1].finished
        assert stopped[-1].outputs[0].finish_reason == "stop"
        # n = 2: counted over its completions, each one's tokens all delivered
        params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=9, ignore_eos=True, output_kind="delta")
        got = await stream(engine, params)
        per_index = {i: sum(len(c.token_ids) for o in got for c in o.outputs if c.index == i) for i in (0, 1)}
        assert len(got) < 9 and per_index == {0: 9, 1: 9}
    finally:
        await engine.shutdown()
        await plain_engine.shutdown()
    assert_no_leaks(engine)


def test_bad_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="stream_interval must be an int >= 1"):
        SamplingParams(stream_interval=0)
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=1.5)
    with pytest.raises(ValueError, match="stream_interval must be a positive integer"):
        EngineArgs(stream_interval=0).validate()
    assert build_parser().parse_args(["serve", "--stream-interval", "8"]).stream_interval == 8


async def test_server_streams_fewer_larger_chunks(tiny_engine_args):
    engine = AsyncLLMEngine.from_engine_args(tiny_engine_args(stream_interval=3))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as http:
            body = {"model": "tiny", "prompt": [5, 17, 99], "max_tokens": 7, "temperature": 0, "ignore_eos": True,
                    "stream": True, "logprobs": 0}  # fmt: skip
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                events = [line[6:] async for line in resp.aiter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        sizes = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"]]
        assert sizes == [1, 3, 3] and chunks[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        await engine.shutdown()
