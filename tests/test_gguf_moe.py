"""Mixture-of-experts GGUF files as llama.cpp writes them (qwen3moe, qwen2moe with its shared
expert, Mixtral as ``llama`` with experts, stacked or one tensor per expert): converted tensors
equal to the source and to transformers' own GGUF loader, generation equal to transformers on the
converted directory, broken files refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import prompt_forward
from test_architectures import assert_engine_greedy
from test_gguf import _cache_entries, _read_all, _transformers_gguf_tensors, write_tiny_gguf
from vllmini import LLM
from vllmini.models.gguf_convert import convert_gguf, hf_tensor_name
from vllmini.models.weight_loader import resolve_model_dir

# (GGUF architecture, stacked experts): llama is Mixtral; per-expert tensors are pre-April-2024 files
CASES = [("qwen3moe", True), ("qwen2moe", True), ("llama", True), ("llama", False)]
IDS = ["qwen3moe", "qwen2moe", "mixtral", "mixtral-per-expert"]


def _write(path: Path, arch: str, stacked: bool = True, **kwargs) -> dict:
    return write_tiny_gguf(path, arch, tied=False, experts=4, stacked=stacked,
                           head_dim=24 if arch == "qwen3moe" else None, **kwargs)  # fmt: skip


def _stacked_like_transformers(got: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """transformers keeps a layer's experts stacked (``experts.gate_up_proj`` [E, 2I, H], gate
    rows first; ``experts.down_proj`` [E, H, I]); ours are per expert, as HF checkpoints."""
    parent, _, leaf = name.rpartition(".")
    n = sum(1 for k in got if k.startswith(parent + ".") and k.endswith(".down_proj.weight"))
    if leaf == "down_proj":
        return torch.stack([got[f"{parent}.{e}.down_proj.weight"] for e in range(n)])
    return torch.stack([torch.cat([got[f"{parent}.{e}.gate_proj.weight"], got[f"{parent}.{e}.up_proj.weight"]])
                        for e in range(n)])  # fmt: skip


def test_expert_tensor_names() -> None:
    assert hf_tensor_name("blk.3.ffn_up_exps.weight", "qwen3moe", expert=2) == "model.layers.3.mlp.experts.2.up_proj.weight"
    assert hf_tensor_name("blk.1.ffn_down_exps.weight", "llama", expert=0) == (
        "model.layers.1.block_sparse_moe.experts.0.w2.weight")
    assert hf_tensor_name("blk.1.ffn_gate.5.weight", "llama") == "model.layers.1.block_sparse_moe.experts.5.w1.weight"
    assert hf_tensor_name("blk.0.ffn_gate_inp.weight", "llama") == "model.layers.0.block_sparse_moe.gate.weight"
    assert hf_tensor_name("blk.0.ffn_gate_inp.weight", "qwen3moe") == "model.layers.0.mlp.gate.weight"
    assert hf_tensor_name("blk.0.ffn_up_shexp.weight", "qwen2moe") == "model.layers.0.mlp.shared_expert.up_proj.weight"
    assert hf_tensor_name("blk.0.ffn_gate_inp_shexp.weight", "qwen2moe") == "model.layers.0.mlp.shared_expert_gate.weight"
    # only where the architecture has experts (a shared expert: qwen2moe alone)
    assert hf_tensor_name("blk.0.ffn_up_exps.weight", "qwen3", expert=0) is None
    assert hf_tensor_name("blk.0.ffn_up_shexp.weight", "qwen3moe") is None


@pytest.mark.parametrize(("arch", "stacked"), CASES, ids=IDS)
def test_tiny_moe_gguf_converts(tmp_path: Path, arch: str, stacked: bool) -> None:
    """Config of the right HF architecture with the experts' keys; every expert's tensor equal to
    the source (Q8_0 round trip) and, where transformers reads the architecture, to its loader;
    the stacked tensors are split expert by expert across shards."""
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    expected = _write(gguf_path, arch, stacked)
    out = convert_gguf(gguf_path, tmp_path / "out", max_shard_bytes=60_000)

    config = json.loads((out / "config.json").read_text())
    want_arch = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "llama": "MixtralForCausalLM"}
    assert config["architectures"] == [want_arch[arch]]
    assert config.get("num_experts", config.get("num_local_experts")) == 4 and config["num_experts_per_tok"] == 2
    if arch == "llama":
        assert config["intermediate_size"] == 128 and config["sliding_window"] is None
    else:  # transformers' GGUF reader leaves the experts' widths at the config class defaults
        assert config["moe_intermediate_size"] == 32 and config["intermediate_size"] == 128
        assert config["norm_topk_prob"] is (arch == "qwen3moe")  # as llama.cpp routes each
        assert (config["decoder_sparse_step"], config["mlp_only_layers"]) == (1, [])
    if arch == "qwen2moe":
        assert config["shared_expert_intermediate_size"] == 96
    if arch == "qwen3moe":
        assert config["head_dim"] == 24

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    if arch == "llama" and stacked:  # one stacked tensor (4 x 32 KB) is larger than a shard: split by expert
        assert len({index["weight_map"][f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"] for e in range(4)}) > 1
    got = _read_all(out)
    assert set(got) == set(expected) == set(index["weight_map"])
    for name, want in expected.items():
        assert torch.equal(got[name], torch.from_numpy(want)), name
    if arch == "llama":
        return  # transformers' GGUF loader reads a llama file with experts as a dense Llama
    oracle = _transformers_gguf_tensors(gguf_path, out)
    assert any(name.endswith("experts.gate_up_proj") for name in oracle)
    for name, tensor in oracle.items():
        mine = _stacked_like_transformers(got, name) if ".experts." in name else got[name]
        assert torch.equal(mine, tensor.float()), name


@pytest.mark.parametrize(("arch", "stacked"), CASES, ids=IDS)
def test_moe_gguf_generates_like_transformers(tmp_path: Path, arch: str, stacked: bool) -> None:
    """``LLM(model=<file>.gguf)`` picks the MoE model class; its greedy tokens (chunked prefill and
    decode sharing steps) equal transformers' on the converted directory, logits within 1e-4."""
    from transformers import AutoModelForCausalLM

    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    _write(gguf_path, arch, stacked, seed=1)
    llm = LLM(model=str(gguf_path), cache_dir=str(tmp_path / "cache"), max_num_batched_tokens=16, max_num_seqs=4)
    (model_dir,) = _cache_entries(tmp_path / "cache")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = llm.llm_engine.model
    assert type(model).__name__ == hf.config.architectures[0] == type(hf).__name__
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 258, (n,), generator=g).tolist() for n in (1, 9, 37, 20)]
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(prompt_forward(model, prompts), want, atol=1e-4, rtol=0)
    assert_engine_greedy(llm, hf, prompts, 12, f"GGUF {arch}")


