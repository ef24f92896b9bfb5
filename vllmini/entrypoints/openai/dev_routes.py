"""The server's development routes, as vLLM's (registered only with ``VLLMINI_SERVER_DEV_MODE=1``,
vLLM's ``VLLM_SERVER_DEV_MODE``: any client may then pause the engine or run a worker method):

- ``POST /pause?mode=abort|wait|keep&clear_cache=true`` (``wait_for_inflight_requests=true``: the
  older spelling of mode=wait), ``POST /resume``, ``GET /is_paused`` -> ``{"is_paused": bool}``;
- ``POST /sleep?level=1&mode=abort``, ``POST /wake_up?tags=weights&tags=kv_cache`` (none: both),
  ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``;
- ``POST /collective_rpc`` with ``{"method": name, "args": [...], "kwargs": {...}, "timeout": s}``
  -> ``{"results": [...]}`` (JSON arguments only; a worker method's name, e.g. ``reload_weights``);
- ``POST /reset_prefix_cache?reset_running_requests=false``.

A bad argument is a 400 naming it, as vLLM's.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from vllmini.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("vllmini")

DEV_MODE_ENV = "VLLMINI_SERVER_DEV_MODE"  # (vLLM: VLLM_SERVER_DEV_MODE)


def server_dev_mode() -> bool:
    return os.environ.get(DEV_MODE_ENV, "0").strip().lower() in ("1", "true")


def dev_routes(engine: AsyncLLMEngine, json_response: Callable[[Any], Response],
               error_response: Callable[[int, str], Response]) -> list[Route]:  # fmt: skip
    """The routes above, or none outside dev mode."""
    if not server_dev_mode():
        return []
    logger.warning("%s is set: /pause, /sleep, /collective_rpc and the other development routes are served "
                   "(any client may stop the engine or run a worker method)", DEV_MODE_ENV)  # fmt: skip

    def flag(request: Request, name: str, default: bool) -> bool:
        value = request.query_params.get(name)
        if value is None:
            return default
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value.lower() in ("true", "1")

    def guarded(call: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                result = await call(request)
            except (ValueError, TypeError, NotImplementedError) as exc:
                return error_response(400, str(exc))
            except TimeoutError as exc:  # collective_rpc's timeout (the call itself completes)
                return error_response(504, str(exc))
            except RuntimeError as exc:  # e.g. resume while asleep
                return error_response(409, str(exc))
            return result if isinstance(result, Response) else json_response(result)

        return endpoint

    async def pause(request: Request) -> Any:
        await engine.pause_generation(mode=request.query_params.get("mode", "abort"),
                                      wait_for_inflight_requests=flag(request, "wait_for_inflight_requests", False),
                                      clear_cache=flag(request, "clear_cache", True))  # fmt: skip
        return {"status": "paused"}

    async def resume(request: Request) -> Any:
        await engine.resume_generation()
        return {"status": "resumed"}

    async def sleep(request: Request) -> Any:
        level = request.query_params.get("level", "1")
        if not level.isdigit():
            raise ValueError(f"level must be 0, 1 or 2, got {level!r}")
        await engine.sleep(int(level), request.query_params.get("mode", "abort"))
        return Response(status_code=200)

    async def wake_up(request: Request) -> Any:
        await engine.wake_up(request.query_params.getlist("tags") or None)
        return Response(status_code=200)

    async def collective_rpc(request: Request) -> Any:
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as exc:
            raise ValueError(f"JSON decode error: {exc}") from None
        if not isinstance(body, dict) or not isinstance(body.get("method"), str):
            raise ValueError("the body must be a JSON object with a 'method' (the name of a worker method)")
        args, kwargs, timeout = body.get("args", []), body.get("kwargs", {}), body.get("timeout")
        if not isinstance(args, list):  # (checked before anything runs: a string would be spread into characters)
            raise ValueError(f"'args' must be a JSON array, got {type(args).__name__}")
        if not isinstance(kwargs, dict):
            raise ValueError(f"'kwargs' must be a JSON object, got {type(kwargs).__name__}")
        results = await engine.collective_rpc(body["method"], timeout, tuple(args), kwargs)
        shown = [r if r is None or isinstance(r, (dict, list, str, int, float, bool)) else
                 sorted(r) if isinstance(r, (set, frozenset)) else str(r) for r in results]  # fmt: skip
        return {"results": shown}

    async def reset_prefix_cache(request: Request) -> Any:
        await engine.reset_prefix_cache(flag(request, "reset_running_requests", False))
        return Response(status_code=200)

    async def is_paused(request: Request) -> Any:
        return {"is_paused": await engine.is_paused()}

    async def is_sleeping(request: Request) -> Any:
        return {"is_sleeping": await engine.is_sleeping()}

    posts = {"/pause": pause, "/resume": resume, "/sleep": sleep, "/wake_up": wake_up,
             "/collective_rpc": collective_rpc, "/reset_prefix_cache": reset_prefix_cache}  # fmt: skip
    gets = {"/is_paused": is_paused, "/is_sleeping": is_sleeping}
    return [*(Route(path, guarded(fn), methods=["POST"]) for path, fn in posts.items()),
            *(Route(path, guarded(fn), methods=["GET"]) for path, fn in gets.items())]  # fmt: skip
