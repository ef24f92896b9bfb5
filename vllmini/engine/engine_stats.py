"""What ``AsyncLLMEngine.get_stats`` reports: the batch, the KV cache and the recent rate of
generation (tokens per second over the last few seconds, from the engine's running count)."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks referenced by live sequences
    num_free_blocks: int
    generation_tokens_per_s: float  # over the last few seconds


class GenerationRate:
    """Tokens generated per second over the last ``window_s`` seconds. ``update`` takes the engine's
    running total after each step (outputs may be cumulative: their lengths are not the new tokens)."""

    def __init__(self, total: int, window_s: float = 5.0, keep: int = 256) -> None:
        self.seen, self.window_s, self.keep = total, window_s, keep
        self.samples: list[tuple[float, int]] = []  # (time.monotonic(), tokens of that step)

    def update(self, total: int) -> None:
        self.samples.append((time.monotonic(), total - self.seen))
        self.seen = total
        del self.samples[: -self.keep]

    def per_second(self) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in self.samples if now - t < self.window_s]
        span = (now - recent[0][0]) if recent else 0.0
        return sum(n for _, n in recent) / span if span > 0 else 0.0
