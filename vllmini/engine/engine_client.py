"""What ``AsyncLLMEngine`` offers besides request streams (vLLM's ``EngineClient`` calls): its
state (running, stopped, healthy), the tokenizer, and the management calls that run on the
engine's worker thread between steps (prefix cache reset, profiling, LoRA adapters).

Kept apart from async_engine.py, whose subject is the streams and the step loop that feeds
them; both share the ``LLMEngine``, its one worker thread and the shut-down flag.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from vllmini.engine.llm_engine import LLMEngine
from vllmini.lora.request import LoRARequest

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """Raised by calls made after ``shutdown()``."""


class EngineClient:
    """The engine, the worker thread that steps it, and whether it was shut down."""

    engine: LLMEngine
    _executor: ThreadPoolExecutor
    _dead: bool

    def run_on_engine_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(*args)`` on the engine's worker thread, between steps, and wait for it
        (blocking: for set-up and measurement code, not for the event loop's hot path)."""
        return self._executor.submit(fn, *args).result()

    @property
    def is_running(self) -> bool:
        """True until ``shutdown()``, as vLLM's (before the first request too: the step loop
        starts then, and again after an event loop that ran it has ended)."""
        return not self._dead

    @property
    def is_stopped(self) -> bool:
        """True once ``shutdown()`` was called: new requests are refused."""
        return self._dead

    @property
    def errored(self) -> bool:
        """vLLM's name: the engine takes no more requests (here: it was shut down; a failed
        step fails only its own requests)."""
        return self._dead

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError("the engine is shut down; create a new AsyncLLMEngine")

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` once the engine is shut down (vLLM's health probe). A failed
        step does not kill the engine: only its requests fail."""
        if self._dead:
            raise self.dead_error

    @property
    def tokenizer(self) -> Any:
        """The tokenizer, None with skip_tokenizer_init (``get_tokenizer`` raises then)."""
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix, between two steps; False (nothing done) while requests
        are unfinished, as in vLLM, unless ``reset_running_requests`` (they are preempted first)."""
        await self.check_health()
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.reset_prefix_cache,
                                                                reset_running_requests)  # fmt: skip

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: record the steps with the torch profiler, on the engine's thread (needs
        ``EngineArgs.profiler_config``; engine/profiler.py)."""
        await self.check_health()
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.start_profile, profile_prefix)

    async def stop_profile(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.stop_profile)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests, off the event loop (vLLM's name)."""
        await self.check_health()
        return await asyncio.to_thread(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return self.engine.remove_lora(lora_id)

    async def list_loras(self) -> set[int]:
        return self.engine.list_loras()
