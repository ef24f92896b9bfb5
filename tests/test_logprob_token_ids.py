"""vLLM's ``SamplingParams.logprob_token_ids``: given tokens' logprobs at each sampled position
(scoring label tokens), with their true ranks, instead of the top-N."""
from __future__ import annotations

import httpx
import pytest

from test_engine import assert_no_leaks
from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.entrypoints.openai.api_server import build_app

PROMPTS = [{"prompt_token_ids": [5, 17, 99, 342, 7]}, {"prompt_token_ids": [8, 8, 1000, 3]},
           {"prompt_token_ids": [40, 41]}]  # fmt: skip
IDS = [17, 3, 49151, 260]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), max_logprobs=-1)


def test_listed_tokens_get_the_whole_vocabularys_logprobs_and_ranks(llm):
    """Each position's dict holds the sampled token first, then the listed ones, with the
    logprobs that the whole-vocabulary logprobs give them and their true ranks; greedy and sampled rows,
    and rows asking for the top-N or nothing, share the batch."""
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprob_token_ids=IDS),
              SamplingParams(temperature=0.9, seed=4, max_tokens=6, ignore_eos=True, logprob_token_ids=IDS[:2], logprobs=2),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)]  # fmt: skip
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    full_params = [p.clone(logprob_token_ids=None, logprobs=-1, detokenize=False) for p in params[:2]]
    full = [o.outputs[0] for o in llm.generate(PROMPTS[:2], full_params, use_tqdm=False)]
    for out, ref, listed in zip(got, full, (IDS, IDS[:2])):
        assert out.token_ids == ref.token_ids
        assert out.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-4)
        for token, entry, whole in zip(out.token_ids, out.logprobs, ref.logprobs):
            assert list(entry) == list(dict.fromkeys([token, *listed]))  # (logprobs=2 names their count)
            values = sorted((v.logprob for v in whole.values()), reverse=True)
            for t, lp in entry.items():  # rank: how many tokens are at least as likely (ties count)
                assert lp.logprob == pytest.approx(whole[t].logprob, abs=1e-5)
                assert lp.rank == sum(1 for v in values if v >= whole[t].logprob)
            assert entry[IDS[0]].decoded_token == llm.get_tokenizer().decode([IDS[0]])
    assert all(len(entry) <= 3 for entry in got[2].logprobs)  # (its own top-2, untouched)
    assert_no_leaks(llm)


@pytest.mark.parametrize("ids, message", [
    ([], "logprob_token_ids must be a list of 1 to 128 ints >= 0"),
    ([-1], "logprob_token_ids must be a list of 1 to 128 ints >= 0"),
    (list(range(129)), "logprob_token_ids must be a list of 1 to 128"),
    ("17", "logprob_token_ids must be a list"),
])  # fmt: skip
def test_bad_lists_are_refused_naming_the_field(ids, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(logprob_token_ids=ids)


def test_logprobs_given_too_must_count_the_ids():
    """vLLM 0.32 refuses logprobs that differ from len(logprob_token_ids) (it once let the ids win)."""
    for logprobs in (0, 1, 3, -1):
        with pytest.raises(ValueError, match=f"logprob_token_ids: .*must equal len\\(logprob_token_ids\\)=2, got logprobs={logprobs}"):
            SamplingParams(logprob_token_ids=[5, 6], logprobs=logprobs)
    assert SamplingParams(logprob_token_ids=[5, 6], logprobs=2).logprobs == 2


def test_ids_outside_the_vocabulary_are_refused_and_others_go_on(llm):
    with pytest.raises(ValueError, match=r"logprob_token_ids has token ids outside the vocabulary \[0, 49152\): \[49152\]"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, logprob_token_ids=[1, 49152])],
                     use_tqdm=False)  # fmt: skip
    assert_no_leaks(llm)
    assert SamplingParams(logprob_token_ids=[3, 3, 4]).logprob_token_ids == [3, 4]  # one entry per token


async def test_server_lists_them_as_top_logprobs(tiny_dir, llm):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny"))
    want = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3, logprob_token_ids=IDS[:2]),
                        use_tqdm=False)[0].outputs[0]  # fmt: skip
    text = [{llm.get_tokenizer().decode([t]): round(e[t].logprob, 4) for t in IDS[:2]} for e in want.logprobs]
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as http:
            body = {"model": "tiny", "prompt": PROMPTS[0]["prompt_token_ids"], "max_tokens": 3, "temperature": 0,
                    "logprob_token_ids": IDS[:2], "logprobs": 1}  # (vLLM 0.32's server: logprobs set, any count)  # fmt: skip
            out = (await http.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
            for top, ids, token in zip(out["top_logprobs"], text, out["tokens"]):  # the ids', and the chosen token's
                assert {t: round(v, 4) for t, v in top.items() if t in ids} == ids and token in top and len(top) <= 3
            bad = await http.post("/v1/completions", json={**body, "logprobs": None})  # (vLLM's 400)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_token_ids", bad.json()
            echo = (await http.post("/v1/completions", json={**body, "echo": True})).json()
            tops = echo["choices"][0]["logprobs"]["top_logprobs"]  # echoed prompt positions: their own token + top 1
            n = len(PROMPTS[0]["prompt_token_ids"])
            assert tops[0] is None and all(len(t) in (1, 2) for t in tops[1:n]) and tops[n:] == out["top_logprobs"]
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
                    "logprob_token_ids": IDS[:2], "logprobs": True}  # fmt: skip
            content = (await http.post("/v1/chat/completions", json=chat)).json()["choices"][0]["logprobs"]["content"]
            assert len(content) == 2 and all(len(c["top_logprobs"]) == 2 for c in content)
            bad = await http.post("/v1/completions", json={**body, "logprob_token_ids": [99999]})
            assert bad.status_code == 400 and "logprob_token_ids" in bad.json()["error"]["message"]
    finally:
        await engine.shutdown()
