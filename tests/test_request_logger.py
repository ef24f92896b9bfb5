"""vLLM's enable_log_requests / max_log_len: the async engine logs each accepted request and each abort."""
from __future__ import annotations

import asyncio
import logging

import pytest

from vllmini import AsyncLLMEngine, EngineArgs, SamplingParams


def run_two_requests(tiny_dir, **args) -> None:
    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=16 << 20, **args))
        async with engine:
            async for _ in engine.generate("hello there, friend", SamplingParams(max_tokens=3, seed=7), "first"):
                pass
            stream = engine.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, SamplingParams(max_tokens=50), "second")
            await anext(stream)
            await stream.aclose()  # leaving early aborts it

    asyncio.run(main())


@pytest.fixture
def log(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("vllmini"), "propagate", True)
    caplog.set_level(logging.INFO, logger="vllmini")
    return caplog


def test_each_request_and_abort_is_logged_cut_to_max_log_len(tiny_dir, log):
    run_two_requests(tiny_dir, enable_log_requests=True, max_log_len=4)
    received = [r.getMessage() for r in log.records if r.getMessage().startswith("Received request")]
    assert len(received) == 2
    first, second = received
    assert first.startswith("Received request first: prompt: 'hell', params: SamplingParams(") and "seed=7" in first
    assert first.endswith("lora_request: None") and first.count(",", first.index("prompt_token_ids: [")) >= 3
    assert "prompt: None" in second and "prompt_token_ids: [5, 6, 7, 8], lora_request" in second
    assert [r.getMessage() for r in log.records if r.getMessage().startswith("Aborted")] == ["Aborted request(s) second."]


def test_nothing_is_logged_by_default(tiny_dir, log):
    run_two_requests(tiny_dir)
    assert not [r for r in log.records if r.getMessage().startswith(("Received request", "Aborted request"))]


def test_max_log_len_must_be_positive():
    with pytest.raises(ValueError, match="max_log_len must be a positive integer"):
        EngineArgs(max_log_len=0).validate()
    with pytest.raises(ValueError, match="enable_log_requests must be True or False"):
        EngineArgs(enable_log_requests="yes").validate()
