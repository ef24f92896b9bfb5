"""Pause / resume and sleep mode, with vLLM's rules (engine/async_pause.py, engine/worker.py):
in-flight requests aborted, drained or frozen; requests that arrive while paused or asleep wait;
no KV block leaks; the KV cache's (and, at level 2, the weights') memory really given back;
outputs after wake_up equal those before. The server's development routes exist only in dev mode."""
from __future__ import annotations

import asyncio
import gc
import weakref

import httpx
import pytest
import torch

from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.entrypoints.openai.api_server import build_app
from vllmini.entrypoints.openai.dev_routes import DEV_MODE_ENV

PROMPT = {"prompt_token_ids": [5, 17, 300, 42, 9, 1200, 77, 3, 8, 12, 99, 4000, 5, 6, 7, 8, 9, 10, 11]}
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def assert_no_leaks(engine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert not engine.has_unfinished_requests() and not engine.scheduler.running and not engine.scheduler.waiting
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"


def async_engine(tiny_dir, **kwargs) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=1 << 24, **kwargs))


async def started(engine: AsyncLLMEngine, n: int, params: SamplingParams = LONG) -> list[tuple[asyncio.Task, list]]:
    """``n`` streams, each having produced a first output; (task collecting outputs, outputs)."""
    runs = []
    for _ in range(n):
        seen: list = []
        stream = await engine.add_request(None, PROMPT, params)

        async def collect(stream=stream, seen=seen):
            async for out in stream:
                seen.append(out)
            return seen

        runs.append((asyncio.create_task(collect()), seen))
    while not all(seen for _, seen in runs):
        await asyncio.sleep(0.01)
    return runs


def test_pause_abort_mode_and_requests_arriving_while_paused(tiny_dir):
    """vLLM's default mode: the streams in flight end with finish_reason "abort"; a request that
    arrives while paused is accepted and waits, unscheduled, until resume_generation."""
    engine = async_engine(tiny_dir)

    async def main():
        runs = await started(engine, 3)
        assert not await engine.is_paused()
        await engine.pause_generation()
        assert await engine.is_paused()
        for task, _ in runs:
            outs = await asyncio.wait_for(task, 5)
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        assert_no_leaks(engine.engine)
        late = asyncio.create_task(_final(engine, GREEDY))
        await asyncio.sleep(0.3)
        assert not late.done() and not engine.engine.has_unfinished_requests()  # waiting, not admitted
        await engine.pause_generation()  # again while paused: the waiting request is in flight too (vLLM's)
        out = await asyncio.wait_for(late, 5)
        assert out.outputs[0].finish_reason == "abort" and not out.outputs[0].token_ids
        late = asyncio.create_task(_final(engine, GREEDY))
        await asyncio.sleep(0.3)
        assert not late.done()
        await engine.resume_generation()
        out = await asyncio.wait_for(late, 10)
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == GREEDY.max_tokens
        assert not await engine.is_paused()
        assert_no_leaks(engine.engine)
        await engine.shutdown()

    asyncio.run(main())


async def _final(engine: AsyncLLMEngine, params: SamplingParams, prompt=PROMPT):
    async for out in engine.generate(prompt, params):
        pass
    return out


