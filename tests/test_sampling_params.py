"""SamplingParams: vLLM defaults, normalization, one rejected case per bad value, JSON round-trip."""
from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllmini.engine.sampling_params import SAMPLING_EPS, RequestOutputKind, SamplingParams, SamplingType


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (16, 0, [], [])
    assert (p.ignore_eos, p.logprobs, p.repetition_penalty) == (False, None, 1.0)
    assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)
    assert (p.include_stop_str_in_output, p.skip_special_tokens, p.output_kind) == (False, True, "cumulative")
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_keyword_construction_and_greedy():
    p = SamplingParams(max_tokens=32, temperature=0)
    assert p.max_tokens == 32 and p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.0).is_greedy
    low = SamplingParams(temperature=1e-6)  # vLLM raises (0, 0.01) to 0.01: only 0 is greedy
    assert low.temperature == 0.01 and not low.is_greedy and low.clone().temperature == 0.01
    assert SamplingParams(temperature=0.02).temperature == 0.02
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(seed=3, temperature=0).sampling_type is SamplingType.GREEDY
    with pytest.raises(TypeError):
        SamplingParams(1)  # keyword-only, like vLLM's usage
    with pytest.raises(TypeError):
        SamplingParams(max_token=3)  # typo'd field names are not silently ignored


def test_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop=None).stop == [] and SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    assert SamplingParams(top_k=-1).top_k == 0 and not SamplingParams(top_k=-1).top_k_enabled
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(min_tokens=5, max_tokens=5).min_tokens == 5
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1  # the whole vocabulary (the engine resolves it)
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-1).sampling_type is SamplingType.RANDOM  # vLLM's "no seed"
    assert SamplingParams(seed=-2).seed == -2
    for kind, name in ((RequestOutputKind.CUMULATIVE, "cumulative"), (RequestOutputKind.DELTA, "delta"),
                       (RequestOutputKind.FINAL_ONLY, "final")):  # fmt: skip
        p = SamplingParams(output_kind=kind)  # vLLM's enum, stored as our string (and so JSON-safe)
        assert p.output_kind == name and msgspec.json.decode(msgspec.json.encode(p), type=SamplingParams) == p
        assert p.output_kind == kind and SamplingParams(output_kind=name).output_kind == kind  # vLLM code compares so


def test_default_lists_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


BAD = [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", True), ("n", 16385), ("n", 10**9),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", math.nan), ("top_p", None),
    ("top_k", -2), ("top_k", 2.0), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", math.nan),
    ("seed", 1.0), ("seed", "7"), ("seed", False),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 1.0),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 5),
    ("stop_token_ids", [1.0]), ("stop_token_ids", ["1"]), ("stop_token_ids", [-1]), ("stop_token_ids", [True]),
    ("stop_token_ids", 3),
    ("ignore_eos", 1), ("ignore_eos", "yes"),
    ("logprobs", -2), ("logprobs", 1.0), ("logprobs", True), ("prompt_logprobs", -2),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    # finite in float64, not in the sampler's float32 (inf temperature, a penalty that rounds to 0)
    ("temperature", 1e39), ("repetition_penalty", 1e39), ("repetition_penalty", 1e-50),
    ("presence_penalty", 10**400),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("presence_penalty", math.nan),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("include_stop_str_in_output", 0), ("skip_special_tokens", None), ("detokenize", 0),
    ("output_kind", "streaming"), ("output_kind", 1),
]  # fmt: skip


def test_n_is_capped_as_vllm_caps_it(monkeypatch):
    """Every sequence of a request is made when it is added: n is bounded by vLLM's default
    VLLM_MAX_N_SEQUENCES (16384), which $VLLMINI_MAX_N_SEQUENCES changes."""
    assert SamplingParams(n=16384, temperature=1.0).n == 16384
    monkeypatch.setenv("VLLMINI_MAX_N_SEQUENCES", "4")
    assert SamplingParams(n=4, temperature=1.0).n == 4
    with pytest.raises(ValueError, match=r"n must be an int in \[1, 4\]"):
        SamplingParams(n=5, temperature=1.0)


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_rejects_bad_value(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="stop strings need detokenize=True.*stop=\\['x'\\]"):
        SamplingParams(stop="x", detokenize=False)
    assert SamplingParams(stop_token_ids=[5], detokenize=False).stop_token_ids == [5]  # ids need no text


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens.*max_tokens"):
        SamplingParams(min_tokens=17, max_tokens=16)


def test_boundaries_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, top_k=1, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=1e-3, temperature=100, n=8, seed=-5, logprobs=20)  # fmt: skip
    SamplingParams(temperature=3.4e38, repetition_penalty=2.0**-149)  # the float32 extremes


def _params(n: int, temperature: float, **kwargs) -> SamplingParams:
    """(greedy sampling takes n=1 only: more is refused, as in vLLM)"""
    return SamplingParams(n=1 if temperature < SAMPLING_EPS else n, temperature=temperature, **kwargs)


params_st = st.builds(
    _params,
    n=st.integers(1, 8),
    temperature=st.floats(0, 5),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    max_tokens=st.none() | st.integers(20, 4096),
    min_tokens=st.integers(0, 20),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=3) | st.text(min_size=1, max_size=4),
    stop_token_ids=st.lists(st.integers(0, 50000), max_size=3),
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20),
    repetition_penalty=st.floats(0.01, 5),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    include_stop_str_in_output=st.booleans(),
    skip_special_tokens=st.booleans(),
    output_kind=st.sampled_from(["cumulative", "delta", "final"]),
)


@settings(deadline=None, max_examples=100)
@given(params_st)
def test_msgspec_json_round_trip(p):
    data = msgspec.json.encode(p)
    q = msgspec.json.decode(data, type=SamplingParams)
    assert q == p
    assert msgspec.json.encode(q) == data


def test_decode_validates():
    with pytest.raises(ValueError, match="top_p"):
        msgspec.json.decode(b'{"top_p": 0}', type=SamplingParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"n": "2"}', type=SamplingParams)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"bogus": 1}', type=SamplingParams)
    p = msgspec.json.decode(b'{"temperature": 0, "stop": "x"}', type=SamplingParams)
    assert p.is_greedy and p.stop == ["x"]


def test_greedy_sampling_takes_one_sequence_as_in_vllm():
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        SamplingParams(n=2, temperature=0)
    assert SamplingParams(n=2, temperature=0.5).n == 2 and SamplingParams(n=1, temperature=0).is_greedy
