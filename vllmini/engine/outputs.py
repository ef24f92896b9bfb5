"""What the engine hands back, with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllmini.lora.request import LoRARequest


class Logprob(float):
    """One token's logprob, as vLLM reports it: ``.logprob``, ``.rank`` (1-based, ties counted
    as vLLM does: how many tokens have a logprob >= this one) and ``.decoded_token`` (None when
    the request has detokenize=False). It is also the float itself, so ``entry[token]`` works
    in arithmetic without ``.logprob``; for the same reason it compares, hashes and JSON-encodes
    as that float (``json.dumps`` writes the number; rank and decoded_token are attributes)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank = rank
        self.decoded_token = decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"

    def __reduce__(self) -> tuple:
        return Logprob, (float(self), self.rank, self.decoded_token)


# one position's logprobs: the actual token first, then the top-N (vLLM's shape)
LogprobsEntry = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[LogprobsEntry] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic()) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """vLLM's fields in vLLM's positional order (request_id, prompt, prompt_token_ids,
    prompt_logprobs, outputs, finished, metrics), so that code building one by position, as
    vLLM's own tests and mocks do, gets the same object."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one dict per token
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    lora_request: LoRARequest | None = None  # the adapter it ran with (None: the base model)
    num_cached_tokens: int | None = field(default=None, kw_only=True)  # prompt tokens from the prefix cache
