"""``POST /v1/embeddings`` on a ``--runner pooling`` server: answers equal the engine's own offline
``LLM.embed`` (floats and base64, through OpenAI's client too), the chat form, bad requests refused
naming the field with nothing leaked, and each runner's server refusing the other runner's routes."""
from __future__ import annotations

import base64
import re

import httpx
import numpy as np
import openai
import pytest

from helpers import vllmini_serve
from test_openai_server import wait_idle
from vllmini import LLM, AsyncLLMEngine, EngineArgs, PoolingParams
from vllmini.cli import _engine_args, build_parser
from vllmini.entrypoints.openai.api_server import build_app

KV = 16 << 20
NAME = "tiny-embed"
ARGS = dict(runner="pooling", kv_cache_memory=KV, max_model_len=64, max_num_batched_tokens=32, served_model_name=NAME)
TEXTS = ["The capital of France is Paris.", "Hi", "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), **ARGS))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(model=str(tiny_dir), **ARGS)


def client_of(engine) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME)), base_url="http://test")


@pytest.fixture
def http(engine):
    return client_of(engine)


def expected(offline, prompts, **params) -> list[np.ndarray]:
    outs = offline.embed(prompts, pooling_params=PoolingParams(**params), use_tqdm=False)
    return [np.array(o.outputs.embedding, dtype=np.float32) for o in outs]


def assert_embeddings(got: list, want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float32), w, atol=1e-5)


async def test_text_and_token_inputs_equal_the_offline_engine(http, engine, offline):
    tok = offline.get_tokenizer()
    ids = [tok(t).input_ids for t in TEXTS]
    body = (await http.post("/v1/embeddings", json={"model": NAME, "input": TEXTS})).json()
    assert body["object"] == "list" and body["model"] == NAME and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"embedding"}
    assert_embeddings([d["embedding"] for d in body["data"]], expected(offline, TEXTS))
    total = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                             "prompt_tokens_details": None}  # fmt: skip
    one = (await http.post("/v1/embeddings", json={"input": TEXTS[0]})).json()  # model may be left out
    by_ids = (await http.post("/v1/embeddings", json={"model": NAME, "input": ids})).json()
    single_ids = (await http.post("/v1/embeddings", json={"model": NAME, "input": ids[2]})).json()
    assert_embeddings([one["data"][0]["embedding"]], expected(offline, TEXTS[:1]))
    assert_embeddings([d["embedding"] for d in by_ids["data"]], expected(offline, TEXTS))
    assert_embeddings([single_ids["data"][0]["embedding"]], expected(offline, TEXTS[2:]))
    # vLLM's extras: normalize, truncate_prompt_tokens, add_special_tokens
    raw = (await http.post("/v1/embeddings", json={"input": TEXTS[:1], "normalize": False,
                                                    "truncate_prompt_tokens": 4})).json()  # fmt: skip
    assert raw["usage"]["prompt_tokens"] == 4
    assert_embeddings([raw["data"][0]["embedding"]], expected(offline, TEXTS[:1], normalize=False, truncate_prompt_tokens=4))
    # vLLM 0.32's truncation_side: the first tokens kept ("right", its pooling default), or the last ("left")
    for side, kept in ((None, ids[0][:4]), ("right", ids[0][:4]), ("left", ids[0][-4:])):
        cut = (await http.post("/v1/embeddings", json={"input": TEXTS[:1], "truncate_prompt_tokens": 4,
                                                        "truncation_side": side})).json()  # fmt: skip
        assert_embeddings([cut["data"][0]["embedding"]], expected(offline, [kept]))
    bad = await http.post("/v1/embeddings", json={"input": "Hi", "truncate_prompt_tokens": 1, "truncation_side": "up"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation_side"
    await wait_idle(engine)


async def test_base64_is_little_endian_float32_and_openais_client_reads_it(http, engine, offline):
    want = expected(offline, TEXTS)
    body = (await http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"})).json()
    assert_embeddings([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]], want)
    client = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http, max_retries=0)
    default = await client.embeddings.create(model=NAME, input=TEXTS)  # (the client asks for base64)
    floats = await client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    assert_embeddings([d.embedding for d in default.data], want)
    assert_embeddings([d.embedding for d in floats.data], want)
    assert default.usage.prompt_tokens == default.usage.total_tokens == body["usage"]["prompt_tokens"]
    with pytest.raises(openai.BadRequestError, match="dimensions=8: this model does not support matryoshka"):
        await client.embeddings.create(model=NAME, input=TEXTS, dimensions=8)
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model="other", input=TEXTS)
    await wait_idle(engine)


