"""GGUF -> HF directory conversion: tiny files written here, and the bundled default model."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors import safe_open

from vllmini.models import gguf_convert, gguf_rope, weight_loader
from vllmini.models.gguf_convert import convert_gguf, hf_tensor_name, unpermute_rotary
from vllmini.models.weight_loader import load_model, resolve_model_dir

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}  # fmt: skip
_EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def _gguf_name(hf: str, stacked: bool = True) -> str:
    """llama.cpp's name of an HF tensor; an expert's goes into its layer's stacked ``ffn_*_exps``
    tensor, or (``stacked=False``, files before April 2024) a tensor of its own ``ffn_*.<e>``."""
    if m := _EXPERT_RE.match(hf):
        layer, expert, proj = m[1], m[2], _EXPERT_PROJ[m[3]]
        return f"blk.{layer}.ffn_{proj}_exps.weight" if stacked else f"blk.{layer}.ffn_{proj}.{expert}.weight"
    stem, _, leaf = hf.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, sub = stem.split(".", 3)
        return f"blk.{layer}.{_GGUF_NAMES[sub]}.{leaf}"
    return f"{_GGUF_NAMES[stem]}.{leaf}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows of llama models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_tokenizer() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, two merges, three control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + ["he", "ll"]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    return tokens, types, ["h e", "l l"]


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    tied: bool = True,
    head_dim: int | None = None,
    extra_kv: dict | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    seed: int = 0,
    rope_dims: int | None = None,
    experts: int = 0,
    experts_used: int = 2,
    stacked: bool = True,
    skip_tensors: tuple[str, ...] = (),
    drop_kv: tuple[str, ...] = (),
) -> dict[str, np.ndarray]:
    """Write a 2-layer model; returns the HF-layout fp32 tensors the converter must reproduce.

    2-D tensors with 32-multiple rows are stored Q8_0 (so expected = quantize round-trip), the rest F32.
    ``experts``: a mixture of experts in every layer as llama.cpp writes it (qwen2moe, qwen3moe, or
    ``llama`` for Mixtral), stacked per projection unless ``stacked=False``; ``skip_tensors``: GGUF
    names left out (``extra_tensors`` of the same names replace them); ``drop_kv``: metadata keys left out."""
    hidden, heads, kv_heads, inter, layers = 64, 4, 2, 128, 2
    moe_width, shared_width = (inter, 0) if arch == "llama" else (32, 96)
    hd = head_dim or hidden // heads
    tokens, types, merges = _tiny_tokenizer()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        if arch == "phi3":  # q/k/v and gate/up fused, as in Phi-3's own checkpoints
            shapes |= {p + "self_attn.qkv_proj.weight": ((heads + 2 * kv_heads) * hd, hidden),
                       p + "mlp.gate_up_proj.weight": (2 * inter, hidden)}  # fmt: skip
        else:
            shapes |= {
                p + "self_attn.q_proj.weight": (heads * hd, hidden),
                p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                p + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
            }
        shapes |= {
            p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if experts:
            block, projs = ("block_sparse_moe", ("w1", "w3", "w2")) if arch == "llama" else (
                "mlp", ("gate_proj", "up_proj", "down_proj"))  # fmt: skip
            shapes[p + f"{block}.gate.weight"] = (experts, hidden)
            for e in range(experts):
                shapes |= {p + f"{block}.experts.{e}.{projs[0]}.weight": (moe_width, hidden),
                           p + f"{block}.experts.{e}.{projs[1]}.weight": (moe_width, hidden),
                           p + f"{block}.experts.{e}.{projs[2]}.weight": (hidden, moe_width)}  # fmt: skip
            if arch == "qwen2moe":
                shapes |= {p + "mlp.shared_expert.gate_proj.weight": (shared_width, hidden),
                           p + "mlp.shared_expert.up_proj.weight": (shared_width, hidden),
                           p + "mlp.shared_expert.down_proj.weight": (hidden, shared_width),
                           p + "mlp.shared_expert_gate.weight": (1, hidden)}  # fmt: skip
        elif arch != "phi3":
            shapes |= {p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter)}  # fmt: skip
        else:
            shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        if arch in ("qwen3", "qwen3moe"):
            shapes |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
        if arch in ("qwen2", "qwen2moe"):
            shapes |= {p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv_heads * hd,),
                       p + "self_attn.v_proj.bias": (kv_heads * hd,)}  # fmt: skip

    w = GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    if arch == "phi3":
        w.add_sliding_window(200)
        w.add_rope_dimension_count(rope_dims or hd)
        w.add_pad_token_id(vocab - 1)  # else Phi3Config's default (32000) lies outside this vocabulary
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(experts_used)
        if arch != "llama":  # llama (Mixtral): the experts' width is feed_forward_length
            w.add_expert_feed_forward_length(moe_width)
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(shared_width)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_kv or {}).items():
        add = {float: w.add_float32, int: w.add_uint32, str: w.add_string, list: w.add_array}[type(value)]
        add(key, value)  # a key written above is overwritten
    for key in drop_kv:
        del w.kv_data[0][key]

    expected: dict[str, np.ndarray] = {}
    stored_tensors: dict[str, list[np.ndarray]] = {}  # GGUF name -> its array (a stacked one: each expert's)
    for name, shape in shapes.items():
        hf = rng.standard_normal(shape).astype(np.float32)
        stored = hf
        if arch == "llama" and ".q_proj." in name:
            stored = _llama_cpp_permute(hf, heads)
        elif arch == "llama" and ".k_proj." in name:
            stored = _llama_cpp_permute(hf, kv_heads)
        elif name.endswith(".shared_expert_gate.weight"):
            stored = hf.reshape(-1)  # llama.cpp keeps it as a vector
        if stored.ndim == 2 and shape[1] % 32 == 0:
            hf = dequantize(quantize(hf, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
        expected[name] = hf
        stored_tensors.setdefault(_gguf_name(name, stacked), []).append(stored)
    for name, arrays in stored_tensors.items():
        array = np.stack(arrays) if "_exps." in name else arrays[0]
        if name in skip_tensors:
            continue
        if array.ndim >= 2 and array.shape[-1] % 32 == 0:  # Q8_0 blocks run along rows: stacking is per expert
            w.add_tensor(name, quantize(array, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, array)
    finish_gguf(w, extra_tensors)
    return expected


def finish_gguf(w: GGUFWriter, extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """Add the extra (e.g. unknown) tensors and write the file out."""
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(weight_loader.iter_weights(model_dir))


def _transformers_gguf_tensors(gguf_path: Path, model_dir: Path) -> dict[str, torch.Tensor]:
    """The oracle: transformers' own GGUF tensor loader (dequantize + its reverse permutation)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)["tensors"]


