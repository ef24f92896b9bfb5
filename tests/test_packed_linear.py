"""oneDNN-prepacked CPU linears: same results as nn.Linear, swapped in by the engine on CPU
(float32, and bfloat16 where the CPU has native bf16 kernels), tied embeddings untouched."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM as HFLlama

from helpers import save_tiny_model, tiny_llama_config
from vllmini.models.packed_linear import PackedLinear, packing_available, prepack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
BF16_PACKING = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
DTYPES = [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not BF16_PACKING, reason="no native bf16 in oneDNN here")),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_packed_linear_matches_nn_linear(bias, rows, dtype):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    packed = PackedLinear(lin)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    assert packed(x).dtype == dtype
    torch.testing.assert_close(packed(x), lin(x), **tol)
    torch.testing.assert_close(packed(x.t().contiguous().t()), lin(x), **tol)  # non-contiguous input


def test_prepack_replaces_every_linear_and_keeps_tied_embedding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 50)))
    model[2][1].weight = model[0].weight  # tied
    x = torch.randint(0, 50, (7,))
    with torch.inference_mode():
        want = model(x)
        assert prepack_linears(model) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model[0], nn.Embedding) and model[0].weight.shape == (50, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packing_only_on_cpu_for_float32_and_native_bfloat16():
    assert packing_available(torch.device("cpu"), torch.float32)
    assert packing_available(torch.device("cpu"), torch.bfloat16) == BF16_PACKING
    assert not packing_available(torch.device("cpu"), torch.float16)
    assert not packing_available(torch.device("cuda"), torch.float32)
    assert not packing_available(torch.device("cuda"), torch.bfloat16)


def test_engine_uses_packed_linears_and_matches_hf(tmp_path, default_model_dir):
    from vllmini import LLM, SamplingParams

    torch.manual_seed(0)
    hf = HFLlama(tiny_llama_config(vocab_size=49152)).eval()
    path = save_tiny_model(hf, tmp_path, default_model_dir)
    llm = LLM(model=str(path), kv_cache_memory=2**22)
    model = llm.llm_engine.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) > 0
    prompt = [5, 17, 300, 41, 9, 2000, 7]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)[0, len(prompt):]
    assert out[0].outputs[0].token_ids == want.tolist()
