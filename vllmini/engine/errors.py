"""The engine's own exception."""
from __future__ import annotations


class StepError(RuntimeError):
    """One step's forward (or its sampling) failed; its requests were aborted (the engine is still usable)."""

    def __init__(self, request_ids: list[str], cause: Exception) -> None:
        super().__init__(f"step failed for requests {request_ids}: {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


class VLLMValidationError(ValueError):
    """A bad request value, with the field at fault (vLLM's class and fields): the server answers a
    400 whose ``error.param`` names it, as vLLM's does. A ValueError, so that callers of the offline
    API catch it as any other bad value."""

    def __init__(self, message: str, *, parameter: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value
