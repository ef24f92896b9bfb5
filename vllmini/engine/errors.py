"""The engine's own exception."""
from __future__ import annotations


class StepError(RuntimeError):
    """One step's forward (or its sampling) failed; its requests were aborted (the engine is still usable)."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"step failed for requests {request_ids}: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause
