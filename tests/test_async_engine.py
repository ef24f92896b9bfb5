"""AsyncLLMEngine: concurrent streams equal offline results, the loop stays responsive,
cancellation frees blocks, errors stay with their request, shutdown ends streams."""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from test_engine import assert_no_leaks
from vllmini import LLM, EngineArgs, SamplingParams
from vllmini.engine.async_engine import AsyncLLMEngine, EngineDeadError

KV = 256 << 20


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request):
    if request.param == "uvloop":
        import uvloop  # a dev dependency: the async tests run under both loops

        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()


@pytest.fixture(scope="module")
def offline(tiny_dir):
    return LLM(model=str(tiny_dir), kv_cache_memory=KV)


def make_engine(model_dir, **kw) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(EngineArgs(model=str(model_dir), kv_cache_memory=KV, **kw))


def workload(n: int):
    prompts = [{"prompt_token_ids": [100 + (i * 37 + j * 11) % 4000 for j in range(5 + i % 23)]} for i in range(n)]
    params = []
    for i in range(n):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=8 + i % 17, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=10 + i % 9, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=30, stop=["e", "a "], ignore_eos=True))
    return prompts, params


async def consume(engine, prompt, params, request_id, kind="delta"):
    import msgspec

    p = msgspec.structs.replace(params, output_kind=kind)
    outs = [o async for o in engine.generate(prompt, p, request_id=request_id)]
    return outs


async def test_64_concurrent_streams_match_offline_and_loop_stays_responsive(tiny_dir, offline):
    prompts, params = workload(64)
    expected = offline.generate(prompts, params, use_tqdm=False)
    lags: list[float] = []
    stop = asyncio.Event()

    async def probe():  # (2 ms ticks: a fast machine runs the whole workload in ~0.2 s)
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.002)
            lags.append(time.perf_counter() - t - 0.002)

    async with make_engine(tiny_dir) as engine:
        probe_task = asyncio.create_task(probe())
        kinds = ["delta", "cumulative"]
        results = await asyncio.gather(
            *[consume(engine, p, sp, f"r{i}", kinds[i % 2]) for i, (p, sp) in enumerate(zip(prompts, params))]
        )
        stop.set()
        await probe_task
        assert_no_leaks(engine)
    for i, (outs, exp) in enumerate(zip(results, expected)):
        assert outs[-1].finished
        want = exp.outputs[0]
        if i % 2 == 0:  # delta: pieces add up to the offline result
            assert "".join(o.outputs[0].text for o in outs) == want.text
            assert sum((o.outputs[0].token_ids for o in outs), []) == want.token_ids
        else:  # cumulative: every text a prefix of the final one
            assert all(want.text.startswith(o.outputs[0].text) for o in outs)
            assert outs[-1].outputs[0].text == want.text and outs[-1].outputs[0].token_ids == want.token_ids
        assert outs[-1].outputs[0].finish_reason == want.finish_reason
        m = outs[-1].metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(lags) > 20
    p99 = statistics.quantiles(lags, n=100)[98]
    assert p99 < 0.050, f"event-loop lag p99 {p99 * 1e3:.1f} ms; largest {sorted(lags)[-4:]} of {len(lags)}"


async def test_cancel_half_of_40_streams(tiny_dir, offline):
    prompts = [{"prompt_token_ids": [200 + i, 300 + i, 400 + i]} for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = offline.generate(prompts, params, use_tqdm=False)
    async with make_engine(tiny_dir) as engine:
        started = asyncio.Event()

        async def run(i):
            outs = []
            async for out in engine.generate(prompts[i], params, request_id=f"c{i}"):
                outs.append(out)
                if len(outs) == 3:
                    started.set()
                if i % 4 == 0 and len(outs) == 5:  # 10 consumers leave by break
                    break
            return outs

        tasks = [asyncio.create_task(run(i)) for i in range(40)]
        await started.wait()
        for i in range(40):
            if i % 4 == 1 and i < 30:  # 8 cancelled tasks
                tasks[i].cancel()
        for i in (2, 6):  # 2 explicit aborts
            await engine.abort(f"c{i}")
        done = await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)
        while engine.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        assert_no_leaks(engine)
    for i, res in enumerate(done):
        if i % 4 == 1 and i < 30:
            assert isinstance(res, asyncio.CancelledError) or (res and res[-1].finished)
        elif i % 4 == 0:
            assert len(res) == 5 and not res[-1].finished
        elif i in (2, 6):
            assert res[-1].finished and res[-1].outputs[0].finish_reason == "abort"
        else:
            assert res[-1].outputs[0].token_ids == expected[i].outputs[0].token_ids


async def test_errors_stay_with_their_request(tiny_dir, monkeypatch):
    async with make_engine(tiny_dir) as engine:
        runner = engine.engine.runner
        original = runner.execute

        def execute(sched, bm):
            if any(s.seq.request_id == "boom" for s in sched.scheduled):
                raise RuntimeError("simulated kernel failure")
            return original(sched, bm)

        monkeypatch.setattr(runner, "execute", execute)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        with pytest.raises(Exception, match="simulated kernel failure"):
            async for _ in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, request_id="boom"):
                pass
        outs = [o async for o in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, request_id="after")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6

        real_check = engine.engine.output_processor.check_stop

        def check_stop(state, seq, *rest):
            if state.request_id == "bad-detok":
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated detokenizer failure")
            return real_check(state, seq, *rest)

        monkeypatch.setattr(engine.engine.output_processor, "check_stop", check_stop)

        async def good():
            return [o async for o in engine.generate({"prompt_token_ids": [9, 9]}, params, request_id="good")]

        async def bad():
            return [o async for o in engine.generate({"prompt_token_ids": [9, 8]}, params, request_id="bad-detok")]

        res = await asyncio.gather(good(), bad(), return_exceptions=True)
        assert res[0][-1].finished and len(res[0][-1].outputs[0].token_ids) == 6
        assert isinstance(res[1], UnicodeDecodeError)
        assert_no_leaks(engine)


async def test_bad_input_raises_at_the_call(tiny_dir):
    engine = make_engine(tiny_dir, max_model_len=64)
    params = SamplingParams(max_tokens=4)

    async def first(gen):
        return [o async for o in gen]

    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        await first(engine.generate("hi", {"max_tokens": 3}))
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with a string 'role'"):
        await first(engine.generate([{"role": "user", "content": "hi"}, {"content": "hi"}], params))
    with pytest.raises(ValueError, match="max_model_len"):
        await first(engine.generate({"prompt_token_ids": [1] * 80}, params))
    running = engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=20, ignore_eos=True), "dup")
    first_out = await running.__anext__()
    with pytest.raises(ValueError, match="already in use"):
        await first(engine.generate("x", params, request_id="dup"))
    rest = [o async for o in running]
    assert (rest or [first_out])[-1].finished  # the other request kept streaming
    chat = await first(engine.generate([{"role": "user", "content": "hello"}], params))
    assert chat[-1].finished
    await engine.shutdown()
    with pytest.raises(EngineDeadError):
        await first(engine.generate("hi", params))


async def test_shutdown_ends_running_streams(tiny_dir):
    engine = make_engine(tiny_dir)
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)

    async def run(i):
        return [o async for o in engine.generate({"prompt_token_ids": [i + 1] * 4}, params)]

    tasks = [asyncio.create_task(run(i)) for i in range(6)]
    await asyncio.sleep(0.3)
    assert engine.is_running and engine.get_stats().num_running > 0
    await asyncio.wait_for(engine.shutdown(), timeout=30)
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    for outs in results:
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert not engine.is_running
    assert_no_leaks(engine)


def test_engine_is_built_and_stepped_on_one_thread(tiny_dir, monkeypatch):
    """torch's OpenMP pool is per thread: the model must load on the thread that steps it
    (one pool on the cores), not on the caller's. The first forward of a step and the
    construction are checked to run on the same, non-caller thread."""
    import threading

    from vllmini.engine.llm_engine import LLMEngine
    from vllmini.engine.model_runner import ModelRunner

    seen: dict[str, set[int]] = {"build": set(), "step": set()}
    build, execute = LLMEngine.from_engine_args.__func__, ModelRunner.execute

    def recording_build(cls, args):
        seen["build"].add(threading.get_ident())
        return build(cls, args)

    def recording_execute(self, *a, **k):
        seen["step"].add(threading.get_ident())
        return execute(self, *a, **k)

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(recording_build))
    monkeypatch.setattr(ModelRunner, "execute", recording_execute)
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=2**20))

    async def go() -> int:
        async with engine:
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), "t"):
                pass
            return engine.run_on_engine_thread(threading.get_ident)

    helper_thread = asyncio.run(go())
    assert len(seen["build"]) == 1 and seen["build"] == seen["step"] == {helper_thread}
    assert threading.get_ident() not in seen["build"]


