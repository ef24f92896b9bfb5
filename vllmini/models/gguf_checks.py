"""Checks that turn a broken or odd GGUF file into one error naming the file and what is wrong,
before anything is written to the cache.

Why: the ``gguf`` reader fails on a cut file with numpy's words ("cannot reshape array of size
8703 into shape (64,136)"), transformers' GGUF config reader fills a missing key with its own
default (32 layers, 4096 wide), and a file whose tensors disagree with its metadata used to be
converted and cached, then failed at every load with an error naming the cache folder's
config.json, which the user never wrote. llama.cpp refuses all of these files at load.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np

from vllmini.files import foreign_file_hint

# GGUF value types (gguf.GGUFValueType), by what a key must hold
_INT_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}
_NUMBER_TYPES = _INT_TYPES | {"FLOAT32", "FLOAT64"}
# the format before GGUF (llama.cpp until August 2023): magic -> its name, as the bytes lie on disk
_GGML_MAGICS = {b"lmgg": "ggml", b"fmgg": "ggmf", b"tjgg": "ggjt", b"algg": "ggla", b"nsgg": "ggsn"}
# keys whose value is one integer (per-layer arrays are llama.cpp's, for architectures not read here)
_INT_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
             "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
             "attention.sliding_window", "rope.dimension_count", "expert_count", "expert_used_count",
             "expert_feed_forward_length", "expert_shared_feed_forward_length")  # fmt: skip
_FLOAT_KEYS = ("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.factor", "rope.scale_linear")
_REQUIRED = ("block_count", "context_length", "embedding_length", "attention.head_count")
_SPECIAL_TOKEN_KEYS = ("bos", "eos", "unknown", "padding", "seperator", "sep", "eot", "eom")


def open_reader(gguf: Any, gguf_path: Path) -> Any:
    """``gguf.GGUFReader(gguf_path)``; a file it cannot read is refused saying what the file is
    (a Git LFS pointer, an HTML page, a GGML-era file), or where it ends short of its own header."""
    try:
        reader = gguf.GGUFReader(gguf_path)
    except PermissionError as exc:
        raise PermissionError(exc.errno, f"{gguf_path} cannot be read: {exc.strerror}") from None
    except Exception as exc:  # the reader fails with numpy's IndexError/ValueError/TypeError on a cut file
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {_why_unreadable(gguf, gguf_path, exc)}") from exc
    if reader.byte_order == "S":  # (transformers' own reader then fails with "GGUF v50331648")
        raise ValueError(f"{gguf_path} is a big-endian GGUF file (made for s390x hosts); vllmini reads little-endian "
                         "ones, the byte order of every other GGUF file")  # fmt: skip
    return reader


def _why_unreadable(gguf: Any, gguf_path: Path, exc: Exception) -> str:
    size = gguf_path.stat().st_size
    with open(gguf_path, "rb") as f:
        head = f.read(512)
    if size == 0:
        return "it is empty (0 bytes)"
    if size < 4 and b"GGUF".startswith(head):
        return f"it is truncated: it has {size} bytes"
    if not head.startswith(b"GGUF"):
        if (hint := foreign_file_hint(head)) is not None:
            return hint
        if head[:4] in _GGML_MAGICS:
            return (f"it is a GGML-era file (magic {_GGML_MAGICS[head[:4]]!r}), the format before GGUF; convert it "
                    "with llama.cpp's convert_llama_ggml_to_gguf.py, or fetch a GGUF version of the model")
        return f"it does not start with the GGUF magic b'GGUF' but with {head[:8]!r}"
    version = int.from_bytes(head[4:8], "little") if len(head) >= 8 else None
    if version is not None and not version & 0xFFFF:  # a big-endian file, as the reader reads it
        version = int.from_bytes(head[4:8], "big")
    supported = getattr(gguf.gguf_reader, "READER_SUPPORTED_VERSIONS", [2, 3])
    if version is not None and version not in supported:
        newer = " (a newer format: upgrade the gguf package, pip install -U gguf)" if version > max(supported) else ""
        return f"GGUF version {version} is not readable by the installed gguf package, which reads {supported}{newer}"
    if (end := _end_of_header_data(gguf, gguf_path)) is not None:
        return (f"it is truncated or corrupted: it has {size} bytes, but its header describes data up to byte {end} "
                "at least (an interrupted download or copy? fetch it again)")
    return str(exc)


def _end_of_header_data(gguf: Any, gguf_path: Path) -> int | None:
    """Where the file's header first points past its end (None: nowhere): the reader is run again
    with each read bounds-checked, only after it failed (the check costs time on large vocabularies)."""

    class PastEnd(Exception):
        pass

    class Checked(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self.data):
                raise PastEnd(end)
            return super()._get(offset, dtype, count, override_order)

    try:
        Checked(gguf_path)
    except PastEnd as past:
        return past.args[0]
    except Exception:  # another fault: the first error says it
        return None
    return None


def gguf_value_type(name: str) -> Any:
    from gguf import GGUFValueType

    return GGUFValueType[name]


def field_info(reader, key: str) -> tuple[str, Any] | None:
    """(GGUF value type name, value) of a metadata key; None when the file lacks it. An array's type
    is ``ARRAY`` (its items' type does not matter to the checks here)."""
    field = reader.fields.get(key)
    if field is None:
        return None
    return field.types[0].name if field.types else "", field.contents()


def check_single_file(reader, gguf_path: Path) -> None:
    """A part of a model split by llama.cpp's gguf-split (``*-00001-of-00003.gguf``) is refused, as
    vLLM refuses it: its first part holds the metadata and only some of the tensors."""
    if (split := field_info(reader, "split.count")) is not None and split[1] not in (0, 1):
        part = field_info(reader, "split.no")
        which = f"part {int(part[1]) + 1}" if part is not None and part[0] in _INT_TYPES else "a part"
        raise ValueError(
            f"{gguf_path} is {which} of a model split into {split[1]} GGUF files (llama.cpp's gguf-split); "
            "vllmini reads single-file GGUF models, as vLLM does: merge the parts first with llama.cpp's "
            "`llama-gguf-split --merge <first part> <merged.gguf>`"
        )


def check_metadata(reader, gguf_path: Path, arch: str) -> None:
    """The keys the conversion reads hold one number each, the sizes are positive and agree, and
    its tokenizer keys can be rebuilt into a tokenizer."""
    for name in _INT_KEYS + _FLOAT_KEYS:
        key = f"{arch}.{name}"
        if (info := field_info(reader, key)) is None:
            if name in _REQUIRED or (name == "feed_forward_length" and not _has_experts(reader, arch)):
                raise ValueError(f"{gguf_path}: the metadata key {key!r} is missing; every {arch} GGUF file has it")
            continue
        kind, value = info
        want = _INT_TYPES if name in _INT_KEYS else _NUMBER_TYPES
        if kind == "ARRAY" and name in _INT_KEYS:
            raise ValueError(f"{gguf_path}: {key} is a per-layer array ({_short(value)}); vllmini's {arch} models "
                             "take one value for every layer")  # fmt: skip
        if kind not in want:
            what = "an integer" if name in _INT_KEYS else "a number"
            raise ValueError(f"{gguf_path}: the metadata key {key!r} holds {kind} {_short(value)}, expected {what}")
    sizes = {name: int(field_info(reader, f"{arch}.{name}")[1]) for name in _REQUIRED}
    for name in ("block_count", "embedding_length", "attention.head_count"):
        if sizes[name] < 1:
            extra = " (a model without layers)" if name == "block_count" else ""
            raise ValueError(f"{gguf_path}: {arch}.{name} is {sizes[name]}{extra}; it must be at least 1")
    heads = sizes["attention.head_count"]
    kv = field_info(reader, f"{arch}.attention.head_count_kv")
    kv_heads = heads if kv is None else int(kv[1])
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{gguf_path}: {arch}.attention.head_count_kv ({kv_heads}) must be at least 1 and divide "
                         f"{arch}.attention.head_count ({heads})")  # fmt: skip
    hidden = sizes["embedding_length"]
    if field_info(reader, f"{arch}.attention.key_length") is None and hidden % heads:
        raise ValueError(f"{gguf_path}: {arch}.embedding_length ({hidden}) is not a multiple of "
                         f"{arch}.attention.head_count ({heads}), and no {arch}.attention.key_length gives the head size")  # fmt: skip
    _check_tokenizer_keys(reader, gguf_path)


