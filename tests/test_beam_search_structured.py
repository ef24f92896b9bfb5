"""``BeamSearchParams.structured_outputs`` (vLLM 0.32's): each beam constrained by the grammar. The
expected beams are vLLM 0.32's own (its offline beam search on the default model, fp32, with
``structured_outputs_config={"backend": "xgrammar"}``: its default "auto" backend fails there),
written out: these tests need neither vLLM nor the network."""
from __future__ import annotations

import asyncio
import json
import re

import pytest

from vllmini import LLM, AsyncLLMEngine, EngineArgs
from vllmini.engine.beam_search import BeamSearchParams
from vllmini.engine.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")

PROMPTS = [{"prompt": "Is the sky blue? Answer:"}, {"prompt": "The capital of France is"}]
REGEX = r" [A-Z][a-z]+\."
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# vLLM 0.32's beams per prompt: (generated token ids, cumulative logprob), best first
VLLM_REGEX = [[([9230, 30, 2], -6.3964)], [([7042, 30, 2], -3.572), ([4528, 30, 2], -7.4601)]]
VLLM_JSON = [[([39428, 81, 18, 216, 198, 42, 216, 34], -44.3169), ([39428, 81, 18, 216, 198, 42, 216, 198], -44.4477),
              ([39428, 81, 18, 216, 198, 42, 216, 33], -44.5069)],
             [([107, 629, 476, 81, 1799, 33, 32, 32], -33.4723), ([107, 629, 476, 81, 1799, 216, 33, 32], -33.5373),
              ([107, 629, 476, 81, 1799, 33, 34, 35], -33.6931)]]  # fmt: skip


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=str(default_model_dir), dtype="float32", max_model_len=512, kv_cache_memory=64 << 20)


def beams(llm: LLM, so: StructuredOutputsParams, **params) -> list[list[tuple[list[int], float]]]:
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8, structured_outputs=so, **params))
    lengths = [len(llm.get_tokenizer()(p["prompt"]).input_ids) for p in PROMPTS]
    return [[(s.tokens[n:], s.cum_logprob) for s in out.sequences] for out, n in zip(outs, lengths)]


def assert_beams(got: list, want: list) -> None:
    assert [[ids for ids, _ in per] for per in got] == [[ids for ids, _ in per] for per in want]
    assert [lp for per in got for _, lp in per] == pytest.approx([lp for per in want for _, lp in per], abs=1e-3)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_beams_follow_the_grammar_as_vllms(llm, ignore_eos):
    """A beam whose grammar has ended (after its EOS) is completed, with ignore_eos too (vLLM's then
    lists such a beam twice, a bug not copied)."""
    regex = beams(llm, StructuredOutputsParams(regex=REGEX), ignore_eos=ignore_eos)
    assert_beams(regex, VLLM_REGEX)
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=ignore_eos,
                                                     structured_outputs=StructuredOutputsParams(regex=REGEX)))  # fmt: skip
    for prompt, out in zip(PROMPTS, outs):
        for seq in out.sequences:
            assert re.fullmatch(REGEX, seq.text[len(prompt["prompt"]) :]) and seq.finish_reason == "stop"
    assert_beams(beams(llm, StructuredOutputsParams(json=SCHEMA), ignore_eos=ignore_eos), VLLM_JSON)


def test_a_choice_constrains_the_beams(llm):
    """(vLLM 0.32's beam search fails on a choice: "grammar is not of valid supported types".)"""
    outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=8, structured_outputs=
                                                     StructuredOutputsParams(choice=["yes", "no", "Paris"])))  # fmt: skip
    texts = [[s.text[len(p["prompt"]) :] for s in out.sequences] for p, out in zip(PROMPTS, outs)]
    assert all(t in ("yes", "no", "Paris") for per in texts for t in per) and all(texts)


def test_a_bad_constraint_is_refused_before_any_work(llm, monkeypatch):
    with pytest.raises(ValueError, match="structured_outputs"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs={"regex": "a"})  # type: ignore[arg-type]
    monkeypatch.setattr(llm, "generate", lambda *a, **k: pytest.fail("a step ran"))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex cannot be used"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=4,
                                                  structured_outputs=StructuredOutputsParams(regex="(")))  # fmt: skip


def test_the_async_engines_beam_search_is_constrained_too(tiny_dir):
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=32 << 20))

    async def run():
        params = BeamSearchParams(beam_width=2, max_tokens=12, structured_outputs=StructuredOutputsParams(json=SCHEMA))
        return [out async for out in engine.beam_search("Hi", "b1", params)][-1]

    try:
        final = asyncio.run(run())
    finally:
        engine.shutdown()
    for c in final.outputs:  # (a random model: what it writes, the grammar allows)
        assert c.text.startswith("{") or c.text == "", c.text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text)["a"], int)