async def test_a_request_id_is_free_again_once_its_stream_is_closed(tiny_dir, offline):
    """Retry-on-timeout with the same id, a stream closed after its request finished, a list
    abort, and auto ids next to a caller's "0": each request gets its own outputs, as in vLLM
    (closing a stream awaits the abort)."""
    engine = make_engine(tiny_dir, max_model_len=1024)
    prompt = {"prompt_token_ids": list(range(200, 230))}
    short = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = offline.generate(prompt, short, use_tqdm=False)[0].outputs[0].token_ids

    async def run(params, rid):
        return [o async for o in engine.generate(prompt, params, request_id=rid)]

    async with engine:
        with pytest.raises((asyncio.TimeoutError, TimeoutError)):  # first attempt: too slow
            await asyncio.wait_for(run(SamplingParams(max_tokens=900, ignore_eos=True), "req-1"), 0.2)
        retry = await run(short, "req-1")
        assert retry[-1].outputs[0].finish_reason == "length" and retry[-1].outputs[0].token_ids == want
        # finished in the engine before its consumer read the final output, then closed
        gen = engine.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True), request_id="B")
        await gen.__anext__()
        while "B" in engine.engine.requests:
            await asyncio.sleep(0.01)
        await gen.aclose()
        again = await run(short, "B")
        assert again[-1].outputs[0].finish_reason == "length" and again[-1].outputs[0].token_ids == want
        # abort() takes a list of ids, and returns once both are aborted
        long = SamplingParams(max_tokens=900, ignore_eos=True)
        tasks = [asyncio.create_task(run(long, rid)) for rid in ("x", "y")]
        while not {"x", "y"} <= set(engine.engine.requests):
            await asyncio.sleep(0.01)
        await engine.abort(["x", "y"])
        assert not {"x", "y"} & set(engine.engine.requests)
        for outs in await asyncio.gather(*tasks):
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        # an auto id never takes a caller's id
        caller = asyncio.create_task(run(long, "0"))
        while "0" not in engine.engine.requests:
            await asyncio.sleep(0.01)
        auto = await run(short, None)
        assert auto[-1].request_id != "0" and auto[-1].outputs[0].token_ids == want
        await engine.abort("0")
        await caller
        assert_no_leaks(engine)


async def test_closing_a_stream_is_cancellable_and_never_hangs(tiny_dir, monkeypatch):
    """Closing waits for the abort, but a cancel of that wait still cancels (the abort goes on,
    and the id stays taken until it is done); an engine step that raises does not leave an
    abort waiting forever; abort() takes any id generate() took (an int)."""
    engine = make_engine(tiny_dir, max_model_len=1024)
    prompt, long = {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=900, ignore_eos=True)
    real_step, calls = engine.engine.step, {"slow": False, "raise_at": None, "n": 0}

    def step():
        calls["n"] += 1
        if calls["n"] == calls["raise_at"]:
            raise RuntimeError("engine bug")
        if calls["slow"]:
            time.sleep(0.3)  # a long prefill on a slow device
        return real_step()

    monkeypatch.setattr(engine.engine, "step", step)
    async with engine:
        gen = engine.generate(prompt, long, request_id="a")
        await gen.__anext__()
        calls["slow"] = True
        closer = asyncio.create_task(gen.aclose())
        await asyncio.sleep(0.05)
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        with pytest.raises(ValueError, match="already in use"):  # the abort is not done yet
            await engine.generate(prompt, long, request_id="a").__anext__()
        while "a" in engine._streams:
            await asyncio.sleep(0.05)
        calls["slow"] = False
        outs = [o async for o in engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True), request_id="a")]
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 3

        async def consume(rid):
            with pytest.raises(RuntimeError, match="engine bug"):
                async for _ in engine.generate(prompt, long, request_id=rid):
                    pass

        tasks = [asyncio.create_task(consume(rid)) for rid in ("b", "c")]
        while not {"b", "c"} <= set(engine.engine.requests):
            await asyncio.sleep(0.01)
        calls["raise_at"] = calls["n"] + 1
        await asyncio.wait_for(engine.abort("b"), 10)  # returns although the step it rode on failed
        await asyncio.gather(*tasks)
        assert not engine.engine.requests  # "c", failed but never aborted, left the engine too
        seven = asyncio.create_task(consume_all(engine, prompt, long, 7))
        while "7" not in engine.engine.requests:
            await asyncio.sleep(0.01)
        await engine.abort(7)
        assert (await seven)[-1].outputs[0].finish_reason == "abort"
        assert_no_leaks(engine)