def _cache_entries(cache: Path) -> list[Path]:
    root = cache / "gguf"
    return sorted(root.iterdir()) if root.exists() else []


def test_tensor_names_and_unpermute() -> None:
    assert hf_tensor_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.0.ssm_conv1d.weight") is None
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert np.array_equal(unpermute_rotary(_llama_cpp_permute(w, 3), 3), w)
    with pytest.raises(ValueError, match="un-permute"):
        unpermute_rotary(np.zeros((10, 4), np.float32), 3)


@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen2", "qwen3"])
def test_tiny_gguf_converts(tmp_path: Path, arch: str) -> None:
    from transformers import AutoTokenizer

    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    tied = arch == "llama"
    expected = write_tiny_gguf(gguf_path, arch, tied=tied, head_dim=24 if arch == "qwen3" else None)
    out = convert_gguf(gguf_path, tmp_path / "out")

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [gguf_convert.GGUF_ARCHITECTURES[arch]]
    assert config["tie_word_embeddings"] is tied
    assert config["dtype"] == "float32"
    assert config["num_key_value_heads"] == 2 and config["num_hidden_layers"] == 2
    if arch == "qwen3":
        assert config["head_dim"] == 24  # from attention.key_length, not Qwen3Config's default 128
    if arch == "phi3":
        assert config["sliding_window"] == 200  # transformers' GGUF reader drops it

    got = _read_all(out)
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert torch.equal(got[name], torch.from_numpy(want)), name
        assert got[name].dtype == torch.float32
    oracle = _transformers_gguf_tensors(gguf_path, out)
    for name, tensor in oracle.items():
        assert torch.equal(got[name], tensor.float()), name

    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("hello")["input_ids"]) == "hello"
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_special_tokens_follow_the_gguf_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever transformers' GGUF tokenizer rebuild decides (5.17 swaps SmolLM2's EOS for
    <|im_start|>), the converted tokenizer's special tokens are the file's."""
    from transformers import AutoTokenizer

    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, "llama")
    real = AutoTokenizer.from_pretrained

    def rebuilt_wrongly(*args, **kwargs):
        tok = real(*args, **kwargs)
        tok.eos_token, tok.bos_token = "<|endoftext|>", "<|im_end|>"
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", rebuilt_wrongly)
    out = convert_gguf(gguf_path, tmp_path / "out")
    monkeypatch.undo()
    tok = AutoTokenizer.from_pretrained(out)
    vocab = len(_tiny_tokenizer()[0])
    assert (tok.bos_token_id, tok.eos_token_id) == (vocab - 2, vocab - 1)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_converted_tiny_gguf_loads_into_model(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(gguf_path, "llama", tied=True)
    model, config = load_model(resolve_model_dir(str(gguf_path), tmp_path / "cache"), torch.float32, torch.device("cpu"))
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, torch.from_numpy(expected["model.embed_tokens.weight"]))


@pytest.mark.parametrize("arch", ["phi3", "qwen2"])
def test_converted_gguf_runs_like_transformers(tmp_path: Path, arch: str) -> None:
    """qwen2's q/k/v biases and phi3's fused qkv / gate_up tensors land where our model and
    transformers' (loading the same converted directory) both read them: equal logits."""
    from transformers import AutoModelForCausalLM

    from helpers import prompt_forward

    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(gguf_path, arch, tied=False)
    model_dir = resolve_model_dir(str(gguf_path), tmp_path / "cache")
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"))
    assert config.architectures == [gguf_convert.GGUF_ARCHITECTURES[arch]]
    attn = model.model.layers[1].self_attn
    assert (attn.qkv_proj.bias is not None) == (arch == "qwen2") and attn.o_proj.bias is None
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = [5, 17, 99, 3, 250, 42]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prompt_forward(model, [prompt])[0], want, atol=1e-4, rtol=0)


