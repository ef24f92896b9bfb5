"""Property tests for the incremental detokenizer against the default model's real tokenizer
(SmolLM2: GPT-2-style byte-level BPE, 49152 ids, the first 17 are special tokens).

Reference: ``tokenizer.decode(output_ids, skip_special_tokens=...)`` with the tokenizer's own
defaults. The detokenizer decodes with ``clean_up_tokenization_spaces=False``; this tokenizer's
default is False too (and transformers ignores clean-up for BPE), which ``test_reference_decode``
pins, so comparing against the plain default decode is fair.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from vllmini.engine.detokenizer import IncrementalDetokenizer

VOCAB = 49152
SPECIAL_IDS = list(range(17))
FFFD = "\ufffd"
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def byte_ids(tok) -> list[int]:
    """Ids of the single-byte tokens (lone UTF-8 lead/continuation bytes among them)."""
    tokens = tok.convert_ids_to_tokens(list(range(VOCAB)))
    return [i for i, t in enumerate(tokens) if len(t) == 1 and i not in SPECIAL_IDS]


def stream(tok, prompt: list[int], out: list[int], skip: bool, chunks: list[int] | None = None):
    """Feed ``prompt + out`` to a detokenizer, ``chunks`` new tokens at a time (cycled; 1 if None),
    then flush. Returns (deltas of the non-final steps, with the number of output tokens fed so
    far, final delta, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt, skip)
    steps, k, i = [], 0, 0
    while k < len(out):
        k = min(len(out), k + (chunks[i % len(chunks)] if chunks else 1))
        i += 1
        steps.append((k, detok.step(prompt + out[:k])))
    last = detok.step(prompt + out, final=True)
    return steps, last, detok


def check_stream(tok, prompt, out, skip, chunks=None, expected=None):
    steps, last, detok = stream(tok, prompt, out, skip, chunks)
    want = tok.decode(out, skip_special_tokens=skip)
    if expected is not None:
        assert want == expected
    deltas = [d for _, d in steps] + [last]
    for d in deltas:
        assert isinstance(d, str)
        d.encode("utf-8")  # no lone surrogates
    assert "".join(deltas) == want == detok.text
    # Mid-stream text is final text: the cumulative text is always a prefix of the final decode,
    # so a U+FFFD shows up before the flush only where the full decode has one too.
    cum = ""
    for k, d in steps:
        cum += d
        assert want.startswith(cum), (k, cum, want)
        # and it does not lag: everything but the last few tokens' text is out already
        # (a character spans at most 4 byte tokens; the last char of that decode may still change).
        lag = tok.decode(out[: max(k - 4, 0)], skip_special_tokens=skip)
        assert len(cum) >= len(lag) - 1, (k, cum, lag)
    return want


def token_ids(byte_ids):
    """Arbitrary ids, weighted towards single bytes, special tokens and small ids."""
    return st.one_of(
        st.integers(0, VOCAB - 1),
        st.sampled_from(byte_ids),
        st.sampled_from(SPECIAL_IDS),
        st.integers(17, 1000),
    )


def test_reference_decode(tok):
    """The comparison is fair: the default decode does no clean-up of spaces."""
    ids = tok.encode("Hello , world ! It 's a test . <|im_end|> x", add_special_tokens=False)
    for skip in (True, False):
        plain = tok.decode(ids, skip_special_tokens=skip)
        assert plain == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert " ," in tok.decode(ids)


@PROPS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_one_at_a_time(tok, byte_ids, data, skip):
    ids = token_ids(byte_ids)
    prompt = data.draw(st.lists(ids, max_size=12), label="prompt")
    out = data.draw(st.lists(ids, max_size=40), label="out")
    check_stream(tok, prompt, out, skip)


@PROPS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_in_chunks(tok, byte_ids, data, skip):
    ids = token_ids(byte_ids)
    prompt = data.draw(st.lists(ids, max_size=12), label="prompt")
    out = data.draw(st.lists(ids, max_size=40), label="out")
    chunks = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=6), label="chunks")
    check_stream(tok, prompt, out, skip, chunks)


MULTIBYTE = "éèüñøßçæ中文日本語한국어😀🎉👍🏽👨‍👩‍👧🇫🇷∑≠→€ \n\tab"


