"""LLM.beam_search (vLLM's offline beam search): transformers' beam search gives the same k
sequences in the same order when no beam ends in EOS; beam_width=1 is greedy; a beam ending
in EOS is completed and ranked with the live ones by vLLM's length-penalised score (checked
against a plain re-implementation over transformers' logits); bad parameters are refused
naming the field; several prompts share one generate call per step and leak nothing."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import Qwen3ForCausalLM as HFQwen3

from helpers import save_tiny_model, tiny_qwen3_config
from test_engine import assert_no_leaks
from vllmini import LLM, BeamSearchOutput, BeamSearchParams, BeamSearchSequence, SamplingParams
from vllmini.engine.beam_search import beam_score

KV = 2**22  # ~3600 tokens of the tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = HFQwen3(tiny_qwen3_config()).eval()
    return save_tiny_model(hf, tmp_path_factory.mktemp("tiny-qwen3-beam"), default_model_dir), hf


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(model=str(tiny[0]), kv_cache_memory=KV)


def random_prompts(lengths, seed=1, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_beam_search(hf, prompt, k, max_new, length_penalty):
    """transformers' beam search with EOS out of the way: every beam reaches max_new tokens."""
    with torch.no_grad():
        res = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=k, num_return_sequences=k, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
            length_penalty=length_penalty, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    # sequences_scores = cum_logprob / generated_len ** length_penalty
    return res.sequences.tolist(), [s * max_new**length_penalty for s in res.sequences_scores.tolist()]


@pytest.mark.parametrize("k, length_penalty", [(3, 1.0), (4, 0.5)])
def test_matches_transformers_beam_search(llm, tiny, k, length_penalty):
    """With no EOS, transformers (5.x) marks every candidate finished at max_length, keeps the top k
    by score and returns them best first; all have the same length, so its order is the cumulative
    logprob's, as vLLM's. So all k sequences must be equal, in the same order."""
    hf = tiny[1]
    prompts = random_prompts((5, 17, 30))
    outs = llm.beam_search(prompts, BeamSearchParams(k, 12, ignore_eos=True, length_penalty=length_penalty))
    for prompt, out in zip(prompts, outs):
        hf_tokens, hf_cum = hf_beam_search(hf, prompt, k, 12, length_penalty)
        assert [s.tokens for s in out.sequences] == hf_tokens
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(hf_cum, abs=1e-4)
        for seq in out.sequences:
            assert seq.finish_reason == "length" and seq.stop_reason is None and len(seq.logprobs) == 12
            assert seq.cum_logprob == pytest.approx(sum(e[t] for e, t in zip(seq.logprobs, seq.tokens[len(prompt):])))
            assert all(len(e) == 2 * k for e in seq.logprobs)  # temperature 0: the chosen token is among the top 2k
    assert_no_leaks(llm)


def test_beam_width_1_is_greedy(llm):
    prompts = random_prompts((3, 20), seed=2)
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=10, ignore_eos=True))
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0),
                          use_tqdm=False)  # fmt: skip
    for prompt, out, g in zip(prompts, outs, greedy):
        (seq,) = out.sequences
        assert seq.tokens == prompt + g.outputs[0].token_ids
        # (the beams score each token in a one-token prefill after a prefix-cache hit, generate in the
        # decode kernel: the two round apart by ~1e-6 a token, which depends on the CPU's kernels)
        assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=5e-5)


def reference_beam_search(hf, prompt, k, max_new, eos, length_penalty):
    """vLLM's algorithm written out plainly over transformers' logits (a whole forward per beam):
    each beam's top 2k tokens are candidates, EOS ones completed, the best k others live on;
    the end ranks by cum_logprob / (len(prompt + output) - final EOS) ** length_penalty."""
    live, done = [(list(prompt), 0.0, False)], []
    for _ in range(max_new):
        candidates = []
        for tokens, cum, _ in live:
            with torch.no_grad():
                logprobs = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), -1)
            values, ids = logprobs.topk(2 * k)
            for lp, t in zip(values.tolist(), ids.tolist()):
                (done if t in eos else candidates).append((tokens + [t], cum + lp, t in eos))
        live = sorted(candidates, key=lambda c: c[1], reverse=True)[:k]
    ranked = sorted(done + live, key=lambda c: c[1] / (len(c[0]) - c[2]) ** length_penalty, reverse=True)
    return ranked[:k]


