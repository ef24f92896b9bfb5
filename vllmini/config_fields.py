"""Reading a config that may come as its dataclass, a dict of its fields, or their JSON text
(vLLM's command line passes JSON: ``--pooler-config '{...}'``). Its own module so that every
config (pooling, structured outputs, reasoning, profiler, speculative decoding) reads alike
without importing ``vllmini.config``, which imports them."""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Any


def config_fields(value: Any, name: str, cls: type) -> dict[str, Any]:
    """A config given as a dict of the dataclass ``cls``'s fields or as its JSON text (vLLM's
    command line passes JSON: ``--pooler-config '{...}'``), checked for unknown fields."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a {cls.__name__}, a dict of its fields or their JSON text, got {value!r}")
    known = {f.name for f in fields(cls)}
    if unknown := sorted(set(value) - known, key=str):
        raise ValueError(f"{name} has unknown or unsupported field(s) {unknown}; accepted: {sorted(known)}")
    return value
