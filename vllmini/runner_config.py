"""Which runner an engine is (vLLM's ``runner`` / older ``task``: generate or pooling), how a model
is adapted to pooling (vLLM's ``convert``: embed or classify) and how hidden states become a
vector (vLLM's ``PoolerConfig``): resolved from ``EngineArgs`` and the checkpoint's architecture."""
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
# vLLM's ``convert``: how a model is adapted to the pooling runner; "auto" picks "none" for a pooling
# architecture (a *Model or *ForSequenceClassification one), else "embed"
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM's older ``task`` -> the runner it picks (its "reward" and "transcription" are not built here)
_TASK_RUNNERS = {"generate": "generate", "embed": "pooling", "embedding": "pooling", "classify": "pooling",
                 "score": "pooling"}  # fmt: skip
# ... and the convert it implies (as vLLM's deprecated task did)
_TASK_CONVERTS = {"embed": "embed", "embedding": "embed", "classify": "classify", "score": "classify"}


def _given_convert(args: EngineArgs) -> str:
    """``convert``, or the one the older ``task`` implies (validate() checked that they agree)."""
    return args.convert if args.convert != "auto" or args.task is None else _TASK_CONVERTS.get(args.task, "auto")


def resolve_runner(args: EngineArgs, architectures: list[str] | None) -> str:
    """"generate" or "pooling", as vLLM resolves ``runner`` (and the older ``task``): "auto" is
    "pooling" for an architecture without a language-model head (``*Model``: MistralModel,
    Qwen3Model, ...; ``*ForSequenceClassification``) or when ``convert`` adapts the model to
    pooling ("embed", "classify"), else "generate"."""
    from vllmini.models.registry import is_pooling_architecture

    runner = args.runner if args.task is None else _TASK_RUNNERS[args.task]  # (validate() checked they agree)
    headless = is_pooling_architecture(architectures)
    convert = _given_convert(args)
    if runner == "auto":
        runner = "pooling" if headless or convert in ("embed", "classify") else "generate"
    if runner == "generate" and headless:
        raise ValueError(f"architecture {architectures} has no language-model head, so it cannot generate; "
                         "use runner='pooling' (embeddings, or classification for a classifier)")  # fmt: skip
    if runner == "generate" and convert in ("embed", "classify"):
        raise ValueError(f"convert={convert!r} adapts a model to runner='pooling', not runner='generate'")
    return runner


def resolve_convert(args: EngineArgs, architectures: list[str] | None, runner: str) -> str:
    """vLLM's ``convert`` resolved for ``runner``: "none" (the architecture is used as it is),
    "embed" (a ``*ForCausalLM`` or ``*Model`` body pools hidden states into embeddings, its lm_head
    dropped) or "classify" (the body under a ``score`` head: from the checkpoint, or built from
    lm_head rows by ``classifier_from_token``, models/seq_cls_from_lm.py; the architecture is then
    read as its ``*ForSequenceClassification``). "auto": "none" for a pooling architecture, else
    "embed". A classifier checkpoint cannot be turned into an embedding model here, and a causal LM
    needs a convert to pool, as in vLLM."""
    from vllmini.models.registry import classifier_architecture, is_classifier_architecture, is_pooling_architecture

    convert = _given_convert(args)
    if runner == "generate":
        return "none"
    classifier = is_classifier_architecture(architectures)
    if convert == "auto":
        return "none" if is_pooling_architecture(architectures) else "embed"
    if convert == "none" and not is_pooling_architecture(architectures):
        raise ValueError(f"architecture {architectures} is a causal LM, not a pooling model: runner='pooling' with "
                         "convert='none' cannot run it; pass convert='embed' or 'classify' (or 'auto')")  # fmt: skip
    if convert == "embed" and classifier:
        spelled = f"task={args.task!r}" if args.task is not None and args.convert == "auto" else "convert='embed'"
        raise ValueError(f"{spelled}: architecture {architectures} is a classifier (use task='classify' or "
                         "'score'); turning a classifier into an embedding model is not built")  # fmt: skip
    if convert == "classify" and not classifier and classifier_architecture(architectures) is None:
        raise ValueError(f"convert='classify' is not built for architecture {architectures} (it has no "
                         "*ForSequenceClassification counterpart here)")  # fmt: skip
    return convert