async def consume_all(engine, prompt, params, request_id):
    return [o async for o in engine.generate(prompt, params, request_id=request_id)]


async def test_a_request_submitted_during_a_failing_step_is_not_failed(tiny_dir, monkeypatch):
    """An engine error fails the requests the engine held in that step (and removes them); a
    request submitted while the step ran was not part of it and runs normally."""
    import threading

    engine = make_engine(tiny_dir, max_model_len=1024)
    entered, release, calls = threading.Event(), threading.Event(), {"n": 0}
    real_step = engine.engine.step

    def step():
        calls["n"] += 1
        if calls["n"] == 2:  # "a" is decoding: this step blocks, then fails
            entered.set()
            release.wait(10)
            raise RuntimeError("engine bug")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", step)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    async with engine:
        failing = asyncio.create_task(consume_all(engine, prompt, SamplingParams(max_tokens=900, ignore_eos=True), "a"))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait)
        late = asyncio.create_task(consume_all(engine, prompt, SamplingParams(max_tokens=5, ignore_eos=True), "b"))
        await asyncio.sleep(0.05)
        release.set()
        with pytest.raises(RuntimeError, match="engine bug"):
            await failing
        outs = await late
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 5
        assert_no_leaks(engine)


async def test_the_request_keeps_its_own_sampling_params(tiny_dir):
    """As vLLM, the engine clones the caller's SamplingParams: reusing and changing the object
    while its request runs changes nothing for that request."""
    engine = make_engine(tiny_dir)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    stream = engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "r")
    first_out = await stream.__anext__()
    params.stop_token_ids = list(range(49152))  # every token: would stop it at once
    outs = [first_out] + [o async for o in stream]
    assert len(outs[-1].outputs[0].token_ids) == 30 and outs[-1].outputs[0].finish_reason == "length"
    await engine.shutdown()


async def test_health_tokenizer_and_prefix_cache_reset(tiny_dir):
    """vLLM's AsyncLLM calls: ``check_health()`` passes until shutdown and raises
    EngineDeadError after it; ``reset_prefix_cache()`` runs between steps, refused (False)
    while a stream is open; ``get_tokenizer()`` is the engine's tokenizer."""
    prompt = {"prompt_token_ids": [100 + i for i in range(40)]}  # 2 full blocks
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, output_kind="final")
    engine = make_engine(tiny_dir)
    assert engine.get_tokenizer() is engine.engine.tokenizer
    await engine.check_health()
    outs = []
    for _ in range(2):
        outs.append([o async for o in engine.generate(prompt, params)][-1])
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 32]
    stream = engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=500, ignore_eos=True))
    await stream.__anext__()
    assert await engine.reset_prefix_cache() is False
    await stream.aclose()
    assert await engine.reset_prefix_cache() is True
    cold = [o async for o in engine.generate(prompt, params)][-1]
    assert cold.metrics.num_cached_tokens == 0 and cold.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert not engine.is_stopped
    await engine.shutdown()
    assert engine.is_stopped
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await engine.reset_prefix_cache()
    assert_no_leaks(engine)


async def test_shutdown_is_a_plain_call_as_in_vllm(tiny_dir):
    """``engine.shutdown()`` without await (vLLM's is synchronous) stops the engine: new requests
    are refused at once, running streams end with "abort", and nothing warns of an un-awaited
    coroutine. Awaiting what it returns waits for the clean-up."""
    import warnings

    engine = make_engine(tiny_dir)
    stream = engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=500, ignore_eos=True), "r")
    await stream.__anext__()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.shutdown()
    with pytest.raises(EngineDeadError):
        await engine.generate("hi", SamplingParams(max_tokens=2)).__anext__()
    rest = [o async for o in stream]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    await engine.shutdown()  # the same clean-up, done
    assert not engine.is_running
    assert_no_leaks(engine)


