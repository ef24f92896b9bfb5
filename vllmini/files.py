"""Options that take either a text or the path of a file holding it (a chat template, a JSON
schema, a grammar): one rule for telling them apart."""
from __future__ import annotations

from pathlib import Path


def read_if_file(value: str) -> str | None:
    """The text of the file ``value`` names (``~`` expanded), or None when it names no file:
    the value is then the text itself (one too long, or too odd, to be a path names none)."""
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # e.g. a name too long for a path (ENAMETOOLONG)
        return None
    return path.read_text(encoding="utf-8") if is_file else None


def foreign_file_hint(head: bytes) -> str | None:
    """What a downloaded model file really is when its first bytes are those of the two usual
    stand-ins for it (None: neither): a Git LFS pointer (a repository cloned without git-lfs)
    or a web page (a link to huggingface.co's file page saved instead of the file)."""
    if head.startswith(b"version https://git-lfs"):
        return ("it is a Git LFS pointer (a small text file), not the file itself: the repository was cloned "
                "without Git LFS; fetch the file with `git lfs pull` or `huggingface-cli download`")
    if head.lstrip()[:14].lower().startswith((b"<!doctype html", b"<html")):
        return ("it is an HTML page, not the file: a web page was saved in its place (on huggingface.co, "
                "download .../resolve/main/<file>, not .../blob/main/<file>)")
    return None
