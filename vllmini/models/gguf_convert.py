"""One-time conversion of a GGUF file into an HF-format directory.

Why convert instead of reading GGUF at every start: the rest of the engine then
has a single weight format (safetensors, mmap'd, one tensor at a time), and the
dequantization plus tokenizer reconstruction (a few seconds) is paid once.

The output holds fp32 weights, so it is ~4x the size of a 4-bit GGUF file (gpt-oss's
MXFP4 experts excepted: they stay packed, gguf_gpt_oss.py). Config and tokenizer come
from transformers' own GGUF readers; tensors are dequantized with
``gguf.quants.dequantize`` and renamed to HF names here.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from vllmini.models import gguf_cache, gguf_checks, gguf_gemma, gguf_gpt_oss, gguf_moe, gguf_rope
from vllmini.models.weight_loader import load_config

logger = logging.getLogger(__name__)

# Bump when the converted layout changes: it is part of the cache key, so old entries are not reused.
CONVERTER_VERSION = 6  # 2: special tokens pinned to the GGUF metadata; 3: sliding_window kept; 4: linear rope scaling;
# 5: tokenizer_config.json lists the added tokens; 6: gpt-oss's MXFP4 experts kept packed (its fp32 entries: 84 GB)

# GGUF ``general.architecture`` -> HF architecture name (see registry.py); a ``llama`` file
# with ``llama.expert_count`` is Mixtral (gguf_moe.py); Gemma's settings: gguf_gemma.py; gpt-oss: gguf_gpt_oss.py.
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    **gguf_moe.MOE_ARCHITECTURES, **gguf_gemma.GEMMA_ARCHITECTURES, **gguf_gpt_oss.GPT_OSS_ARCHITECTURES,
}  # fmt: skip

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # phi3: q, k and v fused, as in its HF checkpoints
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# where an architecture names a tensor differently: phi3 keeps gate and up fused in ffn_up; MoE routers;
# Gemma's four norms per layer (ffn_norm is its pre-feedforward norm); gpt-oss's router and MoE pre-norm
_ARCH_BLOCK_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}, **gguf_moe.MOE_BLOCK_NAMES, **gguf_gemma.GEMMA_BLOCK_NAMES,
                     **gguf_gpt_oss.GPT_OSS_BLOCK_NAMES}  # fmt: skip
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")

DEFAULT_MAX_SHARD_BYTES = 2 << 30


def hf_tensor_name(gguf_name: str, arch: str = "llama", expert: int | None = None) -> str | None:
    """HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``);
    of a stacked experts tensor (``blk.3.ffn_up_exps.weight``), that of its expert ``expert``."""
    if (name := gguf_moe.expert_hf_name(gguf_name, arch, expert) or gguf_gpt_oss.hf_tensor_name(gguf_name, arch)):
        return name
    if m := _BLOCK_RE.match(gguf_name):
        layer, kind, leaf = m.groups()
        names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
        return f"model.layers.{layer}.{names[kind]}.{leaf}" if kind in names else None
    if (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (llama-architecture GGUF only).

    llama.cpp's converter reorders each head's rows from HF's "rotate half" layout
    ``[2, head_dim/2]`` to the interleaved ``[head_dim/2, 2]`` its rotary kernel uses.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute a tensor of {rows} rows into {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 source_stat: os.stat_result | None = None) -> Path:  # fmt: skip
    """Write an HF-format directory (config, fp32 safetensors, tokenizer) for ``gguf_path`` at ``out_dir``.

    Everything is written into a temporary sibling folder that is renamed into place
    at the end, so an interrupted or failed conversion leaves nothing at ``out_dir``;
    nor does a source that changed since ``source_stat`` (its stat when the cache key was made).
    """
    import gguf  # local: only conversions need it

    gguf_path = Path(gguf_path).absolute()  # (not resolved: a hub cache's symlink is named, not its blob's hash)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    source_stat = source_stat or gguf_path.stat()
    reader = gguf_checks.open_reader(gguf, gguf_path)
    gguf_checks.check_single_file(reader, gguf_path)
    arch = _architecture(reader, gguf_path)
    gguf_checks.check_metadata(reader, gguf_path, arch)
    rope = _check_supported(reader, gguf_path, arch)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    gguf_cache.remove_stale_tmp(out_dir)
    items = _weight_items(_weight_tensors(reader), arch)
    gguf_cache.check_free_space(gguf_path, out_dir.parent, sum(_out_bytes(t, expert) for t, expert in items))
    tmp = gguf_cache.tmp_dir(out_dir)
    try:
        with gguf_cache.cache_errors(gguf_path, out_dir.parent):
            tmp.mkdir()
            with _parsed_once(gguf, gguf_path, reader):
                config = _write_config(gguf_path, reader, arch, tmp, rope)
                gguf_checks.check_tensors(gguf_path, load_config(tmp), _tensor_names(reader, arch))
                _write_tokenizer(gguf_path, reader, tmp, arch)
            _write_weights(reader, config, arch, tmp, max_shard_bytes)
            gguf_cache.write_source(tmp, gguf_path)
        gguf_cache.check_unchanged(gguf_path, source_stat)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            logger.info("%s was converted concurrently by another process; using it", out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


@contextlib.contextmanager
def _parsed_once(gguf: Any, gguf_path: Path, reader: Any) -> Iterator[None]:
    """transformers' config and tokenizer readers each build a ``gguf.GGUFReader`` of the file
    again (4.5 s apiece for SmolLM2's file, most of it its 49152-token vocabulary's fields): while
    they run, a reader asked for this file is the one already built (read-only: a memory map).
    Readers of other files, and every reader after the block, are built as usual."""
    real, target = gguf.GGUFReader, gguf_path.resolve()

    def reader_of(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and Path(path).resolve() == target:
            return reader
        return real(path, *args, **kwargs)

    gguf.GGUFReader = reader_of
    try:
        yield
    finally:
        gguf.GGUFReader = real


def _architecture(reader, gguf_path: Path) -> str:
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {arch!r} is not supported; "
            f"accepted: {', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return arch


def _check_supported(reader, gguf_path: Path, arch: str) -> dict[str, Any]:
    """Fail before writing anything on what the conversion would silently get wrong: rope settings
    it cannot map (gguf_rope.py), unknown tensor names, quant types gguf cannot dequantize. Returns
    the config.json rope fields (``gguf_rope.rope_config``), read once here."""
    from gguf.quants import dequantize

    rope = gguf_rope.rope_config(reader, gguf_path, arch)
    gguf_gemma.check_rope(gguf_path, arch, rope)
    if arch in gguf_gpt_oss.GPT_OSS_ARCHITECTURES:
        gguf_gpt_oss.check(reader, gguf_path)
    gguf_moe.check_experts(reader, gguf_path, arch)
    probed: set = set()
    for t in _weight_tensors(reader):
        if hf_tensor_name(t.name, arch, expert=0) is None:
            raise ValueError(f"{gguf_path}: GGUF tensor {t.name!r} has no known HF name for architecture {arch!r}")
        if t.tensor_type in probed:
            continue
        try:
            dequantize(t.data if t.data.ndim == 1 else t.data[:1], t.tensor_type)
        except NotImplementedError as exc:
            raise ValueError(
                f"{gguf_path}: tensor {t.name!r} has type {t.tensor_type.name}, which the gguf package cannot "
                "dequantize; accepted: F32, F16, BF16 and the Q*/IQ* quantizations gguf implements"
            ) from exc
        probed.add(t.tensor_type)
    return rope


def _write_config(gguf_path: Path, reader, arch: str, out: Path, rope: dict[str, Any]):
    """config.json and generation_config.json; what transformers refuses (its strict config checks
    raise their own exception types, at assignment or at save) is a ValueError naming the file."""
    try:
        return _save_config(gguf_path, reader, arch, out, rope)
    except Exception as exc:
        if isinstance(exc, OSError) or isinstance(exc, ValueError) and str(exc).startswith(str(gguf_path)):
            raise  # a write that failed (gguf_cache.cache_errors says which), or one of ours
        raise ValueError(f"{gguf_path}: transformers cannot build a valid config from its metadata: {exc}") from exc


def _save_config(gguf_path: Path, reader, arch: str, out: Path, rope: dict[str, Any]):
    from transformers import AutoConfig, GenerationConfig

    if arch in gguf_gpt_oss.GPT_OSS_ARCHITECTURES:  # (transformers' GGUF reader fails on these files)
        config = gguf_gpt_oss.gpt_oss_config(reader, gguf_path, rope)
    else:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, trust_remote_code=False)
        config.architectures = [GGUF_ARCHITECTURES[arch]]
        config = gguf_moe.moe_config(config, reader, gguf_path, arch)
    key_length = reader.fields.get(f"{arch}.attention.key_length")
    if key_length is not None:  # transformers ignores it for qwen3 and falls back to Qwen3Config's default 128
        config.head_dim = int(key_length.contents())
    window = reader.fields.get(f"{arch}.attention.sliding_window")
    if window is not None:  # transformers' GGUF config reader drops it (phi3 has one: 2047 for -mini-4k)
        config.sliding_window = int(window.contents())
    for name, value in rope.items():
        setattr(config, name, {**(config.rope_parameters or {}), **value} if name == "rope_parameters" else value)
    if arch in gguf_gemma.GEMMA_ARCHITECTURES:
        config = gguf_gemma.gemma_config(config, reader, arch, rope)
    config.dtype = "float32"
    config.tie_word_embeddings = all(t.name != "output.weight" for t in reader.tensors)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    return config


def _write_tokenizer(gguf_path: Path, reader, out: Path, arch: str) -> None:
    """Tokenizer files (incl. the chat template) rebuilt by transformers from the GGUF metadata
    (gpt-oss: by its fast tokenizer class itself, as AutoTokenizer reads the file's config and fails)."""
    if "tokenizer.ggml.model" not in reader.fields:
        logger.warning("%s has no tokenizer; pass a tokenizer explicitly (EngineArgs.tokenizer)", gguf_path)
        return
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loader = PreTrainedTokenizerFast if arch in gguf_gpt_oss.GPT_OSS_ARCHITECTURES else AutoTokenizer
    try:
        tok = loader.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, trust_remote_code=False)
    except Exception as exc:  # transformers raises assorted types for tokenizers it cannot rebuild
        raise ValueError(f"{gguf_path}: cannot rebuild its tokenizer with transformers: {exc}") from exc
    _pin_special_tokens(tok, reader)
    tok.save_pretrained(out)
    _list_added_tokens(out)


