"""vLLM's engine profiling: ``start_profile`` / ``stop_profile`` on LLM, AsyncLLMEngine and the
server (``POST /start_profile``, ``/stop_profile``) write a torch profiler trace of the steps in
between and a table of the ops, when ``profiler_config`` (or $VLLMINI_TORCH_PROFILER_DIR) is set."""
from __future__ import annotations

import gzip
import json

import httpx
import pytest

from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.engine.profiler import ProfilerConfig
from vllmini.entrypoints.openai.api_server import build_app


def trace_ops(folder) -> set[str]:
    (trace,) = folder.glob("*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return {e.get("name", "") for e in events}


def test_llm_records_the_steps_between_start_and_stop(tiny_dir, tmp_path):
    llm = LLM(str(tiny_dir), profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    with pytest.raises(RuntimeError, match="no profile is being recorded"):
        llm.stop_profile()
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already being recorded"):
        llm.start_profile()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    llm.stop_profile()
    ops = trace_ops(tmp_path)
    assert {"aten::max", "aten::argmax", "aten::cumsum_"} & ops  # the sampler's (greedy: max)
    assert any(name.startswith(("aten::mm", "aten::addmm", "mkldnn::", "aten::linear")) for name in ops)  # the forward's
    (table,) = tmp_path.glob("*.txt")
    assert "Self CPU" in table.read_text()
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids  # still serving


def test_profiling_needs_a_config_and_bad_configs_are_named(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLMINI_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(str(tiny_dir))
    with pytest.raises(RuntimeError, match="profiling is not enabled: start the engine with profiler_config"):
        llm.start_profile()
    for config, message in [({"profiler": "cuda"}, "profiler_config.profiler must be 'torch'"),
                            ({"profiler": "torch"}, "profiler_config.torch_profiler_dir must name a folder"),
                            ({"profiler": "torch", "torch_profiler_dir": "d", "torch_profiler_with_stack": "y"},
                             "profiler_config.torch_profiler_with_stack must be True or False"),
                            ({"dir": "d"}, "unknown or unsupported field")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(tiny_dir), profiler_config=config).validate()
    assert ProfilerConfig.coerce(None).profiler is None
    monkeypatch.setenv("VLLMINI_TORCH_PROFILER_DIR", str(tmp_path))
    assert ProfilerConfig.coerce(None) == ProfilerConfig("torch", str(tmp_path))


async def test_the_async_engine_and_the_server_profile_on_the_engine_thread(tiny_dir, tmp_path):
    """The routes exist only with a profiler (as vLLM's); a completion between them is in the trace."""
    plain = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="m"))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(plain)), base_url="http://t") as http:
            assert (await http.post("/start_profile")).status_code == 404
    finally:
        await plain.shutdown()
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": True}
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="m", profiler_config=config))
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine)), base_url="http://t") as http:
            assert (await http.post("/start_profile")).status_code == 200
            r = await http.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 3})
            assert r.status_code == 200
            assert (await http.post("/stop_profile")).status_code == 200
        assert any(name.startswith(("aten::mm", "aten::addmm", "mkldnn::", "aten::linear")) for name in trace_ops(tmp_path))
    finally:
        await engine.shutdown()
