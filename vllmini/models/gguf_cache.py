"""The cache of converted GGUF files: which folder holds a file's conversion, and how it gets
there exactly once, whole, even with several processes (or hosts sharing the folder) at it.

  * the key is the file's name, size and mtime (cheap) plus a sample of its content: two files
    of one name, size and mtime (a finetune exported under the same name, then extracted from an
    archive or copied with ``cp -p``) once shared one conversion, and the second model silently
    ran the first one's weights;
  * one process converts, the others wait on a lock instead of dequantizing the same GBs at once;
  * a conversion goes to a temporary sibling renamed into place at the end; one left by a killed
    process is deleted by the next conversion on the same host (a host sharing the cache folder
    over NFS may still be writing its own), and a file that changed while it was read is refused;
  * the disk's free space is checked before the (mostly fp32, ~4x a 4-bit file) weights are written, and
    a full disk is reported as such, naming the file and the folder;
  * each entry records the path it was converted from (``SOURCE_FILE``), and a new conversion of
    that path deletes the entries of its earlier versions (a file replaced, an older converter):
    nothing could load them again, and a 7B model's is ~28 GB.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Iterator

logger = logging.getLogger(__name__)

_SAMPLES, _SAMPLE_BYTES = 16, 64 << 10  # 1 MiB read per key: milliseconds, even for a 40 GB file
_FOREIGN_TMP_AGE_S = 24 * 3600  # another host's leftover: older than any conversion takes
SOURCE_FILE = "vllmini_source.json"  # in each entry: {"path": the GGUF file's absolute path}


def gguf_cache_entry(gguf_path: Path, cache_dir: Path, st: os.stat_result | None = None) -> Path:
    """Cache folder for a GGUF file, keyed on name, size, mtime (of ``st``, its stat, when given), a
    content sample and the converter version (cheap to compute, unlike hashing a multi-GB file)."""
    from vllmini.models.gguf_convert import CONVERTER_VERSION

    st = st or gguf_path.stat()
    key = f"{gguf_path.name}|{st.st_size}|{st.st_mtime_ns}|{_content_sample(gguf_path, st.st_size)}|v{CONVERTER_VERSION}"
    return Path(cache_dir) / "gguf" / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _content_sample(path: Path, size: int) -> str:
    """sha256 of 16 evenly spaced 64 KiB pieces, the first and the last included."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()


def converted_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """The HF-format folder of ``gguf_path`` in ``cache_dir``, converted first when absent."""
    from vllmini.models.gguf_convert import convert_gguf

    source = gguf_path.stat()
    entry = gguf_cache_entry(gguf_path, cache_dir, source)
    if (entry / "config.json").is_file():
        return entry
    with cache_errors(gguf_path, entry.parent):
        entry.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(entry):
        if (entry / "config.json").is_file():  # converted by the process we waited for
            return entry
        if entry.exists():  # not ours (we rename whole folders into place): tampered with, or half deleted
            logger.warning("%s is incomplete (no config.json); converting again", entry)
            _remove(entry)
        logger.info("converting %s into %s (once; later runs reuse it)", gguf_path, entry)
        convert_gguf(gguf_path, entry, source_stat=source)
    remove_earlier_versions(gguf_path, entry)
    return entry


def write_source(folder: Path, gguf_path: Path) -> None:
    """Record in a conversion's folder the path of the GGUF file it came from."""
    (folder / SOURCE_FILE).write_text(json.dumps({"path": str(Path(gguf_path).absolute())}))


