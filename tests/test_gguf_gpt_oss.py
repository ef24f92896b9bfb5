"""gpt-oss GGUF files as llama.cpp writes them (vllmini/models/gguf_gpt_oss.py).

The oracle is the original model, not the converter's own reading: a random tiny transformers
GptOss is written out the way llama.cpp's converter does (its GptOssModel: gpt-oss's tensor names
from gguf-py's own table, the sinks as ``attn_sinks.weight``, gate_up split into its even and odd
columns, down transposed; MXFP4 experts repacked from OpenAI's blocks into GGML's), with the keys it
writes and no others. The converted directory must hold the original tensors (exactly, or their
stored dequantized values), and transformers on it must give the original logits."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from helpers import prompt_forward
from test_gguf import _cache_entries, finish_gguf
from test_gpt_oss import gpt_oss_config, randomize
from vllmini.models import attention, gguf_gpt_oss
from vllmini.models.gguf_convert import convert_gguf, hf_tensor_name
from vllmini.models.mxfp4 import is_mxfp4
from vllmini.models.weight_loader import iter_weights, load_model, resolve_model_dir

HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>"]  # fmt: skip
# merges whose results differ under gpt-4o's split (digits in threes) and gpt2's: "1234" is 123|4, not 12|34
MERGES = ["h e", "l l", "he ll", "hell o", "\u0120 w", "o r", "\u0120w or", "l d", "\u0120wor ld", "1 2", "3 4", "12 3"]
CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start|>assistant{% endif %}")  # fmt: skip


def harmony_vocab() -> tuple[list[str], list[int]]:
    """A byte-level vocabulary with a few merges and gpt-oss's special tokens (CONTROL, as llama.cpp's
    converter marks the tokenizer's special added tokens)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]
    return tokens + HARMONY, [1] * len(tokens) + [3] * len(HARMONY)


VOCAB = harmony_vocab()[0]
BOS, EOS, PAD = VOCAB.index("<|startoftext|>"), VOCAB.index("<|return|>"), VOCAB.index("<|endoftext|>")


def tiny_gpt_oss(seed: int = 0, **overrides):
    """test_gpt_oss's tiny model with llama.cpp's SwiGLU limit (7: it writes none) and layer 0's
    experts wider, so that the clamps still bite; experts 96 wide (not the hidden size: a transposed
    tensor would not fit); this vocabulary's special ids."""
    torch.manual_seed(seed)
    config = gpt_oss_config(vocab_size=len(VOCAB), intermediate_size=96, swiglu_limit=7.0, bos_token_id=BOS,
                            eos_token_id=EOS, pad_token_id=PAD, **overrides)  # fmt: skip
    hf = randomize(AutoModelForCausalLM.from_config(config)).eval()
    with torch.no_grad():
        hf.model.layers[0].mlp.experts.gate_up_proj.mul_(4.0)
    return hf