def _has_experts(reader, arch: str) -> bool:
    return (info := field_info(reader, f"{arch}.expert_count")) is not None and bool(info[1])


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_tokenizer_keys(reader, gguf_path: Path) -> None:
    """What transformers needs to rebuild the tokenizer, and special token ids inside its vocabulary
    (transformers fails on either with a bare KeyError or IndexError)."""
    if field_info(reader, "tokenizer.ggml.model") is None:
        return  # no tokenizer: the conversion warns and writes none
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template", "tokenizer.ggml.tokens",
                "tokenizer.ggml.merges"):  # fmt: skip
        field = reader.fields.get(key)
        if field is not None and field.types[-1:] != [gguf_value_type("STRING")]:  # (an array's: its items' type)
            kinds = "/".join(t.name for t in field.types)
            raise ValueError(f"{gguf_path}: the metadata key {key!r} holds {kinds} {_short(field.contents())}, "
                             "expected text")  # fmt: skip
    tokens = field_info(reader, "tokenizer.ggml.tokens")
    if tokens is None or tokens[0] != "ARRAY":
        raise ValueError(f"{gguf_path}: it names a tokenizer (tokenizer.ggml.model) but has no token list "
                         "(tokenizer.ggml.tokens)")  # fmt: skip
    if field_info(reader, "tokenizer.ggml.merges") is None and field_info(reader, "tokenizer.ggml.scores") is None:
        raise ValueError(f"{gguf_path}: its tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores, "
                         "so it cannot be rebuilt")  # fmt: skip
    n_tokens = len(tokens[1])
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    rows = int(embedding.shape[-1]) if embedding is not None and len(embedding.shape) == 2 else None
    if rows is not None and n_tokens > rows:  # the tokenizer would emit ids the embedding has no row for
        raise ValueError(f"{gguf_path}: its tokenizer has {n_tokens} tokens (tokenizer.ggml.tokens) but "
                         f"token_embd.weight has {rows} rows, one per token id")  # fmt: skip
    for name in _SPECIAL_TOKEN_KEYS:
        key = f"tokenizer.ggml.{name}_token_id"
        if (info := field_info(reader, key)) is None:
            continue
        if info[0] not in _INT_TYPES or not 0 <= int(info[1]) < n_tokens:
            raise ValueError(f"{gguf_path}: {key} is {_short(info[1])}, which is not a token id of its "
                             f"{n_tokens}-token vocabulary (tokenizer.ggml.tokens)")  # fmt: skip


