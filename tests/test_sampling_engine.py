"""Every SamplingParams field is honoured by the engine (n, stop strings, stop ids, ignore_eos,
min_tokens, seeds, logprobs), finish/stop reasons are set as vLLM does, and a row with
invalid logits fails alone."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from helpers import save_tiny_model, tiny_llama_config
from test_engine import assert_no_leaks
from vllmini import LLM, RequestOutputKind, SamplingParams

PROMPT = {"prompt_token_ids": [1, 504, 3458, 282, 4649, 314, 8287, 30, 198, 40, 837]}


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = HFLlama(tiny_llama_config(vocab_size=49152, initializer_range=0.05)).eval()
    return LLM(model=str(save_tiny_model(hf, tmp_path_factory.mktemp("tiny"), default_model_dir)))


@pytest.fixture(scope="module")
def smol(default_model_dir):
    return LLM(model=str(default_model_dir))


def gen(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]


def test_n_completions_share_the_prompt_kv(tiny_llm):
    stats = tiny_llm.llm_engine.scheduler.stats
    before = stats.num_prefill_tokens
    out = gen(tiny_llm, PROMPT, n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    assert stats.num_prefill_tokens - before == len(PROMPT["prompt_token_ids"])  # one prefill, not three
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # siblings sample independently
    again = gen(tiny_llm, PROMPT, n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # (greedy n > 1 is refused, as in vLLM: top_k=1 samples the greedy token)
    top1 = gen(tiny_llm, PROMPT, n=2, temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True)
    single = gen(tiny_llm, PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    assert top1.outputs[0].token_ids == top1.outputs[1].token_ids == single.outputs[0].token_ids
    assert_no_leaks(tiny_llm)


def test_n_completions_count_toward_max_num_seqs(tiny_llm, monkeypatch):
    """n = 5 through 2 sequence slots (as vLLM, each completion is a sequence): no step runs or
    samples more than max_num_seqs rows (the CUDA warm-up sizes the sampler for that many),
    and the seeded completions are those a roomy engine gives."""
    params = SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    want = gen(tiny_llm, PROMPT, n=5, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    eng = tiny_llm.llm_engine
    monkeypatch.setattr(eng.args, "max_num_seqs", 2)
    monkeypatch.setattr(eng.scheduler, "config", dataclasses.replace(eng.scheduler.config, max_num_seqs=2))
    rows, real_sampler = [], eng.sampler
    monkeypatch.setattr(eng, "sampler", lambda logits, *a, **kw: rows.append(logits.shape[0]) or real_sampler(logits, *a, **kw))
    got = tiny_llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert max(rows) == 2 and len(rows) > 6
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert_no_leaks(tiny_llm)


def test_seeded_request_is_batch_invariant(tiny_llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
    alone = tiny_llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [5 + i] * (3 + i)} for i in range(5)]
    mixed = tiny_llm.generate(
        [*others[:2], PROMPT, *others[2:]],
        [SamplingParams(temperature=1.0, max_tokens=10), SamplingParams(temperature=0, max_tokens=20), params,
         SamplingParams(temperature=0.5, seed=1, max_tokens=5), SamplingParams(top_k=3, max_tokens=16),
         SamplingParams(temperature=1.0, presence_penalty=1.0, max_tokens=8)],
        use_tqdm=False,
    )  # fmt: skip
    assert mixed[2].outputs[0].token_ids == alone
    assert_no_leaks(tiny_llm)


def test_stop_token_ids_and_reasons(tiny_llm):
    ref = gen(tiny_llm, PROMPT, temperature=0, max_tokens=20, ignore_eos=True).outputs[0]
    stop_id = ref.token_ids[4]
    first = ref.token_ids.index(stop_id)
    out = gen(tiny_llm, PROMPT, temperature=0, max_tokens=20, stop_token_ids=[stop_id]).outputs[0]
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # vLLM's text rule: the stop token's text is left out unless include_stop_str_in_output
    tok = tiny_llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids[:-1]) != tok.decode(out.token_ids)
    kept = gen(tiny_llm, PROMPT, temperature=0, max_tokens=20, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert kept.outputs[0].text == tok.decode(out.token_ids)
    # min_tokens defers stop ids
    late = gen(tiny_llm, PROMPT, temperature=0, max_tokens=20, stop_token_ids=[stop_id], min_tokens=first + 2).outputs[0]
    assert len(late.token_ids) > first + 1
    assert_no_leaks(tiny_llm)


def _boundary_stop(llm, text_tokens: list[int]) -> str:
    """A stop string that starts inside one token and ends inside the next one."""
    pieces = [llm.get_tokenizer().decode([t]) for t in text_tokens]
    for i in range(2, len(pieces) - 2):
        if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2:
            return pieces[i][-1] + pieces[i + 1][0]
    raise AssertionError(f"the reference output has no two multi-character tokens in a row: {pieces}")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tiny_llm, include):
    ref = gen(tiny_llm, PROMPT, temperature=0, max_tokens=30, ignore_eos=True).outputs[0]
    stop = _boundary_stop(tiny_llm, ref.token_ids)
    pos = ref.text.find(stop)
    assert pos > 0
    out = gen(tiny_llm, PROMPT, temperature=0, max_tokens=30, stop=[stop, "never-appears-xyz"],
              include_stop_str_in_output=include).outputs[0]  # fmt: skip
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (ref.text[: pos + len(stop)] if include else ref.text[:pos])
    assert ref.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < len(ref.token_ids)
    assert_no_leaks(tiny_llm)


def test_min_tokens_defers_stop_strings_as_vllm(tiny_llm):
    """vLLM looks for stop strings only once more than min_tokens tokens are out: a stop string
    whose text is the min_tokens-th token does not stop the request; one token later it does."""
    ref = gen(tiny_llm, PROMPT, temperature=0, max_tokens=24, ignore_eos=True).outputs[0]
    pieces = [tiny_llm.get_tokenizer().decode([t]) for t in ref.token_ids]
    k = next(i for i in range(3, len(pieces) - 2) if len(pieces[i]) >= 2 and ref.text.count(pieces[i]) == 1)
    kw = dict(temperature=0, max_tokens=24, ignore_eos=True, stop=[pieces[k]])
    stopped = gen(tiny_llm, PROMPT, min_tokens=k, **kw).outputs[0]  # token k+1 is past min_tokens
    assert stopped.finish_reason == "stop" and stopped.token_ids == ref.token_ids[: k + 1]
    deferred = gen(tiny_llm, PROMPT, min_tokens=k + 1, **kw).outputs[0]  # the (k+1)-th token is within it
    assert deferred.finish_reason == "length" and deferred.token_ids == ref.token_ids
    assert_no_leaks(tiny_llm)


def test_generation_config_eos_ids_stop_with_their_id_as_reason(tmp_path, default_model_dir):
    """An EOS id that generation_config.json adds (Llama 3's <|eot_id|>) stops a request as vLLM
    does: as a stop id (stop_reason is the id, its text left out); ignore_eos runs past it."""
    torch.manual_seed(0)
    hf = HFLlama(tiny_llama_config(vocab_size=49152, initializer_range=0.05)).eval()
    model_dir = save_tiny_model(hf, tmp_path / "m", default_model_dir)
    ref = gen(LLM(model=str(model_dir)), PROMPT, temperature=0, max_tokens=12, ignore_eos=True).outputs[0]
    extra = next(t for t in ref.token_ids[3:] if t not in ref.token_ids[:3])
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, extra]}))
    llm = LLM(model=str(model_dir), generation_config="vllm")
    out = gen(llm, PROMPT, temperature=0, max_tokens=12).outputs[0]
    cut = ref.token_ids.index(extra)
    assert out.finish_reason == "stop" and out.stop_reason == extra and out.token_ids == ref.token_ids[: cut + 1]
    assert out.text == llm.get_tokenizer().decode(ref.token_ids[:cut])
    assert gen(llm, PROMPT, temperature=0, max_tokens=12, ignore_eos=True).outputs[0].token_ids == ref.token_ids


def test_eos_ignore_eos_and_min_tokens_on_the_default_model(smol):
    chat = smol.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    prompt = {"prompt_token_ids": list(chat)}
    eos = smol.llm_engine.tokenizer.eos_token_id
    natural = gen(smol, prompt, temperature=0, max_tokens=64).outputs[0]
    assert natural.finish_reason == "stop" and natural.stop_reason is None and natural.token_ids[-1] == eos
    # EOS's text stays out even when special tokens are shown (as vLLM), unless asked for
    n = len(natural.token_ids)
    variants = [  # (one batch: they decode in the same steps)
        SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False),
        SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False, include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=n + 6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=64, min_tokens=n + 3),
    ]
    shown, kept, ignored, delayed = (o.outputs[0] for o in smol.generate([prompt] * 4, variants, use_tqdm=False))
    eos_text = smol.get_tokenizer().decode([eos])
    assert shown.text == natural.text and eos_text not in shown.text
    assert kept.text == natural.text + eos_text
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == n + 6
    assert ignored.token_ids[:n] == natural.token_ids  # EOS generated, then decoding went on
    assert len(delayed.token_ids) >= n + 3 and eos not in delayed.token_ids[: n + 3]
    assert_no_leaks(smol)


def test_logprobs_in_outputs(tiny_llm):
    out = gen(tiny_llm, PROMPT, temperature=0.8, seed=3, max_tokens=6, logprobs=3, ignore_eos=True).outputs[0]
    assert len(out.logprobs) == 6
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert all(v <= 0 and math.isfinite(v) for v in entry.values())
        total += entry[token]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert gen(tiny_llm, PROMPT, max_tokens=3).outputs[0].logprobs is None


def test_logprobs_are_vllm_logprob_objects(tiny_llm):
    """vLLM code reads ``entry[token].logprob`` / ``.rank`` / ``.decoded_token``: each value is a
    Logprob (also a plain float). Ranks count the tokens at least as likely, as vLLM's do."""
    import pickle

    from vllmini import Logprob

    tok = tiny_llm.get_tokenizer()
    out = gen(tiny_llm, PROMPT, temperature=1.0, seed=5, max_tokens=8, logprobs=2, ignore_eos=True).outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert all(isinstance(v, Logprob) and v.logprob == float(v) for v in entry.values())
        by_rank = sorted(entry.values(), key=lambda v: v.rank)
        assert [v.rank for v in by_rank][:2] == [1, 2] and by_rank == sorted(by_rank, reverse=True)
        if len(entry) == 3:  # the sampled token is outside the top 2
            assert entry[token].rank > 2
        # a piece of a multi-byte character is read in context (tests/test_output_text.py)
        assert all(v.decoded_token == tok.decode([t]) for t, v in entry.items() if not tok.decode([t]).endswith("\ufffd"))
    greedy = gen(tiny_llm, PROMPT, temperature=0, max_tokens=4, logprobs=0).outputs[0]
    assert all(e[t].rank == 1 and len(e) == 1 for t, e in zip(greedy.token_ids, greedy.logprobs))
    quiet = gen(tiny_llm, PROMPT, temperature=0, max_tokens=2, logprobs=1, detokenize=False).outputs[0]
    assert all(v.decoded_token is None for e in quiet.logprobs for v in e.values())
    v = out.logprobs[0][out.token_ids[0]]
    assert pickle.loads(pickle.dumps(v)).rank == v.rank and "rank=" in repr(v)


def test_logprob_ranks_with_tied_logits(tmp_path, default_model_dir):
    """Every odd token's lm_head row equals the even token's before it, so logits come in exact
    pairs. As in vLLM, each top-N entry's rank is its place in the top-N, the chosen (or prompt)
    token's too when it is one of them (vLLM writes the top-N over it): an entry's top-N ranks are
    1..N once each, whatever order topk puts a tied pair in; outside the top-N the token's rank
    counts the tokens at least as likely (so a greedy token tied with its twin is rank 2 alone)."""
    torch.manual_seed(0)
    hf = HFLlama(tiny_llama_config(vocab_size=49152, initializer_range=0.05)).eval()
    with torch.no_grad():
        hf.lm_head.weight[1::2] = hf.lm_head.weight[0::2]
    llm = LLM(model=str(save_tiny_model(hf, tmp_path, default_model_dir)))
    prompt = PROMPT["prompt_token_ids"]
    for n in (0, 1, 2, 3, 4):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=n, prompt_logprobs=n)
        out = llm.generate(PROMPT, params, use_tqdm=False)[0]
        comp = out.outputs[0]
        entries = list(zip(comp.token_ids, comp.logprobs)) + list(zip(prompt[1:], out.prompt_logprobs[1:]))
        for token, entry in entries:
            assert next(iter(entry)) == token
            top = list(entry.values())[1:] if len(entry) == n + 1 else list(entry.values())
            assert sorted(v.rank for v in top) == list(range(1, n + 1)), (n, token, entry)
            assert sorted(top, key=lambda v: v.rank) == sorted(top, reverse=True), (n, token, entry)
            if len(entry) == n + 1:  # outside the top-N: its twin is at least as likely
                assert entry[token].rank > n and entry[token].rank % 2 == 0, (n, token, entry)
        if n == 0:  # greedy picks the first of a tied pair: rank 2
            assert all(e[t].rank == 2 for t, e in zip(comp.token_ids, comp.logprobs))