def test_pause_wait_mode_drains_and_keep_mode_freezes(tiny_dir):
    """mode="wait" returns once the requests in flight have finished (all their tokens); "keep"
    freezes them (no token while paused) and they finish after the resume exactly as an
    unpaused run does. The deprecated wait_for_inflight_requests=True is mode="wait"."""
    engine = async_engine(tiny_dir)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def main():
        reference = await _final(engine, params)
        runs = await started(engine, 2, params)
        await engine.pause_generation(mode="wait")
        for task, seen in runs:
            assert task.done() or seen[-1].finished
            assert seen[-1].outputs[0].finish_reason == "length"
            assert seen[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        await engine.resume_generation()
        runs = await started(engine, 2, params)
        with pytest.warns(DeprecationWarning, match="mode='wait'"):
            await engine.pause_generation(wait_for_inflight_requests=True)
        assert all(seen[-1].outputs[0].finish_reason == "length" for _, seen in runs)
        await engine.resume_generation()

        runs = await started(engine, 2, params)
        await engine.pause_generation(mode="keep")
        counts = [len(seen[-1].outputs[0].token_ids) for _, seen in runs]
        await asyncio.sleep(0.3)
        assert [len(seen[-1].outputs[0].token_ids) for _, seen in runs] == counts and max(counts) < 30
        assert engine.engine.has_unfinished_requests()  # frozen, not aborted
        await engine.resume_generation()
        for task, _ in runs:
            outs = await asyncio.wait_for(task, 10)
            assert outs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        assert_no_leaks(engine.engine)
        with pytest.raises(ValueError, match="pause mode must be one of"):
            await engine.pause_generation(mode="later")
        await engine.shutdown()

    asyncio.run(main())


def test_pause_clear_cache_forgets_the_prefix_cache(tiny_dir):
    engine = async_engine(tiny_dir)

    async def main():
        await _final(engine, GREEDY)
        await engine.pause_generation(clear_cache=False)
        await engine.resume_generation()
        assert (await _final(engine, GREEDY)).num_cached_tokens == 16
        await engine.pause_generation()  # clear_cache=True
        await engine.resume_generation()
        assert (await _final(engine, GREEDY)).num_cached_tokens == 0
        await engine.shutdown()

    asyncio.run(main())


def _kv_refs(llm_engine) -> list[weakref.ref]:
    return [weakref.ref(t) for pair in llm_engine.runner.kv_caches for t in pair]


def test_llm_sleep_level_1_frees_the_kv_cache_and_wakes_up_the_same(tiny_dir):
    llm = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24, enable_sleep_mode=True)
    before = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    refs = _kv_refs(llm.llm_engine)
    llm.sleep(level=1)
    gc.collect()
    assert llm.is_sleeping() and all(r() is None for r in refs), "the KV cache tensors are still alive"
    with pytest.raises(RuntimeError, match="sleeping: call wake_up"):
        llm.generate(PROMPT, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    after = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0  # (the prefix cache was forgotten with the KV cache)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    assert_no_leaks(llm.llm_engine)


def test_llm_sleep_level_2_discards_the_weights_until_they_are_loaded_again(tiny_dir):
    """Level 2: every weight's memory given back; wake_up(["weights"]), then the weights loaded
    (vLLM's reload_weights through collective_rpc), then wake_up(["kv_cache"]): the same outputs."""
    llm = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24, enable_sleep_mode=True)
    before = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    model = llm.llm_engine.model
    llm.sleep(level=2)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(m.packed.numel() == 0 for m in model.modules() if hasattr(m, "packed"))
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # (the KV cache is still asleep)
    [loaded] = llm.collective_rpc("reload_weights")
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before.outputs[0].token_ids
    with pytest.raises(ValueError, match="wake_up tags must be among"):
        llm.wake_up(tags=["activations"])
    with pytest.raises(ValueError, match="sleep level must be 1"):
        llm.sleep(level=3)


def test_sleep_needs_enable_sleep_mode(tiny_dir):
    llm = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24)
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        llm.sleep()


def test_async_sleep_aborts_in_flight_and_holds_new_requests_until_wake_up(tiny_dir):
    engine = async_engine(tiny_dir, enable_sleep_mode=True)

    async def main():
        reference = await _final(engine, GREEDY)
        runs = await started(engine, 2)
        refs = _kv_refs(engine.engine)
        await engine.sleep(level=1)
        for task, _ in runs:
            assert (await asyncio.wait_for(task, 5))[-1].outputs[0].finish_reason == "abort"
        gc.collect()
        assert await engine.is_sleeping() and all(r() is None for r in refs)
        late = asyncio.create_task(_final(engine, GREEDY))
        await asyncio.sleep(0.3)
        assert not late.done()
        with pytest.raises(RuntimeError, match="sleeping"):
            await engine.resume_generation()
        await engine.wake_up()
        out = await asyncio.wait_for(late, 10)
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        assert not await engine.is_sleeping() and not await engine.is_paused()
        assert_no_leaks(engine.engine)
        await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("dev_mode", [False, True])