@PROPS
@given(
    text=st.text(alphabet=MULTIBYTE, max_size=40),
    prompt_text=st.text(alphabet=MULTIBYTE, max_size=10),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    skip=st.booleans(),
)
def test_multibyte_text(tok, text, prompt_text, chunks, skip):
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    out = tok.encode(text, add_special_tokens=False)
    check_stream(tok, prompt, out, skip, expected=text)
    check_stream(tok, prompt, out, skip, chunks, expected=text)


@PROPS
@given(text=st.text(max_size=30), skip=st.booleans())
def test_arbitrary_text(tok, text, skip):
    """Any valid text (surrogates excluded by encode) round-trips through streaming."""
    out = tok.encode(text, add_special_tokens=False)
    check_stream(tok, tok.encode("Hi", add_special_tokens=False), out, skip, expected=text)


def test_leading_spaces_kept(tok):
    prompt = tok.encode("<|im_start|>assistant\nSure", add_special_tokens=False)
    out = tok.encode(" ok,  two  spaces  and 中文 too", add_special_tokens=False)
    for skip in (True, False):
        assert check_stream(tok, prompt, out, skip).startswith(" ok,  two")


def test_prompt_ending_inside_a_character(tok, byte_ids):
    """A prompt that ends with the first byte of a character: the output is the decode of the
    output ids on their own (its continuation bytes are U+FFFD), not the joined character."""
    head, tail = "😀".encode()[:2], "😀".encode()[2:]
    by_byte = {tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(i)): tok.decode([i]).encode("utf-8", "surrogateescape") for i in byte_ids}
    byte_tok = {tok.decode([i], skip_special_tokens=False): i for i in byte_ids}
    del by_byte, byte_tok  # (ids found below through the vocab instead)
    ids = [_byte_id(tok, b) for b in head], [_byte_id(tok, b) for b in tail]
    prompt = tok.encode("Hi ", add_special_tokens=False) + ids[0]
    out = ids[1] + tok.encode(" ok", add_special_tokens=False)
    for skip in (True, False):
        assert check_stream(tok, prompt, out, skip) == FFFD * 2 + " ok"


def _byte_id(tok, b: int) -> int:
    """The id of the single-byte token for byte ``b`` (GPT-2 byte-to-unicode table)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [c for c in range(256) if c not in printable]
    char = chr(b) if b in printable else chr(256 + extra.index(b))
    return tok.convert_tokens_to_ids(char)


class RecordingTokenizer:
    """Wraps a tokenizer and records the length of every id list given to ``decode``."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)


@pytest.mark.parametrize("kind", ["random", "invalid_bytes", "split_chars", "specials"])
@pytest.mark.parametrize("skip", [True, False])
def test_work_per_step_is_bounded(tok, byte_ids, kind, skip):
    """2000 output tokens fed one at a time: every decode sees a window of a few tokens, never
    the whole output (the old code's window grew without bound behind a trailing U+FFFD)."""
    import random

    rng = random.Random(kind)
    n = 2000
    if kind == "random":
        out = [rng.choice([rng.randrange(VOCAB), rng.choice(byte_ids), rng.choice(SPECIAL_IDS)]) for _ in range(n)]
    elif kind == "invalid_bytes":  # lone continuation bytes: every decode ends in U+FFFD
        out = [_byte_id(tok, 0x80 + rng.randrange(64)) for _ in range(n)]
    elif kind == "split_chars":  # every character split into single-byte tokens
        out = [_byte_id(tok, b) for _ in range(n // 4) for b in rng.choice("😀中é€").encode()]
    else:
        out = [rng.choice(SPECIAL_IDS + [rng.randrange(17, VOCAB)]) for _ in range(n)]
    rec = RecordingTokenizer(tok)
    prompt = tok.encode("A prompt of some length. " * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(rec, prompt, skip)
    for k in range(1, len(out) + 1):
        detok.step(prompt + out[:k])
    detok.step(prompt + out, final=True)
    assert detok.text == tok.decode(out, skip_special_tokens=skip)
    assert max(rec.lengths) <= 16, max(rec.lengths)
    assert sum(rec.lengths) <= 64 * len(out)
