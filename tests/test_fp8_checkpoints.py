"""FP8 checkpoints (models/fp8.py): Qwen3/DeepSeek-style ``quant_method: fp8`` (block scales in
``weight_scale_inv``, or one ``weight_scale`` per tensor) and compressed-tensors' float8 weights
(per tensor, per channel, per block) load dequantized: every weight equals its FP8 value times its
scale (transformers' ``FineGrainedFP8Config(dequantize=True)`` for the block format), the engine's
greedy tokens equal transformers' on those weights, and a broken or foreign checkpoint is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from helpers import assert_engine_matches_transformers, checkpoint_like, save_tiny_model, tiny_llama_config, tiny_qwen3_moe_config
from vllmini import LLM
from vllmini.models.fp8 import fp8_format
from vllmini.models.weight_loader import load_model

CPU = torch.device("cpu")
PROMPTS = [[1, 500, 33, 400, 77, 91], list(range(5, 40))]


def _quantize(w: torch.Tensor, kind: str, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (float8 values, scale, their dense product) as an exporter writes them:
    scales by tile (``ceil`` tiles, the edge ones partial: vLLM's reading), row or tensor."""
    *lead, n, k = w.shape
    if kind in ("tensor", "channel"):
        scale = w.abs().amax() / 448.0 if kind == "tensor" else w.abs().amax(dim=-1, keepdim=True) / 448.0
        q = (w / scale).to(torch.float8_e4m3fn)
        return q, scale.reshape(1) if kind == "tensor" else scale, q.float() * scale
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*lead, nb * bn, kb * bk)
    padded[..., :n, :k] = w
    tiles = padded.view(*lead, nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(-3, -1)) / 448.0
    q_tiles = (tiles / scale[..., :, None, :, None]).to(torch.float8_e4m3fn)
    dense = (q_tiles.float() * scale[..., :, None, :, None]).view(*lead, nb * bn, kb * bk)[..., :n, :k]
    return q_tiles.view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous(), scale, dense.contiguous()


def _write_fp8(dense_dir: Path, out: Path, quantization_config: dict, kind: str, block=None,
               scale_suffix: str = "_scale_inv", extra: dict | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """``dense_dir``'s checkpoint with every projection weight (and stacked experts) in FP8; returns
    the dense weights it stands for (each FP8 value times its scale)."""
    tensors, dequantized = {}, {}
    for name, w in load_file(dense_dir / "model.safetensors").items():
        if name.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj")):
            q, scale, dequantized[name] = _quantize(w.float(), kind, block)
            tensors[name], tensors[name + scale_suffix] = q, scale.float()
        else:
            tensors[name] = dequantized[name] = w
    checkpoint_like(dense_dir, out, {**tensors, **(extra or {})}, quantization_config)
    return dequantized


def _dense(tmp_path: Path, default_model_dir: Path, config, name: str = "dense") -> Path:
    torch.manual_seed(0)
    return save_tiny_model(AutoModelForCausalLM.from_config(config).float(), tmp_path / name, default_model_dir)


def _dense_copy(dense_dir: Path, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """``dense_dir`` with ``weights`` in float32: what the FP8 checkpoint must load as."""
    return checkpoint_like(dense_dir, out, weights)


def _assert_same_parameters(fp8_dir: Path, dense_dir: Path) -> None:
    got, _ = load_model(fp8_dir, torch.float32, CPU)
    want, _ = load_model(dense_dir, torch.float32, CPU)
    want_params = dict(want.named_parameters())
    for name, p in got.named_parameters():
        assert torch.equal(p, want_params[name]), name


def _block_fp8(block) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}


def _compressed(strategy: str, block=None) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    if block:
        weights["block_structure"] = list(block)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}  # fmt: skip


