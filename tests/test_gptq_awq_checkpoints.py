"""GPTQ and AWQ checkpoints (models/gptq_awq.py): a tiny model quantized here, by group, and packed as
AutoGPTQ / GPTQModel (v1 zeros stored minus one, v2, act-order ``g_idx``, 2/4/8 bits) and AutoAWQ's
gemm layout write them, loads as the dense weights ``(q - zero) * scale`` the packing stands for; the
engine's greedy tokens equal transformers' on those weights; broken checkpoints are refused by name.
The packing here is written from the formats' definitions, apart from the module's unpacking."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers import (assert_engine_matches_transformers, assert_loads_as, checkpoint_like, save_tiny_dense, tiny_llama_config,
                     tiny_qwen3_moe_config)  # fmt: skip
from vllmini import LLM
from vllmini.models.weight_loader import load_model

CPU = torch.device("cpu")
PROMPTS = [[1, 500, 33, 400, 77, 91], list(range(5, 40))]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: the word's i-th value (lowest bits first) is column AWQ_ORDER[i]


def _words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., words, per]`` values (each < 2**bits) -> int32 words, value i at bits ``i * bits``."""
    v = values.to(torch.int64).numpy().astype(np.uint64)
    shifts = np.arange(values.shape[-1], dtype=np.uint64) * np.uint64(bits)
    return torch.from_numpy((v << shifts).sum(-1).astype(np.uint32).view(np.int32))


def _quantize(w: torch.Tensor, bits: int, group: int, g_idx: torch.Tensor | None, symmetric: bool = False):
    """``w [N, K]`` -> (q [K, N], zeros [G, N], scales [G, N], group of each input column): min/max by
    group (symmetric: the zero is 2**(bits - 1)), scales rounded to fp16 as the exporters store them."""
    n, k = w.shape
    group_of = g_idx if g_idx is not None else torch.arange(k) // (k if group == -1 else group)
    groups = int(group_of.max()) + 1
    wt, top = w.t(), (1 << bits) - 1
    scales, zeros = torch.empty(groups, n), torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        rows = wt[group_of == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        if symmetric:
            scales[g] = (torch.maximum(-lo, hi) / ((1 << (bits - 1)) - 1)).clamp(min=1e-4).half().float()
            zeros[g] = 1 << (bits - 1)
            continue
        scales[g] = ((hi - lo) / top).clamp(min=1e-4).half().float()
        zeros[g] = (-lo / scales[g]).round().clamp(0, top).long()
    q = (wt / scales[group_of]).round().long().add(zeros[group_of]).clamp(0, top)
    return q, zeros, scales, group_of


def _pack(w: torch.Tensor, fmt: dict, g_idx=None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear's tensors as the format stores them, and the dense weight ``[N, K]`` they stand for."""
    if fmt["quant_method"] == "compressed-tensors":
        return _pack_compressed_tensors(w, fmt["config_groups"]["group_0"]["weights"], g_idx)
    bits, group = fmt.get("bits", 4), fmt.get("group_size", 128)
    q, zeros, scales, group_of = _quantize(w, bits, group, g_idx)
    dense = ((q - zeros[group_of]).float() * scales[group_of]).t().contiguous()
    per = 32 // bits
    if fmt["quant_method"] == "awq":  # both packed along the outputs, in AWQ's column order
        order = list(AWQ_ORDER)
        qweight = _words(q.view(q.shape[0], -1, 8)[..., order], 4)
        qzeros = _words(zeros.view(zeros.shape[0], -1, 8)[..., order], 4)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales.half()}, dense
    stored = zeros - (1 if fmt.get("checkpoint_format", "gptq") == "gptq" else 0)  # (v1: zero - 1)
    qweight = _words(q.t().reshape(q.shape[1], -1, per).permute(1, 0, 2), bits)  # [K / per, N]
    qzeros = _words(stored.reshape(stored.shape[0], -1, per), bits)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.half(), "g_idx": group_of.to(torch.int32)}, dense


