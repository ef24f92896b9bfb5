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
from typing import Any

import numpy as np

from vllmini.files import foreign_file_hint

# the format before GGUF (llama.cpp until August 2023): magic -> its name, as the bytes lie on disk
_GGML_MAGICS = {b"lmgg": "ggml", b"fmgg": "ggmf", b"tjgg": "ggjt", b"algg": "ggla", b"nsgg": "ggsn"}


def open_reader(gguf: Any, gguf_path: Path) -> Any:
    """``gguf.GGUFReader(gguf_path)``; a file it cannot read is refused saying what the file is
    (a Git LFS pointer, an HTML page, a GGML-era file), or where it ends short of its own header."""
    try:
        return gguf.GGUFReader(gguf_path)
    except PermissionError as exc:
        raise PermissionError(exc.errno, f"{gguf_path} cannot be read: {exc.strerror}") from None
    except Exception as exc:  # the reader fails with numpy's IndexError/ValueError/TypeError on a cut file
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {_why_unreadable(gguf, gguf_path, exc)}") from exc


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

