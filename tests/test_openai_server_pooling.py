"""``POST /pooling`` on a ``--runner pooling`` server: vLLM's request (``input`` or ``messages``,
``task``, ``encoding_format``, ...) and response (``data: [{index, object, data}]``); the token
tasks equal transformers' hidden states / token-classification logits, the sequence tasks the
other routes' answers; bad requests are 400s naming the field with nothing leaked, and a
generating server answers 404."""
from __future__ import annotations

import base64
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from helpers import save_tiny_classifier
from test_openai_server import wait_idle
from test_openai_server_score import KV, NAME, TEXTS, client_of, start_engines
from vllmini import AsyncLLMEngine, EngineArgs


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_dir, tiny_dir):
    """name -> (folder, transformers model): the tiny embedding model and a token classifier."""
    tagger = save_tiny_classifier("qwen2", tmp_path_factory.mktemp("srv_tok"), default_model_dir, 3, seed=6, head="Token")
    return {"embed": (tiny_dir, AutoModel.from_pretrained(tiny_dir).eval()), "tagger": tagger}


@pytest.fixture(scope="module")
def engines(models):
    yield from start_engines(models)


def assert_close(got, want: torch.Tensor, what: str) -> None:
    got = torch.tensor(got, dtype=torch.float32)
    assert got.shape == want.shape and (got - want).abs().max().item() < 1e-4, what


async def test_pooling_gives_each_tokens_hidden_state_by_default(models, engines):
    _, hf = models["embed"]
    async with client_of(engines["embed"]) as http:
        response = await http.post("/pooling", json={"model": NAME, "input": TEXTS})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list" and body["id"].startswith("pool-") and body["model"] == NAME
        assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "pooling") for i in range(len(TEXTS))]
        ids = [engines["embed"].engine.tokenizer(t).input_ids for t in TEXTS]
        assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
        for i, (d, tokens) in enumerate(zip(body["data"], ids)):
            with torch.no_grad():
                h = hf(torch.tensor([tokens])).last_hidden_state[0].float()
            assert_close(d["data"], F.normalize(h, dim=-1), f"text {i}")
        # base64: the float32 bytes, row after row; the embed task: the /v1/embeddings vector
        packed = (await http.post("/pooling", json={"input": TEXTS[0], "encoding_format": "base64"})).json()
        rows = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4").reshape(len(ids[0]), -1)
        assert np.allclose(rows, np.array(body["data"][0]["data"], dtype=np.float32), atol=1e-6)
        embed = (await http.post("/pooling", json={"input": TEXTS[1], "task": "embed"})).json()["data"][0]["data"]
        want = (await http.post("/v1/embeddings", json={"input": TEXTS[1]})).json()["data"][0]["embedding"]
        assert embed == want
        chat = await http.post("/pooling", json={"messages": [{"role": "user", "content": "Hi"}], "normalize": False})
        assert chat.status_code == 200 and len(chat.json()["data"]) == 1
    await wait_idle(engines["embed"])


async def test_pooling_classifies_each_token_as_transformers(models, engines):
    _, hf = models["tagger"]
    async with client_of(engines["tagger"]) as http:
        probs = (await http.post("/pooling", json={"input": TEXTS[:2]})).json()["data"]
        logits = (await http.post("/pooling", json={"input": [TEXTS[0]], "task": "token_classify",
                                                    "use_activation": False})).json()["data"]  # fmt: skip
    for i, d in enumerate(probs):
        tokens = engines["tagger"].engine.tokenizer(TEXTS[i]).input_ids
        with torch.no_grad():
            want = hf(torch.tensor([tokens])).logits[0].float()
        assert_close(d["data"], want.softmax(-1), f"text {i} probabilities")
        if i == 0:
            assert_close(logits[0]["data"], want, "logits")
    await wait_idle(engines["tagger"])


@pytest.mark.parametrize("model, body, field", [
    ("embed", {"input": "Hi", "task": "classify"}, r"task='classify' is not supported by /pooling for this model; "
                                                   r"supported: \['embed', 'token_embed'\]"),
    ("embed", {"input": "Hi", "task": "bogus"}, "task='bogus' is not supported"),
    ("embed", {"input": "Hi", "task": 3}, r"\$.task"),
    ("embed", {"input": "Hi", "task": "token_embed", "dimensions": 8}, "does not support matryoshka"),
    ("embed", {}, "set exactly one of input and messages"),
    ("embed", {"input": []}, "input must be"),
    ("embed", {"input": ["ok", ""]}, r"input\[1\] is an empty string"),
    ("embed", {"input": "Hi", "encoding_format": "float16"}, r"\$.encoding_format"),
    ("embed", {"input": list(range(100, 180))}, "maximum context length is 64 tokens"),
    ("tagger", {"input": "Hi", "dimensions": 2}, "dimensions: the token_classify task does not take it"),
    ("tagger", {"input": "Hi", "task": "score"}, r"task='score' is not supported .*\(pairs are scored by /score\)"),
    ("tagger", {"input": "Hi", "use_activation": True, "softmax": False}, "disagree"),
])  # fmt: skip
async def test_bad_pooling_requests_are_400s_naming_the_field(engines, model, body, field):
    engine = engines[model]
    async with client_of(engine) as http:
        response = await http.post("/pooling", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "BadRequestError" and re.search(field, error["message"]), error["message"]
        assert (await http.post("/pooling", json={"input": "ok"})).status_code == 200  # (others are unaffected)
    await wait_idle(engine)  # (no KV block leaked)


async def test_a_generating_server_answers_pooling_404(tiny_dir):
    generating = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV, served_model_name=NAME))
    try:
        async with client_of(generating) as http:
            response = await http.post("/pooling", json={"input": "a"})
            assert response.status_code == 404, response.text
            assert "Pooling API" in response.json()["error"]["message"]
            assert "--runner pooling" in response.json()["error"]["message"]
    finally:
        await generating.shutdown()