async def test_generation_rate_counts_new_tokens_of_cumulative_streams(tiny_dir):
    """get_stats().generation_tokens_per_s counts the tokens generated, not the lengths of
    cumulative outputs (which repeat every earlier token)."""
    engine = make_engine(tiny_dir)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)  # cumulative outputs
    start = time.monotonic()
    outs = await asyncio.gather(*(consume(engine, [i + 1, 2, 3], params, f"r{i}", kind="cumulative") for i in range(4)))
    elapsed = time.monotonic() - start
    assert all(len(o[-1].outputs[0].token_ids) == 60 for o in outs)
    rate = engine.get_stats().generation_tokens_per_s
    assert 0 < rate <= 1.5 * 240 / min(elapsed, 5.0)  # cumulative counting would be ~30x that
    await engine.shutdown()


async def test_chat_messages_with_content_parts_and_the_templated_prompt(tiny_dir, offline):
    """OpenAI-style content parts are joined into the string the template expects (as vLLM does
    for such templates), and RequestOutput.prompt is the templated text, as in vLLM; the same
    from LLM.chat."""
    tok = offline.get_tokenizer()
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?\nAnd 3 + 3?"}]
    parts = [plain[0], {"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"},
                                                   {"type": "text", "text": "And 3 + 3?"}]}]  # fmt: skip
    text = tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    ids = list(tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=False))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    async with make_engine(tiny_dir) as engine:
        for messages in (plain, parts):
            out = [o async for o in engine.generate(messages, params)][-1]
            assert out.prompt == text and out.prompt_token_ids == ids
        with pytest.raises(ValueError, match=r"messages\[1\].content\[0\]: 'image_url' parts are not accepted: vllmini serves text only"):
            await engine.generate([plain[0], {"role": "user", "content": [{"type": "image_url"}]}], params).__anext__()
    outs = offline.chat([plain, parts], params, use_tqdm=False)
    assert [o.prompt for o in outs] == [text, text] and outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with a string 'role'"):
        offline.chat([plain[0], {"content": "hi"}], params)
    with pytest.raises(ValueError, match="prompts must be a prompt or a list of prompts, got NoneType"):
        offline.generate(None, params)


def test_a_bare_shutdown_as_asyncio_run_ends_still_cleans_up(tiny_dir):
    """``engine.shutdown()`` not awaited, then ``asyncio.run`` returns (cancelling the clean-up
    task): the clean-up happens then, so no request keeps its blocks and the worker stops."""
    engine = make_engine(tiny_dir)

    async def main():
        stream = engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=500, ignore_eos=True), "r")
        await stream.__anext__()
        engine.shutdown()

    asyncio.run(main())
    assert not engine.engine.requests and engine._executor_closed
    assert_no_leaks(engine)

    async def again():
        return await engine.shutdown()  # done: still awaitable, in a later loop

    assert asyncio.run(again()) is None


def test_shutdown_from_another_thread_ends_the_streams_there(tiny_dir):
    """The streams live on an event loop in another thread: shutdown() from this thread runs the
    clean-up on that loop and waits, so the consumer gets its "abort" output."""
    import threading

    engine = make_engine(tiny_dir)
    started, result = threading.Event(), {}

    async def consume_all():
        params = SamplingParams(max_tokens=100_000 // 100, ignore_eos=True)
        async for out in engine.generate({"prompt_token_ids": [1, 2]}, params, "r"):
            started.set()
            result["last"] = out

    consumer = threading.Thread(target=lambda: asyncio.run(consume_all()))
    consumer.start()
    assert started.wait(30)
    assert engine.shutdown() is None
    consumer.join(30)
    assert not consumer.is_alive()
    assert result["last"].finished and result["last"].outputs[0].finish_reason == "abort"
    assert_no_leaks(engine)


async def test_requests_not_yet_admitted_end_with_an_abort_output(tiny_dir):
    engine = make_engine(tiny_dir)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    streams = [engine.generate({"prompt_token_ids": [i + 1, 2]}, params, f"r{i}") for i in range(8)]
    tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
    await asyncio.sleep(0)
    await engine.shutdown()
    for t in tasks:
        out = await t
        assert out.finished and out.outputs and out.outputs[0].finish_reason == "abort"
    assert_no_leaks(engine)


def test_a_stream_still_open_as_asyncio_run_ends_aborts_its_request(tiny_dir):
    """``asyncio.run`` returning with a consumer still streaming cancels it together with the step
    loop: the request is aborted all the same (as a cancelled consumer's is), so it keeps no blocks,
    does not run on unread under the next event loop, and its id may be used again there."""
    engine = make_engine(tiny_dir)

    async def leave_it_open():
        async def consume_all():
            async for _ in engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=5000, ignore_eos=True), "t"):
                pass

        asyncio.create_task(consume_all())
        while "t" not in engine.engine.requests:
            await asyncio.sleep(0.01)

    asyncio.run(leave_it_open())
    engine.run_on_engine_thread(lambda: None)  # (the abort is done on the worker)
    assert not engine.engine.requests
    assert_no_leaks(engine)

    async def reuse():
        async with engine:
            return [o async for o in engine.generate([1, 2], SamplingParams(max_tokens=3, ignore_eos=True), "t")]

    outs = asyncio.run(reuse())
    assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 3