def test_server_dev_routes_only_in_dev_mode(tiny_dir, monkeypatch, dev_mode):
    if dev_mode:
        monkeypatch.setenv(DEV_MODE_ENV, "1")
    else:
        monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    engine = async_engine(tiny_dir, enable_sleep_mode=True)
    app = build_app(engine)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            if not dev_mode:
                for method, path in [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/sleep"),
                                     ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/collective_rpc")]:  # fmt: skip
                    assert (await client.request(method, path)).status_code == 404, path
                return
            assert (await client.get("/is_paused")).json() == {"is_paused": False}
            assert (await client.post("/pause", params={"mode": "keep"})).status_code == 200
            assert (await client.get("/is_paused")).json() == {"is_paused": True}
            assert (await client.post("/pause", params={"mode": "never"})).status_code == 400
            assert (await client.post("/resume")).status_code == 200
            assert (await client.post("/sleep", params={"level": "2"})).status_code == 200
            assert (await client.get("/is_sleeping")).json() == {"is_sleeping": True}
            assert (await client.post("/wake_up", params={"tags": "weights"})).status_code == 200
            rpc = await client.post("/collective_rpc", json={"method": "reload_weights"})
            assert rpc.status_code == 200 and "model.norm.weight" in rpc.json()["results"][0]
            assert (await client.post("/collective_rpc", json={"method": "nope"})).status_code == 400
            assert (await client.post("/wake_up")).status_code == 200
            assert (await client.get("/is_sleeping")).json() == {"is_sleeping": False}
            done = await client.post("/v1/completions", json={"prompt": PROMPT["prompt_token_ids"], "max_tokens": 12,
                                                              "temperature": 0, "ignore_eos": True})  # fmt: skip
            assert done.status_code == 200 and done.json()["choices"][0]["finish_reason"] == "length"
        await engine.shutdown()

    asyncio.run(main())
    assert_no_leaks(engine.engine)


def test_weights_stay_in_place_on_update(tiny_dir):
    """The CUDA graphs replay captured addresses: an update copies into the parameters (same
    storage) rather than replacing them (checked on the parameters that are not prepacked)."""
    llm = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24)
    model = llm.llm_engine.model
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    state = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    llm.apply_model(lambda m: m.load_weights(state.items()))
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    assert all(torch.equal(p, state[n]) for n, p in model.named_parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (decode CUDA graphs, weights offloaded)")
def test_cuda_graphs_survive_updates_and_sleep(tiny_dir):
    """On CUDA the decode steps replay graphs of fixed addresses: an in-place update keeps them
    valid; sleep gives the memory back to the driver (weights to the CPU at level 1) and wake_up
    captures them again. Greedy tokens equal the first run's after each."""
    llm = LLM(model=str(tiny_dir), dtype="float32", kv_cache_memory=1 << 28, enable_sleep_mode=True)
    runner = llm.llm_engine.runner
    assert runner.decode_graphs is not None and runner.decode_graphs.graphs
    want = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    noise = {n: torch.randn_like(p) * 0.05 for n, p in llm.llm_engine.model.named_parameters() if n.endswith("proj.weight")}
    llm.collective_rpc(lambda w: w.get_model().load_weights(noise.items()))  # (fused names: not HF's)
    llm.reset_prefix_cache()
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids != want
    llm.collective_rpc("reload_weights")
    llm.reset_prefix_cache()
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    for level in (1, 2):
        before = torch.cuda.memory_allocated()
        llm.sleep(level=level)
        assert torch.cuda.memory_allocated() < before - (1 << 27)
        if level == 2:
            llm.wake_up(["weights"])
            llm.collective_rpc("reload_weights")
        llm.wake_up()
        assert runner.decode_graphs is not None and runner.decode_graphs.graphs
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


def test_collective_rpc_sleep_and_wake_up_are_the_engines(tiny_dir):
    """``collective_rpc("sleep")`` (a worker method's name) is the engine's sleep: the requests in
    flight end ("abort") instead of hanging on a KV cache that is gone, and the prefix cache is
    forgotten with it (a hit would read the zeros wake_up leaves); ``collective_rpc("wake_up")``
    resumes. The same on ``LLM``."""
    engine = async_engine(tiny_dir, enable_sleep_mode=True)

    async def main():
        reference = await _final(engine, GREEDY)
        [(task, _)] = await started(engine, 1)
        assert await engine.collective_rpc("sleep", args=(1,)) == [None]
        assert await engine.is_sleeping()
        assert (await asyncio.wait_for(task, 5))[-1].outputs[0].finish_reason == "abort"
        await engine.collective_rpc("wake_up")
        assert not await engine.is_sleeping()
        out = await asyncio.wait_for(_final(engine, GREEDY), 10)
        assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference.outputs[0].token_ids
        assert_no_leaks(engine.engine)
        await engine.shutdown()

    asyncio.run(main())
    llm = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24, enable_sleep_mode=True)
    before = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    llm.collective_rpc("sleep", kwargs={"level": 1})
    assert llm.is_sleeping()
    llm.collective_rpc("wake_up")
    after = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0 and after.outputs[0].token_ids == before.outputs[0].token_ids


