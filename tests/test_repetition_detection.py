"""vLLM's ``SamplingParams.repetition_detection``: a looping output ends early with
finish_reason "repetition" (stop_reason "repetition_detected")."""
from __future__ import annotations

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_engine import assert_no_leaks
from vllmini import LLM, AsyncLLMEngine, EngineArgs, RepetitionDetectionParams, SamplingParams
from vllmini.entrypoints.openai.api_server import build_app


def loops(tokens: list[int], max_size: int, min_size: int, count: int) -> bool:
    """The definition, spelled out: some size k in range has tokens[-k*count:] made of one k-gram."""
    for k in range(max(1, min_size), max_size + 1):
        if k * count <= len(tokens):
            tail = tokens[len(tokens) - k * count :]
            if all(tail[i] == tail[i % k] for i in range(len(tail))):
                return True
    return False


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=30), st.integers(1, 6), st.integers(0, 6), st.integers(2, 4))
def test_detects_exactly_the_repeated_tails(tokens, max_size, min_size, count):
    min_size = min(min_size, max_size)
    params = RepetitionDetectionParams(max_pattern_size=max_size, min_pattern_size=min_size, min_count=count)
    assert params.detects(tokens) == loops(tokens, max_size, min_size, count)


def first_cut(tokens: list[int], min_tokens: int, max_size: int, count: int) -> int | None:
    """Where a sequence decoding ``tokens`` stops: the first length >= min_tokens that loops."""
    return next((n for n in range(max(1, min_tokens), len(tokens) + 1) if loops(tokens[:n], max_size, 1, count)), None)


@pytest.fixture(scope="module")
def plain_outputs(tiny_dir):
    llm = LLM(str(tiny_dir), max_num_seqs=8)
    batch = [{"prompt_token_ids": [(11 * i + j) % 700 + 5 for j in range(3 + i)]} for i in range(8)]
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    return batch, [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("engine_args", [{}, {"async_scheduling": True},
                                         {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                                 "prompt_lookup_max": 3, "prompt_lookup_min": 1}}])  # fmt: skip
def test_outputs_stop_where_their_tail_first_loops(tiny_dir, plain_outputs, engine_args):
    """Greedy outputs of the random model fall into loops: each stops at the first token where
    its tail is a pattern of at most 4 tokens three times (after min_tokens), else runs to its
    length, with any engine (several tokens a step under speculative decoding)."""
    batch, plain = plain_outputs
    llm = LLM(str(tiny_dir), max_num_seqs=8, **engine_args)
    rd = {"max_pattern_size": 4, "min_count": 3}
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, min_tokens=8 * (i % 2), repetition_detection=rd)
              for i in range(len(batch))]  # fmt: skip
    outs = llm.generate(batch, params, use_tqdm=False)
    cut = 0
    for i, (out, want) in enumerate(zip(outs, plain)):
        c = out.outputs[0]
        n = first_cut(want, 8 * (i % 2), 4, 3)
        if n is None:
            assert (list(c.token_ids), c.finish_reason, c.stop_reason) == (want, "length", None)
        else:
            assert (list(c.token_ids), c.finish_reason, c.stop_reason) == (want[:n], "repetition", "repetition_detected")
            cut += 1
    assert cut >= 4  # (the random model loops in most of them)
    assert_no_leaks(llm)


@pytest.mark.parametrize("value, message", [
    ({"max_pattern_size": 4, "min_count": 1}, r"repetition_detection\.min_count must be >= 2"),
    ({"max_pattern_size": 4, "min_pattern_size": 5, "min_count": 2}, r"repetition_detection\.min_pattern_size must be <="),
    ({"max_pattern_size": -1}, r"repetition_detection\.max_pattern_size must be an int >= 0"),
    ({"max_pattern_size": 5000, "min_count": 2}, r"repetition_detection\.max_pattern_size must be at most 1024"),
    ({"max_pattern_size": 2.5, "min_count": 2}, r"repetition_detection\.max_pattern_size must be an int"),
    ({"max_size": 3}, "repetition_detection: Unexpected keyword argument 'max_size'"),
    ("4", "repetition_detection must be a RepetitionDetectionParams"),
])  # fmt: skip
def test_bad_values_are_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(repetition_detection=value)


@pytest.mark.parametrize("value, message", [
    ({"max_pattern_size": 3, "min_count": 2}, None),  # a dict, as the constructor takes
    ({"max_pattern_size": 3, "min_count": 1}, r"repetition_detection\.min_count must be >= 2"),
    (4, "repetition_detection must be a RepetitionDetectionParams"),
])  # fmt: skip
def test_a_value_set_after_construction_is_checked_by_clone(value, message):
    """The engine clones each request's params, which checks again what a caller changed since."""
    params = SamplingParams()
    params.repetition_detection = value
    if message is None:
        assert params.clone().repetition_detection == RepetitionDetectionParams(max_pattern_size=3, min_count=2)
        return
    with pytest.raises(ValueError, match=message):
        params.clone()


def test_off_by_default_and_with_size_zero_and_round_trips_through_json():
    assert SamplingParams().repetition_detection is None
    assert not RepetitionDetectionParams().detects([1, 1, 1, 1])
    params = SamplingParams(repetition_detection=RepetitionDetectionParams(max_pattern_size=3, min_count=2))
    assert msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams) == params
    clone = params.clone()
    params.repetition_detection.min_count = 9
    assert clone.repetition_detection.min_count == 2  # the engine's copy is its own


async def test_server_reports_the_repetition_and_refuses_bad_values(tiny_dir, plain_outputs):
    batch, plain = plain_outputs
    i, n = next((i, n) for i, want in enumerate(plain) if (n := first_cut(want, 0, 4, 3)) is not None)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny"))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as http:
            body = {"model": "tiny", "prompt": batch[i]["prompt_token_ids"], "max_tokens": 48, "temperature": 0,
                    "ignore_eos": True, "repetition_detection": {"max_pattern_size": 4, "min_count": 3}}  # fmt: skip
            ok = await http.post("/v1/completions", json=body)
            assert ok.status_code == 200, ok.text
            choice = ok.json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == ("repetition", "repetition_detected")
            assert ok.json()["usage"]["completion_tokens"] == n
            bad = await http.post("/v1/completions", json={**body, "repetition_detection": {"max_pattern_size": 4}})
            assert bad.status_code == 400 and "repetition_detection.min_count" in bad.json()["error"]["message"]
    finally:
        await engine.shutdown()
    assert_no_leaks(engine)