async def test_the_chat_form_goes_through_the_template(http, engine, offline):
    messages = [{"role": "user", "content": "What is an embedding?"}]
    body = (await http.post("/v1/embeddings", json={"model": NAME, "messages": messages})).json()
    tok = offline.get_tokenizer()
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False), add_special_tokens=False).input_ids
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert_embeddings([body["data"][0]["embedding"]], expected(offline, [ids]))
    await wait_idle(engine)


@pytest.mark.parametrize("body, field", [
    ({"input": ""}, "input is an empty string"),
    ({"input": []}, "input must be"),
    ({"input": ["ok", ""]}, r"input\[1\] is an empty string"),
    ({"input": [[1, 2], [3, 49152]]}, r"input\[1\] has token ids outside the vocabulary"),
    ({"input": [1, "a"]}, "input"),
    ({"input": list(range(100, 180))}, "maximum context length is 64 tokens. However, you requested 80 tokens"),
    ({"input": "Hi", "encoding_format": "bytes"}, r"encoding_format"),
    ({"input": "Hi", "dimensions": 0}, "dimensions must be a positive integer"),
    ({"input": "Hi", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens=65 exceeds max_model_len"),
    ({"input": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, "exactly one of input and messages"),
    ({"model": NAME}, "exactly one of input and messages"),
    ({"input": "Hi", "normalize": "yes"}, r"\$.normalize"),
])  # fmt: skip
async def test_bad_requests_are_400s_naming_the_field(http, engine, body, field):
    response = await http.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert re.search(field, error["message"]), error["message"]
    ok = await http.post("/v1/embeddings", json={"input": "still served"})  # others are unaffected
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 64
    await wait_idle(engine)  # (no KV block leaked)


async def test_each_runner_refuses_the_other_runners_routes(http, engine, tiny_dir):
    for path, body, api in [("/v1/completions", {"prompt": "Hi"}, "Completions API"),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
                             "Chat Completions API")]:  # fmt: skip
        response = await http.post(path, json=body)
        assert response.status_code == 404 and f"does not support the {api}" in response.json()["error"]["message"]
    assert (await http.post("/tokenize", json={"prompt": "Hi"})).json()["count"] > 0  # (still served)
    generating = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV, served_model_name=NAME))
    try:
        async with client_of(generating) as gen_http:
            response = await gen_http.post("/v1/embeddings", json={"input": "Hi"})
            assert response.status_code == 404 and "--runner pooling" in response.json()["error"]["message"]
            completion = await gen_http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert completion.status_code == 200
    finally:
        await generating.shutdown()
    await wait_idle(engine)


def test_vllmini_serve_takes_the_runner_and_pooler_flags():
    ns = build_parser().parse_args(["serve", "m", "--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}'])
    args = _engine_args(ns)
    assert args.runner == "pooling" and args.pooler_config == '{"pooling_type": "MEAN"}'
    args.validate()  # the JSON is read as a PoolerConfig
    bad = _engine_args(build_parser().parse_args(["serve", "m", "--pooler-config", '{"pooling_type": "MAX"}']))
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        bad.validate()


def test_vllmini_serve_runner_pooling_answers_openais_client(tiny_dir, offline):
    """As a user runs it: ``vllmini serve MODEL --runner pooling``, OpenAI's client, then Ctrl-C."""
    with vllmini_serve(str(tiny_dir), "--served-model-name", "e", "--runner", "pooling", "--kv-cache-memory", str(KV),
                       "--max-model-len", "64") as url:  # fmt: skip
        with openai.OpenAI(api_key="none", base_url=url + "/v1", max_retries=0) as c:
            out = c.embeddings.create(model="e", input=TEXTS)
            assert_embeddings([d.embedding for d in out.data], expected(offline, TEXTS))
            with pytest.raises(openai.NotFoundError, match="does not support the Completions API"):
                c.completions.create(model="e", prompt="hi", max_tokens=4)