@pytest.fixture(scope="module")
def eos_case(tiny, tmp_path_factory):
    """The tiny model with an extra EOS in its generation config: the second most likely first
    token of ``prompt``, so that a beam completes at the first step."""
    model_dir, hf = tiny
    prompt = random_prompts((6,), seed=3)[0]
    with torch.no_grad():
        eos = hf(torch.tensor([prompt])).logits[0, -1].topk(2).indices[1].item()
    eos_dir = tmp_path_factory.mktemp("tiny-eos") / "model"
    shutil.copytree(model_dir, eos_dir)
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    llm = LLM(model=str(eos_dir), kv_cache_memory=KV)
    assert eos in llm.llm_engine.eos_token_ids
    return llm, hf, prompt, eos


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_eos_beam_is_completed_and_ranked(eos_case, length_penalty):
    llm, hf, prompt, eos = eos_case
    k, n = 3, 8
    (out,) = llm.beam_search([prompt], BeamSearchParams(k, n, length_penalty=length_penalty))
    expected = reference_beam_search(hf, prompt, k, n, set(llm.llm_engine.eos_token_ids), length_penalty)
    assert [s.tokens for s in out.sequences] == [t for t, _, _ in expected]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, c, _ in expected], abs=1e-4)
    assert [s.finish_reason for s in out.sequences] == ["stop" if e else "length" for _, _, e in expected]
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped, "the beam that emitted EOS should rank among the best"
    tok = llm.get_tokenizer()
    for s in stopped:
        assert s.tokens[-1] == eos == s.stop_reason and s.text == tok.decode(s.tokens[:-1], skip_special_tokens=True)
    if length_penalty == 1.0:  # the completed beam after 1 token is the first token's 2nd choice
        assert any(s.tokens == prompt + [eos] for s in stopped)
    (with_stop,) = llm.beam_search([prompt], BeamSearchParams(k, n, length_penalty=length_penalty,
                                                              include_stop_str_in_output=True))  # fmt: skip
    assert [s.text for s in with_stop.sequences] == [tok.decode(s.tokens, skip_special_tokens=True) for s in out.sequences]
    assert_no_leaks(llm)


def test_eos_ranking_matches_transformers_without_length_penalty(eos_case):
    """With EOS, transformers ranks by cum_logprob / generated_len ** length_penalty (EOS counted,
    prompt not), vLLM by cum_logprob / (prompt + output - final EOS) ** length_penalty, so only
    length_penalty=0 compares. Here the completed beam (the first token's 2nd choice, then EOS) is
    the best for both; transformers pads it with its first EOS id (2), here."""
    llm, hf, prompt, eos = eos_case
    (out,) = llm.beam_search([prompt], BeamSearchParams(3, 8, length_penalty=0.0))
    with torch.no_grad():
        res = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), num_beams=3,
            num_return_sequences=3, max_new_tokens=8, do_sample=False, eos_token_id=[2, eos], length_penalty=0.0,
            pad_token_id=2,
        )  # fmt: skip
    theirs = [s[: s.index(eos, len(prompt)) + 1] if eos in s[len(prompt):] else s for s in res.tolist()]
    assert [s.tokens for s in out.sequences] == theirs
    assert out.sequences[0].tokens == prompt + [eos]


def test_score_is_vllms():
    """vLLM's get_beam_search_score: the prompt counts in the length, a final EOS does not."""
    stopped = BeamSearchSequence([1, 2, 3, 4, 9], cum_logprob=-3.0, finish_reason="stop", stop_reason=9)
    assert beam_score(stopped, 1.0) == -0.75 and beam_score(stopped, 2.0) == -3.0 / 16
    assert beam_score(BeamSearchSequence([1, 2, 3, 4, 9], cum_logprob=-3.0), 1.0) == -0.6
    assert beam_score(stopped, 0.0) == -3.0


def test_ignore_eos_keeps_eos_beams_going(eos_case):
    llm, hf, prompt, eos = eos_case
    (out,) = llm.beam_search([prompt], BeamSearchParams(3, 8, ignore_eos=True))
    assert all(len(s.tokens) == len(prompt) + 8 and s.finish_reason == "length" for s in out.sequences)
    assert [s.tokens for s in out.sequences] == [t for t, _, _ in reference_beam_search(hf, prompt, 3, 8, set(), 1.0)]


@pytest.mark.parametrize(
    "field, value",
    [("beam_width", 0), ("beam_width", 2.0), ("beam_width", True), ("max_tokens", 0), ("max_tokens", None),
     ("ignore_eos", 1), ("temperature", -0.5), ("temperature", math.nan), ("length_penalty", math.inf),
     ("length_penalty", "1"), ("include_stop_str_in_output", "no"), ("skip_special_tokens", None)],
)  # fmt: skip
def test_bad_params_name_the_field(field, value):
    kwargs = {"beam_width": 2, "max_tokens": 4, field: value}
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


