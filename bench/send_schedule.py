"""The send loop both engines are driven by: start each request at its offset, capped.

Standard library only: bench/vllm_driver.py imports it inside vLLM's virtualenv, where
neither vllmini nor the ``bench`` package is importable (the driver runs as a script, so
this folder is on its ``sys.path``). Sharing it keeps vLLM's arrivals exactly ours.
"""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Iterable


async def send_on_schedule(offsets: list[float], concurrency: int | None,
                           request: Callable[[int], Awaitable[None]]) -> None:  # fmt: skip
    """Start ``request(i)`` at ``offsets[i]`` seconds after the call, with at most
    ``concurrency`` running (None: no cap), and wait for all of them. If cancelled, the
    requests already started are cancelled and awaited; later ones are never started."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None

    async def capped(i: int) -> None:
        if sem is None:
            await request(i)
        else:
            async with sem:
                await request(i)

    tasks: list[asyncio.Task] = []
    start = time.perf_counter()
    try:
        for i, t in enumerate(offsets):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(capped(i)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def span_s(start: float, chunk_times: Iterable[list[float]]) -> float:
    """Benchmark duration: ``start`` to the last chunk any request received (now if none)."""
    ends = [times[-1] for times in chunk_times if times]
    return max((max(ends) if ends else time.perf_counter()) - start, 1e-9)
