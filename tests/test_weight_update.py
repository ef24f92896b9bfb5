"""Weights updated in place on a live engine, as RL frameworks (TRL, verl, OpenRLHF) do with vLLM:
``LLM.apply_model`` / ``collective_rpc`` -> the model's ``load_weights`` with HF names
(engine/live_weights.py, engine/worker.py). transformers is the oracle: an engine built on random
model A and given model B's ``state_dict()`` generates B's greedy tokens and logprobs."""
from __future__ import annotations

import asyncio
import copy
import threading

import pytest
import torch
from helpers import (hf_greedy_logprobs, save_tiny_lora, save_tiny_model, tiny_llama_config, tiny_qwen3_config,
                     tiny_qwen3_moe_config)

from vllmini import LLM, AsyncLLMEngine, EngineArgs, LoRARequest, SamplingParams

PROMPTS = [[1, 520, 33, 4000, 77, 91, 12000], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)


def _hf(kind: str, seed: int):
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama-tied":  # tied embeddings: the update must reach lm_head (a prepacked copy on the CPU)
        return LlamaForCausalLM(tiny_llama_config(vocab_size=49152, initializer_range=0.05, tie_word_embeddings=True)).eval()
    return Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=49152, initializer_range=0.05, tie_word_embeddings=False)).eval()


@pytest.fixture(scope="module", params=["llama-tied", "qwen3"])
def pair(request, tmp_path_factory, default_model_dir):
    """(model A's folder, transformers' A, transformers' B): same architecture, other weights."""
    a, b = _hf(request.param, 0), _hf(request.param, 1)
    return save_tiny_model(a, tmp_path_factory.mktemp(request.param), default_model_dir), a, b


def ours(llm: LLM, params: SamplingParams = GREEDY, lora: LoRARequest | None = None) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=lora)
    return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs]  # fmt: skip


def assert_matches(got, hf_model, what: str) -> None:
    for prompt, (tokens, logprobs) in zip(PROMPTS, got):
        want_tokens, want_logprobs = hf_greedy_logprobs(hf_model, prompt, GREEDY.max_tokens)
        assert tokens == want_tokens, what
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=2e-3, rtol=0, msg=what)


def assert_no_leaks(engine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


def test_apply_model_load_weights_gives_the_new_models_outputs(pair):
    """vLLM's ``apply_model(lambda m: m.load_weights(...))`` with B's whole state_dict: the engine
    then generates B's greedy tokens and logprobs; the names returned cover every parameter."""
    model_dir, hf_a, hf_b = pair
    llm = LLM(model=str(model_dir), enable_prefix_caching=False)
    assert_matches(ours(llm), hf_a, "before the update")
    weights = list(hf_b.state_dict().items())
    [loaded] = llm.apply_model(lambda model: model.load_weights(weights))
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded and "model.embed_tokens.weight" in loaded
    assert_matches(ours(llm), hf_b, "after apply_model(load_weights(B))")
    # and back to A through collective_rpc with a callable taking the worker, as vLLM's
    llm.collective_rpc(lambda worker, w: worker.model_runner.model.load_weights(w), args=(hf_a.state_dict().items(),))
    assert_matches(ours(llm), hf_a, "after collective_rpc back to A")
    assert_no_leaks(llm.llm_engine)


def test_partial_update_and_dtype_cast(pair):
    """A few tensors (one layer's q/k/v, another's gate only: half a fused parameter), given as
    bfloat16: those change, cast to the engine's float32, nothing else does."""
    model_dir, hf_a, hf_b = pair
    llm = LLM(model=str(model_dir), enable_prefix_caching=False)
    names = ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
             "model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.gate_proj.weight", "model.norm.weight",
             "model.embed_tokens.weight"]  # fmt: skip (a tied lm_head follows the embedding)
    state_b = hf_b.state_dict()
    part = [(n, state_b[n].to(torch.bfloat16)) for n in names]
    [loaded] = llm.collective_rpc("load_weights", args=(part,))
    assert loaded == {"model.layers.1.self_attn.qkv_proj.weight", "model.norm.weight", "model.embed_tokens.weight"}
    # (not gate_up_proj: half of it was given)
    mixed = _hf("llama-tied" if hf_a.config.tie_word_embeddings else "qwen3", 0)
    state = {**hf_a.state_dict(), **{n: t.float() for n, t in part}}
    if mixed.config.tie_word_embeddings:  # (one tensor under two names: the last loaded wins)
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    mixed.load_state_dict(state)
    assert_matches(ours(llm), mixed, "after a partial update")


