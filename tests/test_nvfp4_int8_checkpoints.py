"""compressed-tensors' unpacked int weights (``int-quantized`` W8A8, ``naive-quantized`` W8A16: models/int8.py),
NVFP4 (compressed-tensors' ``nvfp4-pack-quantized`` and ModelOpt's, models/nvfp4.py) and ModelOpt's FP8
(models/fp8.py): a tiny model quantized here by the formats' definitions and written in their on-disk
layout (names, dtypes, config.json's quantization_config or ModelOpt's hf_quant_config.json) loads as
the dense weights the tensors stand for; the engine's greedy tokens and logprobs equal transformers' on
those weights; ignored layers stay dense; reload_weights reads the same; broken ones are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers import (assert_engine_matches_transformers, assert_loads_as, checkpoint_like, save_tiny_dense, tiny_llama_config,
                     tiny_qwen3_config, tiny_qwen3_moe_config)  # fmt: skip
from vllmini import LLM
from vllmini.models.weight_loader import load_model

CPU = torch.device("cpu")
PROMPTS = [[1, 500, 33, 400, 77, 91], list(range(5, 40))]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the magnitudes of codes 0-7; bit 3 is the sign


def _expand(t: torch.Tensor, n: int, k: int, strategy: str, group: int | None, block) -> torch.Tensor:
    """A per-tensor / channel / group / block quantity as a full ``[n, k]`` tensor."""
    if strategy == "tensor":
        return t.reshape(1, 1).expand(n, k)
    if strategy == "channel":
        return t.reshape(n, 1).expand(n, k)
    if strategy == "group":
        return t.repeat_interleave(group, dim=1)[:, :k]
    return t.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]


def _int_quantize(w: torch.Tensor, scheme: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w [N, K]`` -> compressed-tensors' unpacked int tensors (``weight`` int8, ``weight_scale`` in bf16
    as llm-compressor stores it, ``weight_zero_point`` int8) and the dense ``(q - zero) * scale``."""
    n, k = w.shape
    strategy, group, block, bits = scheme["strategy"], scheme.get("group_size"), scheme.get("block_structure"), scheme["num_bits"]
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    g_idx = None
    if scheme.get("actorder") == "group":  # (act-order: each input column's group given, out of order)
        g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(k)) // group
        lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(-(-k // group))], 1)
        hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(-(-k // group))], 1)
    elif strategy == "tensor":
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    elif strategy == "channel":
        lo, hi = w.min(1, keepdim=True).values, w.max(1, keepdim=True).values
    else:
        rows, cols = (1, group) if strategy == "group" else block
        padded = torch.nn.functional.pad(w, (0, -k % cols, 0, -n % rows))
        tiles = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
        lo, hi = tiles.amin((1, 3)), tiles.amax((1, 3))
        if strategy == "group":
            lo, hi = lo.view(n, -1), hi.view(n, -1)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if scheme["symmetric"]:
        scale, zero = (torch.maximum(-lo, hi) / qmax).clamp(min=1e-4).bfloat16(), None
    else:
        scale = ((hi - lo) / (qmax - qmin)).clamp(min=1e-4).bfloat16()
        zero = (qmin - lo / scale.float()).round().clamp(qmin, qmax).to(torch.int8)
    def expand(t: torch.Tensor) -> torch.Tensor:
        return t[:, g_idx] if g_idx is not None else _expand(t, n, k, strategy, group, block)

    s = expand(scale.float())
    z = torch.zeros(n, k) if zero is None else expand(zero.float())
    q = (w / s).round().add(z).clamp(qmin, qmax)
    parts = {"weight": q.to(torch.int8), "weight_scale": scale}
    if g_idx is not None:
        parts["weight_g_idx"] = g_idx.to(torch.int32)
    if zero is not None:
        parts["weight_zero_point"] = zero
    return parts, (q - z) * s


def _nvfp4_quantize(w: torch.Tensor, producer: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``w [..., N, K]`` -> NVFP4 as compressed-tensors (``weight_packed``, ``weight_scale`` float8 per 16
    inputs, ``weight_global_scale = 448 * 6 / amax``, dividing) or ModelOpt (``weight``, ``weight_scale``,
    ``weight_scale_2 = amax / (448 * 6)``, multiplying) write it, and the dense value of each code times its
    group's effective scale."""
    *lead, n, k = w.shape
    groups = w.reshape(*lead, n, k // 16, 16)
    amax = w.abs().amax()
    if producer == "compressed-tensors":
        g = (448.0 * 6.0 / amax).float()
        scale = (groups.abs().amax(-1) / 6.0 * g).to(torch.float8_e4m3fn)
        effective = scale.float() / g
    else:
        g = (amax / (448.0 * 6.0)).float()
        scale = (groups.abs().amax(-1) / 6.0 / g).to(torch.float8_e4m3fn)
        effective = scale.float() * g
    x = groups / torch.where(effective == 0, 1.0, effective).unsqueeze(-1)
    codes = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1) | (torch.signbit(x).long() << 3)
    values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    dense = (values * effective.unsqueeze(-1)).reshape(*lead, n, k)
    codes = codes.reshape(*lead, n, k)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # (the low nibble first)
    if producer == "compressed-tensors":
        return {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": g.reshape(1),
                "input_global_scale": torch.tensor([1234.0])}, dense  # fmt: skip
    return {"weight": packed, "weight_scale": scale, "weight_scale_2": g, "input_scale": torch.tensor(0.01)}, dense


def _fp8_per_tensor(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """ModelOpt's FP8: ``weight`` float8 and one float32 ``weight_scale``, an ``input_scale`` beside them."""
    scale = (w.abs().amax() / 448.0).float()
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor(0.02)}, q.float() * scale


def _quantizer(kind: str, quant: dict):
    if kind == "int":
        return lambda w: _int_quantize(w, quant["config_groups"]["group_0"]["weights"])
    if kind == "fp8":
        return _fp8_per_tensor
    return lambda w: _nvfp4_quantize(w, kind)


def _write(dense_dir: Path, out: Path, kind: str, quant: dict, ignore=("mlp.gate.",), hf_quant_config=False,
           extra: dict | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """``dense_dir``'s checkpoint with every projection (but those named in ``ignore``) quantized;
    ``hf_quant_config``: ``quant`` written as ModelOpt's hf_quant_config.json instead of config.json's.
    Returns the dense weights the checkpoint stands for."""
    quantize = _quantizer(kind, quant)
    tensors, want = {}, {}
    for name, w in load_file(dense_dir / "model.safetensors").items():
        if not name.endswith("proj.weight") or any(s in name for s in ignore):
            tensors[name] = want[name] = w
            continue
        parts, want[name] = quantize(w.float())
        tensors.update({f"{name.removesuffix('.weight')}.{leaf}": t for leaf, t in parts.items()})
    checkpoint_like(dense_dir, out, {**tensors, **(extra or {})}, None if hf_quant_config else quant)
    if hf_quant_config:
        (out / "hf_quant_config.json").write_text(json.dumps(quant))
    return want


def _ct_int(strategy="channel", bits=8, group=None, block=None, symmetric=True, fmt="int-quantized", activations=True,
            actorder=None) -> dict:  # fmt: skip
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, "group_size": group,
               "block_structure": list(block) if block else None, "dynamic": False, "actorder": actorder}  # fmt: skip
    group_0 = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    if activations:  # (W8A8: dynamic per-token int8 activations, not applied here)
        group_0["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "quantization_status": "compressed",
            "config_groups": {"group_0": group_0}}  # fmt: skip


def _ct_nvfp4(activations=True) -> dict:
    fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16, "dynamic": False}
    group_0 = {"targets": ["Linear"], "weights": fp4, "input_activations": {**fp4, "dynamic": "local"} if activations else None}
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": group_0}}  # fmt: skip


def _modelopt(algo: str, legacy=False, exclude=("lm_head",)) -> dict:
    """config.json's ModelOpt >= 0.31 quantization_config, or (``legacy``) an hf_quant_config.json."""
    if legacy:
        return {"producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": list(exclude)}}  # fmt: skip
    return {"quant_method": "modelopt", "quant_algo": algo, "ignore": list(exclude), "producer": {"name": "modelopt", "version": "0.39.0"},
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False}, **({"group_size": 16} if "FP4" in algo else {})}  # fmt: skip


def _dense(tmp_path: Path, default_model_dir: Path, config) -> Path:
    return save_tiny_dense(tmp_path, default_model_dir, config)


KV_SCALES = {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(1.5), "model.layers.0.self_attn.v_proj.v_scale": torch.tensor(2.0)}

CASES = {  # name -> (quantizer kind, quantization_config, as hf_quant_config.json, run through the engine)
    "ct-w8a8-channel": ("int", _ct_int(), False, True),
    "ct-w8a8-tensor-asym": ("int", _ct_int("tensor", symmetric=False), False, False),
    "ct-w8a16-group-asym": ("int", _ct_int("group", group=32, symmetric=False, fmt="naive-quantized", activations=False), False, True),
    "ct-w4-group-naive": ("int", _ct_int("group", bits=4, group=16, fmt="naive-quantized", activations=False), False, False),
    "ct-int8-block": ("int", _ct_int("block", block=(32, 48)), False, False),
    "ct-w8a16-actorder": ("int", _ct_int("group", group=16, symmetric=False, activations=False, actorder="group"), False, True),
    "ct-nvfp4": ("compressed-tensors", _ct_nvfp4(), False, True),
    "ct-nvfp4a16": ("compressed-tensors", _ct_nvfp4(activations=False), False, False),
    "modelopt-nvfp4": ("modelopt", _modelopt("NVFP4"), False, True),
    "modelopt-nvfp4-hf-quant-config": ("modelopt", _modelopt("NVFP4", legacy=True), True, False),
    "modelopt-fp8": ("fp8", _modelopt("FP8"), False, False),
    "modelopt-fp8-hf-quant-config": ("fp8", _modelopt("FP8", legacy=True), True, True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_quantized_linears_load_as_their_dense_weights(tmp_path, default_model_dir, name):
    kind, quant, legacy, engine = CASES[name]
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    want = checkpoint_like(dense, tmp_path / "want", _write(dense, tmp_path / "q", kind, quant, hf_quant_config=legacy, extra=KV_SCALES))
    assert_loads_as(tmp_path / "q", want)
    if engine:  # (through the engine: greedy tokens and logprobs as transformers' on the dense weights)
        llm = LLM(model=str(tmp_path / "q"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
        assert_engine_matches_transformers(llm, AutoModelForCausalLM.from_pretrained(want, dtype=torch.float32), PROMPTS, name)


def test_ignored_layers_stay_dense_in_qwen3(tmp_path, default_model_dir):
    """Qwen3 with the layers an export leaves out (``ignore`` / ``exclude_modules``: lm_head, one layer's
    attention) stored dense beside NVFP4 and int8 ones: they load as they are, the rest dequantized."""
    dense = _dense(tmp_path, default_model_dir, tiny_qwen3_config())
    skip = ("model.layers.1.self_attn.",)
    for kind, quant in [("modelopt", _modelopt("NVFP4", exclude=("lm_head", "model.layers.1.self_attn*"))),
                        ("int", {**_ct_int(), "ignore": ["lm_head", "re:.*layers.1.self_attn.*"]})]:  # fmt: skip
        weights = _write(dense, tmp_path / kind, kind, quant, ignore=skip)
        stored = load_file(tmp_path / kind / "model.safetensors")
        assert stored["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
        assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == (torch.uint8 if kind == "modelopt" else torch.int8)
        want = checkpoint_like(dense, tmp_path / f"want_{kind}", weights)
        assert_loads_as(tmp_path / kind, want)
    llm = LLM(model=str(tmp_path / "modelopt"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
    assert_engine_matches_transformers(llm, AutoModelForCausalLM.from_pretrained(tmp_path / "want_modelopt", dtype=torch.float32),
                                       PROMPTS, "qwen3 modelopt nvfp4")  # fmt: skip


@pytest.mark.parametrize("kind", ["modelopt", "compressed-tensors", "int"])
def test_moe_experts_per_expert(tmp_path, default_model_dir, kind):
    """Qwen3-MoE: every expert's projections quantized one by one (the router left dense) load as their dense values."""
    dense = _dense(tmp_path, default_model_dir, tiny_qwen3_moe_config())
    quant = {"modelopt": _modelopt("NVFP4", exclude=("lm_head", "*mlp.gate")), "compressed-tensors": _ct_nvfp4(),
             "int": _ct_int("group", group=16, symmetric=False)}[kind]  # fmt: skip
    weights = _write(dense, tmp_path / "q", kind, quant)
    assert any(".experts.3.down_proj.weight_" in k for k in load_file(tmp_path / "q" / "model.safetensors"))
    want = checkpoint_like(dense, tmp_path / "want", weights)
    assert_loads_as(tmp_path / "q", want)
    if kind == "modelopt":
        llm = LLM(model=str(tmp_path / "q"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
        assert_engine_matches_transformers(llm, AutoModelForCausalLM.from_pretrained(want, dtype=torch.float32), PROMPTS, "moe nvfp4")


def test_reload_weights_reads_nvfp4_and_int8_folders(tmp_path, default_model_dir):
    """``reload_weights`` dequantizes as the first load does, hf_quant_config.json included (no config passed)."""
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    llm = LLM(model=str(dense), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
    for kind, quant, legacy in [("modelopt", _modelopt("NVFP4", legacy=True), True), ("int", _ct_int(), False)]:
        weights = _write(dense, tmp_path / kind, kind, quant, hf_quant_config=legacy)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path / kind)})
        want = dict(load_model(checkpoint_like(dense, tmp_path / f"want_{kind}", weights), torch.float32, CPU)[0].named_parameters())
        for name, p in llm.llm_engine.model.named_parameters():
            assert torch.equal(p, want[name]), (kind, name)


def _broken(tmp_path: Path, dense: Path, name: str, kind: str, quant: dict, edit, legacy=False) -> Path:
    _write(dense, tmp_path / name, kind, quant, hf_quant_config=legacy)
    tensors = load_file(tmp_path / name / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
    return tmp_path / name


def test_broken_and_unreadable_checkpoints_are_refused_by_name(tmp_path, default_model_dir):
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    q = "model.layers.1.self_attn.q_proj"
    cases = [("modelopt", _modelopt("NVFP4"), lambda t: t.pop(f"{q}.weight_scale_2"), rf"NVFP4 checkpoint: {q} \(weight_scale_2 missing\)"),
             ("compressed-tensors", _ct_nvfp4(), lambda t: t.pop(f"{q}.weight_global_scale"), rf"{q} \(weight_global_scale missing\)"),
             ("compressed-tensors", _ct_nvfp4(), lambda t: t.update({f"{q}.weight_scale": t[f"{q}.weight_scale"][:, :2].contiguous()}),
              rf"{q}.weight_scale has shape \(64, 2\).*needs \(64, 4\)"),
             ("modelopt", _modelopt("NVFP4"), lambda t: t.update({f"{q}.weight_scale_2": torch.ones(3)}), rf"{q}.weight_scale_2 has shape \(3,\)"),
             ("int", _ct_int(symmetric=False), lambda t: t.pop(f"{q}.weight_zero_point"), rf"int-quantized checkpoint: {q} \(weight_zero_point missing\)"),
             ("int", _ct_int("group", group=32), lambda t: t.update({f"{q}.weight_scale": t[f"{q}.weight_scale"][:, :1].contiguous()}),
              rf"{q}.weight_scale has shape \(64, 1\); a \[64 x 64\] weight quantized by group needs \(64, 2\)"),
             ("int", _ct_int("group", group=48), lambda t: None, r"model.layers.0.mlp.down_proj.weight has 160 inputs, no multiple of group_size 48")]  # fmt: skip
    for i, (kind, quant, edit, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            load_model(_broken(tmp_path, dense, f"b{i}", kind, quant, edit), torch.float32, CPU)
    config = json.loads((dense / "config.json").read_text())
    for quant, field in [(_modelopt("MXFP8"), "quant_algo 'MXFP8'"), (_modelopt("MIXED_PRECISION"), "quant_algo 'MIXED_PRECISION'"),
                         ({**_ct_nvfp4(), "format": "mxfp4-pack-quantized"}, "format 'nvfp4-pack-quantized'.*got format 'mxfp4-pack-quantized'"),
                         (_ct_int(bits=16), "num_bits is 16"), (_ct_int("token"), "strategy is 'token'"),
                         ({**_ct_int(), "format": "sparse-24-bitmask"}, "format 'pack-quantized'.*sparse-24-bitmask")]:  # fmt: skip
        (dense / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        with pytest.raises(ValueError, match=field):
            LLM(model=str(dense), dtype="float32")
    (dense / "config.json").write_text(json.dumps(config))
    (dense / "hf_quant_config.json").write_text(json.dumps(_modelopt("INT4_AWQ", legacy=True)))
    with pytest.raises(ValueError, match=r"hf_quant_config.json: quantization_config \(ModelOpt\) quant_algo 'INT4_AWQ'"):
        LLM(model=str(dense), dtype="float32")


def test_quantization_argument_takes_vllms_names(tmp_path, default_model_dir):
    """``quantization=`` names the checkpoint's method as vLLM does: "compressed-tensors" for its int8 and
    NVFP4, "modelopt" for ModelOpt's FP8, "modelopt_fp4" (or config.json's "modelopt") for its NVFP4; a
    mismatch is refused, naming what the checkpoint says."""
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    _write(dense, tmp_path / "int", "int", _ct_int())
    _write(dense, tmp_path / "fp4", "modelopt", _modelopt("NVFP4", legacy=True), hf_quant_config=True)
    _write(dense, tmp_path / "fp8", "fp8", _modelopt("FP8"))
    for folder, name in [("int", "compressed-tensors"), ("fp4", "modelopt_fp4"), ("fp4", "modelopt"), ("fp8", "modelopt")]:
        llm = LLM(model=str(tmp_path / folder), dtype="float32", quantization=name, max_num_seqs=2)
        assert llm.model_config.quantization == {"fp4": "modelopt_fp4"}.get(folder, name)  # (vLLM's; hf_quant_config.json's too)
    for folder, name, says in [("fp8", "modelopt_fp4", r"config.json says quant_method 'modelopt' with quant_algo 'FP8'"),
                               ("fp4", "compressed-tensors", r"hf_quant_config.json says quant_method 'modelopt' with quant_algo 'NVFP4'"),
                               ("int", "modelopt", r"config.json says quant_method 'compressed-tensors'")]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"quantization='{name}'.*{says}"):
            LLM(model=str(tmp_path / folder), dtype="float32", quantization=name)


def test_format_readers_and_stacked_experts():
    """The config readers on the layouts the engine tests do not write (ModelOpt's FP8 variants, a lower-case
    algo, W4A16_NVFP4), and NVFP4 experts stacked ``[E, N, K / 2]`` with one global scale per expert."""
    from vllmini.models.fp8 import fp8_format
    from vllmini.models.int8 import int_format
    from vllmini.models.nvfp4 import NvFp4Format, dequantize_nvfp4, nvfp4_format

    assert fp8_format({"quantization_config": _modelopt("FP8_PB_WO")}).block == (128, 128)
    assert fp8_format({"quantization_config": _modelopt("FP8_PER_CHANNEL_PER_TOKEN")}).block is None
    assert fp8_format({"quantization_config": _modelopt("NVFP4")}) is None
    assert nvfp4_format({"quantization_config": _modelopt("nvfp4", legacy=True)}) == NvFp4Format("modelopt", 16)
    assert nvfp4_format({"quantization_config": _modelopt("W4A16_NVFP4")}) == NvFp4Format("modelopt", 16)
    assert nvfp4_format({"quantization_config": _ct_int()}) is None and int_format({"quantization_config": _ct_nvfp4()}) is None
    assert int_format({"quantization_config": {**_ct_int(bits=4, group=32, strategy="group"), "format": "pack-quantized"}}) is None
    torch.manual_seed(0)
    experts = [_nvfp4_quantize(torch.randn(32, 64) * (e + 1), "modelopt") for e in range(3)]
    stacked = dequantize_nvfp4(torch.stack([p["weight"] for p, _ in experts]), torch.stack([p["weight_scale"] for p, _ in experts]),
                               torch.stack([p["weight_scale_2"] for p, _ in experts]), NvFp4Format("modelopt", 16))  # fmt: skip
    assert torch.equal(stacked, torch.stack([dense for _, dense in experts]))