def random_mxfp4(hf, seed: int = 0) -> dict[str, torch.Tensor]:
    """OpenAI's MXFP4 experts (``*_blocks [E, out, in / 32, 16]``, ``*_scales``) for ``hf``'s shapes;
    ``hf``'s experts become their dequantized values (transformers' dequantization)."""
    g = torch.Generator().manual_seed(seed)
    packed = {}
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                experts, inner, outer = param.shape
                blocks = torch.randint(0, 256, (experts, outer, inner // 32, 16), generator=g, dtype=torch.uint8)
                scales = torch.randint(121, 125, (experts, outer, inner // 32), generator=g, dtype=torch.uint8)
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    return packed


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """OpenAI's MXFP4 (two values a byte, in order, the low nibble first) as GGML's blocks: the scale
    byte, then 16 bytes holding values j (low nibble) and j + 16 (high), as llama.cpp's converter repacks."""
    b = blocks.numpy()
    values = np.stack((b & 0x0F, b >> 4), axis=-1).reshape(*b.shape[:-1], 32)
    qs = (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)
    raw = np.concatenate((scales.numpy()[..., None], qs), axis=-1)
    return raw.reshape(*raw.shape[:-2], -1)


def _stored(w: GGUFWriter, name: str, x: np.ndarray, kind: GGMLQuantizationType | None) -> np.ndarray:
    """Write ``x`` as ``kind`` (None: F32); returns what the file holds, dequantized."""
    if kind is None:
        w.add_tensor(name, x)
        return x
    data = quantize(x, kind)
    w.add_tensor(name, data, raw_dtype=kind)
    return dequantize(data, kind).reshape(x.shape)


def write_gpt_oss_gguf(path: Path, hf, *, packed: dict[str, torch.Tensor] | None = None, quantized: bool = False,
                       extra_kv: dict | None = None, drop_kv: tuple[str, ...] = (), skip_tensors: tuple[str, ...] = (),
                       extra_tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:  # fmt: skip
    """``hf`` as llama.cpp's GptOssModel writes it; returns the HF tensors the conversion must give.
    ``packed``: the experts as OpenAI's MXFP4 blocks (random_mxfp4), repacked into GGML's MXFP4;
    ``quantized``: attention BF16, embedding and output Q8_0 (else everything F32)."""
    c = hf.config
    rope = c.rope_parameters
    w = GGUFWriter(str(path), "gpt-oss")
    keys = {  # GGUFWriter.add_<key>, in the order llama.cpp's converter writes them
        "block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
        "head_count": c.num_attention_heads, "head_count_kv": c.num_key_value_heads,
        "rope_scaling_type": gguf.RopeScalingType.YARN, "rope_scaling_factor": rope["factor"],
        "rope_scaling_orig_ctx_len": rope["original_max_position_embeddings"],
        "rope_scaling_yarn_beta_fast": rope["beta_fast"], "rope_scaling_yarn_beta_slow": rope["beta_slow"],
        "rope_freq_base": rope["rope_theta"], "layer_norm_rms_eps": c.rms_norm_eps,
        "expert_count": c.num_local_experts, "expert_used_count": c.num_experts_per_tok, "key_length": c.head_dim,
        "value_length": c.head_dim, "sliding_window": c.sliding_window,
        "expert_feed_forward_length": c.intermediate_size, "tokenizer_model": "gpt2", "tokenizer_pre": "gpt-4o",
        "token_list": harmony_vocab()[0], "token_types": harmony_vocab()[1], "token_merges": MERGES,
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    for key, value in (extra_kv or {}).items():
        {float: w.add_float32, int: w.add_uint32, str: w.add_string, list: w.add_array}[type(value)](key, value)
    for key in drop_kv:
        del w.kv_data[0][key]

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)
    expected, packed = {}, packed or {}
    for name, tensor in hf.state_dict().items():
        x = tensor.numpy().astype(np.float32)
        stem, _, leaf = name.rpartition(".")
        if leaf == "sinks":  # (llama.cpp's converter names it sinks.weight)
            stem, leaf = name, "weight"
        if ".experts." in name:
            expected[name] = x
            _write_experts(w, names, name, x, packed)
            continue
        gguf_name = f"{names.get_name(stem)}.{leaf}"
        kind = None
        if quantized and x.ndim == 2:
            kind = GGMLQuantizationType.BF16 if ".self_attn." in name else GGMLQuantizationType.Q8_0
        expected[name] = _stored(w, gguf_name, x, kind)
    for gguf_name in skip_tensors:
        w.tensors[0].pop(gguf_name, None)
    finish_gguf(w, extra_tensors)
    return expected


def _write_experts(w: GGUFWriter, names, name: str, x: np.ndarray, packed: dict[str, torch.Tensor]) -> None:
    """llama.cpp's split of one HF experts tensor: gate_up [E, H, 2I] -> gate, up [E, I, H] (even and
    odd columns), down [E, I, H] -> [E, H, I]; MXFP4 blocks split by rows the same way."""
    stem = name.rsplit(".", 1)[0] + "."  # model.layers.N.mlp.experts.
    leaf = name.rsplit(".", 1)[1]
    if leaf.endswith("_bias"):
        proj = leaf.removesuffix("_bias")
        parts = {"gate_proj": x[..., ::2], "up_proj": x[..., 1::2]} if proj == "gate_up_proj" else {"down_proj": x}
        for hf_proj, part in parts.items():
            w.add_tensor(f"{names.get_name(stem + hf_proj)}.bias", np.ascontiguousarray(part))
        return
    if name + "_blocks" in packed:
        blocks, scales = packed[name + "_blocks"], packed[name + "_scales"]  # [E, out, G, 16], [E, out, G]
        gate_up = leaf == "gate_up_proj"
        rows = {"gate_proj": np.s_[:, ::2], "up_proj": np.s_[:, 1::2]} if gate_up else {"down_proj": np.s_[:]}
        for hf_proj, sel in rows.items():
            w.add_tensor(f"{names.get_name(stem + hf_proj)}.weight", ggml_mxfp4(blocks[sel], scales[sel]),
                         raw_dtype=GGMLQuantizationType.MXFP4)  # fmt: skip
        return
    t = np.ascontiguousarray(x.swapaxes(-1, -2))  # [E, out, in]
    parts = {"gate_proj": t[:, ::2], "up_proj": t[:, 1::2]} if leaf == "gate_up_proj" else {"down_proj": t}
    for hf_proj, part in parts.items():
        w.add_tensor(f"{names.get_name(stem + hf_proj)}.weight", np.ascontiguousarray(part))


def sink_attention(q, k, v, meta, kv_cache, scale, window=None, sinks=None, **_):
    """Eager attention with gpt-oss's sinks over whole prompts without a cache (a stand-in for the
    backends until they take ``sinks``): each head's sink logit joins its softmax, then is dropped."""
    assert kv_cache is None
    out = torch.empty_like(q)
    bounds = meta.cu_seqlens_q.tolist()
    for start, end in zip(bounds, bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        ks, vs = (t.repeat_interleave(qs.shape[0] // ks.shape[0], dim=0) for t in (ks, vs))
        scores = qs @ ks.transpose(1, 2) * scale
        pos = torch.arange(end - start)
        seen = (pos[None, :] <= pos[:, None]) & ((pos[:, None] - pos[None, :] < window) if window else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            scores = torch.cat((scores, sinks[:, None, None].expand(-1, end - start, 1)), dim=-1)
        probs = torch.softmax(scores.float(), dim=-1)[..., : end - start].to(q.dtype)
        out[start:end] = (probs @ vs).transpose(0, 1)
    return out


def dense(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A converted folder's tensors with each MXFP4 pair as transformers dequantizes it ([E, in, out])."""
    out = {n: t for n, t in tensors.items() if not n.endswith(("_blocks", "_scales"))}
    for name in [n.removesuffix("_blocks") for n in tensors if n.endswith("_blocks")]:
        out[name] = convert_moe_packed_tensors(tensors[name + "_blocks"], tensors[name + "_scales"], dtype=torch.float32)
    return out


def read_converted(model_dir: Path) -> dict[str, torch.Tensor]:
    """A converted folder's tensors as stored (MXFP4 pairs as their bytes)."""
    return dict(iter_weights(model_dir, "mxfp4" if is_mxfp4(json.loads((model_dir / "config.json").read_text())) else None))


def transformers_model(model_dir: Path):
    """transformers on a converted folder (an MXFP4 one as OpenAI's: ``Mxfp4Config(dequantize=True)``)."""
    packed = "quantization_config" in json.loads((model_dir / "config.json").read_text())
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager",
                                                **({"quantization_config": Mxfp4Config(dequantize=True)} if packed else {})
                                                ).eval()  # fmt: skip


def backends_take_sinks() -> bool:
    return "sinks" in inspect.signature(attention.torch_attention).parameters


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, BOS, (n,), generator=g).tolist() for n in (1, 9, 30, 20)]


def test_gpt_oss_tensor_names() -> None:
    assert hf_tensor_name("blk.3.attn_sinks.weight", "gpt-oss") == "model.layers.3.self_attn.sinks"
    assert hf_tensor_name("blk.0.post_attention_norm.weight", "gpt-oss") == (
        "model.layers.0.post_attention_layernorm.weight")
    assert hf_tensor_name("blk.1.ffn_gate_inp.bias", "gpt-oss") == "model.layers.1.mlp.router.bias"
    assert hf_tensor_name("blk.1.attn_output.bias", "gpt-oss") == "model.layers.1.self_attn.o_proj.bias"
    for proj, hf in (("gate", "gate_up_proj"), ("up", "gate_up_proj"), ("down", "down_proj")):
        want = f"model.layers.2.mlp.experts.{hf}"
        assert hf_tensor_name(f"blk.2.ffn_{proj}_exps.weight", "gpt-oss", expert=0) == want
        assert hf_tensor_name(f"blk.2.ffn_{proj}_exps.bias", "gpt-oss") == want + "_bias"
    assert hf_tensor_name("blk.0.attn_sinks.weight", "llama") is None  # only gpt-oss has sinks


def test_ggml_mxfp4_repack_is_transformers_dequantization() -> None:
    """The test's own repack (llama.cpp's, re-derived from GGML's block layout) dequantizes with gguf
    to what transformers makes of OpenAI's blocks: the writer below is right about MXFP4."""
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (2, 3, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (2, 3, 4), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2).numpy()  # [E, out, in]
    got = dequantize(ggml_mxfp4(blocks, scales), GGMLQuantizationType.MXFP4).reshape(want.shape)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("variant", ["f32", "mxfp4"])
def test_gpt_oss_gguf_converts_to_the_original(tmp_path: Path, variant: str) -> None:
    """Every converted tensor is the original's (F32, and MXFP4 experts: exactly) or its stored value
    (BF16 attention, Q8_0 embedding and output); the config is the original's; transformers on the
    converted directory gives the logits of the original model (with those stored values) within 1e-4;
    so does vllmini's GptOssForCausalLM on it (sinks through a stand-in attention)."""
    hf = tiny_gpt_oss()
    packed = random_mxfp4(hf) if variant == "mxfp4" else None
    path = tmp_path / "tiny-gpt-oss.gguf"
    expected = write_gpt_oss_gguf(path, hf, packed=packed, quantized=variant == "mxfp4")
    out = convert_gguf(path, tmp_path / "out", max_shard_bytes=100_000)

    got = read_converted(out)
    if packed:  # OpenAI's bytes, back from GGML's
        assert {n: t for n, t in got.items() if n.endswith(("_blocks", "_scales"))}.keys() == packed.keys()
        assert all(torch.equal(got[n], t) for n, t in packed.items())
    got = dense(got)
    assert set(got) == set(expected) == set(hf.state_dict())
    for name, tensor in expected.items():
        assert torch.equal(got[name], torch.from_numpy(tensor)), name
    if variant == "f32":
        assert all(torch.equal(got[n], t) for n, t in hf.state_dict().items())
    else:
        assert not torch.equal(got["model.embed_tokens.weight"], hf.model.embed_tokens.weight)  # (Q8_0)

    config = json.loads((out / "config.json").read_text())
    original = hf.config.to_dict()
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim",
                "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok",
                "sliding_window", "layer_types", "rope_parameters", "swiglu_limit", "swiglu_alpha", "rms_norm_eps",
                "max_position_embeddings", "attention_bias", "tie_word_embeddings", "vocab_size"):  # fmt: skip
        assert config[key] == original[key], key
    assert config["rope_parameters"]["truncate"] is False and config["rope_parameters"]["rope_type"] == "yarn"

    prompts = _prompts(seed=3)
    reference = tiny_gpt_oss()
    reference.load_state_dict({n: torch.from_numpy(t) for n, t in expected.items()})
    with torch.no_grad():
        want = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
        theirs = transformers_model(out)
        torch.testing.assert_close(torch.stack([theirs(torch.tensor([p])).logits[0, -1] for p in prompts]), want,
                                   atol=1e-4, rtol=0)  # fmt: skip
    ours, _ = load_model(out, torch.float32, torch.device("cpu"))
    assert ours.layer_windows == [12, None, 12, None] and ours.attention_sinks
    ours.set_attention_backend(sink_attention)
    torch.testing.assert_close(prompt_forward(ours, prompts), want, atol=1e-4, rtol=0)


@pytest.mark.skipif(not backends_take_sinks(), reason="the attention backends do not take sinks= yet")
def test_gpt_oss_gguf_generates_like_transformers(tmp_path: Path) -> None:
    """``LLM(model=<file>.gguf)``: greedy tokens and logits of transformers on the converted directory
    (runs once vllmini.models.attention.torch_attention takes ``sinks``)."""
    from test_architectures import assert_engine_greedy
    from vllmini import LLM

    hf = tiny_gpt_oss(seed=1)
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(path, hf, packed=random_mxfp4(hf, seed=1))
    llm = LLM(model=str(path), cache_dir=str(tmp_path / "cache"), max_num_batched_tokens=16, max_num_seqs=4)
    (model_dir,) = _cache_entries(tmp_path / "cache")
    assert (model_dir / "config.json").read_text().count('"quant_method": "mxfp4"') == 1  # (over the packed cache)
    theirs = transformers_model(model_dir)
    prompts = _prompts(seed=4)
    with torch.no_grad():
        want = torch.stack([theirs(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(prompt_forward(llm.llm_engine.model, prompts), want, atol=1e-4, rtol=0)
    assert_engine_greedy(llm, theirs, prompts, 12, "GGUF gpt-oss")
    assert set(llm.llm_engine.eos_token_ids) == {EOS, PAD, VOCAB.index("<|call|>")}


def _experts_bytes(model_dir: Path) -> int:
    return sum(t.nbytes for n, t in read_converted(model_dir).items() if n.endswith(("_proj", "_blocks", "_scales")))


def test_mxfp4_experts_stay_packed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All experts MXFP4: the folder holds OpenAI's blocks and scales (config as OpenAI's), their values the
    dense conversion's exactly, in 17 bytes per 32 weights instead of 128."""
    hf = tiny_gpt_oss()
    path = tmp_path / "m.gguf"
    write_gpt_oss_gguf(path, hf, packed=random_mxfp4(hf))
    out = convert_gguf(path, tmp_path / "packed")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == gguf_gpt_oss.MXFP4_QUANTIZATION_CONFIG
    with monkeypatch.context() as m:  # the dense conversion, as before experts stayed packed
        m.setattr(gguf_gpt_oss, "experts_packed", lambda tensors: False)
        reference = convert_gguf(path, tmp_path / "dense")
    assert "quantization_config" not in json.loads((reference / "config.json").read_text())
    got, want = dense(read_converted(out)), read_converted(reference)
    assert got.keys() == want.keys() and all(torch.equal(got[n], t) for n, t in want.items())
    assert 7.4 < _experts_bytes(reference) / _experts_bytes(out) < 7.6  # 32 bits a weight / 4.25


def test_mixed_experts_are_dequantized(tmp_path: Path) -> None:
    """A file with MXFP4 gates but an F32 ``ffn_up_exps`` keeps the dense layout (no MXFP4 pairs)."""
    hf = tiny_gpt_oss()
    packed = random_mxfp4(hf)
    up = hf.model.layers[0].mlp.experts.gate_up_proj.detach()[..., 1::2].transpose(1, 2).numpy()  # [E, I, H]
    path = tmp_path / "mixed.gguf"
    expected = write_gpt_oss_gguf(path, hf, packed=packed, skip_tensors=("blk.0.ffn_up_exps.weight",),
                                  extra_tensors={"blk.0.ffn_up_exps.weight": np.ascontiguousarray(up)})  # fmt: skip
    out = convert_gguf(path, tmp_path / "out")
    got = read_converted(out)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert got.keys() == expected.keys() and all(torch.equal(got[n], torch.from_numpy(t)) for n, t in expected.items())


def test_gpt_oss_gguf_tokenizer(tmp_path: Path) -> None:
    """The harmony special tokens stay whole and come back on decode; text splits as gpt-4o's
    pre-tokenizer does (digits in threes); BOS/EOS/PAD as the file says, no BOS added; the chat
    template kept; generation ends on <|return|>, <|endoftext|> and <|call|> (not <|end|>)."""
    path = tmp_path / "tok.gguf"
    write_gpt_oss_gguf(path, tiny_gpt_oss())
    out = convert_gguf(path, tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(out)
    ids = {t: VOCAB.index(t) for t in VOCAB}
    text = "<|start|>user<|message|>hello world<|end|><|start|>assistant<|channel|>final<|message|>1234<|return|>"
    encoded = tok(text)["input_ids"]
    assert encoded[:2] == [ids["<|start|>"], ids["u"]] and ids["<|channel|>"] in encoded
    assert encoded[encoded.index(ids["<|message|>"]) + 1:][:2] == [ids["hello"], ids["\u0120world"]]
    assert encoded[-3:] == [ids["123"], ids["4"], ids["<|return|>"]]  # gpt2's split would give 12|34
    assert tok.decode(encoded) == text
    assert tok.decode(encoded, skip_special_tokens=True) == "userhello worldassistantfinal1234"
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|startoftext|>", "<|return|>", "<|endoftext|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|start|>user<|message|>hi<|end|><|start|>assistant"
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [EOS, PAD, ids["<|call|>"]]
    assert (generation["bos_token_id"], generation["pad_token_id"]) == (BOS, PAD)


@pytest.mark.parametrize(("pattern", "types"), [
    (None, ["sliding_attention", "full_attention"] * 2),  # llama.cpp's default: every other, the first sliding
    (3, ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    ([False, True, True, False], ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
], ids=["default", "period", "per-layer"])  # fmt: skip
def test_sliding_layers_follow_llama_cpp(tmp_path: Path, pattern, types: list[str]) -> None:
    path = tmp_path / "p.gguf"
    extra = {} if pattern is None else {"gpt-oss.attention.sliding_window_pattern": pattern}
    write_gpt_oss_gguf(path, tiny_gpt_oss(), extra_kv=extra)
    config = json.loads((convert_gguf(path, tmp_path / "out") / "config.json").read_text())
    assert config["layer_types"] == types and config["sliding_window"] == 12


@pytest.mark.parametrize(("dropped", "rope"), [
    (("type", "factor", "original_context_length", "yarn_beta_fast", "yarn_beta_slow"),
     {"rope_type": "default", "rope_theta": 150000.0}),  # (GptOssConfig's default would be YaRN x32)
    (("yarn_beta_fast", "yarn_beta_slow"), None),  # (llama.cpp's first gpt-oss converter wrote none)
], ids=["no-scaling", "no-betas"])  # fmt: skip
def test_gpt_oss_rope_keys_left_out(tmp_path: Path, dropped: tuple[str, ...], rope: dict | None) -> None:
    """Without rope scaling keys the model rotates plainly; YaRN without betas takes llama.cpp's
    defaults (HF's: 32 and 1), so the config is the original's."""
    path = tmp_path / "plain.gguf"
    hf = tiny_gpt_oss()
    write_gpt_oss_gguf(path, hf, drop_kv=tuple(f"gpt-oss.rope.scaling.{k}" for k in dropped))
    config = json.loads((convert_gguf(path, tmp_path / "out") / "config.json").read_text())
    assert config["rope_parameters"] == (rope or hf.config.rope_parameters)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"skip_tensors": ("blk.1.attn_sinks.weight",)}, r"tensor 'blk\.1\.attn_sinks\.weight' is missing"),
    ({"skip_tensors": ("blk.0.ffn_up_exps.bias",)}, r"tensor 'blk\.0\.ffn_up_exps\.bias' is missing"),
    ({"skip_tensors": ("output.weight",)}, r"tensor 'output\.weight' is missing"),
    ({"drop_kv": ("gpt-oss.attention.sliding_window",)}, r"'gpt-oss\.attention\.sliding_window' is missing"),
    ({"drop_kv": ("gpt-oss.expert_feed_forward_length",)}, r"'gpt-oss\.expert_feed_forward_length' is missing"),
    ({"extra_kv": {"gpt-oss.attention.value_length": 32}}, r"gpt-oss\.attention\.value_length \(32\) differs"),
    ({"extra_kv": {"gpt-oss.rope.freq_base_swa": 10000.0}}, r"gpt-oss\.rope\.freq_base_swa \(10000\.0\) differs"),
    ({"extra_kv": {"gpt-oss.attention.sliding_window_pattern": [True, False]}},
     r"sliding_window_pattern must hold one bool per layer \(4\)"),
    ({"extra_kv": {"gpt-oss.rope.scaling.yarn_log_multiplier": 0.1}}, r"rope scaling 'yarn' with yarn_log_multiplier"),
    ({"skip_tensors": ("blk.2.attn_sinks.weight",), "extra_tensors": {"blk.2.attn_sinks.weight": np.zeros(4, "f4")}},
     r"'blk\.2\.attn_sinks\.weight' has shape \[4\], expected \[8\]"),
    ({"extra_tensors": {"blk.0.attn_gate.weight": np.zeros((8, 64), np.float32)}},
     r"GGUF tensor 'blk\.0\.attn_gate\.weight' has no known HF name for architecture 'gpt-oss'"),
], ids=["sinks", "up-bias", "output", "window", "expert-width", "value-length", "swa-base", "pattern", "yarn-log",
        "sinks-shape", "unknown"])  # fmt: skip
def test_broken_gpt_oss_gguf_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    """What llama.cpp requires and the file lacks, or what GptOssForCausalLM cannot express, is refused
    by name before anything is written."""
    path = tmp_path / "broken.gguf"
    write_gpt_oss_gguf(path, tiny_gpt_oss(), **kwargs)
    with pytest.raises(ValueError, match=r"broken\.gguf: .*" + message):
        resolve_model_dir(str(path), tmp_path / "cache")
    assert _cache_entries(tmp_path / "cache") == []
