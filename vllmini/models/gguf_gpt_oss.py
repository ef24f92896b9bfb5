"""gpt-oss GGUF files (``general.architecture == "gpt-oss"``: ggml-org/gpt-oss-20b-GGUF, -120b), as
llama.cpp's converter writes them (its GptOssModel) and its openai-moe graph reads them.

Why this is its own step of the conversion:
  * transformers' GGUF config and tokenizer readers fail on these files (they read each
    ``rope.scaling.*`` key's name length as its value), so the config is built here from the keys;
  * llama.cpp splits HF's experts: ``gate_up_proj [E, H, 2I]`` (gate and up interleaved along the
    last axis) becomes ``ffn_gate_exps`` / ``ffn_up_exps [E, I, H]`` (its even / odd columns),
    ``down_proj [E, I, H]`` becomes ``ffn_down_exps [E, H, I]``, and the biases follow. They are put
    back into HF's layout here (``FusedExperts``), one expert at a time;
  * MXFP4 experts (GGML type 39: OpenAI's blocks with their scale byte in front, nibbles reordered)
    are repacked byte for byte into OpenAI's ``*_blocks`` / ``*_scales`` with its
    ``quantization_config``, as gpt-oss is published: the cache holds 4.25 bits a weight, not 32
    (~13 GB for gpt-oss-20b instead of ~84), and the loader dequantizes them exactly. A file whose
    experts are not all MXFP4 is dequantized to fp32 as the other architectures are;
  * names: ``attn_sinks.weight`` is HF's ``self_attn.sinks`` (no ``.weight``), ``post_attention_norm``
    the norm before the experts, ``ffn_gate_inp`` (with a bias) the router;
  * what llama.cpp fixes in code: every other layer slides, the first one first, unless
    ``attention.sliding_window_pattern`` says otherwise; SwiGLU alpha 1.702 and limit 7; generation
    ends on ``<|return|>``, ``<|call|>`` and ``<|endoftext|>`` (its end-of-generation list for the
    o200k_harmony vocabulary, as HF's generation_config.json has it);
  * YaRN as HF's gpt-oss config has it, ``truncate: false``. (llama.cpp always rounds YaRN's
    correction range to whole dimensions, which gpt-oss was not trained with; HF and vLLM don't.)
What llama.cpp requires and the file lacks, or what the HF model cannot express, is refused by name.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vllmini.models.gguf_gemma import token_id
from vllmini.models.gguf_moe import field_value, numpy_shape

ARCH = "gpt-oss"
# OpenAI's gpt-oss config.json: only the experts are MXFP4
MXFP4_QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
_GGML_MXFP4_BYTES = 17  # a block of 32 values: its E8M0 scale byte, then 16 bytes of E2M1 pairs
GPT_OSS_ARCHITECTURES = {ARCH: "GptOssForCausalLM"}
GPT_OSS_BLOCK_NAMES = {ARCH: {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"}}
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's build_moe_ffn (LLM_FFN_SWIGLU_OAI_MOE)
_SINKS_RE = re.compile(r"^blk\.(\d+)\.attn_sinks\.weight$")
_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)$")
_HF_EXPERTS = {("gate", "weight"): "gate_up_proj", ("up", "weight"): "gate_up_proj", ("down", "weight"): "down_proj",
               ("gate", "bias"): "gate_up_proj_bias", ("up", "bias"): "gate_up_proj_bias",
               ("down", "bias"): "down_proj_bias"}  # fmt: skip
# llama.cpp's end-of-generation tokens of o200k_harmony (<|end|> ends a message, not the reply)
_END_TOKENS = (b"<|return|>", b"<|endoftext|>", b"<|call|>")
# keys llama.cpp's openai-moe loader requires (the experts' count keys: gguf_moe.check_experts)
_REQUIRED_KEYS = ("attention.sliding_window", "expert_count", "expert_used_count", "expert_feed_forward_length")
# per layer, what llama.cpp's openai-moe loader requires (it refuses the file without any of them)
_LAYER_TENSORS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight",
                  "attn_k.bias", "attn_v.weight", "attn_v.bias", "attn_output.weight", "attn_output.bias",
                  "attn_sinks.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias", "ffn_gate_exps.weight",
                  "ffn_gate_exps.bias", "ffn_up_exps.weight", "ffn_up_exps.bias", "ffn_down_exps.weight",
                  "ffn_down_exps.bias")  # fmt: skip


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """HF name of a gpt-oss tensor llama.cpp names its own way (the sinks, the experts); None for the rest."""
    if arch != ARCH:
        return None
    if m := _SINKS_RE.match(gguf_name):
        return f"model.layers.{m[1]}.self_attn.sinks"
    if m := _EXPERTS_RE.match(gguf_name):
        return f"model.layers.{m[1]}.mlp.experts.{_HF_EXPERTS[m[2], m[3]]}"
    return None


@dataclass
class FusedExperts:
    """One HF experts tensor rebuilt from llama.cpp's: ``gate_up_proj [E, H, 2I]`` from
    ``ffn_gate_exps`` and ``ffn_up_exps [E, I, H]`` (gate at the even columns), ``gate_up_proj_bias
    [E, 2I]`` from their biases, ``down_proj [E, I, H]`` from ``ffn_down_exps [E, H, I]``. It has a
    gguf tensor's ``name``, ``n_elements`` and ``shape`` (fastest dim first), so the conversion plans
    and checks it as one tensor. ``packed``: written as OpenAI's MXFP4 blocks and scales (``mxfp4``)."""

    name: str  # its first part's: hf_tensor_name gives the HF name
    parts: tuple[Any, ...]  # the GGUF tensors: (gate, up), or (down,)
    hf_shape: tuple[int, ...]
    packed: bool = False

    @property
    def out_bytes(self) -> int:
        """What it takes in the converted folder (MXFP4: as many bytes as in the GGUF file)."""
        return sum(int(t.n_bytes) for t in self.parts) if self.packed else 4 * self.n_elements

    @property
    def n_elements(self) -> int:
        return sum(int(t.n_elements) for t in self.parts)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.hf_shape))

    def values(self) -> np.ndarray:
        """The HF tensor in float32, filled one expert at a time (memory: it and one expert's parts)."""
        from gguf.quants import dequantize

        out = np.empty(self.hf_shape, dtype=np.float32)
        for e in range(self.hf_shape[0]):
            pairs = out[e].reshape(*self.hf_shape[1:-1], -1, len(self.parts))  # (gate, up) pairs: interleaved
            for k, t in enumerate(self.parts):  # (assigned through the view: 10x faster than stacking)
                part = np.asarray(dequantize(t.data[e], t.tensor_type), np.float32)
                pairs[..., k] = part.reshape(numpy_shape(t)[1:]).T
        return out

    def mxfp4(self) -> tuple[np.ndarray, np.ndarray]:
        """OpenAI's ``blocks [E, out, in / 32, 16]`` and ``scales [E, out, in / 32]`` (uint8) from GGML's
        MXFP4 bytes, without dequantizing: gate and up rows interleaved (gate at the even rows, as
        ``gate_up_proj_blocks`` has them), scales copied, each block's nibbles reordered (GGML: byte j
        holds values j and j + 16; OpenAI: values 2j and 2j + 1, the low nibble first)."""
        raws = [np.asarray(t.data, np.uint8).reshape(*numpy_shape(t)[:-1], -1, _GGML_MXFP4_BYTES) for t in self.parts]
        experts, rows, groups = raws[0].shape[0], raws[0].shape[1] * len(raws), raws[0].shape[2]
        blocks = np.empty((experts, rows, groups, 16), np.uint8)
        scales = np.empty((experts, rows, groups), np.uint8)
        for e in range(experts):  # (one expert at a time: the temporaries stay small)
            # row k of part p becomes row len(parts) * k + p: gate and up interleaved
            raw = np.stack([r[e] for r in raws], axis=1).reshape(rows, groups, _GGML_MXFP4_BYTES)
            qs = raw[..., 1:]
            values = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # the block's 32 values, in order
            blocks[e] = values[..., 0::2] | (values[..., 1::2] << 4)
            scales[e] = raw[..., 0]
        return blocks, scales


