"""The offline ``LLM`` as vLLM 0.32's, where a run of it (the default model, fp32) showed what
vllmini lacked: ``enqueue_chat``, ``model_config`` (the same object as
``llm_engine.model_config``), and ``tokenization_kwargs`` on the pooling calls, whose
``truncate_prompt_tokens`` keeps a pooled prompt's first tokens (vLLM 0.32's pooling tokenizers
truncate on the right; generate's on the left). The expected values are vLLM's, written out:
these tests need neither vLLM nor the network (the tiny models share the default tokenizer)."""
from __future__ import annotations

import inspect

import pytest
import torch

from test_engine import assert_no_leaks
from vllmini import LLM, SamplingParams

KV = 32 << 20
HI = [{"role": "user", "content": "hi"}]
YES = [{"role": "user", "content": "Say yes."}]
SEVEN = "one two three four five six seven"  # vLLM 0.32's ids: 537 827 1296 1876 2531 2976 4962
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), kv_cache_memory=KV, max_model_len=256)


@pytest.fixture(scope="module")
def pooling(tiny_dir):
    return LLM(model=str(tiny_dir), runner="pooling", kv_cache_memory=KV, max_model_len=64)


def test_enqueue_chat_takes_chats_arguments_and_queues_for_wait_for_completion(llm):
    chat_params = list(inspect.signature(llm.chat).parameters)
    # vLLM 0.32's enqueue_chat (less its mm_processor_kwargs): chat's arguments in chat's order
    assert list(inspect.signature(llm.enqueue_chat).parameters) == chat_params == [
        "messages", "sampling_params", "use_tqdm", "lora_request", "priority", "chat_template",
        "chat_template_content_format", "add_generation_prompt", "continue_final_message", "tools",
        "chat_template_kwargs", "tokenization_kwargs"]  # fmt: skip
    want = llm.chat([HI, YES], GREEDY, use_tqdm=False) + llm.generate(["Hello"], GREEDY, use_tqdm=False)
    one = llm.enqueue_chat(HI, GREEDY, use_tqdm=False)  # (one conversation, or a batch: as chat)
    two = llm.enqueue_chat([HI, YES], GREEDY, use_tqdm=False)
    three = llm.enqueue(["Hello"], GREEDY, use_tqdm=False)
    assert (len(one), len(two), len(three)) == (1, 2, 1) and llm.enqueue_chat([], GREEDY) == []
    got = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in got] == one + two + three  # (request id order, as vLLM's)
    assert [o.outputs[0].token_ids for o in got] == [want[0].outputs[0].token_ids, *(
        o.outputs[0].token_ids for o in want)]  # fmt: skip
    assert got[0].prompt == want[0].prompt and got[0].prompt.startswith("<|im_start|>system")
    cut = llm.enqueue_chat([{"role": "user", "content": "hi there friend"}], GREEDY, use_tqdm=False,
                           tokenization_kwargs={"truncate_prompt_tokens": 5})  # fmt: skip
    assert len(llm.wait_for_completion(use_tqdm=False)[0].prompt_token_ids) == 5 and len(cut) == 1
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.enqueue_chat(HI, GREEDY, continue_final_message=True)
    assert llm.wait_for_completion(use_tqdm=False) == []  # (nothing queued by a refused call)
    assert_no_leaks(llm)


def test_model_config_is_the_engines_and_reads_as_vllms(llm, tiny_dir):
    mc = llm.model_config
    assert mc is llm.llm_engine.model_config
    hf = llm.llm_engine.hf_config
    assert (mc.model, mc.tokenizer, mc.served_model_name) == (str(tiny_dir),) * 3
    assert (mc.dtype, mc.max_model_len, mc.runner_type, mc.convert_type) == (torch.float32, 256, "generate", "none")
    assert (mc.seed, mc.max_logprobs, mc.quantization, mc.trust_remote_code) == (0, 20, None, False)
    assert (mc.architectures, mc.architecture) == (["LlamaForCausalLM"], "LlamaForCausalLM")
    assert mc.hf_config is hf and mc.hf_text_config is hf and mc.hf_overrides == {}
    assert (mc.logprobs_mode, mc.generation_config, mc.tokenizer_mode) == ("raw_logprobs", "auto", "auto")
    assert not mc.is_multimodal_model and not mc.is_encoder_decoder and mc.pooler_config is None
    assert mc.get_vocab_size() == 49152 and mc.get_hidden_size() == mc.get_inputs_embeds_size() == hf.hidden_size
    assert mc.get_head_size() == hf.hidden_size // hf.num_attention_heads and mc.get_sliding_window() is None
    assert mc.get_total_num_kv_heads() == mc.get_num_kv_heads(None) == hf.num_key_value_heads
    assert mc.get_num_attention_heads(None) == hf.num_attention_heads and mc.get_num_layers(None) == hf.num_hidden_layers
    assert mc.get_diff_sampling_param() == {}  # (the default model's generation config sets no sampling field)


def test_pooling_calls_take_tokenization_kwargs_and_truncate_as_vllm(pooling):
    def ids(**kwargs):
        return [list(o.prompt_token_ids) for o in pooling.embed([SEVEN], use_tqdm=False, **kwargs)]

    # vLLM 0.32's ids for each (its run on the default model)
    assert ids() == [[537, 827, 1296, 1876, 2531, 2976, 4962]]
    assert ids(tokenization_kwargs={"truncate_prompt_tokens": 3}) == [[537, 827, 1296]]
    assert ids(tokenization_kwargs={"truncate_prompt_tokens": -1}) == ids()
    assert ids(tokenization_kwargs={"truncate_prompt_tokens": 3, "truncation_side": "left"}) == [[2531, 2976, 4962]]
    tokens = pooling.embed([{"prompt_token_ids": [1, 2, 3, 4, 5, 6]}], tokenization_kwargs={"truncate_prompt_tokens": 3},
                           use_tqdm=False)  # fmt: skip
    assert list(tokens[0].prompt_token_ids) == [1, 2, 3]
    full = pooling.embed(["one two three"], use_tqdm=False)[0].outputs.embedding
    cut = pooling.encode([SEVEN], pooling_task="embed", tokenization_kwargs={"truncate_prompt_tokens": 3}, use_tqdm=False)
    assert torch.allclose(cut[0].outputs.data, torch.tensor(full), atol=1e-5)  # (the first 3 tokens' embedding)
    scores = pooling.score("one two three four", ["five six", "ten"], tokenization_kwargs={"truncate_prompt_tokens": 2},
                           use_tqdm=False)  # fmt: skip
    assert len(scores) == 2
    with pytest.raises(ValueError, match="given twice"):
        pooling.embed([SEVEN], truncate_prompt_tokens=2, tokenization_kwargs={"truncate_prompt_tokens": 3})
    with pytest.raises(ValueError, match=r"tokenization_kwargs: \['padding'\] not supported"):
        pooling.embed([SEVEN], tokenization_kwargs={"padding": True})
    with pytest.raises(ValueError, match="truncation_side"):
        pooling.embed([SEVEN], tokenization_kwargs={"truncate_prompt_tokens": 3, "truncation_side": "middle"})
    with pytest.raises(ValueError, match="only supported for generative models"):
        pooling.enqueue_chat(HI)
    assert_no_leaks(pooling)
