"""Gemma 3 (text) and Gemma 2 (vllmini/models/gemma3.py) against transformers' modeling_gemma3/2.py on
the same weights: logits of a flat batch (1e-4), greedy over the paged cache, each Gemma feature shown
to matter, then the whole engine (chunked prefill, prefix-cache hits, preemption; cpu and torch
backends) with greedy tokens equal and logprobs within 2e-4 of transformers' on the same tokens."""
from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import Gemma2ForCausalLM as HFGemma2
from transformers import Gemma3ForCausalLM as HFGemma3

from helpers import (NEAR_TIE, assert_greedy_matches, greedy_paged, hf_greedy, prompt_forward, randomize_norms,
                     save_tiny_model, tiny_gemma2_config, tiny_gemma3_config)  # fmt: skip
from test_engine import assert_no_leaks, kv_bytes
from vllmini import LLM, SamplingParams
from vllmini.config import resolve_max_model_len
from vllmini.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM, gemma3_rope_parameters
from vllmini.models.layers import GemmaRMSNorm, RMSNorm
from vllmini.models.rotary import inverse_frequencies

CASES = {"gemma3": (tiny_gemma3_config, HFGemma3, Gemma3ForCausalLM),
         "gemma2": (tiny_gemma2_config, HFGemma2, Gemma2ForCausalLM)}  # fmt: skip
WINDOWS = {"gemma3": [12, 12, None, 12], "gemma2": [12, None, 12]}


def _ours(name: str, hf) -> torch.nn.Module:
    model = CASES[name][2](copy.deepcopy(hf.config))  # (a copy: the mutation test edits our config)
    assert model.load_weights(hf.state_dict().items()) == {n for n, _ in model.named_parameters()}
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_pair(request):
    make_config, hf_cls, _ = CASES[request.param]
    torch.manual_seed(0)
    hf = randomize_norms(hf_cls(make_config())).eval()
    return request.param, hf


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _max_logit_error(model, hf, prompts: list[list[int]]) -> float:
    logits = prompt_forward(model, prompts)
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0, -1] for p in prompts]
    return max(float((row - ref).abs().max()) for row, ref in zip(logits, refs))


def test_logits_in_one_flat_batch(tiny_pair):
    name, hf = tiny_pair
    ours = _ours(name, hf)
    assert [layer.self_attn.attn.window for layer in ours.model.layers] == WINDOWS[name]
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()  # tied
    assert _max_logit_error(ours, hf, _prompts(hf.config.vocab_size, [1, 5, 17, 40], 1)) < 1e-4


def test_greedy_over_the_paged_cache(tiny_pair):
    name, hf = tiny_pair
    prompts = _prompts(hf.config.vocab_size, [1, 9, 30], 2)
    distinct = []
    for prompt, out in zip(prompts, greedy_paged(_ours(name, hf), prompts, 24)):
        want, gaps = hf_greedy(hf, prompt, 24)
        assert_greedy_matches(out, want, gaps, f"{name}, prompt of {len(prompt)}")
        distinct.append(len(set(want)))
    assert max(distinct) > 3, "a degenerate tiny model (one token repeated) tells little"


def _drop_norm_offset(model) -> None:
    for module in model.modules():
        if isinstance(module, GemmaRMSNorm):
            module.__class__ = RMSNorm


