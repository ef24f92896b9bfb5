"""What an RL trainer calls on ``AsyncLLMEngine`` between rollouts, with vLLM's (``AsyncLLM``)
names and rules: ``collective_rpc`` (on the engine's worker thread, between steps),
``pause_generation`` / ``resume_generation`` / ``is_paused``, and sleep mode
(``sleep`` / ``wake_up`` / ``is_sleeping``).

A pause takes one of vLLM's modes for the requests in flight (those accepted before the call,
including, when already paused, those waiting for the resume):
``"abort"`` (the default) ends them with finish_reason "abort", ``"wait"`` lets them finish,
``"keep"`` freezes them where they are until ``resume_generation``. In every mode the requests
that arrive while paused are accepted and wait, unscheduled, until the resume; the call returns
once no step is running. ``clear_cache`` (the default) then forgets the prefix cache; with
"keep" it also preempts the frozen requests, as vLLM's (``reset_prefix_cache(reset_running_requests=
True)``): after the resume they are recomputed, so a weight update made meanwhile reaches their
whole context, not only the tokens after it. ``sleep(level, mode)`` pauses in ``mode`` and gives
back the memory (engine/worker.py); ``wake_up`` resumes once weights and KV cache are both back.
Level 0 is vLLM's pause-only sleep (no ``enable_sleep_mode`` needed), woken by ``wake_up()`` or
``wake_up(["scheduling"])``.
``collective_rpc("sleep" | "wake_up")`` is these, not the worker's alone (which would leave the
requests and the prefix cache on a KV cache that is gone).
"""
from __future__ import annotations

import asyncio
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from vllmini.engine.llm_engine import LLMEngine, RequestState
from vllmini.engine.worker import SLEEP_TAGS

PAUSE_MODES = ("abort", "wait", "keep")


class AsyncPause:
    """``AsyncLLMEngine``'s pause, sleep and collective_rpc; it builds the fields below."""

    engine: LLMEngine
    _executor: ThreadPoolExecutor
    _lock: threading.Lock
    _new: list[RequestState]
    _held: list[RequestState]  # accepted while paused: admitted at the resume
    _pause_mode: str | None
    _streams: dict[str, asyncio.Queue]
    _wakeup: asyncio.Event | None
    _idle: asyncio.Event | None
    _ensure_loop: Callable[[], None]
    check_health: Callable[[], Any]
    _abort: Callable[..., Any]

    async def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
        """vLLM's: ``method`` (a worker method's name, or a callable taking the worker first:
        engine/worker.py) run on the engine's thread between two steps; a list of its one result.
        ``timeout``: a TimeoutError after that many seconds (the call itself still completes)."""
        await self.check_health()
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"collective_rpc: timeout must be a positive number of seconds or None, got {timeout!r}")
        if method in ("sleep", "wake_up"):  # the engine's, which pause and resume the requests around the worker's
            future = asyncio.ensure_future(_listed(getattr(self, method)(*args, **(kwargs or {}))))
        else:
            future = asyncio.get_running_loop().run_in_executor(self._executor, self.engine.collective_rpc, method, None,
                                                            args, kwargs)  # fmt: skip
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read: no "never retrieved" after a timeout)
        try:  # (shielded: a sleep cut short would leave the engine paused, half asleep)
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"collective_rpc({getattr(method, '__name__', method)!r}) took more than {timeout} s") from None

    async def pause_generation(self, *, mode: str = "abort", wait_for_inflight_requests: bool | None = None,
                               clear_cache: bool = True) -> None:  # fmt: skip
        """Stop scheduling, e.g. to update the weights. ``mode``: what becomes of the requests in
        flight ("abort", "wait" or "keep"); ``wait_for_inflight_requests=True`` is the older
        spelling of mode="wait" (deprecated, as in vLLM). ``clear_cache``: reset the prefix cache
        once they are done ("keep": the frozen requests are preempted, recomputed at the resume)."""
        if wait_for_inflight_requests:
            warnings.warn("pause_generation(wait_for_inflight_requests=True) is deprecated (as in vLLM): use "
                          "mode='wait'", DeprecationWarning, stacklevel=2)  # fmt: skip
            mode = "wait"
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        await self.check_health()
        with self._lock:  # from here on, new requests wait in _held
            self._pause_mode = mode
            in_flight = list(self._streams)  # (again while paused: those held since the first pause too, as vLLM's)
        if mode == "abort":
            await self._abort(in_flight)
        await self._until_idle()  # "wait": every request in flight finished; else: the running step done
        if clear_cache:  # ("keep": its requests are preempted, recomputed after the resume, as vLLM's)
            await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.reset_prefix_cache, True)

    async def _until_idle(self) -> None:
        """Until the step loop finds nothing it may run (while paused: no request in flight)."""
        self._ensure_loop()
        self._idle.clear()
        self._wakeup.set()
        await self._idle.wait()

    async def resume_generation(self) -> None:
        """Schedule again: frozen requests continue, those that arrived while paused start."""
        if self.engine.is_sleeping():
            raise RuntimeError("the engine is sleeping: wake_up() resumes it once weights and KV cache are back")
        with self._lock:
            self._pause_mode = None
            self._new += self._held
            self._held = []
        self._ensure_loop()
        self._wakeup.set()

    async def is_paused(self) -> bool:
        return self._pause_mode is not None

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: pause in ``mode`` (clearing the prefix cache), then give back the KV cache's
        memory and, at level 2, the weights' (needs ``enable_sleep_mode``). Requests that arrive
        while asleep wait for ``wake_up``; with mode "keep" those in flight are preempted and
        recomputed after it. Level 0 (vLLM's) only pauses, keeping the prefix cache."""
        if isinstance(level, bool) or level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0 (pause only), 1 (keep the weights) or 2 (discard them), got {level!r}")
        if level == 0:
            await self.pause_generation(mode=mode, clear_cache=False)
            return
        if not self.engine.args.enable_sleep_mode:
            raise ValueError("sleep() needs an engine started with enable_sleep_mode=True")
        await self.pause_generation(mode=mode, clear_cache=True)  # (what is left in flight is frozen, preempted)
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.sleep, level, "keep")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` ("weights", "kv_cache"; None: both; vLLM's "scheduling": only the
        resume of a level-0 sleep); generation resumes once the engine sleeps no more."""
        await self.check_health()
        if tags is not None:
            if not isinstance(tags, list) or any(t not in (*SLEEP_TAGS, "scheduling") for t in tags):
                raise ValueError(f"wake_up tags must be among {[*SLEEP_TAGS, 'scheduling']}, got {tags!r}")
            tags = [t for t in tags if t != "scheduling"]
        if self.engine.is_sleeping() and (tags is None or tags):
            await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.wake_up, tags)
        if not self.engine.is_sleeping():
            await self.resume_generation()

    async def is_sleeping(self) -> bool:
        """As vLLM's: True while asleep, and also while merely paused (a pause is its level 0)."""
        return self.engine.is_sleeping() or self._pause_mode is not None


async def _listed(call: Any) -> list[Any]:
    return [await call]
