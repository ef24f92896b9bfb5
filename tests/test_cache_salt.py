"""vLLM's ``cache_salt``: a prompt's salt roots its prefix-cache blocks, so only requests with
the same salt share them (a tenant cannot time another's hits); outputs never change. Over
HTTP the request field ``cache_salt``, and ``--enable-prompt-tokens-details`` reports the hits
as ``usage.prompt_tokens_details.cached_tokens``."""
from __future__ import annotations

import httpx
import pytest

from test_engine import assert_no_leaks
from vllmini import LLM, AsyncLLMEngine, BeamSearchParams, EngineArgs, SamplingParams
from vllmini.entrypoints.openai.api_server import build_app
from vllmini.kv.block_hash import ROOT_HASH, prefix_root

PROMPT = list(range(100, 180))  # five blocks of 16


def greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir))


def run(llm: LLM, salt: str | None, prompt: list[int] = PROMPT) -> tuple[list[int], int]:
    item = {"prompt_token_ids": prompt} | ({} if salt is None else {"cache_salt": salt})
    out = llm.generate(item, greedy(), use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_only_the_same_salt_hits_the_cache(llm):
    llm.reset_prefix_cache()
    tokens, cached = run(llm, "tenant-a")
    assert cached == 0
    assert run(llm, "tenant-a") == (tokens, 64)  # the same salt: four full blocks (the last token is computed)
    assert run(llm, "tenant-b") == (tokens, 0)  # another salt
    assert run(llm, None) == (tokens, 0)  # no salt
    assert run(llm, None) == (tokens, 64)  # unsalted requests share among themselves
    assert run(llm, "tenant-b", PROMPT[:48] + [7] * 32)[1] == 48  # a salt's own prefix
    assert_no_leaks(llm)


def test_roots_differ_by_salt_and_adapter():
    roots = {prefix_root(), prefix_root(0, "a"), prefix_root(0, "b"), prefix_root(1), prefix_root(1, "a")}
    assert len(roots) == 5 and prefix_root() == ROOT_HASH and prefix_root(1, "a") == prefix_root(1, "a")


def test_bad_salts_are_refused_naming_the_field(llm):
    for bad in ("", 5, ["a"]):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate({"prompt_token_ids": PROMPT, "cache_salt": bad}, greedy(), use_tqdm=False)
    assert run(llm, "ok")[0]  # still serving
    assert_no_leaks(llm)


def test_n_beam_search_and_pooling_carry_the_salt(llm, tiny_dir):
    llm.reset_prefix_cache()
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3)
    first = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "s"}, params, use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "s"}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs] and again.num_cached_tokens == 64
    beams = BeamSearchParams(beam_width=2, max_tokens=3)
    salted = llm.beam_search([{"prompt_token_ids": PROMPT[:40], "cache_salt": "beam"}], beams)[0]
    assert [b.tokens for b in salted.sequences] == [b.tokens for b in llm.beam_search([{"prompt_token_ids": PROMPT[:40]}], beams)[0].sequences]
    assert run(llm, "beam", PROMPT[:40] + [9] * 8)[1] == 32  # the search's steps left blocks under its salt
    assert run(llm, "other", PROMPT[:40] + [9] * 8)[1] == 0
    pooling = LLM(str(tiny_dir), runner="pooling")
    want = pooling.embed([{"prompt_token_ids": PROMPT}], use_tqdm=False)[0].outputs.embedding
    got = pooling.embed([{"prompt_token_ids": PROMPT, "cache_salt": "p"}], use_tqdm=False)[0].outputs.embedding
    assert got == pytest.approx(want, abs=1e-5)


async def test_the_server_salts_and_reports_cached_tokens(tiny_dir):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny"))
    try:
        app = build_app(engine, enable_prompt_tokens_details=True)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            async def cached(route: str, salt: str | None) -> int:
                body = {"model": "tiny", "max_tokens": 2, "temperature": 0}
                body |= {"prompt": PROMPT} if route == "completions" else {"messages": [{"role": "user", "content": "hi " * 70}]}
                if salt is not None:
                    body["cache_salt"] = salt
                r = await http.post(f"/v1/{route}", json=body)
                assert r.status_code == 200, r.text
                return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            for route in ("completions", "chat/completions"):
                assert await cached(route, "a") == 0
                assert await cached(route, "a") > 0
                assert await cached(route, "b") == 0
            bad = await http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "cache_salt": ""})
            assert bad.status_code == 400 and "cache_salt" in bad.json()["error"]["message"]
    finally:
        await engine.shutdown()
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny"))
    try:  # (off by default, as vLLM's: null)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as http:
            usage = (await http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1})).json()["usage"]
            assert usage["prompt_tokens_details"] is None
    finally:
        await engine.shutdown()
