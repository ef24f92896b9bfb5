"""PoolingParams: vLLM's per-request options of the pooling runner (embed, classify, score,
token_embed, token_classify), validated at construction. What the value of a field must also fit
(the model's tasks and hidden size, whether it is matryoshka) is checked when the request is added
(engine/pooler.py)."""
from __future__ import annotations

import msgspec

from vllmini.engine.sampling_params import bad_value, check_truncate_prompt_tokens, is_int


class PoolingParams(msgspec.Struct, omit_defaults=True):
    """``truncate_prompt_tokens``: keep k of the prompt's tokens (-1: max_model_len), its first k, or
    with ``truncation_side="left"`` its last k (vLLM 0.32's side for pooling, and its
    ``tokenization_kwargs`` / server field; ``truncation_side`` is not a field of its PoolingParams).
    ``dimensions``: a matryoshka model's embedding cut to its first d values (then normalized).
    ``normalize``: L2-normalize the embedding; ``use_activation`` is vLLM's newer name for it, and
    for classify / score the only one: the softmax (or sigmoid) over the head's logits.
    None: the engine's ``PoolerConfig`` decides (by default: normalized / activated, full size).
    ``task``: "embed", "classify", "score", "token_embed" or "token_classify" (``LLM.encode``'s
    pooling_task sets it; None: the model's first task). ``dimensions`` and ``normalize`` are
    embed's and token_embed's only."""

    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None  # "right" (None) or "left"
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.truncation_side not in (None, "left", "right"):
            raise bad_value("truncation_side", '"left", "right" or None', self.truncation_side)
        if self.dimensions is not None and (not is_int(self.dimensions) or self.dimensions < 1):
            raise bad_value("dimensions", "a positive integer or None", self.dimensions)
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise bad_value(name, "True, False or None", getattr(self, name))
        if self.task is not None and not isinstance(self.task, str):
            raise bad_value("task", "a pooling task name or None", self.task)
        if None not in (self.normalize, self.use_activation) and self.normalize != self.use_activation:
            raise ValueError("normalize and use_activation (its newer name in vLLM) disagree")

    @property
    def wants_normalize(self) -> bool | None:
        """``normalize``, or ``use_activation`` where only that is given."""
        return self.normalize if self.normalize is not None else self.use_activation

    def clone(self, **changes: object) -> PoolingParams:
        """A copy with ``changes`` applied and validated again (the engine keeps its own)."""
        return msgspec.structs.replace(self, **changes)
