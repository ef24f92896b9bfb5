"""Prompts given as embeddings (vLLM's {"prompt_embeds": tensor}, enable_prompt_embeds=True): the
embeddings of a prompt's tokens answer as the tokens do, random embeddings as transformers'
generate(inputs_embeds=...) does, under chunked prefill, preemption, n > 1 and the prefix cache;
bad input is refused by name and leaves the engine as it was."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import assert_greedy_matches, save_tiny_model, tiny_qwen3_config
from test_engine import assert_no_leaks, kv_bytes
from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.engine.beam_search import BeamSearchParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=49152, initializer_range=0.05)).eval()
    return save_tiny_model(hf, tmp_path_factory.mktemp("embeds"), default_model_dir), hf


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(model=str(tiny[0]), enable_prompt_embeds=True, max_num_batched_tokens=16)  # chunked prefill too


def table(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf.model.embed_tokens(torch.tensor(ids))


def prompts(*lengths: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 4000, (n,), generator=g).tolist() for n in lengths]


def test_the_embeddings_of_the_tokens_answer_as_the_tokens(llm, tiny):
    _, hf = tiny
    ids = prompts(1, 17, 40)
    outs = llm.generate([*({"prompt_token_ids": p} for p in ids), *({"prompt_embeds": table(hf, p)} for p in ids)],
                        GREEDY, use_tqdm=False)  # fmt: skip
    for tokens, embeds in zip(outs[:3], outs[3:]):
        assert embeds.outputs[0].token_ids == tokens.outputs[0].token_ids
        assert embeds.outputs[0].text == tokens.outputs[0].text
        for a, b in zip(embeds.outputs[0].logprobs, tokens.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
        assert (embeds.prompt_token_ids, embeds.prompt) == (None, None)  # as vLLM's
    seeded = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    by_tokens, by_embeds = llm.generate([{"prompt_token_ids": ids[1]}, {"prompt_embeds": table(hf, ids[1])}], seeded,
                                        use_tqdm=False)  # fmt: skip
    assert [c.token_ids for c in by_embeds.outputs] == [c.token_ids for c in by_tokens.outputs]
    assert_no_leaks(llm)


def test_random_embeddings_equal_transformers_generate(llm, tiny):
    _, hf = tiny
    g = torch.Generator().manual_seed(11)
    for n in (5, 33):
        embeds = torch.randn(n, hf.config.hidden_size, generator=g) * 0.05
        out = llm.generate({"prompt_embeds": embeds[None]}, GREEDY, use_tqdm=False)[0].outputs[0]  # ([1, L, H] too)
        with torch.no_grad():
            res = hf.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, n, dtype=torch.long),
                              max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)  # fmt: skip
        gaps = [float(step[0].topk(2).values.diff().abs()) for step in res.logits]
        assert_greedy_matches(out.token_ids, res.sequences[0, -12:].tolist(), gaps, f"prompt_embeds of {n}")


def test_prefix_cache_keys_the_embeddings(tiny):
    """The same embeddings hit their cached blocks; other embeddings, or token prompts whose ids equal
    the placeholders, never do."""
    model_dir, hf = tiny
    llm = LLM(model=str(model_dir), enable_prompt_embeds=True, enable_prefix_caching=True)
    embeds = table(hf, prompts(40)[0])
    first = llm.generate({"prompt_embeds": embeds}, GREEDY, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": embeds.clone()}, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == first.outputs[0].token_ids
    other = embeds.clone()
    other[-1] += 0.01  # (only the last block differs: the digest covers the whole prompt)
    assert llm.generate({"prompt_embeds": other}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    zeros = llm.generate({"prompt_token_ids": [0] * 40}, GREEDY, use_tqdm=False)[0]
    assert zeros.num_cached_tokens == 0
    assert llm.generate({"prompt_embeds": embeds, "cache_salt": "a"}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert_no_leaks(llm)


def test_preempted_embeddings_prompts_are_recomputed(tiny):
    """A KV cache too small for the batch preempts requests; a recomputed prompt takes its
    embeddings again (chunked), and every answer equals the tokens' own."""
    model_dir, hf = tiny
    llm = LLM(model=str(model_dir), enable_prompt_embeds=True, max_num_batched_tokens=24, max_num_seqs=8,
              kv_cache_memory=kv_bytes(hf.config, 24))  # fmt: skip
    ids = prompts(*range(30, 70, 5))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_embeds": table(hf, p)} for p in ids], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    want = LLM(model=str(model_dir)).generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ({"prompt_embeds": [[0.0] * 64]}, GREEDY, "prompt_embeds must be a torch.Tensor, got list"),
        ({"prompt_embeds": torch.zeros(3, 32)}, GREEDY, r"prompt_embeds must have shape \[num_tokens, 64\].*\[3, 32\]"),
        ({"prompt_embeds": torch.zeros(2, 3, 64)}, GREEDY, r"must have shape .* got \[2, 3, 64\]"),
        ({"prompt_embeds": torch.zeros(3, 64, dtype=torch.long)}, GREEDY, "must be a floating-point tensor"),
        ({"prompt_embeds": torch.full((3, 64), float("nan"))}, GREEDY, "contains NaN or infinite values"),
        ({"prompt_embeds": torch.zeros(0, 64)}, GREEDY, "prompt_embeds is empty"),
        ({"prompt_embeds": torch.zeros(3, 64), "prompt_token_ids": [1, 2, 3]}, GREEDY, "cannot be given with"),
        ({"prompt_embeds": torch.zeros(3, 64)}, SamplingParams(prompt_logprobs=1), "prompt_logprobs is not available"),
        ({"prompt_embeds": torch.zeros(1024, 64)}, GREEDY, "prompt has 1024 tokens but max_model_len is 1024"),
    ],
)
def test_bad_prompt_embeds_are_refused_by_name(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params, use_tqdm=False)
    assert_no_leaks(llm)


