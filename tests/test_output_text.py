"""Text semantics of the output processor against vLLM v1's, driven with scripted tokens (no
model): stop-string precedence, stop-string hold-back, logprobs' decoded_token."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from vllmini.engine.detokenizer import IncrementalDetokenizer
from vllmini.engine.output_processor import OutputProcessor, RequestState
from vllmini.engine.sampler import SamplerOutput
from vllmini.engine.sampling_params import SamplingParams
from vllmini.scheduler.sequence import Sequence, SequenceStatus

EOS = 2


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


class _Scheduler:
    def finish(self, seq, status, reason=None):
        seq.finish(status, reason)


def run(tok, prompt: list[int], params: SamplingParams, script: list[int]):
    """Feed ``script`` one token per step to one sequence; returns the step outputs."""
    op = OutputProcessor(_Scheduler(), (EOS,), 10**6, tok)
    seq = Sequence(0, "r", list(prompt), params, params.max_tokens)
    seq.status = SequenceStatus.RUNNING
    state = RequestState("r", None, list(prompt), params, [seq], [IncrementalDetokenizer(tok, prompt, params.skip_special_tokens)], 0.0)
    state.logprobs, state.cumulative_logprobs, state.sent = [[]], [0.0], [(0, 0)]
    outs = []
    for token in script:
        k = max(params.logprobs or 0, 1)
        sampled = SamplerOutput(
            torch.tensor([token]), torch.tensor([-0.5]),
            (torch.full((1, k), -0.5), torch.tensor([[token] * k])), torch.tensor([False]), torch.tensor([1]),
        )  # fmt: skip
        op.append_token(state, seq, 0, token, sampled)
        if (out := op.make_output(state)) is not None:
            outs.append(out.outputs[0])
        if state.finished:
            return outs
    raise AssertionError("the script ran out before the request finished")


def test_stop_strings_first_listed_wins(tok):
    """vLLM tries the stop strings in the order given and stops at the first one found in the
    new text, not at the one that starts first: ")." is one token here."""
    out = tok.encode("f(x).")
    assert tok.decode(out[-1:]) == ")."
    script = out + [100] * 4
    a = run(tok, [1], SamplingParams(max_tokens=20, stop=[".", ")"]), script)[-1]
    assert (a.text, a.stop_reason, a.finish_reason) == ("f(x)", ".", "stop")
    b = run(tok, [1], SamplingParams(max_tokens=20, stop=[")", "."]), script)[-1]
    assert (b.text, b.stop_reason, b.finish_reason) == ("f(x", ")", "stop")
    c = run(tok, [1], SamplingParams(max_tokens=20, stop=[".", ")"], include_stop_str_in_output=True), script)[-1]
    assert (c.text, c.stop_reason) == ("f(x).", ".")


def test_include_stop_str_streams_without_holdback(tok):
    """A stop string kept in the output cuts nothing that was streamed before it completes,
    so (as vLLM) no text is held back: each delta is its token's text at once."""
    script = tok.encode(" one two three END four")
    params = SamplingParams(max_tokens=20, stop=["END"], include_stop_str_in_output=True, output_kind="delta")
    outs = run(tok, [1], params, script)
    assert [o.text for o in outs] == [tok.decode([t]) for t in script[: len(outs)]]
    assert "".join(o.text for o in outs) == " one two three END" and outs[-1].stop_reason == "END"
    # without include_stop_str_in_output the possible start of a stop string is held back
    held = run(tok, [1], SamplingParams(max_tokens=20, stop=["END"], output_kind="delta"), script)
    assert held[0].text == " o" and "".join(o.text for o in held) == " one two three "


@pytest.mark.parametrize("text", ["好😀 ok", "日本語", "🤖🤖x", "plain text"])
def test_logprobs_decoded_token_of_split_characters(tok, text):
    """vLLM (PR 28874 / 34875) reads a token whose own text ends in U+FFFD against the sampled
    tokens before it: the token completing a character carries it, the pieces before carry ""
    (the first sampled token has no context, so a piece there is ""). So the sampled tokens'
    decoded_token strings join to the text instead of a run of U+FFFD."""
    script = tok.encode(text) + [EOS]
    assert any(tok.decode([t]) == "\ufffd" for t in script) or text == "plain text"
    outs = run(tok, [1], SamplingParams(max_tokens=20, logprobs=1), script)
    final = outs[-1]
    tokens = [e[t].decoded_token for t, e in zip(final.token_ids, final.logprobs)]
    assert "".join(tokens[:-1]) == text == final.text and tokens[-1] == "<|im_end|>"
    assert all("\ufffd" not in d for d in tokens)


