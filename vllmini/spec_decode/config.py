"""``EngineArgs.speculative_config``: vLLM's dict (or its JSON text, as the CLI passes it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllmini.config import config_fields

METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` "ngram" (prompt lookup): the last ``prompt_lookup_min``..``prompt_lookup_max``
    tokens are looked up earlier in the sequence (prompt and output), and the
    ``num_speculative_tokens`` tokens that followed there are proposed. Unset lookup bounds
    follow vLLM: both 5, or the one given for both. ``disable_by_batch_size``: while more
    requests than this are unfinished (running or waiting), no drafts are proposed (vLLM decides
    per request as it arrives; here it is decided every step, so a batch that drains speculates
    again)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # drafts cost a forward's compute: past this many unfinished requests none are proposed (a full
    # batch gains little, since the batch lasts as long as its slowest sequence)
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: dict[str, Any] | str | SpeculativeConfig) -> SpeculativeConfig:
        """Checked, with the defaults filled in; a ValueError names the bad field."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = config_fields(value, "speculative_config", cls)
        if value.get("method", "ngram") not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)} (no draft models here), "
                             f"got {value.get('method')!r}")  # fmt: skip
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        least = {"num_speculative_tokens": 1, "prompt_lookup_max": 1, "prompt_lookup_min": 1, "disable_by_batch_size": 2}
        for name, lowest in least.items():
            v = value.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lowest):
                raise ValueError(f"speculative_config.{name} must be an integer >= {lowest}, got {v!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
        config = cls(value["num_speculative_tokens"], value.get("method", "ngram"), hi, lo,
                     value.get("disable_by_batch_size"))  # fmt: skip
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return config
