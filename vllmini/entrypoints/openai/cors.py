"""Cross-origin requests (CORS), for a web page that calls the server from the browser.

vLLM's flags: ``--allowed-origins``, ``--allowed-methods`` and ``--allowed-headers`` (JSON lists)
and ``--allow-credentials``. vLLM answers every origin by default; here the server sends no CORS
headers until ``--allowed-origins`` is given (it listens on 127.0.0.1, and a page from any site
must not be able to drive it unasked). Starlette's ``CORSMiddleware`` does the work.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware


@dataclass(frozen=True)
class CorsOptions:
    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str) or not value or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"{name} must be a non-empty list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("allow_credentials with allowed_origins ['*'] would let every site send requests "
                             "with the user's credentials; list the origins instead")  # fmt: skip

    def middleware(self) -> Middleware:
        return Middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                          allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                          allow_credentials=self.allow_credentials)  # fmt: skip


def json_list(flag: str, text: str | None) -> list[str] | None:
    """A flag's JSON list (``'["https://a.example"]'``), as vLLM's; None when not given."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list):
        raise ValueError(f"{flag} must be a JSON list of strings, e.g. '[\"http://localhost:3000\"]', got {text!r}")
    return value


def cors_from_flags(origins: str | None, methods: str | None, headers: str | None, credentials: bool) -> CorsOptions | None:
    """``serve``'s CORS flags as CorsOptions (None: no CORS); the others need ``--allowed-origins``."""
    allowed_origins = json_list("--allowed-origins", origins)
    allowed_methods = json_list("--allowed-methods", methods)
    allowed_headers = json_list("--allowed-headers", headers)
    if allowed_origins is None:
        if allowed_methods is not None or allowed_headers is not None or credentials:
            raise ValueError("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins")
        return None
    return CorsOptions(tuple(allowed_origins), tuple(allowed_methods or ("*",)), tuple(allowed_headers or ("*",)),
                       credentials)  # fmt: skip
