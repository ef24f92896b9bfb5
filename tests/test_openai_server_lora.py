"""LoRA adapters in the OpenAI-compatible server, as vLLM's: a request's ``model`` names the
adapter it runs with (answers equal ``LLM.generate`` / ``LLM.chat`` with the same LoRARequest),
``/v1/models`` lists them, ``--lora-modules`` fails start-up naming a bad one, and the runtime
load/unload routes exist only when the environment allows them."""
from __future__ import annotations

import httpx
import openai
import pytest

from helpers import save_tiny_lora
from test_openai_server import events, wait_idle
from vllmini import LLM, AsyncLLMEngine, EngineArgs, LoRARequest, SamplingParams
from vllmini.cli import main
from vllmini.entrypoints.openai.api_server import build_app
from vllmini.entrypoints.openai.serving_models import RUNTIME_LORA_ENV, LoRAModulePath, parse_lora_module

KV = 64 << 20
NAME = "tiny"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def paths(tiny_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {name: save_tiny_lora(tiny_dir, root / name, seed) for seed, name in enumerate(["a1", "a2", "a3"], start=1)}


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV, dtype="float32",
                                                     enable_lora=True, max_loras=2, served_model_name=NAME))  # fmt: skip
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(model=str(tiny_dir), kv_cache_memory=KV, dtype="float32", enable_lora=True, max_loras=2)


def static(paths) -> list[LoRAModulePath]:
    """``--lora-modules a1=... a2=...``: ids 1 and 2, as the server gives them in order."""
    return [LoRAModulePath("a1", paths["a1"]), LoRAModulePath("a2", paths["a2"])]


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.fixture(scope="module")
def expected(offline, paths) -> dict[str, tuple[str, str]]:
    """Per served name, the greedy completion and chat answer of ``LLM`` with the same adapter."""
    loras = {NAME: None, "a1": LoRARequest("a1", 1, paths["a1"]), "a2": LoRARequest("a2", 2, paths["a2"])}
    out = {}
    for name, lora in loras.items():
        text = offline.generate("The capital of France is", GREEDY, use_tqdm=False, lora_request=lora)[0]
        chat = offline.chat(MESSAGES, GREEDY, use_tqdm=False, lora_request=lora)[0]
        out[name] = (text.outputs[0].text, chat.outputs[0].text)
    return out


@pytest.fixture(scope="module")
def app(engine, paths):
    """One app for the module (its adapters loaded once, ids 1 and 2)."""
    return build_app(engine, NAME, lora_modules=static(paths))


@pytest.fixture
def http(app):
    return client_of(app)


async def test_completions_and_chats_through_an_adapter_equal_llm(http, engine, expected):
    client = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http, max_retries=0)
    assert len({texts for texts in expected.values()}) == 3, "the adapters must change the greedy output"
    for name, (text, chat) in expected.items():
        out = await client.completions.create(model=name, prompt="The capital of France is", max_tokens=12,
                                              temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert out.choices[0].text == text and out.model == name
        answer = await client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=12, temperature=0,
                                                      extra_body={"ignore_eos": True})  # fmt: skip
        assert answer.choices[0].message.content == chat and answer.model == name
    body = {"model": "a2", "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = events((await http.post("/v1/chat/completions", json=body)).text)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == expected["a2"][1]
    assert {c["model"] for c in chunks} == {"a2"}
    await wait_idle(engine)


async def test_adapters_side_by_side_in_one_batch(http, engine, expected):
    """Concurrent requests of the base model and two adapters (max_loras=2) share steps."""
    import asyncio

    async def one(name: str) -> str:
        body = {"model": name, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        return (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]

    names = [NAME, "a1", "a2"] * 2
    assert await asyncio.gather(*(one(n) for n in names)) == [expected[n][0] for n in names]
    await wait_idle(engine)


async def test_models_lists_the_base_then_each_adapter(http, paths, engine):
    data = (await http.get("/v1/models")).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in data] == [
        (NAME, str(engine.engine.model_dir), None), ("a1", paths["a1"], NAME), ("a2", paths["a2"], NAME)]
    assert data[0]["max_model_len"] == engine.engine.max_model_len
    missing = await http.post("/v1/completions", json={"model": "a9", "prompt": "x", "max_tokens": 2})
    assert missing.status_code == 404 and "a9" in missing.json()["error"]["message"]


def test_lora_modules_items_as_vllm_parses_them():
    assert parse_lora_module("a=/x/y") == LoRAModulePath("a", "/x/y")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') == LoRAModulePath("a", "/x", "m")
    for bad in ["nopath", "=/x", '{"name": "a"}', '{"name": "a", "path": "/x", "rank": 8}', "{not json"]:
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)


