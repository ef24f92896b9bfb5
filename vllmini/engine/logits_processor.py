"""Custom logits processors, vLLM v1's programming model (``vllm.v1.sample.logits_processor``).

A logits processor is a class given to the engine at start-up
(``LLM(model, logits_processors=[MyProcessor])``, or ``"package.module.MyProcessor"``); the
engine makes one instance and, at every step that samples, tells it how the batch changed
(``update_state``) and hands it the batch's logits (``apply``), one row per sequence, in the
order of a *persistent batch*: a sequence keeps its row index from step to step until it
leaves; a leaving sequence's index is refilled by a new one or by the batch's last row moving
down (vLLM's condensing). So a processor keeps per-request settings in a dict keyed by row index
and updates it from ``BatchUpdate``: first ``removed``, then ``added``, then ``moved``.

Per-request arguments travel in ``SamplingParams.extra_args`` (the server's ``vllm_xargs``);
``validate_params`` checks them when the request is added, so a bad one is refused there.
:class:`AdapterLogitsProcessor` wraps vLLM's older per-request form, a function of the
output token ids (and optionally the prompt's) and one row of logits.

Where they run here: on each sampled row's logits after the structured-output mask,
``logit_bias``, ``allowed_token_ids`` and the bans (bad words, ``min_tokens``), before the
penalties and temperature, as vLLM runs its non-argmax-invariant processors. A processor
that declares itself argmax-invariant is skipped in a step where every row is greedy (as in
vLLM), and otherwise runs at that same place (vLLM runs those after temperature).
"""
from __future__ import annotations

import enum
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from vllmini.engine.sampling_params import SamplingParams

T = TypeVar("T")

# (index, params, prompt token ids, output token ids): the output list is the sequence's own,
# which grows as it decodes (read it, never change it)
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # the request at ``src`` moves to ``dst``; ``src`` is then empty
    SWAP = enum.auto()  # the requests at the two indices trade places


MovedRequest = tuple[int, int, MoveDirectionality]  # (src, dst, how)


@dataclass(frozen=True)
class BatchUpdate:
    """How the persistent batch changed since the last ``update_state``: apply ``removed``,
    then ``added`` (an index may be reused), then ``moved``. ``batch_size``: rows now."""

    batch_size: int
    removed: Sequence[int]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Subclass and implement ``__init__(vllm_config, device, is_pin_memory)``,
    ``is_argmax_invariant``, ``update_state`` and ``apply`` (and ``validate_params`` to refuse
    bad ``extra_args``). ``vllm_config`` is the engine's ``EngineArgs`` here (vLLM passes its
    ``VllmConfig``)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:  # noqa: B027 (optional hook)
        """Raise ValueError (naming the argument) for parameters this processor cannot use."""

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform ``logits`` [batch_size, vocab] (fp32; in place is fine) and return them."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if it never changes a row's highest-logit token (then greedy-only steps skip it)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before each ``apply``; None: the batch did not change (output lists may have grown)."""
        raise NotImplementedError


def process_dict_updates(
    req_state: dict[int, T], batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:  # fmt: skip
    """Keep ``req_state`` (row index -> a request's setting) in step with ``batch_update``:
    ``new_state(params, prompt_ids, output_ids)`` gives an added request's setting (None: the
    processor leaves that request alone). Returns whether anything changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_state.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_state[index] = state
            changed = True
        elif req_state.pop(index, None) is not None:  # it replaced a request that had a setting
            changed = True
    for src, dst, how in batch_update.moved:
        a, b = req_state.pop(src, None), req_state.pop(dst, None)
        if a is not None:
            req_state[dst] = a
        if b is not None and how is MoveDirectionality.SWAP:
            req_state[src] = b
        changed |= a is not None or b is not None
    return changed


# vLLM's per-request form: fn(output_ids, logits_row) or fn(prompt_ids, output_ids, logits_row)
RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch processor built from a per-request one: implement ``is_argmax_invariant`` and
    ``new_req_logits_processor(params)`` (the request's function, or None to leave it alone);
    each function then runs on its own row, one call per row and step."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.vllm_config, self.device, self.is_pin_memory = vllm_config, device, is_pin_memory
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _bind(self, params: SamplingParams, prompt_ids: list[int] | None,
              output_ids: list[int]) -> Callable[[torch.Tensor], torch.Tensor] | None:  # fmt: skip
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        if len(inspect.signature(fn).parameters) == 3:
            return lambda row: fn(prompt_ids, output_ids, row)
        return lambda row: fn(output_ids, row)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._bind)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, fn in self.req_info.items():
            logits[index] = fn(logits[index])
        return logits
