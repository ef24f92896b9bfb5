"""``EngineArgs.speculative_config``: vLLM's dict (or its JSON text, as the CLI passes it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllmini.config_fields import config_fields

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` "ngram" (prompt lookup): the last ``prompt_lookup_min``..``prompt_lookup_max``
    tokens are looked up earlier in the sequence (prompt and output), and the
    ``num_speculative_tokens`` tokens that followed there are proposed. Unset lookup bounds
    follow vLLM: both 5, or the one given for both. ``disable_by_batch_size``: while more
    requests than this are unfinished (running or waiting), no drafts are proposed (vLLM decides
    per request as it arrives; here it is decided every step, so a batch that drains speculates
    again).

    ``method`` "draft_model" (vLLM's): ``model`` (a folder, a hub id, a GGUF file or "default",
    as ``EngineArgs.model``) drafts greedily with its own KV cache on the target's blocks
    (spec_decode/draft_model.py). Given a ``model`` and no ``method``, the method is
    "draft_model", as vLLM infers it for a plain checkpoint."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # drafts cost a forward's compute: past this many unfinished requests none are proposed (a full
    # batch gains little, since the batch lasts as long as its slowest sequence)
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model (method "draft_model")

    @classmethod
    def parse(cls, value: dict[str, Any] | str | SpeculativeConfig) -> SpeculativeConfig:
        """Checked, with the defaults filled in; a ValueError names the bad field."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = config_fields(value, "speculative_config", cls)
        model = value.get("model")
        if model in ("ngram", "[ngram]"):  # vLLM's older spelling of the n-gram method
            model = None
        method = value.get("method") or ("draft_model" if model is not None else "ngram")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)} (EAGLE, Medusa and MTP are "
                             f"not built), got {value.get('method')!r}")  # fmt: skip
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config.model (the draft model: a folder, a hub id, a .gguf file or "
                                 f"'default') is required for method 'draft_model', got {model!r}")  # fmt: skip
            for name in ("prompt_lookup_max", "prompt_lookup_min"):
                if value.get(name) is not None:
                    raise ValueError(f"speculative_config.{name} applies to method 'ngram' only, not 'draft_model'")
        elif model is not None:
            raise ValueError(f"speculative_config.model={model!r} is for method 'draft_model', not {method!r}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        least = {"num_speculative_tokens": 1, "prompt_lookup_max": 1, "prompt_lookup_min": 1, "disable_by_batch_size": 2}
        for name, lowest in least.items():
            v = value.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lowest):
                raise ValueError(f"speculative_config.{name} must be an integer >= {lowest}, got {v!r}")
        if method == "draft_model":
            return cls(value["num_speculative_tokens"], method, disable_by_batch_size=value.get("disable_by_batch_size"),
                       model=model)  # fmt: skip
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
        config = cls(value["num_speculative_tokens"], method, hi, lo,
                     value.get("disable_by_batch_size"))  # fmt: skip
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return config