def _head_dim_scale(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.attn.scale = layer.self_attn.head_dim**-0.5


MUTATIONS = {  # what each Gemma feature is replaced by: the logits must then move away from transformers'
    "embedding scale": lambda m: setattr(m, "embed", lambda ids: m.model.embed_tokens(ids)),
    "norm offset": _drop_norm_offset,
    "query_pre_attn_scalar": _head_dim_scale,
    "sliding window": lambda m: [setattr(layer.self_attn.attn, "window", None) for layer in m.model.layers],
    "local rope base": lambda m: setattr(m, "local_rope", [False] * len(m.model.layers)),
    "attention softcap": lambda m: [setattr(layer.self_attn.attn, "softcap", None) for layer in m.model.layers],
    "final softcap": lambda m: setattr(m.config, "final_logit_softcapping", None),
}
ONLY = {"local rope base": "gemma3", "attention softcap": "gemma2", "final softcap": "gemma2"}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_feature_matters(tiny_pair, mutation):
    """The tiny configs exercise every feature: without it, the logits leave transformers' by far more than 1e-4."""
    name, hf = tiny_pair
    if ONLY.get(mutation, name) != name:
        pytest.skip(f"{name} has no {mutation}")
    ours = _ours(name, hf)
    MUTATIONS[mutation](ours)
    assert _max_logit_error(ours, hf, _prompts(hf.config.vocab_size, [5, 17, 40], 3)) > 1e-2


def test_rope_of_either_config_format():
    """transformers 5 keeps one rope per layer type (rope_parameters); older configs have rope_theta +
    rope_scaling (full layers) and rope_local_base_freq (sliding): both give the same frequencies."""
    nested = tiny_gemma3_config()
    flat = SimpleNamespace(rope_theta=1000000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                           rope_local_base_freq=10000.0, max_position_embeddings=1024)  # fmt: skip
    for kind in ("full_attention", "sliding_attention"):
        a, b = (inverse_frequencies(gemma3_rope_parameters(c, kind), 24, 1024)[0] for c in (nested, flat))
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    full, local = (inverse_frequencies(gemma3_rope_parameters(nested, k), 24, 1024)[0]
                   for k in ("full_attention", "sliding_attention"))  # fmt: skip
    assert not torch.allclose(full, local)


def test_max_model_len_is_not_scaled_again():
    """As vLLM: Gemma 3's max_position_embeddings is the context its rope scaling gives already."""
    assert resolve_max_model_len(None, tiny_gemma3_config()) == 1024


# -- the whole engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory, default_model_dir):
    """arch -> (folder, transformers model): SmolLM2's vocabulary and tokenizer, saved once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            torch.manual_seed(0)
            hf = randomize_norms(CASES[name][1](CASES[name][0](vocab_size=49152))).eval()
            cache[name] = str(save_tiny_model(hf, tmp_path_factory.mktemp(name), default_model_dir)), hf
        return cache[name]

    return get


def _engine_errors(llm: LLM, hf, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[str]]:
    """Greedy with logprobs through the engine, then transformers over prompt + output in one
    forward: the largest |logprob difference| over the reported tokens, and the steps where the
    engine's token is not transformers' argmax (outside near ties). Every completion must run to
    ``max_tokens`` (a shorter one, cut by NaN logits, would compare fewer steps)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst, wrong = 0.0, []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == max_tokens, f"prompt {i}: {len(tokens)} tokens ({out.outputs[0].finish_reason})"
        with torch.no_grad():
            rows = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        for step, (token, reported, row) in enumerate(zip(tokens, out.outputs[0].logprobs, rows)):
            top2 = row.topk(2).values
            if token != int(row.argmax()) and float(top2[0] - top2[1]) >= NEAR_TIE:
                wrong.append(f"prompt {i} step {step}")
            ref = row.log_softmax(-1)
            worst = max([worst] + [abs(lp - float(ref[t])) for t, lp in reported.items()])
    return worst, wrong


ENGINE_CASES = [("gemma3", "cpu"), ("gemma3", "torch"), ("gemma2", None)]


@pytest.mark.parametrize(("name", "backend"), ENGINE_CASES)
def test_engine_matches_transformers(saved, name, backend):
    """Prompts several windows long, prefilled in 16-token chunks (each chunk reads the window behind
    it back from the cache), one sharing another's prefix; then the same prompts again, from the
    prefix cache. Gemma 2 takes the cpu backend by itself, its C kernel capping the decode rows' scores."""
    model_dir, hf = saved(name)
    llm = LLM(model=model_dir, attention_backend=backend, max_num_batched_tokens=16, enable_prefix_caching=True)
    engine = llm.llm_engine
    assert engine.attention_backend == (backend or "cpu")
    assert [layer.self_attn.attn.window for layer in engine.model.model.layers] == WINDOWS[name]
    assert engine.model.kv_window is None  # full layers read every block: none is released
    assert_cached_runs_match_transformers(llm, hf, name)


def assert_cached_runs_match_transformers(llm: LLM, hf, name: str) -> None:
    """Prompts several windows long (5, 40, 29 tokens), one sharing another's prefix, twice: the second
    time from the prefix cache; 20 greedy tokens each, tokens and logprobs as transformers' (also
    test_attention_sinks.py's)."""
    prompts = _prompts(4000, [5, 40, 29], 6)
    prompts.append(prompts[1][:32] + prompts[2][:8])
    for run in ("first", "prefix-cached"):
        worst, wrong = _engine_errors(llm, hf, prompts, 20)
        assert not wrong, f"{name} {run} run: greedy tokens differ from transformers' at {wrong}"
        assert worst < 2e-4, f"{name} {run} run: logprobs {worst:.2e} from transformers'"
    assert llm.llm_engine.block_manager.prefix_cache_hits > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("name", sorted(CASES))
def test_preempted_requests_recompute_transformers_tokens(saved, name):
    """Room for two of six requests at a time: the rest are preempted and recomputed."""
    model_dir, hf = saved(name)
    blocks_for_two = 2 * -(-(16 + 24) // 4)
    llm = LLM(model=model_dir, block_size=4, kv_cache_memory=kv_bytes(hf.config, blocks_for_two, block_size=4))
    worst, wrong = _engine_errors(llm, hf, [[7 + i, 300, 42, 9] * 4 for i in range(6)], 24)
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    assert not wrong and worst < 2e-4, (wrong, worst)
    assert_no_leaks(llm)


def test_an_unsupported_activation_is_refused_naming_gemmas_key():
    with pytest.raises(ValueError, match=r"hidden_activation 'gelu' is not supported"):
        Gemma2ForCausalLM(tiny_gemma2_config(hidden_activation="gelu"))


def test_gemma2_refuses_a_backend_without_softcap(saved, monkeypatch):
    """flash-attn before 2.6 (its flash_attn_varlen_func without ``softcap``), forced: refused by name."""
    import sys

    from test_attention import _fake_flash_module

    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(softcap=False))
    with pytest.raises(ValueError, match=r"attention_backend='flash_attn' cannot be used: .*attn_logit_softcapping=0.3\)"
                                         r" and this flash-attn's flash_attn_varlen_func takes no softcap"):  # fmt: skip
        LLM(model=saved("gemma2")[0], attention_backend="flash_attn")


def test_disable_sliding_window_keeps_the_local_rope(saved):
    """Every layer attends to all tokens, max_model_len is capped at the window, and the sliding layers
    keep their own rope base: greedy equal to transformers' (sliding) model within the window."""
    model_dir, hf = saved("gemma3")
    llm = LLM(model=model_dir, disable_sliding_window=True)
    model = llm.llm_engine.model
    assert [layer.self_attn.attn.window for layer in model.model.layers] == [None] * 4
    assert model.local_rope == [True, True, False, True] and llm.llm_engine.max_model_len == 12
    prompts = [list(range(300, 305)), list(range(400, 403))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)  # fmt: skip
    for prompt, out in zip(prompts, outs):
        assert_greedy_matches(out.outputs[0].token_ids, *hf_greedy(hf, prompt, 6), "gemma3 without its window")


def test_lora_adapter_equals_peft(saved, tmp_path):
    """A PEFT adapter on every projection of Gemma 3 (q/k/v and gate/up are fused here): greedy tokens
    and logprobs equal to transformers + PEFT, beside base-model rows in the same batch."""
    pytest.importorskip("peft")
    from helpers import save_tiny_lora
    from test_lora import GREEDY, PROMPTS, WHICH, _check, _expected, _requests

    base = saved("gemma3")[0]
    adapters = {"a1": save_tiny_lora(base, tmp_path / "a1", 1, r=8),
                "a2": save_tiny_lora(base, tmp_path / "a2", 2, r=4, target_modules=["q_proj", "v_proj"])}  # fmt: skip
    expected = _expected(base, adapters, WHICH)
    assert expected[0][0] != _expected(base, adapters, [None])[0][0], "adapter a1 does not change the output"
    reqs = _requests(adapters)
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=[reqs[n] if n else None for n in WHICH])  # fmt: skip
    _check(outs, expected, WHICH)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bfloat16_is_as_close_as_transformers_bfloat16(saved, name):
    """In bfloat16 (Gemma's checkpoint dtype) the norms scale in float32 before the cast, and the embedding
    scale rounds to bfloat16 (sqrt(56) to 7.5) as transformers rounds it: logprobs as near transformers' float32 ones as
    transformers' own bfloat16 model."""
    from test_cpu_bfloat16 import assert_as_close_as_transformers_bf16, logprob_errors

    model_dir, _ = saved(name)
    llm = LLM(model=model_dir, dtype="bfloat16", kv_cache_memory=2**22, block_size=8)
    assert llm.llm_engine.attention_backend == "cpu"
    ours, theirs = logprob_errors(llm, model_dir, _prompts(4000, [3, 40, 17], 9), 16)
    assert_as_close_as_transformers_bf16(ours, theirs)
    assert_no_leaks(llm)