def test_invalid_logits_fail_only_that_request(tiny_llm, monkeypatch):
    eng = tiny_llm.llm_engine
    poisoned = {}
    original = eng.runner.execute

    def execute(sched, bm):
        logits, flat = original(sched, bm)
        logits = logits.clone()
        for row, i in enumerate(flat.sample_indices):
            if sched.scheduled[i].seq.request_id == poisoned.get("id"):
                logits[row] = float("nan")
        return logits, flat

    monkeypatch.setattr(eng.runner, "execute", execute)
    poisoned["id"] = eng.add_request("bad", PROMPT, SamplingParams(max_tokens=8, temperature=0.7))
    eng.add_request("good", PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    finals = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o.outputs[0]
    assert finals["bad"].finish_reason == "error" and "NaN" in finals["bad"].stop_reason
    assert finals["good"].finish_reason == "length" and len(finals["good"].token_ids) == 8
    assert_no_leaks(tiny_llm)


def _stream(llm, request_id, prompt, params):
    eng = llm.llm_engine
    eng.add_request(request_id, prompt, params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == request_id]
    return outs


@pytest.mark.parametrize("with_stop", [False, True])
def test_output_kinds_and_stop_string_holdback(tiny_llm, with_stop):
    ref = gen(tiny_llm, PROMPT, temperature=0, max_tokens=24, ignore_eos=True).outputs[0]
    stop = [_boundary_stop(tiny_llm, ref.token_ids)] if with_stop else []
    base = dict(temperature=0, max_tokens=24, ignore_eos=True, stop=stop)
    final = gen(tiny_llm, PROMPT, **base).outputs[0]
    cumulative = _stream(tiny_llm, "c", PROMPT, SamplingParams(**base, output_kind="cumulative"))
    deltas = _stream(tiny_llm, "d", PROMPT, SamplingParams(**base, output_kind="delta"))
    finals = _stream(tiny_llm, "f", PROMPT, SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(finals) == 1 and finals[0].finished and finals[0].outputs[0].text == final.text
    assert len(cumulative) == len(final.token_ids) and cumulative[-1].outputs[0].text == final.text
    for out in cumulative:  # every streamed text is a prefix of the final one: no piece of a cut stop string
        assert final.text.startswith(out.outputs[0].text)
    assert "".join(o.outputs[0].text for o in deltas) == final.text
    assert sum((o.outputs[0].token_ids for o in deltas), []) == final.token_ids
    assert all(o.prompt_logprobs is None for o in deltas)  # not asked for: None, not [] (as vLLM)
    if with_stop:
        assert final.finish_reason == "stop" and stop[0] not in final.text
    assert_no_leaks(tiny_llm)


def test_delta_outputs_of_n_completions_carry_only_what_changed(tiny_llm):
    """n = 3 with different lengths (seeded, a stop string): as in vLLM, a delta output holds
    only the completions that changed, so each completion's end is reported exactly once, and
    each completion's deltas add up to its final text and tokens."""
    base = dict(n=3, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, stop=["P", "C"])
    final = {c.index: c for c in gen(tiny_llm, PROMPT, **base).outputs}
    assert len({len(c.token_ids) for c in final.values()}) > 1  # they end at different steps
    deltas = _stream(tiny_llm, "d", PROMPT, SamplingParams(**base, output_kind="delta"))
    for index, want in final.items():
        mine = [c for o in deltas for c in o.outputs if c.index == index]
        assert "".join(c.text for c in mine) == want.text and sum((c.token_ids for c in mine), []) == want.token_ids
        assert [c.finish_reason for c in mine if c.finish_reason] == [want.finish_reason]
        assert all(c.token_ids or c.finish_reason for c in mine)  # nothing empty
    assert deltas[-1].finished and all(not o.finished for o in deltas[:-1])
    assert_no_leaks(tiny_llm)


def test_offline_generate_reports_a_failed_request_and_frees_everything(tiny_llm, monkeypatch):
    eng = tiny_llm.llm_engine
    real_check = eng.output_processor.check_stop
    calls = {"n": 0}

    def check_stop(state, seq, *rest):
        calls["n"] += 1
        if calls["n"] == 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated detokenizer failure")
        return real_check(state, seq, *rest)

    monkeypatch.setattr(eng.output_processor, "check_stop", check_stop)
    with pytest.raises(UnicodeDecodeError, match="simulated detokenizer failure"):
        tiny_llm.generate([PROMPT, PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert not eng.failed
    assert_no_leaks(tiny_llm)