def test_bad_adapters_stop_start_up_naming_the_module(engine, paths, tmp_path):
    with pytest.raises(ValueError, match="--lora-modules bad=/no/such/adapter: .*not an adapter folder"):
        build_app(engine, NAME, lora_modules=[LoRAModulePath("bad", "/no/such/adapter")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--lora-modules empty=.*adapter_config.json"):
        build_app(engine, NAME, lora_modules=[LoRAModulePath("a1", paths["a1"]), LoRAModulePath("empty", str(tmp_path / "empty"))])
    with pytest.raises(ValueError, match="given twice"):
        build_app(engine, NAME, lora_modules=[LoRAModulePath("a1", paths["a1"])] * 2)
    with pytest.raises(ValueError, match="base model's served name"):
        build_app(engine, NAME, lora_modules=[LoRAModulePath(NAME, paths["a1"])])


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "--lora-modules a: the name is given twice"),
    (["--enable-lora", "--lora-modules", "a"], "expected NAME=PATH"),
])  # fmt: skip
def test_vllmini_serve_refuses_lora_flags_before_the_model_loads(tiny_dir, capsys, flags, message):
    assert main(["serve", str(tiny_dir), *flags]) == 2
    assert message in capsys.readouterr().err


async def test_runtime_load_and_unload_when_the_environment_allows(engine, paths, offline, monkeypatch):
    assert (await http_post(build_app(engine, NAME), "/v1/load_lora_adapter", {})).status_code == 404  # no route
    monkeypatch.setenv(RUNTIME_LORA_ENV, "true")
    async with client_of(build_app(engine, NAME, lora_modules=static(paths))) as http:
        load = {"lora_name": "a3", "lora_path": paths["a3"]}
        r = await http.post("/v1/load_lora_adapter", json=load)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain") and "a3" in r.text
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == [NAME, "a1", "a2", "a3"]
        ref = offline.generate("Hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("a3", 3, paths["a3"]))[0]
        body = {"model": "a3", "prompt": "Hi", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"] == ref.outputs[0].text
        for bad in [load, {"lora_name": NAME, "lora_path": paths["a3"]}, {"lora_name": "x", "lora_path": "/no/such"},
                    {"lora_name": "x"}]:  # fmt: skip
            r = await http.post("/v1/load_lora_adapter", json=bad)
            assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError", r.text
        r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})
        assert r.status_code == 200 and "a3" in r.text and 3 not in engine.engine.list_loras()
        assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"})).status_code == 404
        assert (await http.post("/v1/completions", json=body)).status_code == 404
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == [NAME, "a1", "a2"]
        # a1 was pushed out of the engine's max_cpu_loras (2) by a3: it is read again when asked for
        r = await http.post("/v1/completions", json={**body, "model": "a1", "prompt": "The capital of France is"})
        assert r.status_code == 200
    await wait_idle(engine)


async def http_post(app, path: str, body: dict) -> httpx.Response:
    async with client_of(app) as http:
        return await http.post(path, json=body)


async def test_metrics_name_the_adapters_of_running_requests(http, engine, paths):
    from prometheus_client.parser import text_string_to_metric_families

    def lora_info(text: str) -> dict[str, str]:
        (sample,) = [s for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "vllm:lora_requests_info"]  # fmt: skip
        return sample.labels

    stream = await engine.add_request(None, "Count:", SamplingParams(max_tokens=500, ignore_eos=True),
                                      lora_request=LoRARequest("a1", 1, paths["a1"]))  # fmt: skip
    await anext(stream)  # (its first output: it runs)
    labels = lora_info((await http.get("/metrics")).text)
    assert labels == {"max_lora": "2", "running_lora_adapters": "a1", "waiting_lora_adapters": ""}
    await stream.aclose()
    await wait_idle(engine)
    assert lora_info((await http.get("/metrics")).text)["running_lora_adapters"] == ""
