"""Gemma 2's attention softcap (``attn_logit_softcapping``) on every backend that can apply it: which
backend an engine gets for a capped model, and which it refuses by name. The kernels' own checks are
with their tests (test_cpu_attention.py, test_triton_attention.py, test_attention.py: flash-attn's glue
and the torch backend's tiled prefill); the engine against transformers is in test_gemma.py."""
from __future__ import annotations

import logging
import sys

import pytest
import torch

from test_attention import _fake_flash_module, set_triton
from test_cuda_path import fake_varlen_attn
from vllmini.models import backend_select
from vllmini.models.attention import torch_varlen_backend
from vllmini.models.backend_select import select_backend

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # (selection only: no device is touched)


def capped_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                       window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None,
                       softcap=0.0):  # fmt: skip
    """A varlen_attn whose schema takes a softcap (torch 2.13's does not): it records the softcap it is
    given in ``SOFTCAPS`` and attends as ``fake_varlen_attn`` (uncapped: only the glue is checked)."""
    SOFTCAPS.append(softcap)
    return fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size,
                            enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table)  # fmt: skip


SOFTCAPS: list[float] = []


@pytest.fixture
def log(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)  # let caplog see our records
    caplog.set_level("INFO", logger="vllmini")
    return caplog


def test_auto_picks_the_usual_backend_that_caps(monkeypatch, log):
    """CPU: the cpu backend (its C kernel caps), as for any model. CUDA: flash-attn when its call takes a
    softcap (>= 2.6), else torch's varlen FlashAttention if its schema does, else the Triton kernel, else
    the torch backend; a FlashAttention backend skipped for want of a cap is logged, naming the key."""
    assert select_backend(None, CPU, torch.float32, 16, softcap=50.0) == "cpu"
    assert select_backend(None, CPU, torch.bfloat16, 16, softcap=50.0) == "cpu"
    assert select_backend(None, CPU, torch.float16, 16, softcap=50.0) == "torch"  # (the kernel reads no float16)
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(softcap=True))
    assert select_backend(None, CUDA, torch.bfloat16, 256, softcap=50.0) == "flash_attn"
    assert "attn_logit_softcapping" not in log.text
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(softcap=False))
    monkeypatch.setattr(backend_select, "torch_varlen_backend", lambda: torch_varlen_backend(capped_varlen_attn))
    assert select_backend(None, CUDA, torch.bfloat16, 256, softcap=50.0) == "torch_varlen"
    assert select_backend(None, CUDA, torch.bfloat16, 256) == "flash_attn"  # (uncapped: as before)
    monkeypatch.setattr(backend_select, "torch_varlen_backend", lambda: torch_varlen_backend(fake_varlen_attn))
    for triton, fallback in ((True, "triton"), (False, "torch")):
        set_triton(monkeypatch, present=triton)
        log.clear()
        assert select_backend(None, CUDA, torch.bfloat16, 256, softcap=50.0) == fallback
        skipped = [r.getMessage() for r in log.records if "attn_logit_softcapping=50.0" in r.getMessage()]
        assert len(set(skipped)) == 1 and "flash_attn_varlen_func takes no softcap" in skipped[0]
        assert "varlen_attn takes no softcap" in skipped[0]


def test_a_forced_backend_that_cannot_cap_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(softcap=False))
    monkeypatch.setattr(backend_select, "torch_varlen_backend", lambda: torch_varlen_backend(fake_varlen_attn))
    for forced, why in (("flash_attn", "flash_attn_varlen_func takes no softcap"), ("torch_varlen", "varlen_attn")):
        with pytest.raises(ValueError, match=rf"attention_backend='{forced}' cannot be used: the model caps its "
                                             rf"attention scores \(attn_logit_softcapping=50.0\) and .*{why}"):  # fmt: skip
            select_backend(forced, CUDA, torch.bfloat16, 256, softcap=50.0)
    set_triton(monkeypatch, present=True)
    assert [select_backend(name, CUDA, torch.bfloat16, 256, softcap=50.0) for name in ("triton", "torch")] == [
        "triton", "torch"]  # fmt: skip
    assert select_backend("cpu", CPU, torch.float32, 16, softcap=50.0) == "cpu"
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_module(softcap=True))
    assert select_backend("flash_attn", CUDA, torch.bfloat16, 256, softcap=50.0) == "flash_attn"


def test_torch_varlen_passes_a_softcap_only_where_its_schema_takes_one():
    """torch 2.13's varlen_attn has no softcap: its binding says so, and refuses one rather than drop it."""
    from test_attention import D, build_batch

    q, k, v, cache, meta, *_ = build_batch([1, 5], [9, 5], seed=4)
    uncapped = torch_varlen_backend(fake_varlen_attn)
    assert not uncapped.supports_softcap
    with pytest.raises(ValueError, match="varlen_attn takes no softcap"):
        uncapped(q, k, v, meta, cache, D**-0.5, softcap=0.5)
    capped = torch_varlen_backend(capped_varlen_attn)
    assert capped.supports_softcap
    SOFTCAPS.clear()
    capped(q, k, v, meta, cache, D**-0.5, softcap=0.5)
    assert SOFTCAPS == [0.5]