def _fused(parts: tuple[Any, ...], packed: bool) -> FusedExperts:
    experts, *dims = numpy_shape(parts[0])
    *lead, last = reversed(dims)  # transposed: [E, H, I] -> [E, I, H]; gate with up: the last dim twice
    return FusedExperts(parts[0].name, parts, (experts, *lead, last * len(parts)), packed)


def experts_packed(tensors: list) -> bool:
    """Whether every expert weight is MXFP4, so the experts can stay packed (one that is not, say
    an F32 ``ffn_up_exps``, would need its own format: all are dequantized then)."""
    from gguf import GGMLQuantizationType

    weights = [t for t in tensors if (m := _EXPERTS_RE.match(t.name)) and m[3] == "weight"]
    return bool(weights) and all(t.tensor_type == GGMLQuantizationType.MXFP4 for t in weights)


def weight_items(tensors: list) -> list:
    """The file's tensors as the conversion writes them: the experts' as ``FusedExperts`` (gate with
    up; down transposed; packed when all are MXFP4), the rest as they are."""
    by_name = {t.name: t for t in tensors}
    packed = experts_packed(tensors)
    items = []
    for t in tensors:
        m = _EXPERTS_RE.match(t.name)
        if m is None or (m[2], m[3]) == ("down", "bias"):
            items.append(t)
        elif m[2] == "gate":
            items.append(_fused((t, by_name[f"blk.{m[1]}.ffn_up_exps.{m[3]}"]), packed and m[3] == "weight"))
        elif m[2] == "down":
            items.append(_fused((t,), packed))
    return items


