"""logit_bias, allowed_token_ids and bad_words (vLLM's SamplingParams fields): sampler
properties with hypothesis, then the engine on the default model against transformers'
logits, validation, and async scheduling (multi-token bad words keep a step synchronous)."""
from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_engine import assert_no_leaks
from vllmini import LLM, SamplingParams
from vllmini.engine.sampler import Sampler, SamplingRow, SamplingTensors
from vllmini.testing import logits as logits_st

FAST = settings(deadline=None, max_examples=60)
TEMPS = st.sampled_from([0.0, 0.0, 0.7, 1.5])


@st.composite
def controlled_params(draw, vocab: int):
    ids = st.integers(0, vocab - 1)
    bias = draw(st.none() | st.dictionaries(ids, st.sampled_from([-100.0, -5.0, 0.5, 5.0, 100.0, 1e38]), max_size=4))
    allowed = draw(st.none() | st.lists(ids, min_size=1, max_size=max(1, vocab // 2)))
    return SamplingParams(temperature=draw(TEMPS), logit_bias=bias, allowed_token_ids=allowed, seed=draw(st.integers(0, 99)))


@FAST
@given(logits_st(max_vocab=24), st.data())
def test_bias_and_allowed_tokens_steer_every_row(logits, data):
    """Greedy rows take the argmax of the biased logits among the allowed tokens; sampled rows
    draw only allowed tokens that are not biased down to (almost) nothing."""
    B, V = logits.shape
    params = [data.draw(controlled_params(V)) for _ in range(B)]
    tokens = Sampler()(logits, SamplingTensors.from_rows([SamplingRow(p, [], []) for p in params], V)).token_ids
    for row, (p, token) in enumerate(zip(params, tokens.tolist())):
        x = logits[row].float().clone()
        for t, b in (p.logit_bias or {}).items():
            x[t] = min(x[t] + b, torch.finfo(torch.float32).max)
        if p.allowed_token_ids is not None:
            keep = torch.zeros(V, dtype=torch.bool)
            keep[p.allowed_token_ids] = True
            x[~keep] = -float("inf")
        if x.max() == -float("inf"):
            continue  # every token masked: the row falls back to the raw logits (documented)
        assert x[token] > -float("inf"), (row, token)
        if p.is_greedy:
            assert x[token] == x.max(), (row, token)


@FAST
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=3),
       st.integers(0, 2**31), TEMPS)  # fmt: skip
def test_generation_never_completes_a_bad_word(words, seed, temperature):
    """The invariant bad_words promises: whatever the logits, no output ever ends with a whole
    bad word (vocabulary of 8, so at most 3 bans never mask every token)."""
    g = torch.Generator().manual_seed(seed)
    p = SamplingParams(temperature=temperature, seed=seed)
    out: list[int] = []
    for _ in range(16):
        logits = torch.randn(1, 8, generator=g) * 4
        if words:  # push the model toward completing the first bad word
            logits[0, words[0][min(len(out), len(words[0]) - 1)]] += 8
        row = SamplingRow(p, [], out, bad_words_token_ids=[tuple(w) for w in words])
        out = out + Sampler()(logits, SamplingTensors.from_rows([row], 8)).token_ids.tolist()
        for w in words:
            assert out[-len(w):] != w, (out, w)


@pytest.fixture(scope="module")
def smol(default_model_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(default_model_dir))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return llm, hf


def chat(llm, question: str, **kw):
    params = SamplingParams(**{"max_tokens": 16, "temperature": 0, **kw})
    return llm.chat([{"role": "user", "content": question}], params, use_tqdm=False)[0]


def test_logit_bias_moves_greedy_to_transformers_runner_up(smol):
    llm, hf = smol
    plain = chat(llm, "What is the capital of France?")
    with torch.no_grad():
        top2 = hf(torch.tensor([plain.prompt_token_ids])).logits[0, -1].topk(2).indices.tolist()
    assert plain.outputs[0].token_ids[0] == top2[0]
    biased = chat(llm, "What is the capital of France?", logit_bias={top2[0]: -100.0})
    assert biased.outputs[0].token_ids[0] == top2[1]
    boosted = chat(llm, "What is the capital of France?", logit_bias={top2[1]: 100.0}, max_tokens=3)
    assert boosted.outputs[0].token_ids == [top2[1]] * 3


def test_allowed_token_ids_and_bad_words_on_the_default_model(smol):
    llm, _ = smol
    tok = llm.llm_engine.tokenizer
    plain = chat(llm, "What is the capital of France?").outputs[0].text
    assert "Paris" in plain
    assert "Paris" not in chat(llm, "What is the capital of France?", bad_words=["Paris"]).outputs[0].text
    allowed = tok.encode(" yes no maybe", add_special_tokens=False)
    out = chat(llm, "What is the capital of France?", allowed_token_ids=allowed, ignore_eos=True).outputs[0]
    assert len(out.token_ids) == 16 and set(out.token_ids) <= set(allowed)
    # a multi-token bad word: its last token is banned only right after the rest of it
    multi = chat(llm, "What is the capital of France?", bad_words=["capital of France"]).outputs[0].text
    assert "capital of France" not in multi and "capital of" in multi, multi
    assert_no_leaks(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multi_token_bad_words_under_async_scheduling(default_model_dir, smol, async_scheduling):
    """A continuation would sample before the host sees the token it continues from, so bad
    words (which match it) keep those steps synchronous: the same text either way."""
    want = chat(smol[0], "What is the capital of France?", bad_words=["capital of France", "Paris"]).outputs[0].text
    llm = LLM(model=str(default_model_dir), async_scheduling=async_scheduling)
    got = chat(llm, "What is the capital of France?", bad_words=["capital of France", "Paris"]).outputs[0].text
    assert got == want


def test_one_token_bad_words_keep_async_continuations(default_model_dir, smol, monkeypatch):
    """A one-token bad word is banned whatever came before, so it does not stop async scheduling
    from launching the next step early; a bad word of several tokens does."""
    import vllmini.engine.async_scheduling as async_scheduling

    planned = []
    real = async_scheduling.plan_continuation
    monkeypatch.setattr(async_scheduling, "plan_continuation", lambda *a: planned.append(real(*a)) or planned[-1])
    llm = LLM(model=str(default_model_dir), async_scheduling=True)
    for words, launches_early in ((["Paris"], True), (["capital of France"], False)):
        planned.clear()
        want = chat(smol[0], "What is the capital of France?", bad_words=words).outputs[0].text
        assert chat(llm, "What is the capital of France?", bad_words=words).outputs[0].text == want
        assert any(p is not None for p in planned) == launches_early, words


def test_a_huge_bias_cannot_lift_a_ban_or_break_the_batch(smol):
    """A bias near float32's limit is added first and clamped; bans, min_tokens and the allowed
    mask are written after it, so they hold, no NaN reaches the sampler, and the request next
    to it is untouched. Beyond float32 (or not finite) it is refused up front."""
    llm, _ = smol
    eos = llm.get_tokenizer().eos_token_id
    paris = llm.get_tokenizer().encode(" Paris", add_special_tokens=False)[0]
    alone = chat(llm, "What is the capital of France?").outputs[0].token_ids
    huge = 3.3e38
    cases = [
        dict(min_tokens=4, logit_bias={eos: huge}, temperature=1.0, seed=0),
        dict(allowed_token_ids=[100, 200], logit_bias={paris: huge}),
        dict(bad_words=["Paris"], logit_bias={paris: huge}, temperature=1.0, seed=1),
        {},  # a plain request in the same batch
    ]
    prompts = [[{"role": "user", "content": "What is the capital of France?"}]] * len(cases)
    outs = llm.chat(prompts, [SamplingParams(**{"max_tokens": 16, "temperature": 0, **c}) for c in cases], use_tqdm=False)
    first, allowed, banned, plain = (o.outputs[0].token_ids for o in outs)
    assert eos not in first[:4] and first[4] == eos  # the bias wins once min_tokens allows EOS
    assert set(allowed) <= {100, 200} and paris not in banned
    assert plain == alone
    for bad in (1e39, 10**400, float("inf")):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias={eos: bad})
    assert_no_leaks(llm)


def test_fields_are_validated(smol):
    llm, _ = smol
    bad = {
        "logit_bias": [[1, 2], {1: float("nan")}, {-1: 1.0}, {"a": 1.0}, {True: 1.0}],
        "allowed_token_ids": [[], [-1], [1.5], "12"],
        "bad_words": [[""], ["  "], "Paris", [3]],
    }
    for field, values in bad.items():
        for value in values:
            with pytest.raises(ValueError, match=field):
                SamplingParams(**{field: value})
    for field, value in (("logit_bias", {49152: 1.0}), ("allowed_token_ids", [5, 10**6])):
        with pytest.raises(ValueError, match=f"{field} has token ids outside the vocabulary"):
            llm.generate("hi", SamplingParams(**{field: value}), use_tqdm=False)
    assert_no_leaks(llm)
    decoded = msgspec.json.decode(b'{"logit_bias": {"5": 2}, "allowed_token_ids": [5, 6]}', type=SamplingParams)
    assert decoded.logit_bias == {5: 2.0} and decoded.allowed_token_ids == [5, 6]


def test_constraints_that_leave_nothing_to_sample_are_refused(smol):
    """allowed_token_ids whose every token is banned (a one-token bad word; EOS or a stop id
    while min_tokens holds) would fall back to the raw logits: refused at submission."""
    llm, _ = smol
    eng = llm.llm_engine
    eos = eng.eos_token_ids[0]
    paris = eng.tokenizer.encode("Paris", add_special_tokens=False)
    assert len(paris) == 1
    refused = [
        (dict(allowed_token_ids=paris, bad_words=["Paris"]), "every allowed token is banned by bad_words"),
        (dict(allowed_token_ids=[eos], min_tokens=2), "min_tokens=2 bans"),
        (dict(allowed_token_ids=[eos, 7], stop_token_ids=[7], min_tokens=1), "stop_token_id"),
        (dict(allowed_token_ids=[eos, *paris], bad_words=["Paris"], min_tokens=1), "bad word"),
    ]
    for kw, message in refused:
        with pytest.raises(ValueError, match=f"allowed_token_ids: .*{message}"):
            llm.generate("hi", SamplingParams(max_tokens=4, **kw), use_tqdm=False)
    assert_no_leaks(llm)
    # one token left is enough, and ignore_eos lifts the EOS ban
    for kw in (dict(allowed_token_ids=[eos, 7], min_tokens=2), dict(allowed_token_ids=[eos], min_tokens=2, ignore_eos=True)):
        out = llm.generate("hi", SamplingParams(max_tokens=3, temperature=0, **kw), use_tqdm=False)[0].outputs[0]
        assert out.token_ids[:2] == [kw["allowed_token_ids"][-1]] * 2, out.token_ids
