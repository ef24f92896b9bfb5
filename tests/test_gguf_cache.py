"""The cache of converted GGUF files under the things that happen to real caches: two different
files that look alike, a file still being written, processes converting at once or killed midway,
a cache folder shared with another host, a full disk, a cache path that is not a folder."""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_gguf import _cache_entries, write_tiny_gguf
from vllmini.models import gguf_cache, gguf_convert
from vllmini.models.gguf_cache import gguf_cache_entry
from vllmini.models.weight_loader import resolve_model_dir


def _twins(tmp_path: Path) -> tuple[Path, Path]:
    """Two different models under one name, of one size and one mtime (a finetune exported under
    the same name, unpacked from an archive or copied with ``cp -p``)."""
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for seed, path in enumerate((a, b)):
        path.parent.mkdir()
        write_tiny_gguf(path, seed=seed)
        os.utime(path, ns=(1_700_000_000_000_000_000,) * 2)
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    return a, b


def test_lookalike_files_get_their_own_conversion(tmp_path: Path) -> None:
    """Before: name, size and mtime made the key, and the second model ran the first one's weights."""
    a, b = _twins(tmp_path)
    cache = tmp_path / "cache"
    assert gguf_cache_entry(a, cache) != gguf_cache_entry(b, cache)
    assert resolve_model_dir(str(a), cache) != resolve_model_dir(str(b), cache)
    assert len(_cache_entries(cache)) == 2
    assert resolve_model_dir(str(a), cache) == gguf_cache_entry(a, cache)  # and each is found again


def test_file_changing_during_conversion_is_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A download still appending to the file: its key named the file as it was when read."""
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path)
    real = gguf_convert._write_weights

    def still_downloading(*args, **kwargs):
        real(*args, **kwargs)
        with open(path, "ab") as f:
            f.write(b"\0" * 4096)

    monkeypatch.setattr(gguf_convert, "_write_weights", still_downloading)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"model\.gguf changed while it was being converted .*still being downloaded"):
        resolve_model_dir(str(path), cache)
    assert _cache_entries(cache) == []


def test_concurrent_conversions_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines started on one new file: one converts, the other waits and reuses it (before,
    both dequantized the whole file, twice the time and, until the rename, twice the disk)."""
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path)
    calls = []

    def slow_convert(gguf_path, out_dir, max_shard_bytes=0, source_stat=None):
        calls.append(out_dir)
        time.sleep(0.5)
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")
        return out_dir

    monkeypatch.setattr(gguf_convert, "convert_gguf", slow_convert)
    cache = tmp_path / "cache"
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_dir(str(path), cache))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [gguf_cache_entry(path, cache)] * 2


def test_incomplete_entry_is_converted_again(tmp_path: Path) -> None:
    """An entry folder without config.json (half deleted by hand, say) is replaced; before, the
    rename into place failed with a bare 'Directory not empty'."""
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path)
    cache = tmp_path / "cache"
    entry = gguf_cache_entry(path, cache)
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"partial")
    assert resolve_model_dir(str(path), cache) == entry
    assert (entry / "config.json").is_file() and _cache_entries(cache) == [entry]


def test_leftovers_of_killed_conversions(tmp_path: Path) -> None:
    """This host's leftovers go when their process is gone; another host's (a cache folder shared
    over NFS, where its pid means nothing here) only when a day old."""
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path)
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)  # fmt: skip
    host = socket.gethostname()
    ours = tmp_path / f".out.tmp-{dead}@{host}-deadbeef"
    theirs = tmp_path / f".out.tmp-{dead}@other-host-cafecafe"
    theirs_old = tmp_path / f".out.tmp-{dead}@other-host-0badf00d"
    for d in (ours, theirs, theirs_old):
        d.mkdir()
    os.utime(theirs_old, (time.time() - 2 * 86400,) * 2)
    gguf_convert.convert_gguf(path, tmp_path / "out")
    assert not ours.exists() and theirs.exists() and not theirs_old.exists()


def test_full_disk_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before writing when the free space is short; a disk that fills up meanwhile is an
    OSError(ENOSPC) naming the file and the folder (safetensors raised its own SafetensorError)."""
    import safetensors.torch
    from safetensors import SafetensorError

    path = tmp_path / "model.gguf"
    write_tiny_gguf(path)
    cache = tmp_path / "cache"
    real_usage = gguf_cache.shutil.disk_usage
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=50_000))
    with pytest.raises(OSError, match=r"model\.gguf: its conversion needs 0\.\d MiB for its weights, but .*cache/gguf has 0\.0 MiB free") as info:
        resolve_model_dir(str(path), cache)
    assert info.value.errno == errno.ENOSPC and "VLLMINI_CACHE" in str(info.value)
    monkeypatch.undo()

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def config_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    for module, name, fails in [(safetensors.torch, "save_file", full), (gguf_convert, "_save_config", config_full)]:
        monkeypatch.setattr(module, name, fails)
        with pytest.raises(OSError, match=rf"model\.gguf: converting it into {cache / 'gguf'} failed: No space left") as info:
            resolve_model_dir(str(path), cache)
        assert info.value.errno == errno.ENOSPC
        assert _cache_entries(cache) == []  # (nor a temporary folder)
        monkeypatch.undo()


def test_cache_path_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    write_tiny_gguf(path)
    (tmp_path / "cache").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=r"model\.gguf: converting it into .*cache/gguf failed: Not a directory"):
        resolve_model_dir(str(path), tmp_path / "cache")


def test_a_replaced_file_replaces_its_conversion(tmp_path: Path) -> None:
    """A new version of a file (a re-export, a re-download) converts anew and its earlier entry is
    deleted (nothing could load it again: a 7B model's is ~28 GB); another file of the same name
    keeps its own, and an entry that recorded no path (made before paths were) is left alone."""
    path, other = tmp_path / "model.gguf", tmp_path / "elsewhere" / "model.gguf"
    other.parent.mkdir()
    write_tiny_gguf(path, seed=0)
    write_tiny_gguf(other, seed=2)
    cache = tmp_path / "cache"
    first, kept = resolve_model_dir(str(path), cache), resolve_model_dir(str(other), cache)
    legacy = cache / "gguf" / "model-0123456789abcdef"
    legacy.mkdir()
    (legacy / "config.json").write_text("{}")
    write_tiny_gguf(path, seed=1)
    second = resolve_model_dir(str(path), cache)
    assert second != first and not first.exists()
    assert _cache_entries(cache) == sorted([second, kept, legacy])
    assert resolve_model_dir(str(path), cache) == second  # (found again, nothing removed)
    assert _cache_entries(cache) == sorted([second, kept, legacy])