@pytest.mark.parametrize("name", sorted(CASES))
def test_sequence_classifier_equals_transformers(tmp_path, default_model_dir, name):
    """Gemma2ForSequenceClassification / Gemma3TextForSequenceClassification: the body here, transformers'
    ``score`` head over the last token (no final softcap: that is the language-model head's)."""
    from test_pooling import KV, PROMPTS, assert_close

    from helpers import save_tiny_classifier

    model_dir, hf = save_tiny_classifier(name, tmp_path, default_model_dir, 3)
    randomize_norms(hf).save_pretrained(model_dir)
    llm = LLM(model=str(model_dir), kv_cache_memory=KV, max_num_batched_tokens=8)
    assert llm.llm_engine.runner_type == "pooling"
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, llm.classify(PROMPTS, use_tqdm=False)):
        with torch.no_grad():
            want = hf(torch.tensor([tok(prompt).input_ids])).logits[0].float().softmax(-1)
        assert_close(out.outputs.probs, want, f"{name} {prompt!r}")
    assert llm.llm_engine.scheduler.stats.num_chunked_prefills > 0


def test_headless_gemma3_embeds_as_transformers(saved, tmp_path):
    """A Gemma3TextModel checkpoint (no lm_head) pools: its last token's hidden state, normalized."""
    from transformers import AutoModel

    from test_pooling import KV, PROMPTS, assert_close, hf_embedding

    model_dir, _ = saved("gemma3")
    headless = save_tiny_model(AutoModel.from_pretrained(model_dir), tmp_path / "headless", model_dir)
    llm = LLM(model=str(headless), kv_cache_memory=KV)
    assert llm.llm_engine.runner_type == "pooling" and llm.llm_engine.model.lm_head is None
    out = llm.embed([PROMPTS[3]], use_tqdm=False)[0]
    assert_close(out.outputs.embedding, hf_embedding(Path(model_dir), out.prompt_token_ids, "LAST"), "Gemma3TextModel")