def test_a_bad_name_or_shape_is_refused_with_nothing_changed(pair):
    """A wrong name or shape anywhere in the update (here: last) is a ValueError naming it, raised
    before any tensor is copied; the engine keeps serving the old weights."""
    model_dir, hf_a, hf_b = pair
    llm = LLM(model=str(model_dir), enable_prefix_caching=False)
    good = list(hf_b.state_dict().items())
    bad_name = good + [("model.layers.0.self_attn.q_proj.weigth", good[3][1])]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weigth' has no matching parameter"):
        llm.apply_model(lambda m: m.load_weights(bad_name))
    bad_shape = good + [("model.layers.2.mlp.down_proj.weight", torch.zeros(3, 5))]
    with pytest.raises(ValueError, match=r"'model\.layers\.2\.mlp\.down_proj\.weight' has shape \(3, 5\)"):
        llm.collective_rpc("load_weights", args=(bad_shape,))
    with pytest.raises(TypeError, match="takes \\(name, tensor\\) pairs"):
        llm.collective_rpc("load_weights", args=([("model.norm.weight", [1.0, 2.0])],))
    assert_matches(ours(llm), hf_a, "after refused updates")
    with pytest.raises(NotImplementedError, match="the worker has no method 'no_such_method'"):
        llm.collective_rpc("no_such_method")
    assert_no_leaks(llm.llm_engine)


def test_prefix_cache_keeps_old_kv_until_reset(pair):
    """As in vLLM, an update leaves the prefix cache alone: a prompt whose prefix is cached reads
    K/V computed with the old weights until ``reset_prefix_cache()``; after it, B's outputs."""
    model_dir, hf_a, hf_b = pair
    llm = LLM(model=str(model_dir))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0)
    long_prompt = {"prompt_token_ids": PROMPTS[1] * 2}  # 36 tokens: two full blocks get cached
    llm.generate(long_prompt, params, use_tqdm=False)
    llm.apply_model(lambda m: m.load_weights(hf_b.state_dict().items()))
    want, want_lp = hf_greedy_logprobs(hf_b, PROMPTS[1] * 2, 4)
    stale = llm.generate(long_prompt, params, use_tqdm=False)[0]
    assert stale.num_cached_tokens == 32
    stale_lp = [next(iter(lp.values())).logprob for lp in stale.outputs[0].logprobs]
    assert not torch.allclose(torch.tensor(stale_lp), torch.tensor(want_lp), atol=1e-2)  # A's K/V for the prefix
    assert llm.reset_prefix_cache()
    fresh = llm.generate(long_prompt, params, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0 and list(fresh.outputs[0].token_ids) == want
    fresh_lp = [next(iter(lp.values())).logprob for lp in fresh.outputs[0].logprobs]
    torch.testing.assert_close(torch.tensor(fresh_lp), torch.tensor(want_lp), atol=2e-3, rtol=0)


def test_update_under_lora(pair, tmp_path):
    """With enable_lora the adapted projections are wrapped: an update still reaches their base
    weights, and an adapter's requests then run on B (transformers + PEFT on B as the oracle)."""
    peft = pytest.importorskip("peft")
    model_dir, hf_a, hf_b = pair
    adapter = save_tiny_lora(model_dir, tmp_path / "adapter", seed=3, r=4, lora_alpha=8)
    lora = LoRARequest("a", 1, adapter)
    llm = LLM(model=str(model_dir), enable_lora=True, max_lora_rank=8, enable_prefix_caching=False)
    ours(llm, lora=lora)  # (the adapter loaded into its slot before the update)
    llm.apply_model(lambda m: m.load_weights(hf_b.state_dict().items()))
    assert_matches(ours(llm), hf_b, "base model after the update, LoRA enabled")
    oracle = peft.PeftModel.from_pretrained(copy.deepcopy(hf_b), adapter, "a").eval()  # (PEFT wraps in place)
    assert_matches(ours(llm, lora=lora), oracle, "adapter on the updated base")


def test_async_engine_collective_rpc_runs_on_the_engine_thread(pair):
    model_dir, hf_a, hf_b = pair
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), enable_prefix_caching=False))

    async def main():
        [name] = await engine.collective_rpc(lambda worker: threading.current_thread().name)
        assert name.startswith("vllmini-step")
        [loaded] = await engine.collective_rpc("load_weights", args=(list(hf_b.state_dict().items()),))
        assert "model.norm.weight" in loaded
        got = []
        for prompt in PROMPTS:
            async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY):
                pass
            got.append((list(out.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs]))
        assert_matches(got, hf_b, "async engine after collective_rpc(load_weights)")
        with pytest.raises(TimeoutError):
            await engine.collective_rpc(lambda worker: __import__("time").sleep(0.5), timeout=0.05)
        await engine.shutdown()

    asyncio.run(main())