def test_unsupported_architecture_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    w = GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError) as info:
        resolve_model_dir(str(path), tmp_path / "cache")
    msg = str(info.value)
    assert "gpt2.gguf" in msg and "'gpt2'" in msg and "llama" in msg and "qwen3" in msg
    assert _cache_entries(tmp_path / "cache") == []


def test_not_a_gguf_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(ValueError, match=r"fake\.gguf is not a readable GGUF file"):
        resolve_model_dir(str(path), tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []


def test_stale_tmp_folder_of_dead_process_removed(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.tmp-{int(dead.stdout)}-deadbeef"
    alive = tmp_path / f".out.tmp-{os.getpid()}-cafecafe"  # a conversion still running: left alone
    stale.mkdir()
    alive.mkdir()
    convert_gguf(gguf_path, tmp_path / "out")
    assert not stale.exists() and alive.exists()


def test_undequantizable_type_refused(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    write_tiny_gguf(path, extra_tensors={"blk.0.attn_norm.bias": np.zeros(64, np.int32)})
    with pytest.raises(ValueError, match=r"int\.gguf.*'blk\.0\.attn_norm\.bias'.*I32.*accepted"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unknown_tensor_and_rope_scaling_refused(tmp_path: Path) -> None:
    path = tmp_path / "ssm.gguf"
    write_tiny_gguf(path, extra_tensors={"blk.0.ssm_a.weight": np.zeros(64, np.float32)})
    with pytest.raises(ValueError, match=r"ssm\.gguf.*'blk\.0\.ssm_a\.weight'"):
        convert_gguf(path, tmp_path / "out")
    path = tmp_path / "yarn.gguf"
    write_tiny_gguf(path, extra_kv={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match=r"yarn\.gguf: yarn rope scaling needs llama\.rope\.scaling\.factor and "
                                         r"llama\.rope\.scaling\.original_context_length"):  # fmt: skip
        convert_gguf(path, tmp_path / "out")
    path = tmp_path / "yarn2.gguf"  # llama.cpp's own attention factor: not transformers'
    write_tiny_gguf(path, extra_kv={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                    "llama.rope.scaling.original_context_length": 32,
                                    "llama.rope.scaling.yarn_log_multiplier": 0.1})  # fmt: skip
    with pytest.raises(ValueError, match=r"rope scaling 'yarn' with yarn_log_multiplier is not supported"):
        convert_gguf(path, tmp_path / "out")
    path = tmp_path / "ntk.gguf"  # a factor does not make another type linear
    write_tiny_gguf(path, extra_kv={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(ValueError, match=r"rope scaling 'longrope' is not supported"):
        convert_gguf(path, tmp_path / "out")
    path = tmp_path / "phi35.gguf"  # LongRoPE: both factor tensors and the original context, or nothing
    write_tiny_gguf(path, "phi3", extra_tensors={"rope_factors_long.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match=r"phi35\.gguf: LongRoPE scaling \(rope_factors_long/short\) needs "
                                         r"rope_factors_short\.weight"):  # fmt: skip
        convert_gguf(path, tmp_path / "out")
    write_tiny_gguf(path, "phi3", extra_tensors=dict.fromkeys(gguf_rope.LONGROPE_TENSORS, np.ones(8, np.float32)))
    with pytest.raises(ValueError, match=r"needs phi3\.rope\.scaling\.original_context_length"):
        convert_gguf(path, tmp_path / "out")
    write_tiny_gguf(path, "phi3", extra_tensors=dict.fromkeys(gguf_rope.LONGROPE_TENSORS, np.ones(5, np.float32)),
                    extra_kv={"phi3.rope.scaling.original_context_length": 32})  # fmt: skip
    with pytest.raises(ValueError, match=r"rope_factors_long\.weight has 5 factors; 16 rotary dims need 8"):
        convert_gguf(path, tmp_path / "out")
    path = tmp_path / "partial.gguf"  # llama files' q/k are permuted over the whole head
    write_tiny_gguf(path, extra_kv={"llama.rope.dimension_count": 12})
    with pytest.raises(ValueError, match=r"partial rotary embedding \(12 of 16 dims\) is not supported for 'llama'"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("extra_kv", "factor"),
    [
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, 4.0),
        ({"llama.rope.scaling.factor": 2.0}, 2.0),  # no type: llama.cpp reads linear
        ({"llama.rope.scale_linear": 8.0}, 8.0),  # the old key (2023 convert.py)
        ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
        ({"llama.rope.scaling.factor": 1.0}, None),
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,  # Qwen3's long-context GGUFs
          "llama.rope.scaling.original_context_length": 32, "llama.rope.scaling.yarn_beta_fast": 16.0}, 4.0),
    ],
)
def test_rope_scaling_is_converted(tmp_path: Path, extra_kv: dict, factor: float | None) -> None:
    """transformers' GGUF config reader drops rope scaling; the converter writes it as
    rope_parameters (linear, or yarn with its original context and betas), and the model then
    matches transformers on the converted directory at positions where the scaling changes the angles."""
    from transformers import AutoModelForCausalLM

    from helpers import prompt_forward

    gguf_path = tmp_path / "scaled.gguf"
    write_tiny_gguf(gguf_path, extra_kv=extra_kv)
    model_dir = resolve_model_dir(str(gguf_path), tmp_path / "cache")
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"))
    params = config.rope_parameters
    kind = extra_kv.get("llama.rope.scaling.type", "linear")
    assert (params["rope_type"], params.get("factor")) == ((kind, factor) if factor else ("default", None))
    if kind == "yarn":
        assert (params["original_max_position_embeddings"], params["beta_fast"]) == (32, 16.0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = [(7 * i) % 250 + 3 for i in range(40)]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prompt_forward(model, [prompt])[0], want, atol=1e-4, rtol=0)


def test_phi4_mini_longrope_gguf_is_converted(tmp_path: Path) -> None:
    """A phi3 file with LongRoPE factor tensors and a partial rotary embedding (Phi-4-mini: 3/4 of each
    head; Phi-3.5-mini: the factors): the config gets longrope, its factors, the original context, the
    attention factor and partial_rotary_factor, and the model matches transformers on the converted folder,
    with the long factors at the file's full context and the short ones within the original context."""
    from transformers import AutoModelForCausalLM

    from helpers import prompt_forward

    long, short = np.linspace(1.0, 4.0, 6, dtype=np.float32), np.linspace(1.0, 1.5, 6, dtype=np.float32)
    gguf_path = tmp_path / "phi4mini.gguf"
    write_tiny_gguf(gguf_path, "phi3", rope_dims=12,
                    extra_tensors={"rope_factors_long.weight": long, "rope_factors_short.weight": short},
                    extra_kv={"phi3.rope.scaling.original_context_length": 32, "phi3.rope.scaling.attn_factor": 1.15})
    model_dir = resolve_model_dir(str(gguf_path), tmp_path / "cache")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = hf.config.rope_parameters
    assert (params["rope_type"], params["original_max_position_embeddings"], params["attention_factor"]) == (
        "longrope", 32, pytest.approx(1.15))
    assert params["long_factor"] == pytest.approx(long.tolist()) and hf.config.partial_rotary_factor == 0.75
    for max_model_len, n in ((None, 40), (32, 30)):  # (the file's context is 256: long factors unless capped)
        model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), max_model_len=max_model_len)
        assert model.model.rotary_emb.rotary_dim == 12
        prompt = [(7 * i) % 250 + 3 for i in range(n)]
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(prompt_forward(model, [prompt])[0], want, atol=1e-4, rtol=0)


def _llama_cpp_rope_freqs(params: dict, base: float, dim: int) -> np.ndarray:
    """What llama.cpp's converter writes as rope_freqs.weight for Llama 3 rope parameters."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old = params["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize("params", [
    {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 1024},
    {"factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0, "original_max_position_embeddings": 4096},
])  # fmt: skip
def test_llama3_rope_freqs_are_read_back(tmp_path: Path, params: dict) -> None:
    """Llama 3.1/3.2 files hold llama3 scaling only as rope_freqs.weight (a divisor per frequency): the
    converter reads the parameters back, and the model equals transformers running the true parameters
    on the same weights (a low factor of 2 comes back as an equivalent 1, with old and high halved)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import prompt_forward

    gguf_path = tmp_path / "llama31.gguf"
    write_tiny_gguf(gguf_path, extra_tensors={"rope_freqs.weight": _llama_cpp_rope_freqs(params, 10000.0, 16)},
                    extra_kv={"llama.context_length": 8192})  # fmt: skip
    model_dir = resolve_model_dir(str(gguf_path), tmp_path / "cache")
    model, config = load_model(model_dir, torch.float32, torch.device("cpu"))
    got = config.rope_parameters
    scale = params["low_freq_factor"]
    assert (got["rope_type"], got["factor"], got["low_freq_factor"]) == ("llama3", params["factor"], 1.0)
    assert got["high_freq_factor"] == pytest.approx(params["high_freq_factor"] / scale)
    assert got["original_max_position_embeddings"] == params["original_max_position_embeddings"] / scale
    truth = AutoConfig.from_pretrained(model_dir)
    truth.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, **params}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, config=truth, dtype=torch.float32).eval()
    prompt = [(7 * i) % 250 + 3 for i in range(60)]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(prompt_forward(model, [prompt])[0], want, atol=1e-4, rtol=0)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with torch.no_grad():  # (the scaling matters at these positions)
        assert (plain(torch.tensor([prompt])).logits[0, -1] - want).abs().max() > 1e-3


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, extra_tensors={"rope_freqs.weight": np.linspace(1.0, 3.0, 8, dtype=np.float32) ** 2})
    with pytest.raises(ValueError, match=r"odd\.gguf: rope_freqs\.weight does not follow Llama 3's rope scaling"):
        convert_gguf(path, tmp_path / "out")
    write_tiny_gguf(path, extra_tensors={"rope_freqs.weight": np.ones(5, np.float32)})
    with pytest.raises(ValueError, match=r"rope_freqs\.weight has 5 values; 16 rotary dims need 8"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_failed_conversion_leaves_nothing_in_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path)
    cache = tmp_path / "cache"
    real_write = gguf_convert._write_weights

    def disk_full(reader, config, arch, out, max_shard_bytes):
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_convert, "_write_weights", disk_full)
    with pytest.raises(OSError, match="No space left"):
        resolve_model_dir(str(gguf_path), cache)
    assert _cache_entries(cache) == []

    monkeypatch.setattr(gguf_convert, "_write_weights", real_write)
    first = resolve_model_dir(str(gguf_path), cache)
    assert _cache_entries(cache) == [first]

    monkeypatch.setattr(gguf_convert, "convert_gguf", lambda *a, **k: pytest.fail("cache entry not reused"))
    assert resolve_model_dir(str(gguf_path), cache) == first
    st = gguf_path.stat()
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: a new entry
    assert weight_loader.gguf_cache_entry(gguf_path, cache) != first


