"""bfloat16 on the CPU (opt-in: ``dtype="bfloat16"``; auto stays float32). The cpu attention
backend reads a bfloat16 cache with float32 math and the linears are prepacked for oneDNN's
native bf16 kernels where the CPU has them. bfloat16 cannot equal float32 token for token, so
the oracle is precision: the engine's logprobs must sit no further from transformers' float32
ones than transformers' own bfloat16 model does, on the same tokens."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers import Qwen3ForCausalLM as HFQwen3

from helpers import save_tiny_model, tiny_qwen3_config
from test_engine import assert_no_leaks
from vllmini import LLM, SamplingParams
from vllmini.models.packed_linear import PackedLinear, packing_available

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors:", "The quick brown fox", "In 1969, humans"]  # fmt: skip


def logprob_errors(llm: LLM, hf_dir, prompt_ids: list[list[int]], max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """|logprob - transformers float32's| over every reported (top-5) token of a greedy run, for
    the engine and for transformers in bfloat16, teacher-forced on the engine's tokens."""
    hf32 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    ours, theirs = [], []
    for prompt, out in zip(prompt_ids, outs):
        done = out.outputs[0]
        assert len(done.token_ids) == max_tokens
        seq = torch.tensor([prompt + done.token_ids])
        with torch.no_grad():
            ref = hf32(seq).logits[0].float().log_softmax(-1)
            half = hf16(seq).logits[0].float().log_softmax(-1)
        for k, top in enumerate(done.logprobs):
            pos = len(prompt) + k - 1  # the logits that chose token k
            for token_id, lp in top.items():
                ours.append(abs(lp - ref[pos, token_id].item()))
                theirs.append(abs(half[pos, token_id].item() - ref[pos, token_id].item()))
    return torch.tensor(ours), torch.tensor(theirs)


def assert_as_close_as_transformers_bf16(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.mean() <= 1.25 * theirs.mean(), f"mean error {ours.mean():.4f} vs transformers bf16's {theirs.mean():.4f}"
    assert ours.max() <= 1.5 * theirs.max(), f"max error {ours.max():.4f} vs transformers bf16's {theirs.max():.4f}"
    assert ours.mean() > 0  # really computed in bfloat16


def test_default_model_in_bfloat16(default_model_dir):
    from transformers import AutoTokenizer

    llm = LLM(model="default", dtype="bfloat16", kv_cache_memory=2**26)
    eng = llm.llm_engine
    assert eng.attention_backend == "cpu"
    assert {c.dtype for layer in eng.runner.kv_caches for c in layer} == {torch.bfloat16}
    assert {p.dtype for p in eng.model.parameters()} == {torch.bfloat16}
    if packing_available(torch.device("cpu"), torch.bfloat16):
        assert not any(isinstance(m, nn.Linear) for m in eng.model.modules())
        assert any(isinstance(m, PackedLinear) for m in eng.model.modules())
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ours, theirs = logprob_errors(llm, default_model_dir, [tok(p).input_ids for p in PROMPTS], 40)
    assert_as_close_as_transformers_bf16(ours, theirs)
    assert_no_leaks(llm)


def test_tiny_qwen3_in_bfloat16(tmp_path, default_model_dir):
    """q/k norms, tied embeddings, head_dim != hidden / heads; contexts over many blocks."""
    torch.manual_seed(0)
    hf = HFQwen3(tiny_qwen3_config(vocab_size=49152, initializer_range=0.05)).eval()
    path = save_tiny_model(hf, tmp_path, default_model_dir)
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_memory=2**22, block_size=8)
    assert llm.llm_engine.attention_backend == "cpu"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 49152, (n,), generator=g).tolist() for n in (3, 40, 17, 90)]
    ours, theirs = logprob_errors(llm, path, prompts, 24)
    assert_as_close_as_transformers_bf16(ours, theirs)
    assert_no_leaks(llm)


def test_float16_on_cpu_runs_on_the_torch_backend(tmp_path, default_model_dir):
    torch.manual_seed(0)
    hf = HFQwen3(tiny_qwen3_config(vocab_size=49152)).eval()
    path = save_tiny_model(hf, tmp_path, default_model_dir)
    llm = LLM(model=str(path), dtype="float16", kv_cache_memory=2**22)
    assert llm.llm_engine.attention_backend == "torch"
    out = llm.generate([{"prompt_token_ids": [5, 17, 300]}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="attention_backend='cpu' cannot be used"):
        LLM(model=str(path), dtype="float16", attention_backend="cpu")
