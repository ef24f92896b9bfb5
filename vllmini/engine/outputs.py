"""What the engine hands back, with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from vllmini.lora.request import LoRARequest

if TYPE_CHECKING:
    import torch

    from vllmini.scheduler.sequence import Sequence

_O = TypeVar("_O")


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
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "repetition"
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

    @staticmethod
    def of(seqs: list[Sequence], arrival_time: float, finished: bool) -> RequestMetrics:
        """A request's, from its sequences: first scheduled and first token of any of them, finished
        with the last of them (None until the request is)."""
        return RequestMetrics(
            arrival_time=arrival_time,
            first_scheduled_time=min((s.first_scheduled_time for s in seqs if s.first_scheduled_time), default=None),
            first_token_time=min((s.first_token_time for s in seqs if s.first_token_time), default=None),
            finished_time=max((s.finished_time or 0 for s in seqs), default=None) if finished else None,
            num_preemptions=sum(s.num_preemptions for s in seqs),
            num_cached_tokens=seqs[0].num_cached_tokens,
        )


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


@dataclass
class PoolingOutput:
    """A prompt's pooled vector (vLLM's name): ``data``, a float32 CPU tensor ``[hidden]``
    (``[dimensions]`` for a matryoshka cut, ``[num_labels]`` for a classifier); the token tasks'
    ``[num_prompt_tokens, hidden | dimensions | num_labels]``."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput(Generic[_O]):
    """What ``LLM.encode`` and ``AsyncLLMEngine.encode`` return, in vLLM's positional order. A
    pooling request reports once, when its prompt is computed; one aborted before that reports
    ``outputs=None``. (No finish_reason, as in vLLM.)"""

    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0  # prompt tokens from the prefix cache (LAST pooling only)
    finished: bool = True


@dataclass
class EmbeddingOutput:
    """An embedding as a list of floats (``LLM.embed``'s ``.outputs``)."""

    embedding: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> EmbeddingOutput:
        return EmbeddingOutput(_vector(pooling_output, "embedding"))

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """``LLM.embed``'s output per prompt: ``.outputs.embedding``."""

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return _typed(EmbeddingRequestOutput, request_output, EmbeddingOutput.from_base(request_output.outputs))


@dataclass
class ClassificationOutput:
    """A prompt's class probabilities (``LLM.classify``'s ``.outputs``; the logits with
    ``use_activation=False``)."""

    probs: list[float]

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ClassificationOutput:
        return ClassificationOutput(_vector(pooling_output, "probability"))

    @property
    def num_classes(self) -> int:
        return len(self.probs)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """``LLM.classify``'s output per prompt: ``.outputs.probs``."""

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return _typed(ClassificationRequestOutput, request_output, ClassificationOutput.from_base(request_output.outputs))


@dataclass
class ScoringOutput:
    """A pair's score (``LLM.score``'s ``.outputs``): the cosine similarity of two embeddings, or a
    cross-encoder's relevance."""

    score: float

    @staticmethod
    def from_base(pooling_output: PoolingOutput) -> ScoringOutput:
        if pooling_output.data.numel() != 1:
            raise ValueError("pooled data should be a scalar score")
        return ScoringOutput(pooling_output.data.item())


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """``LLM.score``'s output per pair: ``.outputs.score``."""

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ScoringRequestOutput:
        return _typed(ScoringRequestOutput, request_output, ScoringOutput.from_base(request_output.outputs))


def _vector(pooling_output: PoolingOutput, what: str) -> list[float]:
    if pooling_output.data.ndim != 1:
        raise ValueError(f"pooled data should be a 1-D {what} vector")
    return pooling_output.data.tolist()


_R = TypeVar("_R", bound=PoolingRequestOutput)


def _typed(cls: type[_R], base: PoolingRequestOutput, outputs: object) -> _R:
    """``base`` as the task's own output class (vLLM's ``*RequestOutput.from_base``)."""
    return cls(base.request_id, outputs, base.prompt_token_ids, base.num_cached_tokens, base.finished)
