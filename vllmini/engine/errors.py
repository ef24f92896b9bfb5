"""The engine's own exception."""
from __future__ import annotations


class StepError(RuntimeError):
    """The forward of one step failed; its requests were aborted (the engine is still usable)."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"forward failed for requests {request_ids}: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause
