"""vLLM's ``skip_tokenizer_init=True``: an engine over a model folder with no tokenizer files at all
takes token-id prompts and gives token ids (text "", logprobs' decoded_token None, as
``detokenize=False``), the same tokens as transformers and as an engine with the tokenizer; what
needs a tokenizer is refused by name (a 400 on the server) and leaks nothing."""
from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
from transformers import LlamaForCausalLM

from helpers import TOKENIZER_FILES, assert_greedy_matches, hf_greedy
from test_engine import assert_no_leaks
from vllmini import (LLM, AsyncLLMEngine, BeamSearchParams, EngineArgs, PoolingParams, SamplingParams,
                     StructuredOutputsParams)  # fmt: skip
from vllmini.entrypoints.openai.api_server import build_app

KV = 1 << 24
PROMPTS = [[5, 17, 300, 42, 9, 1200, 77, 3], [8, 8, 1000, 3], [31, 4, 15, 92, 65, 35, 89, 79, 32, 38, 46]]
TOKENIZER_NAMES = (*TOKENIZER_FILES, "tokenizer.model", "vocab.json", "merges.txt")


@pytest.fixture(scope="module")
def bare_dir(tiny_dir, tmp_path_factory):
    """tiny_dir's config and weights, without any tokenizer file."""
    out = tmp_path_factory.mktemp("bare")
    for path in tiny_dir.iterdir():
        if path.name not in TOKENIZER_NAMES:
            shutil.copy(path, out / path.name)
    assert not [p.name for p in out.iterdir() if p.name in TOKENIZER_NAMES or "token" in p.name]
    return out


@pytest.fixture(scope="module")
def llm(bare_dir):
    return LLM(str(bare_dir), skip_tokenizer_init=True, kv_cache_memory=KV)


@pytest.fixture(scope="module")
def with_tokenizer(tiny_dir):
    return LLM(str(tiny_dir), kv_cache_memory=KV)


def as_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def test_the_folder_has_no_tokenizer_and_the_engine_loads_none(bare_dir, llm):
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        LLM(str(bare_dir), kv_cache_memory=KV)
    assert llm.llm_engine.tokenizer is None
    with pytest.raises(ValueError, match="^Unable to get tokenizer because skip_tokenizer_init is True$"):
        llm.get_tokenizer()


def test_greedy_tokens_equal_transformers(bare_dir, llm):
    hf = LlamaForCausalLM.from_pretrained(bare_dir).eval()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(as_prompts(PROMPTS), params, use_tqdm=False)):
        theirs, gaps = hf_greedy(hf, prompt, 16)
        assert_greedy_matches(list(out.outputs[0].token_ids), theirs, gaps, f"prompt {prompt}")
        assert out.outputs[0].text == "" and out.prompt is None and out.prompt_token_ids == prompt


def test_eos_comes_from_the_model_config(llm, with_tokenizer):
    """The same EOS ids as from the tokenizer; an EOS stops (its id the stop_reason, as vLLM's
    generation-config EOS without a tokenizer), after min_tokens."""
    eos = with_tokenizer.llm_engine.eos_token_ids
    assert llm.llm_engine.eos_token_ids == eos
    params = SamplingParams(max_tokens=8, temperature=0, logit_bias={eos[0]: 100.0})
    out = llm.generate(as_prompts(PROMPTS[:1]), params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos[0]], "stop", eos[0])
    out = llm.generate(as_prompts(PROMPTS[:1]), params.clone(min_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos[0] and out.finish_reason == "stop"


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2),
    SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=3, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                   logit_bias={77: 4.0, 300: -50.0}, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.7, seed=3, allowed_token_ids=[3, 9, 42, 77, 1200], ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0, logprob_token_ids=[3, 9], ignore_eos=True),
], ids=["logprobs", "n-seed", "penalties-bias", "allowed", "logprob-token-ids"])  # fmt: skip
def test_outputs_equal_an_engine_with_the_tokenizer_and_detokenize_false(llm, with_tokenizer, params):
    """Tokens, logprobs and finish reasons as with the tokenizer; text and decoded tokens exactly
    what SamplingParams(detokenize=False) gives there."""
    ours = llm.generate(as_prompts(PROMPTS), params, use_tqdm=False)
    theirs = with_tokenizer.generate(as_prompts(PROMPTS), params.clone(detokenize=False), use_tqdm=False)
    assert [[(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason) for c in o.outputs]
            for o in ours] == [[(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason)
                                for c in o.outputs] for o in theirs]  # fmt: skip
    assert [o.prompt_logprobs for o in ours] == [o.prompt_logprobs for o in theirs]
    assert all(c.text == "" for o in ours for c in o.outputs)
    if params.logprobs is not None:
        assert all(lp.decoded_token is None for o in ours for c in o.outputs for e in c.logprobs for lp in e.values())
    if params.prompt_logprobs is not None:
        assert ours[0].prompt_logprobs[1][PROMPTS[0][1]].decoded_token is None
    assert_no_leaks(llm)