def test_logprob_entry_ranks_follow_the_top_n_as_vllm(tok):
    """The chosen token tied with another for the best logprob counts 2 tokens at least as likely,
    but when it is in the top-N its rank is its place there (vLLM's LogprobsProcessor writes the
    top-N over it), so the entry's ranks are 1..N once each; outside the top-N it keeps its own."""
    op = OutputProcessor(_Scheduler(), (EOS,), 10**6, tok)
    state = RequestState("r", None, [1], SamplingParams(logprobs=2), [], [], 0.0)
    entry = op.logprob_entry(state, 7, -0.5, 2, [-0.5, -0.5], [7, 9])
    assert list(entry) == [7, 9] and [v.rank for v in entry.values()] == [1, 2]
    entry = op.logprob_entry(state, 7, -0.5, 2, [-0.5, -0.5], [9, 7])
    assert list(entry) == [7, 9] and [v.rank for v in entry.values()] == [2, 1]
    entry = op.logprob_entry(state, 7, -0.5, 3, [-0.5, -0.5], [9, 11])
    assert list(entry) == [7, 9, 11] and [v.rank for v in entry.values()] == [3, 1, 2]


def test_logprobs_decoded_token_keeps_invalid_bytes_that_nothing_completes(tok):
    """A lone continuation byte completes nothing: "" as in vLLM; the text keeps its U+FFFD."""
    lone = tok.convert_tokens_to_ids("Ģ")  # byte 0x80
    script = tok.encode("a") + [lone] + tok.encode("b") + [EOS]
    final = run(tok, [1], SamplingParams(max_tokens=20, logprobs=0), script)[-1]
    assert final.text == "a\ufffdb"
    assert [e[t].decoded_token for t, e in zip(final.token_ids, final.logprobs)] == ["a", "", "b", "<|im_end|>"]


def test_prompt_logprobs_decoded_token_of_split_characters(default_model_dir, tok):
    """The same reading for prompt_logprobs, against the prompt tokens before (from the second:
    the first has no entry, as in vLLM)."""
    from vllmini import LLM

    torch.set_num_threads(1)
    llm = LLM(model=str(default_model_dir), max_model_len=64)
    prompt = tok.encode("ab 日本語😀 ok")
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    entries = out.prompt_logprobs
    assert entries[0] is None and len(entries) == len(prompt)
    texts = [e[t].decoded_token for t, e in zip(prompt[1:], entries[1:])]
    assert "".join(texts) == tok.decode(prompt[1:]) and all("\ufffd" not in t for t in texts)


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final"])
def test_character_cut_at_the_end_is_left_out_as_vllm(tok, kind):
    """vLLM does not flush its decode stream when a request ends: the pieces of a character that
    max_tokens (or EOS) cut off are left out of the text, not shown as U+FFFD."""
    emoji = tok.encode("ok 😀")
    cut = emoji[:-1]
    assert tok.decode(cut) == "ok \ufffd" and tok.decode(cut[-1:]) == " \ufffd"
    # (" " and the emoji's first byte are one token: it goes with them, as in vLLM's DecodeStream)

    def final_text(params, script):
        outs = run(tok, [1], params, script)
        return "".join(o.text for o in outs) if kind == "delta" else outs[-1].text, outs[-1].finish_reason

    assert final_text(SamplingParams(max_tokens=len(cut), output_kind=kind), cut) == ("ok", "length")
    assert final_text(SamplingParams(max_tokens=20, output_kind=kind), cut + [EOS]) == ("ok", "stop")
    kept = SamplingParams(max_tokens=20, output_kind=kind, skip_special_tokens=False, include_stop_str_in_output=True)
    assert final_text(kept, cut + [EOS]) == (tok.decode(cut + [EOS]), "stop")  # EOS's text ends it: decoded as it stands
    assert final_text(SamplingParams(max_tokens=len(emoji), output_kind=kind), emoji) == ("ok 😀", "length")


def test_spaces_between_special_tokens_is_accepted(tok):
    """vLLM's SamplingParams field: accepted (a bool) instead of refused as unknown; with a fast
    tokenizer the text of adjacent special tokens is their content either way, as vLLM's."""
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")
    script = [1, 1, 2] + tok.encode("x") + [100] * 3
    for spaces in (True, False):
        params = SamplingParams(max_tokens=4, ignore_eos=True, skip_special_tokens=False, spaces_between_special_tokens=spaces)
        assert run(tok, [5], params, script)[-1].text == "<|im_start|><|im_start|><|im_end|>x"
