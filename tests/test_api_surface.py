"""vLLM's API surface where a user porting vLLM code relies on it: argument names, positional
orders, properties, and outputs that do not reach into the engine's own state."""
from __future__ import annotations

import inspect
import time

import pytest

from vllmini import (
    AsyncLLMEngine, CompletionOutput, EngineArgs, EngineDeadError, LLMEngine, RequestOutput, SamplingParams,
)

KV = 2**22


@pytest.fixture(scope="module")
def engine(tiny_dir) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV))


def run(engine: LLMEngine, on_output=None) -> dict[str, RequestOutput]:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if on_output is not None:
                on_output(out)
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_request_output_takes_vllms_positional_order():
    """vLLM: RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished,
    metrics, ..., num_cached_tokens=...); a mock built by position must not swap fields."""
    comp = CompletionOutput(0, "x", [5], None, None, "length")
    out = RequestOutput("r", "p", [1, 2], None, [comp], True, None, num_cached_tokens=2)
    assert out.prompt_logprobs is None and out.outputs == [comp] and out.finished is True
    assert out.num_cached_tokens == 2 and "num_cached_tokens=2" in repr(out)


def test_llm_engine_takes_vllms_argument_names(engine):
    """from_engine_args(engine_args=...), get_tokenizer(), abort_request(request_ids=[...]); the
    engine's own outputs carry num_cached_tokens as an attribute."""
    for cls in (LLMEngine, AsyncLLMEngine):
        inspect.signature(cls.from_engine_args).bind(engine_args=EngineArgs())
    assert engine.get_tokenizer() is engine.tokenizer
    engine.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    aborted = engine.abort_request(request_ids=["a"])
    assert [o.outputs[0].finish_reason for o in aborted] == ["abort"]
    finals = run(engine)
    assert list(finals) == ["b"] and finals["b"].num_cached_tokens == 0


def test_output_prompt_token_ids_is_not_the_engines_list(engine):
    """A caller changing an output's prompt_token_ids (e.g. extending it into the next prompt) must
    not change what the engine samples from: repetition_penalty reads the prompt's tokens."""
    prompt = [7, 8, 9, 10, 11, 12]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=3.0, output_kind="delta")
    engine.add_request("ref", {"prompt_token_ids": prompt}, params)
    ref = [t for out in run_all(engine) for t in out.outputs[0].token_ids]

    engine.add_request("mut", {"prompt_token_ids": prompt}, params)
    got: list[int] = []

    def mutate(out: RequestOutput) -> None:
        got.extend(out.outputs[0].token_ids)
        out.prompt_token_ids[:] = ref  # were it the engine's list, the penalty would now ban ref's next tokens

    run(engine, mutate)
    assert got == ref


def run_all(engine: LLMEngine) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    run(engine, outs.append)
    return outs


def test_arrival_time_is_vllms_wall_clock(engine, monkeypatch):
    """vLLM's arrival_time is a time.time() value; RequestMetrics use time.monotonic(), so it is
    moved onto that clock (taken as is, every latency from the metrics would be nonsense).

    The engine reads both clocks; a thread descheduled between its two readings (a loaded core)
    must not fail the test, so the bounds come from readings of both clocks around the submissions
    (no tolerance window), and a 20 ms stall is put between the engine's readings to show it."""
    wall_clock = time.time

    def stalled_wall_clock() -> float:
        time.sleep(0.02)
        return wall_clock()

    before, wall = time.monotonic(), time.time()
    with monkeypatch.context() as m:
        m.setattr(time, "time", stalled_wall_clock)
        engine.add_request("w", "hi", SamplingParams(max_tokens=2), arrival_time=wall - 0.5)
        engine.add_request("f", "hi", SamplingParams(max_tokens=2), arrival_time=wall + 60)  # future: now
    wall_after, after = time.time(), time.monotonic()
    outs = run(engine)
    # arrival = monotonic() - (time.time() - (wall - 0.5)), each reading taken between ours
    rounding = 1e-6  # (time.time()'s float spacing near 1.7e9 s is 2.4e-7)
    lowest = before - (wall_after - wall) - 0.5
    assert lowest - rounding <= outs["w"].metrics.arrival_time <= after - 0.5 + rounding
    assert before <= outs["f"].metrics.arrival_time <= after
    assert outs["w"].metrics.first_token_time - outs["w"].metrics.arrival_time > 0.3


