"""vLLM's request fields that shape the prompt: chat's ``documents`` and ``reasoning_effort``
(handed to the chat template) and ``add_special_tokens`` (completions: true by default, chat:
false, the template writing its own), seen in the prompt's token ids (``return_token_ids``)."""
from __future__ import annotations

import shutil

import httpx
import pytest

from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.entrypoints.openai.api_server import build_app

TEMPLATE = ("{% for d in documents or [] %}[{{ d.title }}]{% endfor %}{{ reasoning_effort or '' }}|"
            "{% for m in messages %}{{ m.content }}{% endfor %}")  # fmt: skip
BOS = 1  # "<|im_start|>", which the tokenizer below adds in front of a text it encodes


@pytest.fixture(scope="module")
def bos_dir(tiny_dir, tmp_path_factory):
    """The tiny model with a tokenizer that adds a BOS (as Llama's do)."""
    from tokenizers import Tokenizer, processors

    out = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(tiny_dir, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", BOS)])
    tok.save(str(out / "tokenizer.json"))
    return out


@pytest.fixture
async def http(bos_dir):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(bos_dir), served_model_name="tiny"))
    try:
        app = build_app(engine, trust_request_chat_template=True)  # (the requests bring their own template)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            yield client, engine.get_tokenizer()
    finally:
        await engine.shutdown()


async def test_documents_and_reasoning_effort_reach_the_template(http):
    client, tok = http
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": TEMPLATE,
            "return_token_ids": True, "documents": [{"title": "a", "text": "x"}, {"title": "b", "text": "y"}],
            "reasoning_effort": "high"}  # fmt: skip
    prompt = (await client.post("/v1/chat/completions", json=body)).json()["prompt_token_ids"]
    assert prompt == tok("[a][b]high|hi", add_special_tokens=False).input_ids  # (chat: no BOS of the tokenizer's)
    plain = (await client.post("/v1/chat/completions", json={**body, "documents": None, "reasoning_effort": None})).json()
    assert tok.decode(plain["prompt_token_ids"]) == "|hi"
    bad = await client.post("/v1/chat/completions", json={**body, "reasoning_effort": "extreme"})
    assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["message"]


async def test_add_special_tokens(http):
    client, tok = http
    assert tok("hi").input_ids[0] == BOS and tok("hi", add_special_tokens=False).input_ids[0] != BOS
    body = {"model": "tiny", "prompt": "hi there", "max_tokens": 1, "return_token_ids": True}
    default = (await client.post("/v1/completions", json=body)).json()["choices"][0]["prompt_token_ids"]
    without = (await client.post("/v1/completions", json={**body, "add_special_tokens": False, "echo": True})).json()
    assert default == tok("hi there").input_ids and default[0] == BOS
    assert without["choices"][0]["prompt_token_ids"] == default[1:] and without["choices"][0]["text"].startswith("hi there")
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": TEMPLATE,
            "return_token_ids": True}  # fmt: skip
    plain = (await client.post("/v1/chat/completions", json=chat)).json()["prompt_token_ids"]
    with_bos = (await client.post("/v1/chat/completions", json={**chat, "add_special_tokens": True})).json()["prompt_token_ids"]
    assert plain[0] != BOS and with_bos == [BOS, *plain]
