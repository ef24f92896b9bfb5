"""Property tests for the incremental detokenizer against the default model's real tokenizer
(SmolLM2: GPT-2-style byte-level BPE, 49152 ids, the first 17 are special tokens).

Reference: ``tokenizer.decode(output_ids, skip_special_tokens=...)`` with the tokenizer's own
defaults. The detokenizer decodes with ``clean_up_tokenization_spaces=False``; this tokenizer's
default is False too (and transformers ignores clean-up for BPE), which ``test_reference_decode``
pins, so comparing against the plain default decode is fair.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from vllmini.engine.detokenizer import IncrementalDetokenizer

VOCAB = 49152
SPECIAL_IDS = list(range(17))
FFFD = "\ufffd"
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Tok:
    """The tokenizer with a short repr (hypothesis prints the arguments of a failing example)."""

    def __init__(self, tokenizer):
        self.t = tokenizer

    def __getattr__(self, name):
        return getattr(self.t, name)

    def __repr__(self) -> str:
        return "tok"


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return Tok(AutoTokenizer.from_pretrained(default_model_dir))


@pytest.fixture(scope="module")
def ids(tok):
    """Strategy: arbitrary ids, weighted towards single-byte tokens (lone UTF-8 lead and
    continuation bytes), special tokens and small ids."""
    tokens = tok.convert_ids_to_tokens(list(range(VOCAB)))
    byte_ids = [i for i, t in enumerate(tokens) if len(t) == 1 and i not in SPECIAL_IDS]
    return st.one_of(
        st.integers(0, VOCAB - 1), st.sampled_from(byte_ids), st.sampled_from(SPECIAL_IDS), st.integers(17, 1000)
    )


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


def test_reference_decode(tok):
    """The comparison is fair: the default decode does no clean-up of spaces."""
    ids = tok.encode("Hello , world ! It 's a test . <|im_end|> x", add_special_tokens=False)
    for skip in (True, False):
        plain = tok.decode(ids, skip_special_tokens=skip)
        assert plain == tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert " ," in tok.decode(ids)


@PROPS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_one_at_a_time(tok, ids, data, skip):
    prompt = data.draw(st.lists(ids, max_size=12), label="prompt")
    out = data.draw(st.lists(ids, max_size=40), label="out")
    check_stream(tok, prompt, out, skip)


@PROPS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_in_chunks(tok, ids, data, skip):
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
    """Any text streams like its decode. (Not always ``text`` itself: the vocab lacks some bytes,
    e.g. the lead byte F1 of U+40000..U+7FFFF, which encode drops.)"""
    out = tok.encode(text, add_special_tokens=False)
    check_stream(tok, tok.encode("Hi", add_special_tokens=False), out, skip)


def test_leading_spaces_kept(tok):
    prompt = tok.encode("<|im_start|>assistant\nSure", add_special_tokens=False)
    out = tok.encode(" ok,  two  spaces  and 中文 too", add_special_tokens=False)
    for skip in (True, False):
        assert check_stream(tok, prompt, out, skip).startswith(" ok,  two")


def test_prompt_ending_inside_a_character(tok):
    """A prompt that ends with the first byte of a character: the output is the decode of the
    output ids on their own (its continuation bytes are U+FFFD), not the joined character."""
    byte_id = _byte_ids(tok)
    head, tail = "😀".encode()[:2], "😀".encode()[2:]
    prompt = tok.encode("Hi ", add_special_tokens=False) + [byte_id[b] for b in head]
    out = [byte_id[b] for b in tail] + tok.encode(" ok", add_special_tokens=False)
    for skip in (True, False):
        assert check_stream(tok, prompt, out, skip) == FFFD * 2 + " ok"


def _byte_ids(tok) -> dict[int, int]:
    """Byte -> id of its single-byte token (GPT-2 byte-to-unicode table), for the 235 bytes in
    the vocab (it lacks e.g. C0, C1, F1, F2 and F5..FF)."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = [c for c in range(256) if c not in printable]
    vocab = tok.get_vocab()
    chars = {b: chr(b) if b in printable else chr(256 + extra.index(b)) for b in range(256)}
    return {b: vocab[c] for b, c in chars.items() if c in vocab}


class RecordingTokenizer:
    """Wraps a tokenizer and records the length of every id list given to ``decode``."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kwargs)


@pytest.mark.parametrize("kind", ["random", "invalid_bytes", "split_chars", "specials"])
@pytest.mark.parametrize("skip", [True, False])
def test_work_per_step_is_bounded(tok, kind, skip):
    """2000 output tokens fed one at a time: every decode sees a window of a few tokens, never
    the whole output (a window that waits for a trailing U+FFFD to resolve grows without bound
    on a run of invalid bytes)."""
    rng, n, byte_id = random.Random(kind), 2000, _byte_ids(tok)
    if kind == "random":
        pools = [range(VOCAB), list(byte_id.values()), SPECIAL_IDS]
        out = [rng.choice(rng.choice(pools)) for _ in range(n)]
    elif kind == "invalid_bytes":  # lone continuation bytes: every decode ends in U+FFFD
        out = [byte_id[0x80 + rng.randrange(64)] for _ in range(n)]
    elif kind == "split_chars":  # every character split into single-byte tokens
        out = [byte_id[b] for _ in range(n // 4) for b in rng.choice("😀中é€").encode()]
    else:
        out = [rng.choice(SPECIAL_IDS + [rng.randrange(17, VOCAB)]) for _ in range(n)]
    rec = RecordingTokenizer(tok)
    prompt = tok.encode("A prompt of some length. " * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(rec, prompt, skip)
    for k in range(1, len(out) + 1):
        detok.step(prompt + out[:k])
    detok.step(prompt + out, final=True)
    assert detok.text == tok.decode(out, skip_special_tokens=skip)
    if kind == "split_chars":
        assert FFFD not in detok.text
    assert max(rec.lengths) <= 24, max(rec.lengths)  # _MAX_WINDOW + a few
    assert sum(rec.lengths) <= 64 * len(out)


def test_fast_and_plain_decode_paths_agree(tok):
    """A fast tokenizer is decoded through its Rust backend directly; any other tokenizer through
    ``decode``. Both give the same stream (the backend path is what the default model uses)."""

    class Plain(Tok):
        is_fast = False

    assert IncrementalDetokenizer(tok, [1])._backend is not None
    assert IncrementalDetokenizer(Plain(tok.t), [1])._backend is None
    prompt = tok.encode("Say something:", add_special_tokens=False)
    out = tok.encode(" héllo wörld 🙂 <|im_end|> done", add_special_tokens=False) + [0, 200, 195]
    for skip in (True, False):
        assert check_stream(tok, prompt, out, skip) == check_stream(Plain(tok.t), prompt, out, skip)