def test_keep_mode_with_clear_cache_preempts_and_sleep_keeps_requests(tiny_dir):
    """As vLLM's: ``pause_generation(mode="keep")`` with clear_cache (the default) preempts the
    frozen requests and forgets the prefix cache (they are recomputed at the resume: a weight update
    made meanwhile reaches their whole context, tests/test_weight_update.py); ``sleep(mode="keep")``
    with requests in flight keeps them, and they finish after wake_up as an unpaused run does.
    ``reset_prefix_cache(reset_running_requests=True)`` works while streams run."""
    engine = async_engine(tiny_dir, enable_sleep_mode=True)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)

    async def main():
        reference = await _final(engine, params)
        runs = await started(engine, 2, params)
        await engine.pause_generation(mode="keep")
        sched = engine.engine.scheduler
        assert not sched.running and len(sched.waiting) == 2  # preempted, not aborted
        assert engine.engine.block_manager.num_free_blocks == engine.engine.block_manager.num_blocks
        await engine.resume_generation()
        for task, _ in runs:
            assert (await asyncio.wait_for(task, 10))[-1].outputs[0].token_ids == reference.outputs[0].token_ids

        runs = await started(engine, 2, params)
        await engine.sleep(level=1, mode="keep")
        assert await engine.is_sleeping() and engine.engine.has_unfinished_requests()
        await engine.wake_up()
        for task, _ in runs:
            assert (await asyncio.wait_for(task, 10))[-1].outputs[0].token_ids == reference.outputs[0].token_ids

        runs = await started(engine, 2, params)
        assert await engine.reset_prefix_cache() is False
        assert await engine.reset_prefix_cache(reset_running_requests=True) is True
        for task, _ in runs:
            assert (await asyncio.wait_for(task, 10))[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        assert_no_leaks(engine.engine)
        await engine.shutdown()

    asyncio.run(main())


def test_dev_route_collective_rpc_checks_its_arguments_first(tiny_dir, monkeypatch):
    """A bad ``args``, ``kwargs`` or ``timeout`` is a 400 naming it, before anything runs; a
    folder without weights is a 400 too; a timeout that passes is a 504; the engine goes on."""
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    engine = async_engine(tiny_dir)
    app = build_app(engine)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            async def rpc(body):
                return await client.post("/collective_rpc", json=body)

            for body, field in [({"method": "reload_weights", "args": "abc"}, "'args'"),
                                ({"method": "reload_weights", "kwargs": ["x"]}, "'kwargs'"),
                                ({"method": "reload_weights", "timeout": "soon"}, "timeout"),
                                ({"method": "reload_weights", "timeout": -1}, "timeout"),
                                ({"method": "reload_weights", "kwargs": {"weights_path": 5}}, "weights_path"),
                                ({"method": "reload_weights", "kwargs": {"weights_path": str(tiny_dir.parent)}},
                                 "no *.safetensors")]:  # fmt: skip
                answer = await rpc(body)
                assert answer.status_code == 400 and field in answer.json()["error"]["message"], (body, answer.text)
            slow = await rpc({"method": "reload_weights", "timeout": 1e-6})
            assert slow.status_code == 504 and "took more than" in slow.text
            assert (await client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})).status_code == 200
            done = await client.post("/v1/completions", json={"prompt": PROMPT["prompt_token_ids"], "max_tokens": 4})
            assert done.status_code == 200
        await engine.shutdown()

    asyncio.run(main())
    assert_no_leaks(engine.engine)


def test_sleep_level_0_is_a_pause_woken_by_the_scheduling_tag(tiny_dir):
    """vLLM's level 0: a pause in ``mode`` that keeps the prefix cache and needs no sleep mode;
    ``is_sleeping()`` says so; ``wake_up(["scheduling"])`` (or ``wake_up()``) resumes."""
    engine = async_engine(tiny_dir)

    async def main():
        reference = await _final(engine, GREEDY)
        for tags in (["scheduling"], None):
            runs = await started(engine, 2)
            await engine.sleep(level=0)
            assert await engine.is_sleeping() and await engine.is_paused()
            for task, _ in runs:
                assert (await asyncio.wait_for(task, 5))[-1].outputs[0].finish_reason == "abort"
            late = asyncio.create_task(_final(engine, GREEDY))
            await asyncio.sleep(0.2)
            assert not late.done()
            await engine.wake_up(tags)
            out = await asyncio.wait_for(late, 10)
            assert out.num_cached_tokens == 16 and out.outputs[0].token_ids == reference.outputs[0].token_ids
            assert not await engine.is_sleeping()
        with pytest.raises(ValueError, match="wake_up tags must be among"):
            await engine.wake_up(["activations"])
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            await engine.sleep(level=1)
        assert_no_leaks(engine.engine)
        await engine.shutdown()

    asyncio.run(main())
    llm = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24, enable_sleep_mode=True)
    llm.sleep(level=1)
    llm.wake_up(["scheduling", "weights"])  # (the sync engine has no pause: "scheduling" is a no-op there)
    assert llm.is_sleeping()
    llm.wake_up(["kv_cache", "scheduling"])
    assert not llm.is_sleeping()


def test_collective_rpc_sleep_past_its_timeout_still_completes(tiny_dir):
    """As other collective_rpc calls: the TimeoutError leaves the call running to its end (a sleep
    cancelled halfway would leave the engine paused but awake)."""
    engine = async_engine(tiny_dir, enable_sleep_mode=True)

    async def main():
        await started(engine, 2)
        with pytest.raises(TimeoutError, match="took more than"):
            await engine.collective_rpc("sleep", timeout=1e-6)
        for _ in range(100):
            if engine.engine.is_sleeping():
                break
            await asyncio.sleep(0.02)
        assert engine.engine.is_sleeping()
        await engine.wake_up()
        assert_no_leaks(engine.engine)
        await engine.shutdown()

    asyncio.run(main())