def test_meta_or_non_float_tensors_are_refused_with_nothing_changed(pair):
    """A tensor without data (the meta device: the copy would fail halfway) or of a non-floating
    dtype (ints, bools: silently cast otherwise) is a TypeError naming it, before any copy."""
    model_dir, hf_a, hf_b = pair
    llm = LLM(model=str(model_dir), enable_prefix_caching=False)
    good = list(hf_b.state_dict().items())
    shape = hf_b.state_dict()["model.norm.weight"].shape
    for bad, what in [(torch.empty(shape, device="meta"), "meta device"), (torch.ones(shape, dtype=torch.int64), "torch.int64"),
                      (torch.ones(shape, dtype=torch.bool), "torch.bool")]:  # fmt: skip
        with pytest.raises(TypeError, match=rf"'model\.norm\.weight' .*{what}"):
            llm.apply_model(lambda m: m.load_weights(good + [("model.norm.weight", bad)]))
    assert_matches(ours(llm), hf_a, "after refused updates")


def test_update_while_paused_in_keep_mode_reaches_the_frozen_requests(pair):
    """verl's partial rollouts: pause_generation(mode="keep") (clear_cache=True, the default, as in
    vLLM), load new weights, resume. The frozen requests are recomputed, so each continues as B
    would from its tokens so far (transformers' B as the oracle), not on K/V of A's."""
    model_dir, hf_a, hf_b = pair
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), enable_prefix_caching=False))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompt = PROMPTS[1]

    async def main():
        seen: list[list] = [[], []]

        async def run(i):
            async for out in engine.generate({"prompt_token_ids": prompt}, params):
                seen[i].append(out)
            return out

        tasks = [asyncio.create_task(run(i)) for i in range(2)]
        while not all(s and len(s[-1].outputs[0].token_ids) >= 3 for s in seen):
            await asyncio.sleep(0.005)
        await engine.pause_generation(mode="keep")
        done = [len(s[-1].outputs[0].token_ids) for s in seen]
        await engine.collective_rpc("load_weights", args=(list(hf_b.state_dict().items()),))
        await engine.resume_generation()
        for k, out in zip(done, await asyncio.gather(*tasks)):
            tokens = list(out.outputs[0].token_ids)
            want, _ = hf_greedy_logprobs(hf_b, prompt + tokens[:k], params.max_tokens - k)
            assert tokens[k:] == want, f"continued on stale K/V after {k} tokens"
        assert_no_leaks(engine.engine)
        await engine.shutdown()

    asyncio.run(main())


def test_mixture_of_experts_takes_a_trainers_state_dict(tmp_path, default_model_dir):
    """Qwen3-MoE: transformers >= 5 holds each layer's experts in two tensors (``experts.gate_up_proj``,
    ``experts.down_proj``), and that is what a trainer's ``state_dict()`` names; the per-expert
    names of a checkpoint on disk work too (reload_weights)."""
    from transformers import Qwen3MoeForCausalLM

    def moe(seed: int):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(tiny_qwen3_moe_config(vocab_size=49152, initializer_range=0.05)).eval()

    hf_a, hf_b = moe(0), moe(1)
    llm = LLM(model=str(save_tiny_model(hf_a, tmp_path / "moe", default_model_dir)), enable_prefix_caching=False)
    [loaded] = llm.apply_model(lambda m: m.load_weights(hf_b.state_dict().items()))
    assert "model.layers.0.mlp.experts.w13" in loaded and "model.layers.0.mlp.experts.w2" in loaded
    assert_matches(ours(llm), hf_b, "Qwen3-MoE after load_weights(B's state_dict)")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.down_proj' has shape \(3, 3\)"):
        llm.apply_model(lambda m: m.load_weights([("model.layers.0.mlp.experts.down_proj", torch.zeros(3, 3))]))
    llm.collective_rpc("reload_weights")
    assert_matches(ours(llm), hf_a, "Qwen3-MoE after reload_weights (A's per-expert names)")