@pytest.mark.parametrize(
    ("arch", "kwargs", "message"),
    [
        ("qwen3moe", {"experts_used": 5}, r"qwen3moe\.expert_used_count \(5\) must be in 1\.\.qwen3moe\.expert_count \(4\)"),
        ("llama", {"experts_used": 0}, r"llama\.expert_used_count \(0\) must be in 1\.\.llama\.expert_count \(4\)"),
        ("qwen2moe", {"skip_tensors": ("blk.1.ffn_down_exps.weight",)}, r"expert tensor 'blk\.1\.ffn_down_exps\.weight' is missing"),
        ("llama", {"stacked": False, "skip_tensors": ("blk.0.ffn_up.3.weight",)}, r"expert tensor 'blk\.0\.ffn_up\.3\.weight' is missing"),
        ("qwen2moe", {"skip_tensors": ("blk.0.ffn_gate_inp_shexp.weight",)}, r"'blk\.0\.ffn_gate_inp_shexp\.weight' is missing"),
        ("qwen3moe", {"skip_tensors": ("blk.1.ffn_gate_inp.weight",)}, r"'blk\.1\.ffn_gate_inp\.weight' is missing"),
        ("qwen3moe", {"extra_kv": {"qwen3moe.expert_feed_forward_length": 48}},
         r"'blk\.0\.ffn_gate_exps\.weight' has shape \[4, 32, 64\], expected \[4, 48, 64\]"),
        ("llama", {"stacked": False, "extra_tensors": {"blk.0.ffn_up.4.weight": torch.zeros(128, 64).numpy()}},
         r"'blk\.0\.ffn_up\.4\.weight' is expert 4, but llama\.expert_count is 4"),
    ],
    ids=["top-k-above-count", "top-k-zero", "missing-stacked", "missing-per-expert", "missing-shared-gate",
         "missing-router", "wrong-width", "expert-beyond-count"],
)  # fmt: skip
def test_broken_moe_gguf_refused(tmp_path: Path, arch: str, kwargs: dict, message: str) -> None:
    """A file llama.cpp would reject fails at conversion with the key or tensor named, and leaves
    nothing in the cache."""
    path = tmp_path / "broken.gguf"
    _write(path, arch, **kwargs)
    with pytest.raises(ValueError, match=r"broken\.gguf: .*" + message):
        resolve_model_dir(str(path), tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []


def test_experts_without_expert_count_refused(tmp_path: Path) -> None:
    """Expert tensors in a file whose keys say dense (or a MoE architecture without its count)."""
    path = tmp_path / "nocount.gguf"
    write_tiny_gguf(path, "llama", extra_tensors={"blk.0.ffn_gate_inp.weight": torch.zeros(4, 64).numpy()})
    with pytest.raises(ValueError, match=r"nocount\.gguf: tensor 'blk\.0\.ffn_gate_inp\.weight' is an expert's, "
                                         r"but llama\.expert_count is not set"):  # fmt: skip
        convert_gguf(path, tmp_path / "out")
    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, "qwen3moe")  # dense MLPs, no expert keys
    with pytest.raises(ValueError, match=r"qwen\.gguf: qwen3moe\.expert_count is missing"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
