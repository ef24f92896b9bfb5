"""GGUF files as users really have them: cut short by a failed download, a Git LFS pointer or a web
page in their place, keys of the wrong type or missing, tensors that disagree with the metadata, one
part of a split model. Each is refused before anything is written to the cache, with one error
naming the file and the fault (not numpy's words from deep inside the reader)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from test_gguf import _cache_entries, write_tiny_gguf
from vllmini.models.weight_loader import resolve_model_dir


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("src") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


def _refused(path: Path, cache: Path, *needles: str) -> str:
    """Resolve ``path`` as a model; it must fail with a ValueError naming the file and each needle,
    and leave nothing in the cache."""
    with pytest.raises(ValueError) as info:
        resolve_model_dir(str(path), cache)
    msg = str(info.value)
    assert msg.startswith(str(path)), msg
    for needle in needles:
        assert needle in msg, msg
    assert _cache_entries(cache) == []
    return msg


def _duplicate_tensor_name(data: bytes) -> bytes:
    """Rename blk.0.attn_v.weight to blk.0.attn_k.weight in the header (names of equal length)."""
    assert data.count(b"blk.0.attn_v.weight") == 1
    return data.replace(b"blk.0.attn_v.weight", b"blk.0.attn_k.weight")


@pytest.mark.parametrize(
    "content, needles",
    [
        (lambda d: b"", ["it is empty (0 bytes)"]),
        (lambda d: d[:2], ["it is truncated: it has 2 bytes"]),
        (lambda d: b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64 + b"\nsize 99\n",
         ["Git LFS pointer", "git lfs pull"]),
        (lambda d: b"\n<!DOCTYPE html>\n<html><body>model page</body></html>", ["HTML page", "/resolve/main/"]),
        (lambda d: b"tjgg" + d[4:], ["GGML-era file (magic 'ggjt')", "convert_llama_ggml_to_gguf.py"]),
        (lambda d: b"PK\x03\x04" + d[4:], ["does not start with the GGUF magic b'GGUF' but with b'PK\\x03\\x04"]),
        (lambda d: d[:4] + (4).to_bytes(4, "little") + d[8:], ["GGUF version 4", "reads [2, 3]", "pip install -U gguf"]),
        (_duplicate_tensor_name, ["duplicated tensor", "blk.0.attn_k.weight"]),
    ],
    ids=["empty", "two-bytes", "lfs-pointer", "html", "ggml-era", "zip", "version-4", "duplicate-tensor"],
)
def test_unreadable_files_say_what_they_are(tmp_path: Path, tiny_bytes: bytes, content, needles) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content(tiny_bytes))
    _refused(path, tmp_path / "cache", *needles)


@pytest.mark.parametrize("where", [6, 20, 700, 0.3, 0.6, -1])
def test_truncated_file_is_named_truncated(tmp_path: Path, tiny_bytes: bytes, where: float) -> None:
    """Cut in the header, the metadata, the tensor infos, the tensor data, and one byte short."""
    cut = where if isinstance(where, int) and where > 0 else len(tiny_bytes) + where if where < 0 else int(len(tiny_bytes) * where)
    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_bytes[:cut])
    msg = _refused(path, tmp_path / "cache", f"it is truncated or corrupted: it has {cut} bytes", "fetch it again")
    end = int(re.search(r"data up to byte (\d+)", msg)[1])
    assert cut < end <= len(tiny_bytes)


_ONES = np.ones((64, 64), np.float32)


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        ({"drop_kv": ("llama.block_count",)}, ["'llama.block_count' is missing"]),
        ({"drop_kv": ("llama.attention.head_count",)}, ["'llama.attention.head_count' is missing"]),
        ({"drop_kv": ("llama.feed_forward_length",)}, ["'llama.feed_forward_length' is missing"]),
        ({"extra_kv": {"llama.block_count": "2"}}, ["'llama.block_count' holds STRING '2', expected an integer"]),
        ({"extra_kv": {"llama.context_length": 4096.0}}, ["'llama.context_length' holds FLOAT32 4096.0"]),
        ({"extra_kv": {"llama.rope.freq_base": "1e4"}}, ["'llama.rope.freq_base' holds STRING '1e4', expected a number"]),
        ({"extra_kv": {"llama.attention.head_count_kv": [2, 2]}}, ["head_count_kv is a per-layer array ([2, 2])"]),
        ({"extra_kv": {"llama.block_count": 0}}, ["llama.block_count is 0 (a model without layers)"]),
        ({"extra_kv": {"llama.attention.head_count": 0}}, ["llama.attention.head_count is 0"]),
        ({"extra_kv": {"llama.attention.head_count_kv": 3}}, ["head_count_kv (3) must be at least 1 and divide"]),
        ({"extra_kv": {"llama.attention.head_count": 6, "llama.attention.head_count_kv": 3}},
         ["embedding_length (64) is not a multiple of llama.attention.head_count (6)"]),
        ({"extra_kv": {"tokenizer.ggml.eos_token_id": 9999}},
         ["tokenizer.ggml.eos_token_id is 9999, which is not a token id of its 261-token vocabulary"]),
        ({"drop_kv": ("tokenizer.ggml.tokens",)}, ["has no token list (tokenizer.ggml.tokens)"]),
        ({"drop_kv": ("tokenizer.ggml.merges",)}, ["neither tokenizer.ggml.merges nor tokenizer.ggml.scores"]),
        ({"extra_kv": {"split.count": 3, "split.no": 0}}, ["is part 1 of a model split into 3 GGUF files", "--merge"]),
        ({"extra_kv": {"tokenizer.chat_template": 3}}, ["'tokenizer.chat_template' holds UINT32 3, expected text"]),
        ({"extra_kv": {"tokenizer.ggml.tokens": [1, 2, 3]}}, ["'tokenizer.ggml.tokens' holds ARRAY/INT32 [1, 2, 3]"]),
        ({"extra_kv": {"llama.attention.key_length": 15}},  # transformers refuses it when the config is saved
         ["transformers cannot build a valid config from its metadata", "even rotary dimension"]),
    ],
    ids=["no-block_count", "no-head_count", "no-feed_forward_length", "block_count-string", "context_length-float",
         "freq_base-string", "head_count_kv-array", "zero-layers", "zero-heads", "kv-not-dividing",
         "hidden-not-multiple", "eos-out-of-vocab", "no-tokens", "no-merges-no-scores", "split-part",
         "chat-template-int", "tokens-ints", "odd-head-size"],
)
def test_metadata_faults_are_named(tmp_path: Path, kwargs: dict, needles: list[str]) -> None:
    """Before: transformers' defaults (32 layers, 4096 wide) filled a missing key, its strict config
    check or ``int()`` failed on a wrong type, a zero divided, with no file named."""
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, **kwargs)
    _refused(path, tmp_path / "cache", *needles)


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        ({"skip_tensors": ("blk.1.attn_k.weight",)}, ["tensors missing for the model", ": blk.1.attn_k.weight"]),
        ({"skip_tensors": ("blk.0.attn_k.weight",), "extra_tensors": {"blk.0.attn_k.weight": _ONES}},
         ["GGUF tensor 'blk.0.attn_k.weight' does not fit", "head_count_kv=2", "(64, 64)"]),
        ({"extra_kv": {"llama.block_count": 3}}, ["block_count=3", "blk.2.attn_norm.weight, blk.2.attn_q.weight"]),
        ({"extra_kv": {"llama.block_count": 1}}, ["GGUF tensor 'blk.1.", "block_count=1"]),
        ({"extra_kv": {"llama.vocab_size": 300}}, ["GGUF tensor 'token_embd.weight' does not fit", "vocab=300"]),
        ({"extra_kv": {"llama.vocab_size": 200},
          "skip_tensors": ("token_embd.weight",), "extra_tensors": {"token_embd.weight": np.ones((200, 64), np.float32)}},
         ["its tokenizer has 261 tokens (tokenizer.ggml.tokens) but token_embd.weight has 200 rows"]),
        ({"extra_kv": {"llama.attention.head_count_kv": 4}}, ["GGUF tensor 'blk.0.attn_k.weight' does not fit"]),
    ],
    ids=["missing-attn_k", "attn_k-shape", "block_count-3", "block_count-1", "vocab_size", "tokens-beyond-rows",
         "head_count_kv"],
)
def test_tensors_disagreeing_with_metadata_are_refused_before_caching(tmp_path: Path, kwargs: dict,
                                                                       needles: list[str]) -> None:  # fmt: skip
    """Before: converted and cached, then refused at every load naming the cache folder's config.json
    (or, tokens beyond the embedding, an IndexError at the first prompt using one)."""
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path, **kwargs)
    _refused(path, tmp_path / "cache", *needles)


def test_a_hub_cache_symlink_is_named_not_its_blob(tmp_path: Path, tiny_bytes: bytes) -> None:
    """Files in Hugging Face's cache are symlinks (snapshots/<rev>/model.gguf -> blobs/<sha256>):
    errors named the blob's hash, which says nothing of the model; a good one converts."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    (blobs / ("9" * 64)).write_bytes(tiny_bytes[:5000])
    (snapshot / "model.gguf").symlink_to(blobs / ("9" * 64))
    _refused(snapshot / "model.gguf", tmp_path / "cache", "it is truncated or corrupted")
    (blobs / ("9" * 64)).write_bytes(tiny_bytes)
    assert (resolve_model_dir(str(snapshot / "model.gguf"), tmp_path / "cache") / "config.json").is_file()


def test_big_endian_file_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' reader said 'is GGUF v50331648; this reader handles v2 and v3'."""
    import gguf

    import test_gguf

    class BigEndianWriter(test_gguf.GGUFWriter):
        def __init__(self, path, arch, **kwargs):
            super().__init__(path, arch, endianess=gguf.GGUFEndian.BIG, **kwargs)

    monkeypatch.setattr(test_gguf, "GGUFWriter", BigEndianWriter)
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path)
    _refused(path, tmp_path / "cache", "is a big-endian GGUF file")