def check_tensors(gguf_path: Path, config, tensors: Iterator[tuple[str, str, tuple[int, ...]]]) -> None:
    """Load ``(GGUF name, HF name, HF shape)`` into the model class ``config`` names, built without
    memory (meta): a tensor of the wrong shape, one no parameter takes, or a parameter no tensor fills
    is refused with the GGUF names, as the engine would refuse the converted folder at every load."""
    import torch

    from vllmini.models import registry
    from vllmini.models.weight_loader import missing_checkpoint_tensors

    try:
        with torch.device("meta"):
            model = registry.get_model_class(config.architectures)(config)
    except ValueError as exc:  # a setting the model class refuses
        raise ValueError(f"{gguf_path}: {exc}") from None
    to_gguf: dict[str, str] = {}
    current: list[str] = []

    def meta_tensors() -> Iterator[tuple[str, Any]]:
        for gguf_name, hf_name, shape in tensors:
            to_gguf[hf_name] = gguf_name
            current[:] = [gguf_name]
            yield hf_name, torch.empty(shape, dtype=torch.float32, device="meta")

    try:
        loaded = model.load_weights(meta_tensors()) or set()
    except ValueError as exc:
        raise ValueError(f"{gguf_path}: GGUF tensor {current[0]!r} does not fit the file's metadata "
                         f"({metadata_summary(config)}): {exc}") from None  # fmt: skip
    missing = missing_checkpoint_tensors(model, set(loaded))
    if missing:
        names = [gguf_tensor_name(hf, to_gguf) for hf in missing]
        shown = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
        raise ValueError(f"{gguf_path}: tensors missing for the model its metadata describes "
                         f"({metadata_summary(config)}): {shown}")  # fmt: skip


def metadata_summary(config) -> str:
    """The sizes the model is built with, under their GGUF key names."""
    keys = (("block_count", "num_hidden_layers"), ("embedding_length", "hidden_size"),
            ("head_count", "num_attention_heads"), ("head_count_kv", "num_key_value_heads"),
            ("key_length", "head_dim"), ("feed_forward_length", "intermediate_size"), ("vocab", "vocab_size"))  # fmt: skip
    return ", ".join(f"{key}={getattr(config, attr)}" for key, attr in keys if getattr(config, attr, None) is not None)


def gguf_tensor_name(hf_name: str, known: dict[str, str]) -> str:
    """The GGUF name of an HF tensor: from the file where it holds one, else llama.cpp's usual name."""
    from vllmini.models.gguf_convert import _BLOCK_NAMES, _GLOBAL_NAMES

    if hf_name in known:
        return known[hf_name]
    stem, _, leaf = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, sub = stem.split(".", 3)
        kind = {v: k for k, v in _BLOCK_NAMES.items()}.get(sub)
        return f"blk.{layer}.{kind}.{leaf}" if kind else hf_name
    kind = {v: k for k, v in _GLOBAL_NAMES.items()}.get(stem)
    return f"{kind}.{leaf}" if kind else hf_name