def test_stop_token_ids_and_a_token_id_list_prompt(llm):
    free = llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop = tokens[3]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(stop) + 1]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, "")


REFUSED = [
    ("Hello", SamplingParams(), "You cannot pass text prompts when `skip_tokenizer_init` is True"),
    ({"prompt": "Hello"}, SamplingParams(), "You cannot pass text prompts when `skip_tokenizer_init` is True"),
    (PROMPTS[0], SamplingParams(stop=["\n"]), r"^stop=\['\\n'\] \(stop strings are matched in the text\) needs a tokenizer"),
    (PROMPTS[0], SamplingParams(bad_words=["hello"]), r"^bad_words=\['hello'\] .* needs a tokenizer"),
    (PROMPTS[0], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a", "b"])),
     "^structured_outputs .* needs a tokenizer, but this engine was started with skip_tokenizer_init=True"),
]  # fmt: skip


@pytest.mark.parametrize("prompt, params, message", REFUSED, ids=["text", "text-dict", "stop", "bad_words", "structured"])
def test_what_needs_a_tokenizer_is_refused_by_name(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPTS[1], prompt], params, use_tqdm=False)  # (the good prompt first: nothing is queued)
    assert_no_leaks(llm)


def test_chat_beam_search_and_score_are_refused(llm):
    with pytest.raises(ValueError, match="^a chat template .* needs a tokenizer, but .*skip_tokenizer_init=True"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    with pytest.raises(ValueError, match="^beam search .* needs a tokenizer"):
        llm.beam_search([{"prompt_token_ids": PROMPTS[0]}], BeamSearchParams(beam_width=2, max_tokens=3))
    assert_no_leaks(llm)


def test_a_reasoning_config_is_refused_at_start(bare_dir):
    with pytest.raises(ValueError, match=r"^reasoning_config .* needs a tokenizer"):
        EngineArgs(model=str(bare_dir), skip_tokenizer_init=True, reasoning_config={"reasoning_parser": "qwen3"}).validate()
    with pytest.raises(ValueError, match="skip_tokenizer_init must be True or False, got 1"):
        EngineArgs(skip_tokenizer_init=1).validate()


def test_the_pooling_runner_embeds_token_ids(bare_dir, tiny_dir):
    kw = dict(runner="pooling", kv_cache_memory=KV)
    ours = LLM(str(bare_dir), skip_tokenizer_init=True, **kw)
    theirs = LLM(str(tiny_dir), **kw)
    got = [o.outputs.embedding for o in ours.embed(as_prompts(PROMPTS), use_tqdm=False)]
    assert got == [o.outputs.embedding for o in theirs.embed(as_prompts(PROMPTS), use_tqdm=False)]
    with pytest.raises(ValueError, match="You cannot pass text prompts"):
        ours.embed(["Hello"], pooling_params=PoolingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="Unable to get tokenizer because skip_tokenizer_init is True"):
        ours.score([1, 2, 3], [4, 5, 6])
    assert_no_leaks(ours)


@pytest.fixture
async def engine(bare_dir):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(bare_dir), skip_tokenizer_init=True, kv_cache_memory=KV,
                                                        served_model_name="tiny"))  # fmt: skip
    try:
        yield engine
    finally:
        await engine.shutdown()


