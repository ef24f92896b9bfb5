"""GGUF files as users really have them: cut short by a failed download, a Git LFS pointer or a web
page in their place, keys of the wrong type or missing, tensors that disagree with the metadata, one
part of a split model. Each is refused before anything is written to the cache, with one error
naming the file and the fault (not numpy's words from deep inside the reader)."""
from __future__ import annotations

import re
from pathlib import Path

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
