"""A sequence's state machine: WAITING -> RUNNING -> FINISHED_*, with preemption back to WAITING.

The scheduler only moves sequences between states and counts tokens; it never
touches tensors. ``num_computed_tokens`` is how many of ``token_ids`` already have
their K/V in the cache: the unit of progress for chunked prefill, decode and recompute.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # e.g. NaN logits: this sequence ends, the engine goes on
    FINISHED_REPETITION = "repetition"  # its output fell into a loop (SamplingParams.repetition_detection)

    @property
    def finished(self) -> bool:
        return self is not SequenceStatus.WAITING and self is not SequenceStatus.RUNNING


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: Any  # SamplingParams; the scheduler reads nothing from it
    max_tokens: int  # resolved: params.max_tokens, or what max_model_len leaves
    index: int = 0  # which of the request's n completions
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # scheduling_policy="priority": lower is served first (vLLM's convention)
    lora: Any = None  # its LoRA adapter (lora/adapter.py), None: the base model; the scheduler reads lora_key
    cache_salt: str | None = None  # its prompt's (vLLM's): prefix-cache hits only among requests with the same
    # the prompt as embeddings [num_prompt_tokens, hidden] (engine/prompt_embeds.py); its prompt_token_ids
    # are then placeholders, which the forward replaces and nothing else reads
    prompt_embeds: Any = None
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission
    num_preemptions: int = 0
    # prompt_logprobs: the first prompt position whose logits are still wanted (None: none are).
    # Positions before it are recorded; the scheduler takes no prefix-cache hit past it.
    prompt_logits_from: int | None = None
    # a pooling request that needs every prompt position computed (vLLM's name): no prefix-cache hit
    skip_reading_prefix_cache: bool = False
    # speculative decoding: the tokens guessed to follow (spec_decode/), verified at its next decode
    spec_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None  # the inter-token latency metric's clock
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_ids: list[int] = []  # token_ids past the prompt, kept apart: read every step

    @property
    def lora_key(self) -> int:
        """Its adapter's key (0: none; unique per loaded adapter): the scheduler caps the adapters
        running at once, and the prefix cache keeps each adapter's blocks apart (``prefix_root``)."""
        return 0 if self.lora is None else self.lora.key

    @property
    def known_prompt_ids(self) -> list[int]:
        """The prompt's token ids for what reads them (penalties, the thinking budget): none for a
        prompt given as embeddings."""
        return [] if self.prompt_embeds is not None else self.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens: the sequence's own list (no copy), for reading only."""
        return self._output_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def prompt_logits_rows(self, start: int, num_new: int) -> int:
        """How many prompt positions a chunk of ``num_new`` tokens from ``start`` scores."""
        if self.prompt_logits_from is None:
            return 0
        return max(0, min(start + num_new, self.num_prompt_tokens - 1) - max(start, self.prompt_logits_from))

    def cap_prompt_logits_rows(self, start: int, num_new: int, rows: int) -> int:
        """The longest chunk (at most ``num_new``) from ``start`` that scores at most ``rows``
        prompt positions (positions already scored, before ``prompt_logits_from``, are free)."""
        assert self.prompt_logits_from is not None
        return min(num_new, max(0, self.prompt_logits_from - start) + rows)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self._output_ids.append(token_id)
        self.last_token_time = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

    def finish(self, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        self.status = status
        self.stop_reason = stop_reason
        self.finished_time = time.monotonic()
