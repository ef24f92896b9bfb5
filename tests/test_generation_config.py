"""Default sampling parameters from the model's generation_config.json (vLLM's
generation_config="auto"): they apply to requests that pass no SamplingParams, never to
requests that pass their own."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from helpers import save_tiny_model, tiny_llama_config
from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams

PROMPT = {"prompt_token_ids": [101, 202, 303, 404, 505]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = HFLlama(tiny_llama_config(vocab_size=49152, initializer_range=0.05)).eval()
    out = save_tiny_model(hf, tmp_path_factory.mktemp("genconfig"), default_model_dir)
    config = json.loads((out / "generation_config.json").read_text())
    config.update(temperature=0.7, top_k=1, max_new_tokens=5, do_sample=True)  # top_k=1: deterministic
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


def test_model_defaults_apply_only_without_sampling_params(model_dir, default_model_dir, tmp_path):
    llm = LLM(model=str(model_dir))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 5)
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0].outputs[0]
    implicit = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    assert implicit.token_ids == greedy.token_ids  # top_k=1 from the model's config, 5 tokens
    explicit = llm.generate(PROMPT, SamplingParams(seed=0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(explicit.token_ids) == 16  # SamplingParams' own default max_tokens: nothing merged in

    plain = LLM(model=str(model_dir), generation_config="vllm").get_default_sampling_params()
    assert plain == SamplingParams()
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "repetition_penalty": 1.3}))
    other = LLM(model=str(model_dir), generation_config=str(tmp_path)).get_default_sampling_params()
    assert (other.top_p, other.repetition_penalty, other.top_k, other.max_tokens) == (0.5, 1.3, 0, 16)
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(model=str(model_dir), generation_config=str(tmp_path / "missing"))
    # the bundled default model's config sets none of these: requests keep SamplingParams' defaults
    assert LLM(model=str(default_model_dir)).get_default_sampling_params() == SamplingParams()


async def test_async_engine_uses_the_defaults(model_dir):
    async with AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir))) as engine:
        outs = [o async for o in engine.generate(PROMPT, None, request_id="d")]
    assert len(outs[-1].outputs[0].token_ids) == 5


def test_defaults_are_copies_clamped_and_lenient(model_dir, tmp_path):
    llm = LLM(model=str(model_dir), max_model_len=64)
    mine = llm.get_default_sampling_params()
    mine.max_tokens = 2  # the caller's copy: the engine's defaults stay
    mine.stop.append("x")  # its containers too
    assert llm.get_default_sampling_params().max_tokens == 5
    assert llm.get_default_sampling_params().stop == []
    assert len(llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids) == 5

    # the model's max_new_tokens beyond max_model_len: cut to what is left (vLLM stops there too)
    big = tmp_path / "big"
    big.mkdir()
    (big / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2048, "top_k": 1, "top_p": 0.0}))
    roomy = LLM(model=str(model_dir), max_model_len=64, generation_config=str(big))
    defaults = roomy.get_default_sampling_params()  # top_p 0 is refused by SamplingParams: dropped, logged
    assert (defaults.top_p, defaults.top_k, defaults.max_tokens) == (1.0, 1, 2048)
    out = roomy.generate({"prompt_token_ids": list(range(100, 160))}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
    # a caller's own max_tokens past max_model_len stops there too, as vLLM's LLM.generate does
    out = roomy.generate({"prompt_token_ids": list(range(100, 160))}, SamplingParams(max_tokens=2048, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert len(out.token_ids) == 4 and out.finish_reason == "length"

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json cannot be read"):
        LLM(model=str(model_dir), generation_config=str(broken))
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        LLM(model=str(model_dir), generation_config="no-such-folder")  # a local folder, never a hub id


def test_override_generation_config(model_dir):
    """vLLM's override_generation_config: merged over the model's generation config ("auto"), the
    only defaults with generation_config="vllm"; a dict or JSON text (the CLI's); a field or value it
    cannot take is refused by name before the model loads."""
    merged = LLM(model=str(model_dir), override_generation_config={"temperature": 0.2, "max_new_tokens": 3})
    defaults = merged.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.2, 1, 3)  # top_k: the model's
    assert len(merged.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids) == 3
    alone = LLM(model=str(model_dir), generation_config="vllm", override_generation_config='{"top_p": 0.8}')
    assert alone.get_default_sampling_params() == SamplingParams(top_p=0.8)
    for bad, message in (({"seed": 3}, r"override_generation_config: 'seed' cannot be set; accepted: "),
                         ({"temperature": -1}, r"override_generation_config: temperature must be"),
                         ("[1]", r"override_generation_config must map generation config fields to values")):
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(model_dir), override_generation_config=bad).validate()