def remove_earlier_versions(gguf_path: Path, entry: Path) -> None:
    """Delete the other entries converted from this same path (the path as given: a symlink's
    target may change): earlier versions of the file, or an older converter's output. Entries
    made before the path was recorded are left alone (their file cannot be told)."""
    source, prefix = str(Path(gguf_path).absolute()), f"{gguf_path.stem}-"
    for other in entry.parent.iterdir():
        if other == entry or not other.name.startswith(prefix) or not (other / SOURCE_FILE).is_file():
            continue
        try:
            recorded = json.loads((other / SOURCE_FILE).read_text()).get("path")
        except (OSError, ValueError, AttributeError):
            continue
        if recorded == source:
            logger.info("removing %s, the conversion of an earlier version of %s", other, gguf_path)
            with contextlib.suppress(OSError):
                _remove(other)
                (entry.parent.parent / ".locks" / f"{other.name}.lock").unlink(missing_ok=True)


@contextlib.contextmanager
def _conversion_lock(entry: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<cache>/.locks/<entry>.lock`` (kept: deleting a lock file races with
    its next user); where the file system has no locks (some network ones), conversions run
    unlocked (the rename into place still settles it)."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        (locks := entry.parent.parent / ".locks").mkdir(exist_ok=True)
        fd = os.open(locks / f"{entry.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting into %s", entry)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # ENOLCK and friends: no locking here
            pass
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _remove(path: Path) -> None:
    """Rename aside, then delete: a half-deleted folder never sits under a name that is in use."""
    aside = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def tmp_dir(out_dir: Path) -> Path:
    """A fresh temporary sibling of ``out_dir``, named after this host and process."""
    return out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}@{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def remove_stale_tmp(out_dir: Path) -> None:
    """Delete temporary folders left by conversions whose process was killed (they can be GBs):
    this host's when their process is gone, another host's when older than a day."""
    host = socket.gethostname()
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        owner = stale.name.rsplit(".tmp-", 1)[1]
        pid, at, rest = owner.partition("@")
        if not at:  # named before hosts were (pid-uuid)
            pid = owner.split("-")[0]
        elif rest.rsplit("-", 1)[0] != host:
            with contextlib.suppress(OSError):
                if time.time() - stale.stat().st_mtime > _FOREIGN_TMP_AGE_S:
                    shutil.rmtree(stale, ignore_errors=True)
            continue
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_unchanged(gguf_path: Path, before: os.stat_result) -> None:
    """Refuse a conversion whose source changed while it was read (a download or copy still
    running, a file replaced): its cache key names the file as it was."""
    now = gguf_path.stat()
    if (now.st_size, now.st_mtime_ns, now.st_ino, now.st_dev) != \
            (before.st_size, before.st_mtime_ns, before.st_ino, before.st_dev):  # fmt: skip
        raise ValueError(f"{gguf_path} changed while it was being converted (from {before.st_size} to "
                         f"{now.st_size} bytes; still being downloaded or copied?); run again once it is complete")  # fmt: skip


def check_free_space(gguf_path: Path, folder: Path, nbytes: int) -> None:
    """Refuse before writing when ``folder``'s file system has less than ``nbytes`` free."""
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"{gguf_path}: its conversion needs {_size(nbytes)} for its weights, but "
                      f"{folder} has {_size(free)} free; {_WHERE}")  # fmt: skip


_WHERE = "free some space there, or pick another cache folder (VLLMINI_CACHE, or EngineArgs.cache_dir / --cache-dir)"


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


@contextlib.contextmanager
def cache_errors(gguf_path: Path, folder: Path) -> Iterator[None]:
    """A write into the cache that fails (a full disk, a folder not writable) says which GGUF file
    was being converted and where; safetensors reports a full disk as its own SafetensorError."""
    try:
        yield
    except Exception as exc:
        full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "os error 28" in str(exc)
        if full:
            raise OSError(errno.ENOSPC, f"{gguf_path}: converting it into {folder} failed: No space left on "
                          f"device; {_WHERE}") from exc  # fmt: skip
        if isinstance(exc, OSError) and exc.errno is not None:
            raise type(exc)(exc.errno, f"{gguf_path}: converting it into {folder} failed: {exc.strerror}"
                            + (f" ({exc.filename})" if exc.filename else "")) from exc  # fmt: skip
        raise