def _list_added_tokens(out: Path) -> None:
    """Copy tokenizer.json's added tokens into tokenizer_config.json as ``added_tokens_decoder``,
    as hub checkpoints have it (transformers 5 no longer writes it). Without it every load takes
    transformers' legacy path, which parses all of tokenizer.json again in Python: SmolLM2's
    tokenizer then loads in 0.25 s instead of 0.16 s, at every engine start."""
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    added = json.loads((out / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens", [])
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


_SPECIAL_TOKEN_FIELDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def _pin_special_tokens(tok, reader) -> None:
    """Special tokens exactly as the GGUF file names them: transformers' rebuild has varied
    across versions (5.17 makes SmolLM2's EOS ``<|im_start|>`` instead of ``<|im_end|>``, so
    a chat reply would never stop on the tokenizer's EOS)."""
    for attr, key in _SPECIAL_TOKEN_FIELDS.items():
        if key not in reader.fields:
            continue
        token_id = int(reader.fields[key].contents())
        if not 0 <= token_id < len(tok):
            continue
        token = tok.convert_ids_to_tokens(token_id)
        if getattr(tok, attr) != token:
            logger.info("GGUF tokenizer: %s set to %r (id %d) from %s", attr, token, token_id, key)
            setattr(tok, attr, token)


def _write_weights(reader, config, arch: str, out: Path, max_shard_bytes: int) -> None:
    """Dequantize to fp32 shard by shard (memory ~ one shard; a stacked experts tensor is read one
    expert at a time, so its experts may land in different shards), then name files like HF does;
    gpt-oss's MXFP4 experts are repacked instead (gguf_gpt_oss.FusedExperts.mxfp4)."""
    from safetensors.torch import save_file

    shards = _plan_shards(_weight_items(_weight_tensors(reader), arch), max_shard_bytes)
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = dict(_dequantized(shard, config, arch))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del tensors
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _weight_tensors(reader) -> list:
    """The file's tensors that become HF tensors (rope factors become config.json fields)."""
    return [t for t in reader.tensors if t.name not in gguf_rope.ROPE_TENSORS]


def _weight_items(tensors: list, arch: str) -> list[tuple[object, int | None]]:
    """``(GGUF tensor, expert)`` per HF tensor to write: one per expert of a stacked experts tensor
    (gpt-oss keeps its experts stacked, and a ``gguf_gpt_oss.FusedExperts`` stands for two of them)."""
    if arch in gguf_gpt_oss.GPT_OSS_ARCHITECTURES:
        return [(t, None) for t in gguf_gpt_oss.weight_items(tensors)]
    items: list[tuple[object, int | None]] = []
    for t in tensors:
        items += [(t, e) for e in range(int(t.shape[-1]))] if gguf_moe.is_stacked(t.name) else [(t, None)]
    return items


def _plan_shards(items: list[tuple[object, int | None]], max_shard_bytes: int) -> list[list]:
    shards: list[list] = [[]]
    size = 0
    for item in items:
        nbytes = _out_bytes(*item)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def _out_bytes(t, expert: int | None) -> int:
    """Bytes a GGUF tensor (one expert of it) takes once converted."""
    if isinstance(t, gguf_gpt_oss.FusedExperts):
        return t.out_bytes
    return int(t.n_elements) * 4 // (1 if expert is None else int(t.shape[-1]))


def _hf_item(t, expert: int | None, arch: str) -> tuple[str, tuple[int, ...]]:
    """HF name and shape of a GGUF tensor (of one expert of a stacked experts tensor)."""
    name = hf_tensor_name(t.name, arch, expert)
    assert name is not None  # checked in _check_supported
    shape = gguf_moe.numpy_shape(t)
    return name, gguf_moe.hf_shape(name, shape if expert is None else shape[1:])


def _tensor_names(reader, arch: str) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, HF name, HF shape) of each tensor the conversion writes, for gguf_checks.check_tensors."""
    for t, expert in _weight_items(_weight_tensors(reader), arch):
        yield t.name, *_hf_item(t, expert, arch)


def _dequantized(items: list, config, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t, expert in items:
        name, shape = _hf_item(t, expert, arch)
        # one expert's rows of a stacked tensor (quantized blocks never span experts)
        if isinstance(t, gguf_gpt_oss.FusedExperts) and t.packed:
            blocks, scales = t.mxfp4()
            yield f"{name}_blocks", torch.from_numpy(blocks)
            yield f"{name}_scales", torch.from_numpy(scales)
            continue
        if isinstance(t, gguf_gpt_oss.FusedExperts):
            w = t.values()
        else:
            data = t.data if expert is None else t.data[expert]
            w = np.asarray(dequantize(data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = gguf_gemma.hf_weight(name, w, arch)
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = unpermute_rotary(w, config.num_attention_heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = unpermute_rotary(w, config.num_key_value_heads)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # own, writable copy
