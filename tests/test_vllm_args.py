"""vLLM's engine arguments that name a choice vllmini does not have (accepted at vllmini's value,
refused by name otherwise), kv_cache_memory_bytes, and hf_overrides (checked against transformers)."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from helpers import assert_greedy_matches, hf_greedy
from vllmini import LLM, AsyncEngineArgs, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.cli import main
from vllmini.vllm_args import FIXED

VLLM_STYLE = dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1, enable_chunked_prefill=True,
                  quantization=None, calculate_kv_scales=False, tokenizer_mode="hf", load_format="safetensors",
                  cpu_offload_gb=0)  # fmt: skip
REFUSED = dict(tensor_parallel_size=2, pipeline_parallel_size=4, data_parallel_size=2, enable_chunked_prefill=False,
               quantization="bitsandbytes", calculate_kv_scales=True, tokenizer_mode="mistral", load_format="pt", cpu_offload_gb=4)  # fmt: skip
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 17, 300, 42, 9, 1200, 77, 3]}


def test_every_fixed_argument_is_covered():
    assert set(VLLM_STYLE) == set(REFUSED) == set(FIXED)


def test_vllm_style_arguments_run_the_same_engine(tiny_dir):
    plain = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24)
    ported = LLM(model=str(tiny_dir), kv_cache_memory_bytes=1 << 24, **VLLM_STYLE)
    assert ported.llm_engine.num_blocks == plain.llm_engine.num_blocks
    assert ported.llm_engine.args.kv_cache_memory == 1 << 24
    want = plain.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert ported.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_value_vllmini_cannot_honour_is_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"^{name}={REFUSED[name]!r} is not supported: .*\(accepted: "):
        EngineArgs(**{name: REFUSED[name]}).validate()


def test_true_is_not_taken_for_one_nor_none_for_false():
    with pytest.raises(ValueError, match="tensor_parallel_size=True"):
        EngineArgs(tensor_parallel_size=True).validate()
    with pytest.raises(ValueError, match="cpu_offload_gb=None"):
        EngineArgs(cpu_offload_gb=None).validate()
    with pytest.raises(ValueError, match="enable_sleep_mode must be True or False, got None"):
        EngineArgs(enable_sleep_mode=None).validate()  # (a real setting now: engine/worker.py)


def test_kv_cache_memory_and_its_vllm_name_must_agree():
    assert EngineArgs(kv_cache_memory=4096, kv_cache_memory_bytes=4096).kv_cache_memory == 4096
    with pytest.raises(ValueError, match="kv_cache_memory=4096 and kv_cache_memory_bytes=8192 disagree"):
        EngineArgs(kv_cache_memory=4096, kv_cache_memory_bytes=8192)
    with pytest.raises(ValueError, match="kv_cache_memory must be a positive integer"):
        EngineArgs(kv_cache_memory_bytes=0).validate()


def test_the_command_line_takes_them_too(capsys):
    assert main(["generate", "--tensor-parallel-size", "2", "hi"]) == 2
    assert "tensor_parallel_size=2 is not supported: vllmini runs a model on one device" in capsys.readouterr().err
    assert main(["generate", "--no-enable-chunked-prefill", "hi"]) == 2
    assert "enable_chunked_prefill=False is not supported" in capsys.readouterr().err
    assert main(["generate", "--hf-overrides", "{not json", "hi"]) == 2
    assert "hf_overrides must be a JSON object" in capsys.readouterr().err


def test_hf_overrides_change_the_model_as_transformers_would(tiny_dir):
    """A dict-valued field (rope_parameters) is updated key by key: rope_theta changes, the llama3
    scaling stays. The engine's prompt logprobs and greedy tokens equal transformers' on the
    overridden config (whose logprobs differ from the plain model's), and max_model_len follows
    max_position_embeddings."""
    overrides = {"rope_parameters": {"rope_theta": 50.0}, "max_position_embeddings": 300}
    llm = LLM(model=str(tiny_dir), hf_overrides=overrides)
    hf_config = llm.llm_engine.hf_config
    assert hf_config.rope_parameters["rope_theta"] == 50.0 and hf_config.rope_parameters["rope_type"] == "llama3"
    assert llm.llm_engine.max_model_len == 300
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    ids = PROMPT["prompt_token_ids"]
    got = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])

    def prompt_logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]

    config = AutoConfig.from_pretrained(tiny_dir)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 50.0}
    oracle = LlamaForCausalLM.from_pretrained(tiny_dir, config=config, dtype=torch.float32).eval()
    want = prompt_logprobs(oracle)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    plain = LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    assert (prompt_logprobs(plain) - want).abs().max() > 10 * 2e-4  # the override matters, well past the tolerance
    tokens, gaps = hf_greedy(oracle, ids, params.max_tokens)
    assert_greedy_matches(list(out.outputs[0].token_ids), tokens, gaps, "hf_overrides")


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", {"": 1}, {1: 2}, 5])
def test_bad_hf_overrides_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="hf_overrides must"):
        EngineArgs(hf_overrides=bad).validate()


def test_async_engine_args_is_vllms_name_for_the_same_fields(tiny_dir):
    async def run() -> list[int]:
        args = AsyncEngineArgs(model=str(tiny_dir), tensor_parallel_size=1, kv_cache_memory_bytes=1 << 24)
        async with AsyncLLMEngine.from_engine_args(args) as engine:
            async for out in engine.generate(PROMPT, GREEDY, "r"):
                pass
        return list(out.outputs[0].token_ids)

    want = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24).generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert asyncio.run(run()) == list(want.outputs[0].token_ids)
