"""Gemma 2 and Gemma 3 GGUF files as llama.cpp writes them (vllmini/models/gguf_gemma.py).

The oracle is not the converter's own reading: a random tiny transformers Gemma is written out with
llama.cpp's conventions (convert_hf_to_gguf.py: norms stored +1, no Q/K permutation, tied output,
the keys it writes and no others); transformers' own GGUF loader, given the original config (its
config reader drops query_pre_attn_scalar, the softcaps and rope scaling), must read back the
original logits, which checks the writer; then ``LLM(model=<file>.gguf)`` must give them too."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from helpers import prompt_forward, randomize_norms, tiny_gemma2_config, tiny_gemma3_config
from test_architectures import assert_engine_greedy
from test_gguf import _cache_entries, _read_all, finish_gguf
from vllmini import LLM
from vllmini.models.gguf_convert import convert_gguf, hf_tensor_name
from vllmini.models.gguf_gemma import query_pre_attn_scalar

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# llama.cpp can state only these: Gemma 3's 5:1 sliding pattern, and the attention scale of head_dim
# (query_pre_attn_scalar = hidden / heads is for the 27B layer counts alone)
CONFIGS = {
    "gemma2": lambda **kw: tiny_gemma2_config(query_pre_attn_scalar=24, **kw),
    "gemma3": lambda **kw: tiny_gemma3_config(num_hidden_layers=7, sliding_window_pattern=6, query_pre_attn_scalar=24,
                                              **kw),
}  # fmt: skip
WINDOWS = {"gemma2": [12, None, 12], "gemma3": [12] * 5 + [None, 12]}


def gemma_vocab(size: int) -> tuple[list[str], list[int]]:
    """A Gemma-style SentencePiece vocabulary: pad/eos/bos/unk, turn markers, byte fallback, a few
    pieces (no merges in the file: transformers rebuilds them from the order), unused tokens."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "he", "ll", "hell", "hello", "\u2581w", "or", "ld", "\u2581wor",
              "\u2581world"]  # fmt: skip
    tokens += pieces
    types += [1] * len(pieces)
    unused = size - len(tokens)
    return tokens + [f"<unused{i}>" for i in range(unused)], types + [5] * unused


def write_gemma_gguf(path: Path, hf, arch: str, *, q8: bool = False, window: bool = True, extra_kv: dict | None = None,
                     extra_tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """``hf``'s weights and config as llama.cpp's Gemma2Model / Gemma3Model write them; returns the
    HF tensors the conversion must give back. ``q8``: the 2-D tensors whose rows allow it stored
    Q8_0 (expected: their dequantized values); ``window=False``: no sliding window key."""
    c = hf.config
    w = GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if arch == "gemma2" and c.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    if arch == "gemma2" and c.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3":  # the full layers' rope (the sliding ones' base is llama.cpp's constant)
        full = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
    if window:
        w.add_sliding_window(c.sliding_window)
    tokens, types = gemma_vocab(c.vocab_size)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_kv or {}).items():
        {float: w.add_float32, int: w.add_uint32, str: w.add_string}[type(value)](key, value)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2 if arch == "gemma2" else gguf.MODEL_ARCH.GEMMA3,
                                     c.num_hidden_layers)  # fmt: skip
    expected = {}
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp writes no output tensor
            continue
        stem, leaf = name.rsplit(".", 1)
        stored = tensor.numpy().astype(np.float32)
        norm = name.endswith("norm.weight")
        if norm:
            stored = stored + np.float32(1.0)
        if q8 and stored.ndim == 2 and stored.shape[1] % 32 == 0:
            data = quantize(stored, GGMLQuantizationType.Q8_0)
            w.add_tensor(f"{names.get_name(stem)}.{leaf}", data, raw_dtype=GGMLQuantizationType.Q8_0)
            stored = dequantize(data, GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"{names.get_name(stem)}.{leaf}", stored)
        expected[name] = stored - np.float32(1.0) if norm else stored
    finish_gguf(w, extra_tensors)
    return expected


def tiny_gemma(arch: str, seed: int = 0, **overrides):
    from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM

    torch.manual_seed(seed)
    cls = Gemma2ForCausalLM if arch == "gemma2" else Gemma3ForCausalLM
    return randomize_norms(cls(CONFIGS[arch](**overrides))).eval()


