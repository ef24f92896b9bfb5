"""The start-up check of attention backends: a kernel that raises where it first runs, or that
returns wrong numbers, is caught before any request; the engine then falls back to the torch
backend with one warning, or refuses a forced backend with a clear error."""
from __future__ import annotations

import logging

import pytest
import torch

from helpers import tiny_qwen3_config, triton_skip_reason
from vllmini.models import backend_check
from vllmini.models.attention import torch_attention
from vllmini.models.backend_check import check_backend, start_backend

CPU = torch.device("cpu")
SHAPES = dict(num_heads=6, num_kv_heads=2, head_dim=16, block_size=8)


def raising_backend(*args):
    raise RuntimeError("PTX .version 9.4 does not support .target sm_90a")  # what a toolchain mismatch says


def off_by_ten_percent(q, k, v, meta, kv_cache, scale, window=None):
    return torch_attention(q, k, v, meta, kv_cache, scale, window) * 1.1


def test_the_torch_path_passes_its_own_check():
    assert check_backend(torch_attention, CPU, torch.float32, **SHAPES) is None


@pytest.mark.skipif(triton_skip_reason(cpu_tensors=True) is not None, reason=str(triton_skip_reason(cpu_tensors=True)))
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(6, 2, 16, 8), (16, 8, 128, 256), (9, 3, 64, 16)])
def test_the_triton_kernel_passes(heads, kv_heads, head_dim, block_size):
    from vllmini.models.triton_attention import triton_attention

    assert check_backend(triton_attention, CPU, torch.float32, heads, kv_heads, head_dim, block_size) is None


def test_failures_are_named():
    problem = check_backend(raising_backend, CPU, torch.float32, **SHAPES)
    assert problem.startswith("RuntimeError: PTX .version 9.4")
    problem = check_backend(off_by_ten_percent, CPU, torch.float32, **SHAPES)
    for kind in ("prompts without a cache", "mixed prefill/decode step", "decode-only step"):
        assert kind in problem


def ignores_the_window(q, k, v, meta, kv_cache, scale, window=None):
    return torch_attention(q, k, v, meta, kv_cache, scale)


def test_a_backend_that_ignores_the_window_fails_for_a_sliding_model():
    assert check_backend(ignores_the_window, CPU, torch.float32, **SHAPES) is None  # no window: no difference
    problem = check_backend(ignores_the_window, CPU, torch.float32, **SHAPES, window=4096)
    for kind in ("prompts without a cache (sliding window 4)", "decode-only step (sliding window 4)"):
        assert kind in problem


@pytest.mark.skipif(triton_skip_reason(cpu_tensors=True) is not None, reason=str(triton_skip_reason(cpu_tensors=True)))
def test_the_triton_kernel_passes_with_a_window():
    from vllmini.models.triton_attention import triton_attention

    assert check_backend(triton_attention, CPU, torch.float32, 6, 2, 16, 8, window=100) is None


@pytest.fixture
def chosen(monkeypatch, caplog):
    """select_backend picks 'triton' (as on a CUDA machine without flash-attn); get_backend
    hands out whatever the test puts in ``chosen.fn``."""

    class Chosen:
        fn = staticmethod(raising_backend)

    monkeypatch.setattr(backend_check, "select_backend", lambda requested, *a: requested or "triton")
    monkeypatch.setattr(backend_check, "get_backend", lambda name: torch_attention if name == "torch" else Chosen.fn)
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)
    caplog.set_level("INFO", logger="vllmini")
    return Chosen


def test_a_failing_auto_choice_falls_back_with_one_warning(chosen, caplog):
    name, fn = start_backend(None, CPU, torch.float32, 8, 6, 2, 16)
    assert (name, fn) == ("torch", torch_attention)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "triton failed its start-up check (RuntimeError: PTX" in warnings[0]
    chosen.fn = staticmethod(off_by_ten_percent)
    assert start_backend(None, CPU, torch.float32, 8, 6, 2, 16)[0] == "torch"


def test_a_failing_forced_backend_is_refused(chosen):
    with pytest.raises(ValueError, match="attention_backend='triton' failed its start-up check: RuntimeError"):
        start_backend("triton", CPU, torch.float32, 8, 6, 2, 16)
    chosen.fn = staticmethod(off_by_ten_percent)
    with pytest.raises(ValueError, match="decode-only step: max \\|diff\\|"):
        start_backend("triton", CPU, torch.float32, 8, 6, 2, 16)


def test_a_passing_backend_is_kept(chosen):
    chosen.fn = staticmethod(lambda *a: torch_attention(*a))
    name, fn = start_backend(None, CPU, torch.float32, 8, 6, 2, 16)
    assert name == "triton" and fn is chosen.fn


def test_the_engine_starts_on_the_torch_backend_when_its_choice_fails(chosen, tmp_path):
    from transformers import AutoModelForCausalLM

    from bench.random_model import save_word_level_tokenizer
    from vllmini import LLM, SamplingParams

    hf = AutoModelForCausalLM.from_config(tiny_qwen3_config(), dtype=torch.float32)
    hf.save_pretrained(tmp_path)
    save_word_level_tokenizer(hf.config.vocab_size, tmp_path)
    llm = LLM(model=str(tmp_path), kv_cache_memory=2**22)
    assert llm.llm_engine.attention_backend == "torch"
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