def test_where_prompt_embeds_are_not_taken(tiny, llm):
    model_dir, _ = tiny
    with pytest.raises(ValueError, match="prompt_embeds needs an engine started with enable_prompt_embeds=True"):
        LLM(model=str(model_dir)).generate({"prompt_embeds": torch.zeros(3, 64)}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_embeds is taken by generate requests only"):
        llm.beam_search([{"prompt_embeds": torch.zeros(3, 64)}], BeamSearchParams(beam_width=2, max_tokens=3))
    pooling = LLM(model=str(model_dir), runner="pooling", enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="prompt_embeds is taken by generate requests only"):
        pooling.embed({"prompt_embeds": torch.zeros(3, 64)}, use_tqdm=False)
    with pytest.raises(ValueError, match="enable_prompt_embeds cannot be combined with speculative_config"):
        EngineArgs(model=str(model_dir), enable_prompt_embeds=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2}).validate()  # fmt: skip


async def test_async_engine_streams_an_embeddings_prompt(tiny):
    model_dir, hf = tiny
    ids = prompts(20)[0]
    async with AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), enable_prompt_embeds=True)) as engine:
        # (repetition_penalty counts the output only: the prompt's tokens are unknown, as in vLLM)
        penalised = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, repetition_penalty=1.3)
        outs = [o async for o in engine.generate({"prompt_embeds": table(hf, ids)}, penalised, request_id="e")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6 and outs[-1].prompt_token_ids is None
        assert_no_leaks(engine)


def test_a_step_with_embeddings_is_never_a_decode_graphs_step():
    """A one-position embeddings prompt looks like a decode row (one token, sampled); a CUDA graph
    replays input ids only, so such a step must take the eager forward."""
    from vllmini.engine.model_runner import FlatBatch

    flat = FlatBatch([0], [0], [0], [1], [1], [[0]], [0], [0], embeds=[(0, torch.zeros(1, 64))])
    assert not flat.is_decode_only
    flat.embeds = []
    assert flat.is_decode_only