def _pack_compressed_tensors(w: torch.Tensor, scheme: dict, g_idx=None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """compressed-tensors' pack-quantized layout: values (signed, stored plus 2**(bits - 1): so the
    unsigned q) packed along the inputs, zero points along the outputs, scales ``[N, groups]``."""
    bits, n, k = scheme["num_bits"], *w.shape
    group = scheme.get("group_size") or -1 if scheme["strategy"] == "group" else -1
    q, zeros, scales, group_of = _quantize(w, bits, group, g_idx, symmetric=scheme["symmetric"])
    dense = ((q - zeros[group_of]).float() * scales[group_of]).t().contiguous()
    per = 32 // bits
    parts = {"weight_packed": _words(q.t().reshape(n, k // per, per), bits), "weight_scale": scales.t().contiguous().half(),
             "weight_shape": torch.tensor([n, k])}  # fmt: skip
    if not scheme["symmetric"]:
        parts["weight_zero_point"] = _words(zeros.t().reshape(n // per, per, -1).permute(0, 2, 1), bits)
    if g_idx is not None:
        parts["weight_g_idx"] = group_of.to(torch.int32)
    return parts, dense


def _write(dense_dir: Path, out: Path, fmt: dict, act_order: bool = False, skip=("mlp.gate.",)) -> dict[str, torch.Tensor]:
    """``dense_dir``'s checkpoint with every projection quantized; returns the dense weights it stands for."""
    g = torch.Generator().manual_seed(1)
    tensors, want = {}, {}
    for name, w in load_file(dense_dir / "model.safetensors").items():
        if not name.endswith("proj.weight") or any(s in name for s in skip):
            tensors[name] = want[name] = w
            continue
        module = name.removesuffix(".weight")
        k, group = w.shape[1], fmt.get("group_size") or fmt.get("config_groups", {}).get("group_0", {}).get("weights", {}).get("group_size") or 128
        g_idx = torch.randperm(k, generator=g) // group if act_order else None  # (act-order: groups out of order)
        parts, want[name] = _pack(w.float(), fmt, g_idx)
        tensors.update({f"{module}.{part}": t for part, t in parts.items()})
    checkpoint_like(dense_dir, out, tensors, fmt)
    return want


def _dense(tmp_path: Path, default_model_dir: Path, config) -> Path:
    return save_tiny_dense(tmp_path, default_model_dir, config)


def _gptq(bits=4, group=32, desc_act=False, fmt="gptq") -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": False,
            "checkpoint_format": fmt}  # fmt: skip


def _compressed(bits=4, group: int | None = 32, symmetric=True, actorder=None) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group" if group else "channel",
               "group_size": group, "actorder": actorder}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}


def _awq(group=32) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}


@pytest.mark.parametrize("name,fmt,act_order", [
    ("gptq-4bit", _gptq(), False), ("gptq-v2", _gptq(fmt="gptq_v2"), False), ("gptq-act-order", _gptq(group=16, desc_act=True), True),
    ("gptq-8bit-one-group", _gptq(bits=8, group=-1), False), ("gptq-2bit", _gptq(bits=2, group=32), False),
    ("awq", _awq(), False), ("awq-group-64", _awq(64), False),
    ("ct-w4a16", _compressed(), False), ("ct-w4a16-asym", _compressed(symmetric=False), False),
    ("ct-w8a16-channel", _compressed(bits=8, group=None), False), ("ct-actorder", _compressed(group=16, actorder="group"), True)])  # fmt: skip
def test_quantized_linears_load_as_their_dense_weights(tmp_path, default_model_dir, name, fmt, act_order):
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    want = checkpoint_like(dense, tmp_path / "want", _write(dense, tmp_path / "q", fmt, act_order))
    assert_loads_as(tmp_path / "q", want)
    if name in ("gptq-act-order", "awq", "ct-w4a16-asym"):  # (through the engine: greedy tokens and logprobs as transformers')
        llm = LLM(model=str(tmp_path / "q"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
        assert_engine_matches_transformers(llm, AutoModelForCausalLM.from_pretrained(want, dtype=torch.float32), PROMPTS, name)


def test_quantized_experts(tmp_path, default_model_dir):
    """GPTQ experts of a Qwen3-MoE (one quantized linear per expert and projection, the router left float)."""
    dense = _dense(tmp_path, default_model_dir, tiny_qwen3_moe_config())
    want = checkpoint_like(dense, tmp_path / "want", _write(dense, tmp_path / "q", _gptq(group=16)))
    assert_loads_as(tmp_path / "q", want)


def test_broken_and_unreadable_checkpoints_are_refused_by_name(tmp_path, default_model_dir):
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    _write(dense, tmp_path / "q", _gptq())
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    q = "model.layers.1.self_attn.q_proj"
    broken = {k: v for k, v in tensors.items() if k != f"{q}.qzeros"}
    save_file(broken, tmp_path / "q" / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{q} \(qzeros missing\)"):
        load_model(tmp_path / "q", torch.float32, CPU)
    save_file({**tensors, f"{q}.scales": tensors[f"{q}.scales"][:1]}, tmp_path / "q" / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{q}.scales has shape \(1, 64\).*needs \(2, 64\)"):
        load_model(tmp_path / "q", torch.float32, CPU)
    save_file({**tensors, f"{q}.g_idx": tensors[f"{q}.g_idx"] + 5}, tmp_path / "q" / "model.safetensors")
    with pytest.raises(ValueError, match=rf"{q}.g_idx must give"):
        load_model(tmp_path / "q", torch.float32, CPU)
    config = json.loads((dense / "config.json").read_text())
    for quant, field in [(_gptq(bits=3), "bits is 3"), ({**_awq(), "version": "gemv"}, "version 'gemv'"),
                         (_gptq(fmt="marlin"), "checkpoint_format 'marlin'"), (_gptq(group=0), "group_size"),
                         ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'")]:  # fmt: skip
        (dense / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        with pytest.raises(ValueError, match=field):
            LLM(model=str(dense), dtype="float32")


def test_quantization_argument_takes_vllms_names_for_the_method(tmp_path, default_model_dir):
    """``quantization="gptq"`` (or vLLM's kernel names for it, ``gptq_marlin``) loads a GPTQ checkpoint;
    AWQ's name on it is refused, naming what the checkpoint says."""
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    _write(dense, tmp_path / "q", _gptq())
    for name in ("gptq", "gptq_marlin"):
        LLM(model=str(tmp_path / "q"), dtype="float32", quantization=name, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"quantization='awq_marlin'.*quant_method 'gptq'"):
        LLM(model=str(tmp_path / "q"), dtype="float32", quantization="awq_marlin")