@pytest.mark.parametrize(("hybrid", "blocks"), [(True, 40), (False, 16)])
def test_draft_model_over_sliding_and_full_layers(saved, hybrid, blocks):
    """A draft model's cache shares the block ids of the target's full-attention KV group (whose
    table keeps every position; grouped: kv/kv_groups.py) or of its one table: Gemma 3 drafting for
    itself through chunked prefill, preemption and the prefix cache has every draft accepted (its
    windowed attention over the shared blocks is the target's), and the tokens are transformers'."""
    model_dir, hf = saved("gemma3")
    llm = LLM(model=model_dir, speculative_config={"model": model_dir, "num_speculative_tokens": 3}, block_size=4,
              max_num_batched_tokens=8, num_gpu_blocks_override=blocks, enable_prefix_caching=True,
              disable_hybrid_kv_cache_manager=not hybrid)  # fmt: skip
    assert llm.llm_engine.block_manager.num_groups == (4 if hybrid else 1)
    prompts = _prompts(4000, [5, 40, 29], 6)
    prompts.append(prompts[1][:32] + prompts[2][:8])
    worst, wrong = _engine_errors(llm, hf, prompts, 16)
    assert not wrong and worst < 2e-4, (wrong, worst)
    stats = llm.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    assert_no_leaks(llm)