def test_sharded_conversion(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(gguf_path, tied=False)
    out = convert_gguf(gguf_path, tmp_path / "out", max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    got = _read_all(out)
    assert set(got) == set(expected) == set(index["weight_map"])


@pytest.mark.slow
def test_default_model_converts_from_scratch(tmp_path: Path, default_gguf: Path) -> None:
    """The bundled SmolLM2: config, tokenizer and every tensor equal to transformers' own GGUF loader."""
    from transformers import AutoTokenizer, GenerationConfig

    out = resolve_model_dir("default", tmp_path / "cache")
    assert out.parent == tmp_path / "cache" / "gguf"
    config = weight_loader.load_config(out)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (30, 576, 9)
    assert config.num_key_value_heads == 3 and config.tie_word_embeddings and config.vocab_size == 49152
    assert GenerationConfig.from_pretrained(out).eos_token_id == 2

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    # tokenizer_config.json lists the added tokens (no legacy re-read of tokenizer.json at load),
    # and the tokenizer loads the same as transformers' own rebuild from the GGUF file
    listed = json.loads((out / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {int(i): t["content"] for i, t in listed.items()} == {i: t.content for i, t in tok.added_tokens_decoder.items()}
    rebuilt = AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)
    assert tok.added_tokens_decoder == rebuilt.added_tokens_decoder
    sample = "<|im_start|>user\nnaïve café, 2 + 2?<|im_end|>\n<|endoftext|> done"
    assert tok(sample).input_ids == rebuilt(sample).input_ids
    assert tok.decode(tok(sample).input_ids, skip_special_tokens=True) == rebuilt.decode(rebuilt(sample).input_ids, skip_special_tokens=True)

    got = _read_all(out)
    oracle = _transformers_gguf_tensors(default_gguf, out)
    assert set(got) == set(oracle) and len(got) == 272  # tied: no lm_head.weight
    for name, tensor in oracle.items():
        assert torch.equal(got[name], tensor), name
    del oracle
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
