"""Which runner an engine is (vLLM's ``runner`` / older ``task``: generate or pooling) and, for
pooling, how hidden states become a vector (vLLM's ``PoolerConfig``): resolved from
``EngineArgs`` and the checkpoint's architecture."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllmini.config_fields import config_fields

if TYPE_CHECKING:
    from vllmini.config import EngineArgs

POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolerConfig:
    """How the pooling runner turns a prompt's hidden states into one vector (vLLM's
    ``PoolerConfig``): ``pooling_type`` LAST | MEAN | CLS, ``normalize`` (L2; ``use_activation`` is
    vLLM's newer name for it, either may be given) and ``dimensions`` (the default matryoshka size
    of every request). A field left None takes what the model's sentence-transformers files say,
    else vLLM's default for decoder models: LAST, normalized, full size (engine/pooler.py)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            kind = self.pooling_type.upper() if isinstance(self.pooling_type, str) else None
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type must be one of {list(POOLING_TYPES)}, got {self.pooling_type!r}")
            self.pooling_type = kind
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"pooler_config.{name} must be True, False or None, got {getattr(self, name)!r}")
        if None not in (self.normalize, self.use_activation) and self.normalize != self.use_activation:
            raise ValueError("pooler_config: normalize and use_activation (its newer name) disagree")
        if self.normalize is None:
            self.normalize = self.use_activation
        self.use_activation = self.normalize
        dims = self.dimensions
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            raise ValueError(f"pooler_config.dimensions must be a positive integer or None, got {dims!r}")

    @classmethod
    def coerce(cls, value: PoolerConfig | dict | str | None) -> PoolerConfig | None:
        """``EngineArgs.pooler_config`` as given: a PoolerConfig, a dict of its fields, or their JSON
        text (the command line's ``--pooler-config '{"pooling_type": "MEAN"}'``, as vLLM's)."""
        if value is None or isinstance(value, PoolerConfig):
            return value
        return cls(**config_fields(value, "pooler_config", cls))


RUNNERS = ("auto", "generate", "pooling")
# vLLM's older ``task`` -> the runner it picks (its "reward" and "transcription" are not built here)
_TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "embedding": "pooling", "classify": "pooling",
                 "score": "pooling"}  # fmt: skip


def resolve_runner(args: EngineArgs, architectures: list[str] | None) -> str:
    """"generate" or "pooling", as vLLM resolves ``runner`` (and the older ``task``): "auto" is
    "pooling" for an architecture without a language-model head (``*Model``: MistralModel,
    Qwen3Model, ...; ``*ForSequenceClassification``), else "generate". ``task`` "classify" /
    "score" needs a classifier checkpoint and "embed" a model without one (vLLM's ``convert``,
    which would add or drop the head, is not built)."""
    from vllmini.models.registry import is_classifier_architecture, is_pooling_architecture

    runner = args.runner if args.task is None else _TASK_RUNNERS[args.task]  # (validate() checked they agree)
    headless = is_pooling_architecture(architectures)
    classifier = is_classifier_architecture(architectures)
    if args.task in ("classify", "score") and not classifier:
        raise ValueError(f"task={args.task!r} needs a *ForSequenceClassification checkpoint; architecture "
                         f"{architectures} has no classifier head (vLLM's convert='classify' is not built)")  # fmt: skip
    if args.task in ("embed", "embedding") and classifier:
        raise ValueError(f"task={args.task!r}: architecture {architectures} is a classifier (use task='classify' "
                         "or 'score'; vLLM's convert='embed' is not built)")  # fmt: skip
    if runner == "auto":
        return "pooling" if headless else "generate"
    if runner == "generate" and headless:
        raise ValueError(f"architecture {architectures} has no language-model head, so it cannot generate; "
                         "use runner='pooling' (embeddings, or classification for a classifier)")  # fmt: skip
    return runner