async def test_async_engine_streams_token_ids(engine, llm):
    params = SamplingParams(max_tokens=9, temperature=0.8, seed=5, n=2, ignore_eos=True, output_kind="delta")
    want = llm.generate(as_prompts(PROMPTS[:1]), params.clone(output_kind="cumulative"), use_tqdm=False)[0]
    got: dict[int, list[int]] = {0: [], 1: []}
    async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, params, "r1"):
        for c in out.outputs:
            assert c.text == ""
            got[c.index] += c.token_ids
    assert [got[c.index] for c in want.outputs] == [c.token_ids for c in want.outputs]
    with pytest.raises(ValueError, match="You cannot pass text prompts"):
        async for _ in engine.generate("Hello", params, "r2"):
            pass
    with pytest.raises(ValueError, match="^a chat template"):
        async for _ in engine.generate([{"role": "user", "content": "hi"}], params, "r3"):
            pass
    with pytest.raises(ValueError, match="Unable to get tokenizer"):
        engine.get_tokenizer()
    assert_no_leaks(engine)


@pytest.fixture
async def http(engine):
    app = build_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        yield client


async def test_server_completes_token_id_prompts(http, engine, llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    want = [o.outputs[0].token_ids for o in llm.generate(as_prompts(PROMPTS[:2]), params, use_tqdm=False)]
    body = {"model": "tiny", "prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True}  # fmt: skip
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["token_ids"] for c in choices] == want
    assert [c["prompt_token_ids"] for c in choices] == PROMPTS[:2]
    assert all(c["text"] == "" for c in choices)
    assert choices[0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in want[0]]
    async with http.stream("POST", "/v1/completions", json={**body, "prompt": PROMPTS[0], "stream": True}) as s:
        lines = [line[6:] async for line in s.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert [t for line in lines[:-1] for t in json.loads(line)["choices"][0]["token_ids"]] == want[0]
    assert_no_leaks(engine)


@pytest.mark.parametrize("route, body, message", [
    ("/v1/completions", {"prompt": "Hello"}, "You cannot pass text prompts when `skip_tokenizer_init` is True"),
    ("/v1/completions", {"prompt": PROMPTS[0], "echo": True}, r"^echo .* needs a tokenizer"),
    ("/v1/completions", {"prompt": PROMPTS[0], "stop": ["x"]}, r"^stop=\['x'\] .* needs a tokenizer"),
    ("/v1/completions", {"prompt": PROMPTS[0], "bad_words": ["x"]}, r"^bad_words=\['x'\] .* needs a tokenizer"),
    ("/v1/completions", {"prompt": PROMPTS[0], "structured_outputs": {"choice": ["a", "b"]}},
     "^structured_outputs .* needs a tokenizer"),
    ("/v1/completions", {"prompt": PROMPTS[0], "use_beam_search": True, "n": 2}, "^beam search .* needs a tokenizer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "^/v1/chat/completions needs a tokenizer"),
    ("/v1/responses", {"input": "hi"}, "^/v1/responses needs a tokenizer"),
    ("/tokenize", {"prompt": "hi"}, "^/tokenize needs a tokenizer"),
    ("/detokenize", {"tokens": [1, 2]}, "^/detokenize needs a tokenizer"),
    ("/v1/embeddings", {"input": [[1, 2]]}, "^/v1/embeddings needs a tokenizer"),
])  # fmt: skip
async def test_server_refuses_what_needs_a_tokenizer_with_a_400(http, engine, route, body, message):
    r = await http.post(route, json={"model": "tiny", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert re.search(message, error["message"]), error["message"]
    assert (await http.get("/health")).status_code == 200
    assert_no_leaks(engine)


async def test_a_chat_template_is_refused_at_start(engine):
    with pytest.raises(ValueError, match="^a chat template .* needs a tokenizer"):
        build_app(engine, chat_template="{{ messages }}")