@pytest.mark.parametrize("block", [(16, 16), (32, 32), (128, 128), (32, 48)])
def test_block_fp8_loads_as_transformers_dequantizes_it(tmp_path, default_model_dir, block):
    """Qwen3's -FP8 layout: tiles of ``weight_block_size`` share one ``weight_scale_inv``; every
    weight equals transformers' dequantization, and the engine's greedy tokens and logprobs equal
    transformers' on it. Where a weight's size is no multiple of the tile (64 and 160 against 128 or
    48), the edge tiles are partial, as vLLM reads them (``ceil(N / bn)`` rows of scales); transformers
    instead divides the weight evenly by the scale grid (160 rows over 2 scales: 80 each), so there the
    test's own dequantization is the reference and transformers runs on its dense result."""
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    weights = _write_fp8(dense, tmp_path / "fp8", _block_fp8(block), "block", block)
    want = _dense_copy(dense, weights, tmp_path / "want")
    _assert_same_parameters(tmp_path / "fp8", want)
    if 64 % block[0] == 64 % block[1] == 160 % block[0] == 160 % block[1] == 0:
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32,
                                                  quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=block))  # fmt: skip
        for name, p in hf.state_dict().items():
            assert torch.equal(p, weights[name]), name  # (the test's dequantization is transformers')
    else:
        hf = AutoModelForCausalLM.from_pretrained(want, dtype=torch.float32)
    llm = LLM(model=str(tmp_path / "fp8"), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
    assert_engine_matches_transformers(llm, hf, PROMPTS, f"fp8 blocks {block}")


@pytest.mark.parametrize("fmt", ["fp8-tensor", "ct-tensor", "ct-channel", "ct-block"])
def test_per_tensor_channel_and_compressed_tensors_scales(tmp_path, default_model_dir, fmt):
    """vLLM's per-tensor ``fp8`` (``weight_scale``) and llm-compressor's float8 exports (per tensor,
    channel or block ``weight_scale``, activation scales beside them, dropped) load as their dense values."""
    kind = fmt.split("-")[1]
    block = (16, 32) if kind == "block" else None
    config = {"quant_method": "fp8", "activation_scheme": "static"} if fmt == "fp8-tensor" else _compressed(kind, block)
    extra = {"model.layers.0.self_attn.q_proj.input_scale": torch.tensor([0.02]),
             "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(1.5)}  # fmt: skip
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    weights = _write_fp8(dense, tmp_path / "fp8", config, "block" if kind == "block" else kind, block, "_scale", extra)
    _assert_same_parameters(tmp_path / "fp8", _dense_copy(dense, weights, tmp_path / "want"))


def test_fp8_experts_per_expert_and_stacked(tmp_path, default_model_dir):
    """Qwen3-MoE: the per-expert layout of Qwen3-30B-A3B-FP8 (each expert's projections with their
    tiles' scales) and transformers' stacked experts (``gate_up_proj [E, 2I, H]`` with ``[E, tiles...]``
    scales) both load as their dense values; the engine's greedy tokens equal transformers' on them."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_moe_config()).float()
    dense = save_tiny_model(model, tmp_path / "dense", default_model_dir)  # (saved per expert)
    weights = _write_fp8(dense, tmp_path / "per_expert", _block_fp8((16, 16)), "block", (16, 16))
    want = _dense_copy(dense, weights, tmp_path / "want")
    _assert_same_parameters(tmp_path / "per_expert", want)
    stacked = checkpoint_like(dense, tmp_path / "dense_stacked", model.state_dict())  # (a trainer's: experts stacked)
    assert any(k.endswith("experts.gate_up_proj") for k in load_file(stacked / "model.safetensors"))
    _write_fp8(stacked, tmp_path / "stacked", _block_fp8((16, 16)), "block", (16, 16))  # (tiles split at I = 48)
    _assert_same_parameters(tmp_path / "stacked", want)
    hf = AutoModelForCausalLM.from_pretrained(want, dtype=torch.float32)
    assert_engine_matches_transformers(LLM(model=str(tmp_path / "per_expert"), dtype="float32", max_num_seqs=4,
                                           max_num_batched_tokens=16), hf, PROMPTS, "fp8 experts")  # fmt: skip


def test_reload_weights_reads_an_fp8_folder(tmp_path, default_model_dir):
    """``reload_weights`` (vLLM's live update from a folder) dequantizes as the first load does."""
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    weights = _write_fp8(dense, tmp_path / "fp8", _block_fp8((16, 16)), "block", (16, 16))
    llm = LLM(model=str(dense), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path / "fp8")})
    want, _ = load_model(_dense_copy(dense, weights, tmp_path / "want"), torch.float32, CPU)
    want_params = dict(want.named_parameters())
    for name, p in llm.llm_engine.model.named_parameters():
        assert torch.equal(p, want_params[name]), name


def _break(tmp_path: Path, dense: Path, name: str, config: dict, edit) -> Path:
    out = tmp_path / name
    _write_fp8(dense, out, config, "block", (16, 16))
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_broken_fp8_checkpoints_are_refused_by_name(tmp_path, default_model_dir):
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    q = "model.layers.1.self_attn.q_proj.weight"
    lone = _break(tmp_path, dense, "lone", _block_fp8((16, 16)), lambda t: t.pop(q + "_scale_inv"))
    with pytest.raises(ValueError, match=rf"{q} \(no scale\)"):
        load_model(lone, torch.float32, CPU)
    shape = _break(tmp_path, dense, "shape", _block_fp8((16, 16)), lambda t: t.update({q + "_scale_inv": torch.ones(3, 3)}))
    with pytest.raises(ValueError, match=rf"{q}.*scale of shape \(3, 3\).*16x16 tile"):
        load_model(shape, torch.float32, CPU)
    no_weight = _break(tmp_path, dense, "no_weight", _block_fp8((16, 16)), lambda t: t.update({q: t[q].float()}))
    with pytest.raises(ValueError, match=rf"{q}'s scale \(no FP8 tensor"):
        load_model(no_weight, torch.float32, CPU)
    config = json.loads((dense / "config.json").read_text())
    for quant, field in [({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
                         ({**_compressed("channel"), "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}}}}, "format 'float-quantized'"),
                         ({**_compressed("channel"), "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}},
                                                                       "f": {"weights": {"type": "float", "num_bits": 8}}}}, "config_groups.g.weights"),
                         ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'")]:  # fmt: skip
        (dense / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        with pytest.raises(ValueError, match=field):
            LLM(model=str(dense), dtype="float32")


def test_fp8_format_reads_the_quantization_config():
    assert fp8_format({"quantization_config": _block_fp8((128, 128))}).block == (128, 128)
    assert fp8_format({"quantization_config": {"quant_method": "fp8"}}).block is None
    assert fp8_format({"quantization_config": _compressed("block", (64, 128))}).block == (64, 128)
    assert fp8_format({"quantization_config": _compressed("channel")}).method == "compressed-tensors"
    assert fp8_format({"quantization_config": {"quant_method": "mxfp4"}}) is None
    assert fp8_format({}) is None


def test_quantization_argument_names_the_checkpoints_own_method(tmp_path, default_model_dir):
    """vLLM's ``quantization="fp8"`` on an FP8 checkpoint loads it; on an unquantized one (vLLM would
    quantize online) it is refused by name, as is a method other than the checkpoint's."""
    dense = _dense(tmp_path, default_model_dir, tiny_llama_config())
    _write_fp8(dense, tmp_path / "fp8", _block_fp8((16, 16)), "block", (16, 16))
    LLM(model=str(tmp_path / "fp8"), dtype="float32", quantization="fp8", max_num_seqs=2)
    with pytest.raises(ValueError, match=r"quantization='fp8'.*not quantized.*does not quantize online"):
        LLM(model=str(dense), dtype="float32", quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization='compressed-tensors'.*quant_method 'fp8'"):
        LLM(model=str(tmp_path / "fp8"), dtype="float32", quantization="compressed-tensors")
    with pytest.raises(ValueError, match=r"quantization='bitsandbytes' is not supported"):
        LLM(model=str(tmp_path / "fp8"), dtype="float32", quantization="bitsandbytes")
