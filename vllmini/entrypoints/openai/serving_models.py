"""The models a server answers to, as vLLM's ``OpenAIServingModels``: the base model under its
served name, and LoRA adapters under their own names (``--lora-modules`` at start-up, or
``POST /v1/load_lora_adapter`` at run time when allowed).

A request's ``model`` picks the adapter it runs with (none for the base name). Adapters get
``lora_int_id`` 1, 2, ... in the order they are added (after any id the engine holds already) and
an id is never given twice, so that an id always names one adapter (the engine would also keep an
adapter unloaded and another loaded later under the same id apart: it keys them by id, name and path).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllmini.lora.request import LoRARequest

if TYPE_CHECKING:
    from vllmini.engine.async_engine import AsyncLLMEngine
    from vllmini.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger("vllmini")

RUNTIME_LORA_ENV = "VLLMINI_ALLOW_RUNTIME_LORA_UPDATING"  # (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve (404, as in vLLM); ``parameter``:
    the request field, as vLLM's error.param."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


def runtime_lora_updating() -> bool:
    """Whether the load/unload routes exist: only when the environment asks, as in vLLM (any
    client may then make the server read an adapter folder)."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` item (vLLM's name and fields)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoRAModulePath:
    """``NAME=PATH``, or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if item.lstrip().startswith("{"):
        try:
            fields = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {item!r}: not valid JSON ({exc})") from None
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"}) if isinstance(fields, dict) else []
        if not isinstance(fields, dict) or unknown:
            raise ValueError(f"--lora-modules {item!r}: a JSON item is an object with name, path and optionally "
                             f"base_model_name" + (f" (unknown: {', '.join(unknown)})" if unknown else ""))  # fmt: skip
        name, path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
    else:
        name, sep, path = item.partition("=")
        base = None
        if not sep:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH or a JSON object")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {item!r}: the name and the path must be non-empty strings")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"--lora-modules {item!r}: base_model_name must be a string")
    return LoRAModulePath(name, path, base)


def check_lora_modules(modules: list[LoRAModulePath], enable_lora: bool, served_model_name: str) -> None:
    """What can be refused before the model loads: adapters without ``--enable-lora``, names
    given twice or taken by the base model."""
    if modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (the engine has no adapter slots without it)")
    seen: set[str] = set()
    for m in modules:
        if m.name == served_model_name:
            raise ValueError(f"--lora-modules {m.name}: the name is the base model's served name")
        if m.name in seen:
            raise ValueError(f"--lora-modules {m.name}: the name is given twice")
        seen.add(m.name)


def permission() -> dict[str, Any]:
    """vLLM's ModelPermission of a model card (its fixed values: every model may be sampled, none
    fine-tuned), which OpenAI's older clients read."""
    return {"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission", "created": int(time.time()),
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}  # fmt: skip


class OpenAIServingModels:
    """The served names and their adapters; ``/v1/models`` and the load/unload routes."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str) -> None:
        self.engine, self.base_name = engine, served_model_name
        self.created = int(time.time())
        self.lora_requests: dict[str, LoRARequest] = {}  # by name, in the order added
        self._last_id = 0
        self._lock = asyncio.Lock()  # one load or unload at a time: a name is checked, then taken

    def _new_request(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        self._last_id = max([self._last_id, *self.engine.engine.list_loras()]) + 1
        if base_model_name is not None and base_model_name != self.base_name:
            logger.warning("LoRA adapter %r: base_model_name %r is not served here; its parent is %r", name,
                           base_model_name, self.base_name)  # fmt: skip
            base_model_name = None
        return LoRARequest(name, self._last_id, path, base_model_name)

    def load_static(self, modules: list[LoRAModulePath]) -> None:
        """Load ``--lora-modules`` before the server listens (the engine's loop is not running
        yet); a bad adapter stops start-up with a ValueError naming it."""
        check_lora_modules(modules, self.engine.engine.lora_manager is not None, self.base_name)
        for m in modules:
            request = self._new_request(m.name, m.path, m.base_model_name)
            try:
                self.engine.engine.add_lora(request)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {exc}") from None
            self.lora_requests[m.name] = request

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model); ModelNotFoundError
        for a name not served."""
        if model is None or model == self.base_name:
            return None
        if (request := self.lora_requests.get(model)) is not None:
            return request
        raise ModelNotFoundError(f"The model `{model}` does not exist. Valid aliases: {self.base_name}.", "model")

    def cards(self, max_model_len: int) -> dict[str, Any]:
        """``GET /v1/models``: the base model, then each adapter with its folder and parent."""
        def card(name: str, root: str, parent: str | None, length: int | None) -> dict[str, Any]:
            return {"id": name, "object": "model", "created": self.created, "owned_by": "vllm", "root": root,
                    "parent": parent, "max_model_len": length, "permission": [permission()]}  # fmt: skip

        data = [card(self.base_name, str(self.engine.engine.model_dir), None, max_model_len)]
        data += [card(r.lora_name, r.lora_path, r.base_model_name or self.base_name, None)
                 for r in self.lora_requests.values()]  # fmt: skip
        return {"object": "list", "data": data}

    async def load(self, body: LoadLoRAAdapterRequest) -> str:
        """``POST /v1/load_lora_adapter``: ValueError (400) for a name taken or an adapter the
        engine refuses; the adapter is loaded (and checked) before its name answers."""
        if not body.lora_name or not body.lora_path:
            raise ValueError("Both 'lora_name' and 'lora_path' must be provided.")
        async with self._lock:
            if body.lora_name == self.base_name or body.lora_name in self.lora_requests:
                raise ValueError(f"The lora adapter '{body.lora_name}' has already been loaded.")
            request = self._new_request(body.lora_name, body.lora_path, None)
            await self.engine.add_lora(request)
            self.lora_requests[body.lora_name] = request
        logger.info("LoRA adapter %r loaded from %s (id %d)", request.lora_name, request.lora_path, request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    async def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        """``POST /v1/unload_lora_adapter``: its name stops answering (404 after), the engine
        forgets its weights; requests already running finish with it."""
        if not body.lora_name:
            raise ValueError("'lora_name' must be provided.")
        async with self._lock:
            request = self.lora_requests.pop(body.lora_name, None)
            if request is None:
                raise ModelNotFoundError(f"The lora adapter '{body.lora_name}' cannot be found.")
            await self.engine.remove_lora(request.lora_int_id)
        logger.info("LoRA adapter %r unloaded (id %d)", request.lora_name, request.lora_int_id)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
