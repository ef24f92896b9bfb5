"""Released config.json values that transformers' strict config classes now refuse, rewritten to
what the old code read them as, so that the release loads as published (no hand-edit needed).

Llama 4 Scout / Maverick publish ``"attn_temperature_tuning": 4`` in ``text_config``: transformers
4.51 only tested it for truth, 5.x types the field as a bool and refuses an int. vllmini reads the
repaired config for the model and hands the same one to the tokenizer (AutoTokenizer reads
config.json too, to find its model type)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

# model_type -> fields read as truth values by the code the release was made for
TRUTH_FIELDS: dict[str, tuple[str, ...]] = {"llama4_text": ("attn_temperature_tuning",)}
NESTED = ("text_config",)


def repaired(raw: dict) -> dict | None:
    """``raw`` (config.json) with its legacy values rewritten (a copy); None when nothing needs it."""
    fixed, changed = copy.deepcopy(raw), False
    for part in (fixed, *(fixed.get(k) for k in NESTED)):
        if not isinstance(part, dict):
            continue
        for field in TRUTH_FIELDS.get(part.get("model_type", ""), ()):
            if field in part and not isinstance(part[field], bool):
                part[field], changed = bool(part[field]), True
    return fixed if changed else None


def repaired_config(raw: dict) -> Any | None:
    """The transformers config built from ``raw`` (config.json) repaired; None when it needs no repair."""
    from transformers import AutoConfig

    fixed = repaired(raw)
    if fixed is None or not isinstance(fixed.get("model_type"), str):
        return None
    model_type = fixed.pop("model_type")
    return AutoConfig.for_model(model_type, **fixed)


def tokenizer_config_override(model_dir: Path | str) -> dict[str, Any]:
    """``{"config": ...}`` for AutoTokenizer when ``model_dir``'s config.json needs a repair, else
    ``{}`` (a missing or unreadable config.json is the tokenizer's own business)."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    fixed = repaired_config(raw) if isinstance(raw, dict) else None
    return {} if fixed is None else {"config": fixed}