def test_bad_requests_are_refused_before_any_work(llm, monkeypatch):
    with pytest.raises(TypeError):
        BeamSearchParams(2, 4, n=3)  # an unknown field
    cap = llm.llm_engine.input_processor.max_logprobs
    with pytest.raises(ValueError, match="beam_width.*max_logprobs"):  # 2 * beam_width logprobs per step
        llm.beam_search([[1, 2]], BeamSearchParams(cap // 2 + 1, 4))
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.beam_search([[1, 2]], SamplingParams())
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([[1, 2]], BeamSearchParams(2, 4), concurrency_limit=0)
    with pytest.raises(ValueError, match="vocabulary"):  # one bad prompt of several: nothing runs
        llm.beam_search([[1, 2], [1, 10**6]], BeamSearchParams(2, 4))
    calls = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda ps, *a, **kw: calls.append(len(ps)) or generate(ps, *a, **kw))
    too_long = [1] * llm.llm_engine.max_model_len  # in the second group: refused before the first one runs
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([[1, 2], too_long], BeamSearchParams(2, 4), concurrency_limit=1)
    assert calls == []
    assert_no_leaks(llm)


def test_several_prompts_one_generate_call_per_step(llm, monkeypatch):
    """Text (words whose ids fit the tiny model's vocabulary), token-id and dict prompts together:
    each gets what it gets alone, every step's live beams of all prompts go to one generate call,
    and no KV block is left behind."""
    tok = llm.get_tokenizer()
    ids = random_prompts((9, 25), seed=4)
    prompts = ["a b c d", ids[0], {"prompt_token_ids": ids[1]}, {"prompt": "in the"}]
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    alone = [llm.beam_search([p], params)[0] for p in prompts]
    calls = []
    generate = llm.generate
    monkeypatch.setattr(llm, "generate", lambda ps, *a, **kw: calls.append(len(ps)) or generate(ps, *a, **kw))
    together = llm.beam_search(prompts, params)
    assert calls == [4] + [4 * 3] * 5  # one call per step: the prompts, then 3 live beams each
    assert all(isinstance(o, BeamSearchOutput) and len(o.sequences) == 3 for o in together)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in alone]
    assert together[0].sequences[0].tokens[:len(tok("a b c d").input_ids)] == tok("a b c d").input_ids
    assert together[0].sequences[0].text == tok.decode(together[0].sequences[0].tokens, skip_special_tokens=True)  # as vLLM
    calls.clear()
    limited = llm.beam_search(prompts, params, concurrency_limit=3)  # prompts 0-2, then 3
    assert calls == [3] + [9] * 5 + [1] + [3] * 5
    assert [[s.tokens for s in o.sequences] for o in limited] == [[s.tokens for s in o.sequences] for o in alone]
    assert llm.beam_search("a b c d", params)[0].sequences[0].tokens == together[0].sequences[0].tokens
    assert_no_leaks(llm)


def test_text_skips_special_tokens_unless_asked(llm):
    """vLLM 0.32's offline text: prompt + output decoded with ``skip_special_tokens`` (default
    True), so a chat prompt's markers are left out, as vLLM's ``LLM.beam_search`` leaves them."""
    tok = llm.get_tokenizer()
    prompt = [1, 9, 10, 11, 2, 198, 1, 12]  # <|im_start|> ... <|im_end|>\n<|im_start|> ...
    (out,) = llm.beam_search([prompt], BeamSearchParams(2, 4, ignore_eos=True))
    (kept,) = llm.beam_search([prompt], BeamSearchParams(2, 4, ignore_eos=True, skip_special_tokens=False))
    for s, k in zip(out.sequences, kept.sequences):
        assert s.tokens == k.tokens and s.tokens[: len(prompt)] == prompt
        assert s.text == tok.decode(s.tokens, skip_special_tokens=True) and "<|im_start|>" not in s.text
        assert k.text == tok.decode(k.tokens) and k.text.startswith("<|im_start|>")


def test_temperature_adds_the_sampled_token_to_the_candidates(llm):
    """As in vLLM: above 0 each beam's sampled token joins its top 2k (raw logprobs rank them)."""
    (out,) = llm.beam_search([[7, 8, 9]], BeamSearchParams(2, 5, ignore_eos=True, temperature=1.0))
    assert len(out.sequences) == 2
    for seq in out.sequences:
        assert all(len(e) in (4, 5) for e in seq.logprobs) and len(seq.tokens) == 8
        assert seq.cum_logprob == pytest.approx(sum(e[t] for e, t in zip(seq.logprobs, seq.tokens[3:])))
    assert_no_leaks(llm)


def test_beams_that_fill_the_context_end_with_length(tiny):
    llm = LLM(model=str(tiny[0]), kv_cache_memory=KV, max_model_len=12)
    (out,) = llm.beam_search([[5, 6, 7, 8, 9]], BeamSearchParams(2, 20, ignore_eos=True))
    assert [len(s.tokens) for s in out.sequences] == [12, 12]
    assert all(s.finish_reason == "length" for s in out.sequences)
    assert_no_leaks(llm)