def test_shutdown_is_awaitable_in_a_later_event_loop(tiny_dir):
    """The engine served one ``asyncio.run``; ``async with engine`` (or ``await engine.shutdown()``)
    in a later one, before any request there, must not fail on awaiting None."""
    engine = make_engine(tiny_dir)

    async def serve():
        return [o async for o in engine.generate([1, 2], SamplingParams(max_tokens=2, ignore_eos=True))]

    asyncio.run(serve())

    async def close():
        async with engine:
            pass

    asyncio.run(close())
    assert engine.is_stopped and engine._executor_closed
    assert_no_leaks(engine)


@pytest.mark.parametrize("first", ["consumer", "step loop"])
def test_a_stream_cancelled_with_the_step_loop_still_aborts_its_request(tiny_dir, first):
    """As ``asyncio.run`` ends it cancels the consumer and the step loop in the same tick, in no set
    order: the consumer's clean-up may find the step loop still alive and queue its abort there,
    and the loop then ends without taking it (or with a step in flight whose results are dropped).
    The request is aborted all the same and its id is free."""
    engine = make_engine(tiny_dir)

    async def cancel_both():
        async def consume_all():
            async for _ in engine.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=5000, ignore_eos=True), "t"):
                pass

        consumer = asyncio.create_task(consume_all())
        while "t" not in engine.engine.requests:
            await asyncio.sleep(0.01)
        tasks = [consumer, engine._loop_task] if first == "consumer" else [engine._loop_task, consumer]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(cancel_both())
    engine.run_on_engine_thread(lambda: None)  # (the abort is done on the worker)
    assert not engine.engine.requests and not engine._streams and not engine._aborts
    assert_no_leaks(engine)
    engine.shutdown()


async def test_add_request_refuses_at_the_call_and_abort_frees_an_unread_stream(tiny_dir, offline):
    """vLLM's ``add_request``: a bad request raises at the call (nothing queued); a good one is
    queued before its first output. A stream that is never read still holds its id until
    ``abort()``, which frees it (and the request's KV blocks)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    async with make_engine(tiny_dir) as engine:
        with pytest.raises(ValueError, match="temperature"):
            await engine.add_request("bad", "hi", SamplingParams(temperature=-1))
        assert "bad" not in engine._streams
        stream = await engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, params)
        assert [o async for o in stream][-1].outputs[0].token_ids == offline.generate(
            {"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False
        )[0].outputs[0].token_ids
        await engine.add_request("unread", "hello", SamplingParams(max_tokens=500, ignore_eos=True))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("unread", "hello", params)
        await engine.abort("unread")
        assert "unread" not in engine._streams
        again = await engine.add_request("unread", {"prompt_token_ids": [5, 6, 7]}, params)
        outs = [o async for o in again]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        assert_no_leaks(engine)


async def test_add_requests_checks_every_prompt_before_it_queues_one(tiny_dir, offline):
    """A bad prompt (or an id taken twice) among many refuses them all with nothing queued, as
    vLLM's server checks a request's prompts before it schedules one; good ones run as add_request's."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    good = {"prompt_token_ids": [5, 6, 7]}
    async with make_engine(tiny_dir) as engine:
        for ids, prompts, error in ((["a", "b", "c"], [good, good, [10**9]], "outside the vocabulary"),
                                    (["a", "a"], [good, good], "already in use")):  # fmt: skip
            with pytest.raises(ValueError, match=error):
                await engine.add_requests(ids, prompts, params)
            assert not engine._streams and not engine._new and not engine.engine.requests
        streams = await engine.add_requests(["a", None], [good, "Hi"], params)
        finals = []
        for stream in streams:
            finals.append([o async for o in stream][-1])
        expected = offline.generate([good, "Hi"], params, use_tqdm=False)
        assert [f.outputs[0].token_ids for f in finals] == [e.outputs[0].token_ids for e in expected]
        assert_no_leaks(engine)