def test_gemma_tensor_names_and_attention_scale() -> None:
    assert hf_tensor_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.post_ffw_norm.weight", "gemma2") == "model.layers.2.post_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.0.post_attention_norm.weight", "gemma3") == (
        "model.layers.0.post_attention_layernorm.weight")
    assert hf_tensor_name("blk.0.attn_norm.weight", "gemma2") == "model.layers.0.input_layernorm.weight"
    assert hf_tensor_name("blk.0.attn_k_norm.weight", "gemma3") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.0.ffn_norm.weight", "llama") == "model.layers.0.post_attention_layernorm.weight"
    # the 27B models' query_pre_attn_scalar (Gemma 2: 4608 / 32 = 144; Gemma 3: 5376 / 32 = 168), else head_dim
    assert query_pre_attn_scalar("gemma2", 46, 4608, 32, 128) == 144
    assert query_pre_attn_scalar("gemma3", 62, 5376, 32, 128) == 168
    assert query_pre_attn_scalar("gemma3", 26, 1152, 4, 256) == 256  # gemma-3-1b
    assert query_pre_attn_scalar("gemma2", 42, 3584, 16, 256) == 256  # gemma-2-9b


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_generates_like_the_original(tmp_path: Path, arch: str) -> None:
    """transformers' GGUF loader reads the file back to the original logits (the writer follows
    llama.cpp's conventions); the engine on ``<file>.gguf`` gives those logits (1e-4) and greedy tokens,
    with the settings the file leaves to llama.cpp's defaults; the tokenizer comes back Gemma's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = tiny_gemma(arch)
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_gemma_gguf(gguf_path, hf, arch)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(6, 512, (n,), generator=g).tolist() for n in (1, 9, 37, 20)]
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf_path.name, config=hf.config,
                                                      dtype=torch.float32).eval()  # fmt: skip
        torch.testing.assert_close(theirs(torch.tensor([prompts[2]])).logits[0, -1], want[2], atol=1e-5, rtol=0)

    llm = LLM(model=str(gguf_path), cache_dir=str(tmp_path / "cache"), max_num_batched_tokens=16, max_num_seqs=4)
    (model_dir,) = _cache_entries(tmp_path / "cache")
    got = _read_all(model_dir)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], torch.from_numpy(tensor)), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__] and config["tie_word_embeddings"] is True
    assert config["query_pre_attn_scalar"] == 24 and config["hidden_activation"] == "gelu_pytorch_tanh"
    if arch == "gemma2":
        assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (0.3, 2.0)
    else:
        assert config["rope_parameters"]["full_attention"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
        assert config["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 5] and llm.llm_engine.eos_token_ids == (1, 5)  # <eos>, <end_of_turn>
    model = llm.llm_engine.model
    assert type(model).__name__ == type(hf).__name__
    assert [layer.self_attn.attn.window for layer in model.model.layers] == WINDOWS[arch]
    torch.testing.assert_close(prompt_forward(model, prompts), want, atol=1e-4, rtol=0)
    assert_engine_greedy(llm, hf, prompts, 12, f"GGUF {arch}")

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = {t: i for i, t in enumerate(gemma_vocab(512)[0])}
    assert tok("hello world")["input_ids"] == [2, vocab["hello"], vocab["\u2581world"]]  # no prefix space
    assert tok("h\u00e9")["input_ids"][1:] == [vocab["h"], vocab["<0xC3>"], vocab["<0xA9>"]]  # byte fallback
    assert tok.decode(tok("hello h\u00e9llo")["input_ids"], skip_special_tokens=True) == "hello h\u00e9llo"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    assert tok(text, add_special_tokens=False)["input_ids"][:2] == [2, 4]  # control tokens kept whole
    assert (tok.eos_token, tok.pad_token) == ("<eos>", "<pad>")


def test_q8_0_gemma_gguf_is_dequantized(tmp_path: Path) -> None:
    """Q8_0 tensors (hidden 64: every projection and the embedding quantizable; norms stay F32, as
    llama.cpp keeps them) convert to their dequantized values, norms less 1."""
    hf = tiny_gemma("gemma3", seed=1, hidden_size=64)
    path = tmp_path / "q8.gguf"
    expected = write_gemma_gguf(path, hf, "gemma3", q8=True)
    got = _read_all(convert_gguf(path, tmp_path / "out"))
    quantized = [name for name, t in expected.items() if t.ndim == 2]
    assert len(quantized) == 1 + 7 * 7  # the embedding, and q, k, v, o, gate, up, down in each layer
    assert not np.array_equal(expected[quantized[0]], hf.state_dict()[quantized[0]].numpy())
    for name, tensor in expected.items():
        assert torch.equal(got[name], torch.from_numpy(tensor)), name


def test_gemma_defaults_llama_cpp_assumes(tmp_path: Path) -> None:
    """What the file may leave out: Gemma 2's window and softcaps take llama.cpp's defaults (4096,
    50, 30); a Gemma 3 file without a window has full attention in every layer, and a final softcap
    only where it states one."""
    path = tmp_path / "g2.gguf"
    hf = tiny_gemma("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
    write_gemma_gguf(path, hf, "gemma2", window=False)
    config = json.loads((convert_gguf(path, tmp_path / "g2") / "config.json").read_text())
    caps = (config["attn_logit_softcapping"], config["final_logit_softcapping"])
    assert config["sliding_window"] == 4096 and caps == (50.0, 30.0)
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    path = tmp_path / "g3.gguf"
    write_gemma_gguf(path, tiny_gemma("gemma3"), "gemma3", window=False,
                     extra_kv={"gemma3.final_logit_softcapping": 2.0})
    config = json.loads((convert_gguf(path, tmp_path / "g3") / "config.json").read_text())
    assert config["sliding_window"] is None and config["layer_types"] == ["full_attention"] * 7
    assert (config["final_logit_softcapping"], config["attn_logit_softcapping"]) == (2.0, None)


def test_broken_gemma_gguf_refused(tmp_path: Path) -> None:
    """A tensor with no known name, and rope scaling other than linear on Gemma 3: refused by name,
    nothing left in the cache."""
    hf = tiny_gemma("gemma3")
    path = tmp_path / "laurel.gguf"  # (a Gemma 3n tensor)
    write_gemma_gguf(path, hf, "gemma3", extra_tensors={"blk.0.laurel_l.weight": np.zeros((8, 56), np.float32)})
    with pytest.raises(ValueError, match=r"laurel\.gguf: GGUF tensor 'blk\.0\.laurel_l\.weight' has no known HF name "
                                         r"for architecture 'gemma3'"):  # fmt: skip
        convert_gguf(path, tmp_path / "out")
    path = tmp_path / "yarn.gguf"
    write_gemma_gguf(path, hf, "gemma3", extra_kv={"gemma3.rope.scaling.type": "yarn",
                                                   "gemma3.rope.scaling.original_context_length": 256})  # fmt: skip
    with pytest.raises(ValueError, match=r"yarn\.gguf: gemma3\.rope\.scaling\.type 'yarn' is not supported for gemma3"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
