"""What ``LLMEngine`` offers besides add_request / step / abort (vLLM's ``LLMEngine`` calls):
its state (unfinished requests, supported tasks, KV capacity, metrics), the tokenizer, default
sampling parameters, and the management calls made between steps (LoRA adapters, prefix-cache
reset, profiling). ``LLM`` and the async engine's ``EngineClient`` forward to these.

Kept apart from llm_engine.py, whose subject is a request's way through the engine: each of
these only reads, or hands the call on to, a component the engine built.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from vllmini.engine.skip_tokenizer import tokenizer_or_raise
from vllmini.metrics.reader import get_metrics_snapshot

if TYPE_CHECKING:
    from pathlib import Path

    from vllmini.config import EngineArgs
    from vllmini.engine.input_processor import InputProcessor, PromptType
    from vllmini.engine.output_processor import RequestState
    from vllmini.engine.pooler import Pooler
    from vllmini.engine.profiler import Profiler
    from vllmini.engine.sampling_params import SamplingParams
    from vllmini.engine.worker import Worker
    from vllmini.kv.hybrid_block_manager import KVBlockManager
    from vllmini.lora.adapter import LoRAAdapter
    from vllmini.lora.manager import LoRAManager
    from vllmini.lora.request import LoRARequest
    from vllmini.metrics.reader import Metric
    from vllmini.metrics.stat_logger import StatLogger
    from vllmini.scheduler.scheduler import Scheduler

logger = logging.getLogger("vllmini")


class LLMEngineCalls:
    """The engine's calls besides a request's own; ``LLMEngine`` builds the fields below."""

    args: EngineArgs
    max_model_len: int
    num_blocks: int
    tokenizer: Any
    input_processor: InputProcessor
    lora_manager: LoRAManager | None
    pooler: Pooler | None
    block_manager: KVBlockManager
    profiler: Profiler
    stat_logger: StatLogger | None
    requests: dict[str, RequestState]
    worker: Worker
    scheduler: Scheduler
    _in_flight: Any
    abort_request: Callable[..., list[Any]]

    def get_tokenizer(self) -> Any:
        """The tokenizer (vLLM's ValueError with skip_tokenizer_init, which loads none)."""
        return tokenizer_or_raise(self.tokenizer)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``prompt``: text, a token-id list, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``."""
        return self.input_processor.tokenize(prompt)

    def get_default_sampling_params(self) -> SamplingParams:
        """A copy of what a request without SamplingParams gets (vLLM's name)."""
        return self.input_processor.defaults()

    @property
    def capacity_tokens(self) -> int:
        """The longest sequence the cache can hold: all of it, unless some layers slide and
        release what falls behind their window (kv/block_manager.py, kv/hybrid_block_manager.py)."""
        return self.block_manager.capacity_tokens(self.args.max_num_batched_tokens, self.max_model_len)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ----------------------------------
    def _lora_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        if self.lora_manager is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        return self.lora_manager.get(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests (ValueError when it cannot be used)."""
        self._lora_adapter(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget a loaded adapter (running requests finish with it); False when it was not loaded."""
        return self.lora_manager is not None and self.lora_manager.remove(lora_id)

    def list_loras(self) -> set[int]:
        return set() if self.lora_manager is None else self.lora_manager.list_loras()

    # ---- state and management ---------------------------------------------------------------
    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: ("generate",), or the pooling tasks of the model ("embed"; "classify", "score")."""
        return ("generate",) if self.pooler is None else self.pooler.tasks

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix, so that the next prompts start cold (a benchmark's
        points, a weight swap). As in vLLM, refused (False, with a warning) while requests
        run: the blocks they hold would keep their hashes; ``reset_running_requests=True``
        preempts them first (they are recomputed when scheduled again, e.g. after a weight
        update: vLLM's ``pause_generation(mode="keep", clear_cache=True)``)."""
        if reset_running_requests:  # (then every request is queued, holding no block)
            self._in_flight = None  # (async scheduling: its tokens are dropped, as vLLM's discard_latest_async_tokens)
            self.scheduler.preempt_running()
        elif self.requests:
            logger.warning("prefix cache not reset: %d requests are unfinished", len(self.requests))
            return False
        self.block_manager.reset_prefix_cache()
        return True

    # ---- the worker (vLLM's collective_rpc / apply_model) and sleep mode -------------------------
    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:  # fmt: skip
        """vLLM's: call ``method`` (a name of one of the worker's methods, or a callable taking the
        worker first: engine/worker.py) and return the one worker's result in a list. It runs here,
        between steps; ``timeout`` is not used (vLLM's in-process executor does not either)."""
        from vllmini.engine.worker import run_method

        if method in ("sleep", "wake_up"):  # the engine's: the worker's alone would leave the requests
            return [getattr(self, method)(*args, **(kwargs or {}))]  # and prefix cache on a freed KV cache
        return [run_method(self.worker, method, args, kwargs)]

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """vLLM's: ``[func(model)]``; the model's ``load_weights`` updates it in place."""
        return self.collective_rpc("apply_model", args=(func,))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's sleep mode (needs ``enable_sleep_mode``): unfinished requests are aborted (``mode``
        "keep": preempted, recomputed after ``wake_up``), the prefix cache forgotten and the KV
        cache's memory given back; level 1 keeps the weights, level 2 discards them (load them
        again after ``wake_up``)."""
        if not self.args.enable_sleep_mode:
            raise ValueError("sleep() needs an engine started with enable_sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (keep the weights) or 2 (discard them), got {level!r}")
        if mode not in ("abort", "keep"):
            raise ValueError(f"sleep mode must be 'abort' or 'keep' here (the async engine also takes 'wait'), got {mode!r}")
        if mode == "abort":
            self.abort_request(list(self.requests))
        self.reset_prefix_cache(reset_running_requests=True)  # (its blocks' K/V go with the cache)
        self.worker.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` (``"weights"``, ``"kv_cache"``; None: both; vLLM's ``"scheduling"``, level
        0's, is the async engine's resume: nothing here)."""
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
            if not tags:
                return
        if not self.args.enable_sleep_mode:
            raise ValueError("wake_up() needs an engine started with enable_sleep_mode=True")
        self.worker.wake_up(tags)

    def is_sleeping(self) -> bool:
        return bool(self.worker.sleeping_tags)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Record the steps from now on with the torch profiler (engine/profiler.py); call it
        on the thread that steps the engine."""
        self.profiler.start(profile_prefix)

    def stop_profile(self) -> Path:
        """Stop recording; writes the trace (its path returned) and the ops table."""
        return self.profiler.stop()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_metrics(self) -> list[Metric]:
        """The engine's metrics now (metrics/reader.py), under the names /metrics serves."""
        if self.stat_logger is None:
            raise RuntimeError("metrics are off: build the engine with disable_log_stats=False")
        return get_metrics_snapshot(self.stat_logger.registry)