async def test_a_stream_from_add_request_closed_before_its_first_read_aborts_its_request(tiny_dir):
    """add_request's stream closed unread (a client gone before the first output) aborts its
    request and frees its id, as one closed after reading does."""
    engine = make_engine(tiny_dir)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    async with engine:
        stream = await engine.add_request("a", prompt, SamplingParams(max_tokens=900, ignore_eos=True))
        await stream.aclose()
        assert "a" not in engine._streams and "a" not in engine.engine.requests
        stream = await engine.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
        outs = [o async for o in stream]
        assert outs[-1].outputs[0].finish_reason == "length" and not engine._streams
        assert_no_leaks(engine)


async def test_closing_a_stream_after_abort_freed_its_id_leaves_a_newer_request_with_that_id(tiny_dir):
    """abort() frees the id before the stream reads its "abort" output; a new request may take the
    id then, and closing the old stream must not abort that one (aborts go by id)."""
    engine = make_engine(tiny_dir)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    async with engine:
        old = await engine.add_request("a", prompt, SamplingParams(max_tokens=900, ignore_eos=True))
        await anext(old)
        await engine.abort("a")
        new = await engine.add_request("a", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        await old.aclose()
        outs = [o async for o in new]
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 5
        assert_no_leaks(engine)


async def test_a_stale_abort_spares_a_newer_request_with_its_id(tiny_dir):
    """A stream closed while abort() runs (a client hanging up meanwhile, or the garbage collector
    closing a dropped stream) queues its own abort, by id, behind the one in flight. Once abort()
    has freed the id a newer request may take it before that stale abort reaches the worker: it
    must not end the newer request. (The interleaving is set up directly: it depends on timing.)"""
    from vllmini.engine.async_engine import _Abort

    prompt = {"prompt_token_ids": [5, 6, 7]}
    async with make_engine(tiny_dir) as engine:
        old = await engine.add_request("x", prompt, SamplingParams(max_tokens=900, ignore_eos=True))
        await anext(old)
        old_queue = engine._streams["x"]
        await engine.abort("x")  # the id is free
        new = await engine.add_request("x", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        engine._aborts.append(_Abort("x", asyncio.Event(), old_queue))  # the old stream's, still queued
        outs = [o async for o in new]
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 5
        await old.aclose()
        assert_no_leaks(engine)


async def test_an_abort_spares_a_request_that_takes_its_id_while_the_step_runs(tiny_dir):
    """An abort passes the loop's check (the old stream still holds the id), then the old stream
    reads its final output and a newer request takes the id while the worker is starting the
    step: the worker must not admit the newer request before it applies that abort. (The
    interleaving is set up directly: the worker waits at the step's start.)"""
    import threading

    prompt = {"prompt_token_ids": [5, 6, 7]}
    async with make_engine(tiny_dir) as engine:
        loop, gate, entered = asyncio.get_running_loop(), threading.Event(), asyncio.Event()
        real = engine._step_once

        def held(*args):
            if "x" in args[-1]:  # the step that applies the abort of "x"
                loop.call_soon_threadsafe(entered.set)
                gate.wait(10)
            return real(*args)

        engine._step_once = held
        old = await engine.add_request("x", prompt, SamplingParams(max_tokens=1))
        while engine._streams["x"].empty():  # finished: its final output waits unread
            await asyncio.sleep(0.01)
        abort = asyncio.ensure_future(engine.abort("x"))
        await entered.wait()
        assert [o.finished for o in [o async for o in old]] == [True]  # the id is free
        new = await engine.add_request("x", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        gate.set()
        await abort
        outs = [o async for o in new]
        assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 5
        assert_no_leaks(engine)


async def test_shutdown_frees_the_kv_cache_at_once(tiny_dir):
    """The engine never steps again: its KV cache goes now, not when the last reference to the
    engine does (a server's routes hold it in cycles that only a full collection frees)."""
    import weakref

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=16 << 20))
    async for _ in engine.generate("Hi", SamplingParams(max_tokens=2), "r"):
        pass
    k_cache = weakref.ref(engine.engine.runner.kv_caches[0][0])
    await engine.shutdown()
    assert k_cache() is None and engine.engine.runner.kv_caches == []
    assert engine.engine.num_generated_tokens == 2  # (the engine's counts are still there to read)