def test_a_draft_model_without_a_full_attention_group_keeps_one_table(saved, monkeypatch, caplog):
    """Were every KV group sliding (layers with different windows, no full one), no group's table
    would keep every position for the draft's cache: the groups are turned off, and said so."""
    import logging

    from vllmini.engine import engine_setup
    from vllmini.kv.kv_groups import plan_kv_layout

    model_dir, _ = saved("gemma3")
    spec = {"model": model_dir, "num_speculative_tokens": 2}
    assert LLM(model=model_dir, speculative_config=spec).llm_engine.block_manager.num_groups == 4  # a full group
    monkeypatch.setattr(engine_setup, "plan_kv_layout", lambda windows: plan_kv_layout([w or 24 for w in windows]))
    assert engine_setup.plan_kv_layout([12, None]).group_windows == (12, 24)  # (what the engine now sees)
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # let caplog see our records
    with caplog.at_level(logging.INFO, logger="vllmini"):
        llm = LLM(model=model_dir, speculative_config=spec)
    assert llm.llm_engine.block_manager.num_groups == 1
    assert "hybrid KV cache off: no full-attention layer group" in caplog.text


@pytest.mark.parametrize(("name", "kv_cache_dtype"), [("gemma2", "fp8_e5m2"), ("gemma3", "fp8_e4m3")])
def test_torch_backend_over_a_nan_filled_fp8_cache(saved, name, kv_cache_dtype):
    """Every KV slot starts as NaN (as a block reused from a request whose K/V were NaN): the torch
    backend's mixed prefill/decode steps (8-token chunks, preemption, prefix-cache hits) must read
    only what they wrote, through the score softcap too (Gemma 2: a masked NaN value times its zero
    weight is NaN). Greedy tokens and logprobs equal transformers' with K/V rounded as the cache."""
    import importlib

    from helpers import register_rounded_kv_attention

    model_dir, _ = saved(name)
    eager = importlib.import_module(f"transformers.models.{name}.modeling_{name}").eager_attention_forward
    rounded = CASES[name][1].from_pretrained(model_dir, attn_implementation=register_rounded_kv_attention(
        kv_cache_dtype, eager)).eval()  # fmt: skip
    llm = LLM(model=model_dir, attention_backend="torch", kv_cache_dtype=kv_cache_dtype, block_size=8,
              max_num_batched_tokens=8, num_gpu_blocks_override=20, enable_prefix_caching=True)  # fmt: skip
    for layer in llm.llm_engine.runner.kv_caches:
        for cache in layer:
            cache.view(torch.uint8).fill_(0xFF)  # NaN in both fp8 formats
    prompts = _prompts(4000, [5, 40, 29, 3], 6)
    prompts.append(prompts[1][:32] + prompts[2][:8])
    for run in ("first", "prefix-cached"):
        worst, wrong = _engine_errors(llm, rounded, prompts, 16)
        assert not wrong and worst < 2e-4, (run, wrong, worst)
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0 and llm.llm_engine.block_manager.prefix_cache_hits > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("window", [None, 3])
def test_softcapped_torch_attention_over_every_kind_of_row(window):
    """Gemma 2's score cap in the torch backend against a dense reference: prompts, chunks after cached
    tokens and decode rows in one step, then the same decode rows through the static (CUDA-graph)
    path, which Gemma 2's decode steps take on a GPU; NaN in every slot no row may read stays out."""
    from test_attention import BS, D, H, HKV, build_batch

    from vllmini.models.attention import torch_attention
    from vllmini.models.base import AttentionMetadata, block_table_tensor

    cap, scale = 0.5, D**-0.5
    for q_lens, seq_lens in (([1, 5, 1, 8, 2], [9, 5, 17, 12, 2]), ([1, 1, 1], [5, 1, 13])):
        q, k, v, (k_cache, v_cache), meta, hk, hv = build_batch(q_lens, seq_lens)
        readable = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
        for b, n in enumerate(seq_lens):
            for p in range(n):
                readable[meta.block_tables[b, p // BS], p % BS] = True
        k_cache[~readable], v_cache[~readable] = float("nan"), float("nan")
        cache = (k_cache, v_cache)
        out = torch_attention(q, k, v, meta, tuple(c.clone() for c in cache), scale, window, softcap=cap)
        start = 0
        for q_len, k_seq, v_seq in zip(q_lens, hk, hv):
            scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len], k_seq.repeat_interleave(H // HKV, 1)) * scale
            pos_q, pos_k = torch.arange(len(k_seq) - q_len, len(k_seq))[:, None], torch.arange(len(k_seq))[None, :]
            seen = (pos_k <= pos_q) & (pos_k > pos_q - (window or len(k_seq)))
            probs = (torch.tanh(scores / cap) * cap).masked_fill(~seen, float("-inf")).softmax(-1)
            ref = torch.einsum("hqk,khd->qhd", probs, v_seq.repeat_interleave(H // HKV, 1))
            torch.testing.assert_close(out[start : start + q_len], ref, atol=1e-5, rtol=1e-5)
            start += q_len
        if max(q_lens) == 1:  # the static path, over table columns padded to 8
            cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
            static = AttentionMetadata.for_static_decode(cu, cu, torch.tensor(seq_lens, dtype=torch.int32),
                                                         meta.slot_mapping, block_table_tensor(meta.block_tables.tolist(), 8),
                                                         8 * BS)  # fmt: skip
            got = torch_attention(q, k, v, static, tuple(c.clone() for c in cache), scale, window, softcap=cap)
            torch.testing.assert_close(got, out, atol=1e-5, rtol=1e-5)


def test_a_forced_backend_the_draft_cannot_run_is_refused_as_the_drafts(saved, monkeypatch):
    """Gemma 3 may have flash-attn < 2.6 (a stand-in, let onto the CPU; the engine fails before a forward), its
    Gemma 2 draft may not (its scores are capped, which that flash-attn cannot): the error names the draft."""
    import sys

    from test_attention import _fake_flash_module

    from vllmini.models import backend_check, backend_select

    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(softcap=False))
    monkeypatch.setattr(backend_select, "_fused_problems", lambda *args: [])
    monkeypatch.setattr(backend_check, "check_backend", lambda *args: None)
    with pytest.raises(ValueError, match=r"the draft model \(speculative_config.model\): attention_backend='flash_attn' "
                                         r"cannot be used: .*attn_logit_softcapping=0.3"):  # fmt: skip
        LLM(model=saved("gemma3")[0], attention_backend="flash_attn",
            speculative_config={"model": saved("gemma2")[0], "num_speculative_tokens": 2})  # fmt: skip


@pytest.mark.parametrize(("name", "backend"), [("gemma2", "torch"), ("gemma3", "torch"), ("gemma2", "cpu")])
def test_padded_static_decode_equals_eager(name, backend):
    """What a CUDA graph replays for a Gemma decode step (rows padded, tables as wide as max_model_len,
    padding rows in the pad block; the torch backend's static path) equals the eager step: per-layer windows
    (7 keys here) and rope tables, both softcaps; on the cpu backend the eager step's decode rows are its
    C kernel's (capped there), the static ones the eager math's."""
    from test_cuda_path import _decode_state, _random_model

    from vllmini.engine.cuda_graph import DecodeGraphRunner
    from vllmini.models.backend_select import get_backend

    block_size, max_model_len = 4, 40
    model = _random_model(CASES[name][0](max_position_embeddings=64, sliding_window=7), get_backend(backend))
    for batch in (3, 17):
        caches, flat, num_blocks = _decode_state(model, batch, block_size, max_model_len, seed=batch)
        static_caches = [(k.clone(), v.clone()) for k, v in caches]
        with torch.no_grad():
            ref = model(torch.tensor(flat.ids), torch.tensor(flat.positions), flat.to_model_input("cpu").attn_metadata, caches)
        runner = DecodeGraphRunner(model, static_caches, block_size, 20, max_model_len, num_blocks, torch.device("cpu"),
                                   use_graphs=False)  # fmt: skip
        assert runner.can_run(flat) and runner.padded_size(batch) > batch
        torch.testing.assert_close(runner.run(flat), ref, atol=1e-4, rtol=1e-4)