def check(reader, gguf_path: Path) -> None:
    """Before anything is written: the keys and tensors llama.cpp requires of a gpt-oss file, what
    the HF model cannot express (another head size for values or sliding layers, another rope base
    for sliding layers), and the shapes of the tensors HF lays out differently."""
    def key(name: str) -> Any:
        return field_value(reader, f"{ARCH}.{name}")

    for name in _REQUIRED_KEYS:
        if key(name) is None:
            raise ValueError(f"{gguf_path}: the metadata key '{ARCH}.{name}' is missing; llama.cpp requires it")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim, base = key("attention.key_length") or hidden // heads, key("rope.freq_base") or 10000.0
    for name, same_as in (("attention.value_length", head_dim), ("attention.key_length_swa", head_dim),
                          ("attention.value_length_swa", head_dim), ("rope.freq_base_swa", base)):  # fmt: skip
        value = key(name)
        if value is not None and value != same_as:
            raise ValueError(f"{gguf_path}: {ARCH}.{name} ({value}) differs from the full layers' ({same_as}); "
                             "GptOssForCausalLM has one for every layer")  # fmt: skip
    tensors = {t.name: t for t in reader.tensors}
    layers = int(key("block_count"))
    for name in ("token_embd.weight", "output_norm.weight", "output.weight",
                 *(f"blk.{i}.{leaf}" for i in range(layers) for leaf in _LAYER_TENSORS)):  # fmt: skip
        if name not in tensors:
            raise ValueError(f"{gguf_path}: tensor {name!r} is missing; every gpt-oss GGUF file has it")
    experts, width = int(key("expert_count")), int(key("expert_feed_forward_length"))
    for i in range(layers):
        want = {f"blk.{i}.ffn_gate_exps.bias": (experts, width), f"blk.{i}.ffn_up_exps.bias": (experts, width),
                f"blk.{i}.ffn_down_exps.bias": (experts, hidden), f"blk.{i}.ffn_gate_inp.bias": (experts,),
                f"blk.{i}.attn_sinks.weight": (heads,)}  # fmt: skip
        for name, shape in want.items():
            if (got := numpy_shape(tensors[name])) != shape:
                raise ValueError(f"{gguf_path}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                                 f"({ARCH}.expert_count={experts}, expert width {width}, hidden size {hidden}, "
                                 f"{heads} heads)")  # fmt: skip


def layer_types(reader, gguf_path: Path, layers: int) -> list[str]:
    """Which layers slide: llama.cpp's default is every other one, the first one first; a file may
    state a period (``n``: the last of every ``n`` layers is full) or one flag per layer."""
    pattern = reader.fields.get(f"{ARCH}.attention.sliding_window_pattern")
    value = 2 if pattern is None else pattern.contents()
    if isinstance(value, list):
        if len(value) != layers or not all(isinstance(v, bool) for v in value):
            raise ValueError(f"{gguf_path}: {ARCH}.attention.sliding_window_pattern must hold one bool per layer "
                             f"({layers}), got {value!r}")  # fmt: skip
        sliding = value
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        sliding = [value == 0 or i % value < value - 1 for i in range(layers)]  # (llama.cpp's set_swa_pattern)
    else:
        raise ValueError(f"{gguf_path}: {ARCH}.attention.sliding_window_pattern is {value!r}, expected a period "
                         "or one bool per layer")  # fmt: skip
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def gpt_oss_config(reader, gguf_path: Path, rope: dict[str, Any]):
    """The GptOssConfig the file's keys describe (``rope``: gguf_rope.rope_config's fields)."""
    from transformers import GptOssConfig

    def key(name: str, default: Any = None) -> Any:
        value = field_value(reader, f"{ARCH}.{name}")
        return default if value is None else value

    layers, hidden, heads = int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count"))
    vocab = next(numpy_shape(t)[0] for t in reader.tensors if t.name == "token_embd.weight")  # (check: it is there)
    base = float(key("rope.freq_base", 10000.0))
    params = {"rope_type": "default", **rope.get("rope_parameters", {}), "rope_theta": base}
    if params["rope_type"] == "yarn":  # (llama.cpp's defaults for betas the file leaves out are HF's)
        params = {"beta_fast": 32.0, "beta_slow": 1.0, **params, "truncate": False}
    eos = _token_key(reader, "eos_token_id")
    ends = [i for i in dict.fromkeys([eos, *(token_id(reader, t) for t in _END_TOKENS)]) if i is not None]
    return GptOssConfig(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(key("expert_feed_forward_length")),
        num_hidden_layers=layers, num_attention_heads=heads, head_dim=int(key("attention.key_length", hidden // heads)),
        num_key_value_heads=int(key("attention.head_count_kv", heads)), num_local_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")), sliding_window=int(key("attention.sliding_window")),
        layer_types=layer_types(reader, gguf_path, layers), max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(str(np.float32(key("attention.layer_norm_rms_epsilon", 1e-5)))), rope_parameters=params,
        swiglu_limit=SWIGLU_LIMIT, swiglu_alpha=SWIGLU_ALPHA, attention_bias=True, tie_word_embeddings=False,
        bos_token_id=_token_key(reader, "bos_token_id"), pad_token_id=_token_key(reader, "padding_token_id"),
        eos_token_id=ends if len(ends) > 1 else eos, architectures=[GPT_OSS_ARCHITECTURES[ARCH]],
        **({"quantization_config": copy.deepcopy(MXFP4_QUANTIZATION_CONFIG)} if experts_packed(reader.tensors) else {}),
    )  # fmt: skip


def _token_key(reader, name: str) -> int | None:
    """A ``tokenizer.ggml.*`` id key."""
    value = field_value(reader, f"tokenizer.ggml.{name}")
    return None if value is None else int(value)
