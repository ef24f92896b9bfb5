"""Mixture-of-experts weights prepacked for oneDNN on the CPU (models/packed_experts.py): the packed
loop equals the grouped matmul it replaces; the engine packs the experts and holds no dense copy;
what writes expert weights after load (a live update, sleep level 2 and wake_up) still works."""
from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from helpers import save_tiny_model, tiny_qwen3_moe_config
from test_gpt_oss import gpt_oss_config, randomize
from vllmini import LLM, SamplingParams
from vllmini.models.gpt_oss import GptOssMoE
from vllmini.models.moe import ExpertWeights, FusedMoE
from vllmini.models.packed_experts import PackedExperts, prepack_experts, unpack_experts
from vllmini.models.packed_linear import packing_available

CPU = torch.device("cpu")
DTYPES = [d for d in (torch.float32, torch.bfloat16) if packing_available(CPU, d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="torch without oneDNN: nothing is prepacked")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
PROMPTS = [[1, 520, 33, 4000, 77, 91, 12000], list(range(5, 30))]


def _layer(gpt_oss: bool, num_experts: int, seed: int) -> FusedMoE:
    torch.manual_seed(seed)
    layer = GptOssMoE(gpt_oss_config(num_local_experts=num_experts, num_experts_per_tok=1)) if gpt_oss else FusedMoE(64, 48, num_experts, 1, True)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.sampled_from([0, 0, 1, 1, 2, 5, 17]), min_size=1, max_size=9), gpt_oss=st.booleans(),
       dtype=st.sampled_from(DTYPES or [torch.float32]), seed=st.integers(0, 2**16))  # fmt: skip
def test_packed_experts_equal_the_grouped_matmul(counts, gpt_oss, dtype, seed):
    """Any rows per expert (none, one, many; every expert idle too), with and without gpt-oss's biases
    and clamped SwiGLU: ``run_experts`` on the packed weights equals the grouped matmul on the dense ones."""
    dense = _layer(gpt_oss, len(counts), seed).to(dtype)
    packed = copy.deepcopy(dense)
    assert prepack_experts(packed) == 2 * len(counts)
    counts_t = torch.tensor(counts)
    xs = torch.randn(sum(counts), 64).to(dtype)
    with torch.no_grad():
        want, got = dense.run_experts(xs, counts_t), packed.run_experts(xs, counts_t)
    # Both paths sum in their own order, so the tolerance follows the output's size (outputs reach ~40
    # here; fp32 oneDNN and MKL differ by ~5e-7 of that, bf16 by an ulp on a few hidden activations).
    scale = want.abs().max().item() if want.numel() else 1.0
    tol = 4e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=tol)


def test_packing_releases_the_dense_experts_and_unpacks_exactly():
    """One copy only: after packing, ``w13`` / ``w2`` are no parameters; unpacking gives them back bit for bit."""
    layer = _layer(True, 4, 0)
    w13, w2 = layer.experts.w13.clone(), layer.experts.w2.clone()
    prepack_experts(layer)
    assert layer.experts.w13 is None and isinstance(layer.experts.prepacked, PackedExperts)
    assert {n for n, _ in layer.named_parameters()} == {"router.weight", "router.bias", "experts.b13", "experts.b2"}
    assert prepack_experts(layer) == 0  # (already packed)
    unpack_experts(layer.experts)
    assert layer.experts.prepacked is None
    assert torch.equal(layer.experts.w13, w13) and torch.equal(layer.experts.w2, w2)


def _experts(llm: LLM) -> list[ExpertWeights]:
    return [m for m in llm.llm_engine.model.modules() if isinstance(m, ExpertWeights)]


def _tokens(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs]  # fmt: skip


def _assert_same(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def gpt_oss_pair(tmp_path_factory, default_model_dir):
    """Folders of two random gpt-oss models (biased experts), and B's transformers model."""
    dirs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        hf = randomize(AutoModelForCausalLM.from_config(gpt_oss_config())).eval()
        dirs.append(save_tiny_model(hf, tmp_path_factory.mktemp(f"gpt-oss-{seed}"), default_model_dir))
    return dirs[0], dirs[1], hf


def test_live_update_of_packed_experts_gives_a_fresh_load_of_the_new_weights(gpt_oss_pair):
    """gpt-oss A, prepacked, given B's state_dict through ``apply_model``: B's tokens and logprobs as
    a fresh engine on B gives them; the experts are packed again after, with no dense copy left."""
    dir_a, dir_b, hf_b = gpt_oss_pair
    llm = LLM(model=str(dir_a), enable_prefix_caching=False)
    assert all(e.prepacked is not None and e.w13 is None for e in _experts(llm))
    before = _tokens(llm)
    [loaded] = llm.apply_model(lambda m: m.load_weights(hf_b.state_dict().items()))
    assert {"model.layers.0.mlp.experts.w13", "model.layers.0.mlp.experts.b2"} <= loaded
    assert all(e.prepacked is not None and e.w13 is None and e.w2 is None for e in _experts(llm))
    want = _tokens(LLM(model=str(dir_b)))
    assert want != before
    _assert_same(_tokens(llm), want)


def test_sleep_level_2_discards_packed_experts_and_reload_restores_them(tmp_path, default_model_dir):
    """Qwen3-MoE: sleep(level=2) gives back the packed experts too; wake_up, reload_weights: the same tokens."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_qwen3_moe_config(vocab_size=49152, initializer_range=0.05)).eval()
    llm = LLM(model=str(save_tiny_model(hf, tmp_path, default_model_dir)), kv_cache_memory=1 << 24,
              enable_sleep_mode=True)  # fmt: skip
    before = _tokens(llm)
    experts = _experts(llm)
    assert experts and all(e.prepacked is not None for e in experts)
    llm.sleep(level=2)
    assert all(e.prepacked.w13 == [] and e.prepacked.w2 == [] for e in experts)
    llm.wake_up(tags=["weights"])
    assert all(not e.prepacked.w13[0].to_dense().any() for e in experts)  # (zeros until loaded)
    [loaded] = llm.collective_rpc("reload_weights")
    assert "model.layers.0.mlp.experts.w13" in loaded
    llm.wake_up(tags=["kv_cache"])
    assert all(e.prepacked is not None and e.w13 is None for e in experts)
    _assert_same(_tokens(llm), before)
