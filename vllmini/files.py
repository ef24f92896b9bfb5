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