def test_prompt_dict_with_unsupported_keys_is_refused(engine):
    """vLLM's TextPrompt/TokensPrompt keys this engine cannot honour (multi_modal_data,
    mm_processor_kwargs, ...) are an error naming them, not silently dropped (cache_salt is taken:
    tests/test_cache_salt.py)."""
    for extra in ({"multi_modal_data": {"image": object()}}, {"mm_processor_kwargs": {}}):
        with pytest.raises(ValueError, match=next(iter(extra))):
            engine.add_request("x", {"prompt": "hi", **extra}, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


async def test_async_engine_health_properties_as_vllm(tiny_dir):
    """vLLM's AsyncLLM: is_running is True from creation until shutdown (before any request too),
    errored/is_stopped after it, dead_error is what check_health raises; tokenizer attribute."""
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV))
    assert eng.is_running and not eng.errored and not eng.is_stopped
    assert eng.tokenizer is eng.get_tokenizer()
    await eng.check_health()
    outs = [o async for o in eng.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2), "r")]
    assert outs[-1].finished and eng.is_running
    await eng.shutdown()
    assert not eng.is_running and eng.errored and eng.is_stopped
    assert isinstance(eng.dead_error, EngineDeadError)
    with pytest.raises(EngineDeadError):
        await eng.check_health()


def test_vllm_inputs_prompt_types(engine):
    """``from vllm.inputs import TokensPrompt, TextPrompt`` ports as vllmini.inputs: plain dicts
    with vLLM's keys, required and optional as vLLM's TypedDicts have them."""
    from vllmini.inputs import EmbedsPrompt, TextPrompt, TokensPrompt

    assert TokensPrompt(prompt_token_ids=[1, 2, 3]) == {"prompt_token_ids": [1, 2, 3]}
    assert TokensPrompt.__required_keys__ == {"prompt_token_ids"} and "prompt" in TokensPrompt.__optional_keys__
    assert TextPrompt.__required_keys__ == {"prompt"} and TextPrompt.__optional_keys__ == {"cache_salt"}
    assert EmbedsPrompt.__required_keys__ == {"prompt_embeds"}
    engine.add_request("t", TokensPrompt(prompt_token_ids=[1, 2, 3], cache_salt="s"), SamplingParams(max_tokens=2))
    assert run(engine)["t"].prompt_token_ids == [1, 2, 3]


def test_enqueue_then_wait_for_completion(tiny_dir):
    """vLLM 0.32's LLM.enqueue (requests added, checked, not run) and wait_for_completion (run
    them all; the outputs in request id order): the same outputs as generate's."""
    from vllmini import LLM

    llm = LLM(model=str(tiny_dir), kv_cache_memory=KV)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
    want = llm.generate(prompts, params, use_tqdm=False)
    ids = llm.enqueue(prompts, params, use_tqdm=False) + llm.enqueue(prompts[0], params[0], priority=0)
    assert llm.llm_engine.get_num_unfinished_requests() == 3 and not llm.llm_engine.scheduler.running
    with pytest.raises(ValueError, match="sampling_params has 1 entries"):
        llm.enqueue(prompts, params[:1])
    assert llm.llm_engine.get_num_unfinished_requests() == 3  # (a refused call adds nothing)
    outs = llm.wait_for_completion(use_tqdm=False)
    assert [o.request_id for o in outs] == ids and all(o.finished for o in outs)
    assert [o.outputs[0].token_ids for o in outs] == [w.outputs[0].token_ids for w in want + want[:1]]
    assert llm.wait_for_completion(use_tqdm=False) == [] and not llm.llm_engine.has_unfinished_requests()
