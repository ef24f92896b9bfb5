"""AsyncLLMEngine: per-request async streams over the continuous-batching core.

The event loop never runs a forward. Requests are validated and tokenized at the call
(errors raise right there), then handed to one worker thread that owns the
``LLMEngine``: it adds new requests and aborts between steps, runs ``step()`` and
sends each ``RequestOutput`` back to its request's ``asyncio.Queue``. The loop task
sleeps when there is no work and wakes as soon as a request arrives.

Leaving an ``async for`` early (break, ``aclose()``, task cancellation, a timeout)
aborts the request and waits until the worker has done it (its KV blocks are then free), as
``await abort(...)`` does: afterwards the request id may be used again, and nothing of the old
request reaches a new stream with the same id.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from vllmini.config import EngineArgs
from vllmini.engine.async_aborts import AsyncAborts, _Abort
from vllmini.engine.async_beam_search import start_beam_search
from vllmini.engine.async_pause import AsyncPause
from vllmini.engine.beam_search import BeamSearchParams
from vllmini.engine.chat import render_chat
from vllmini.engine.engine_client import EngineClient, EngineDeadError  # noqa: F401 (re-exported, as before)
from vllmini.engine.engine_stats import EngineStats, GenerationRate
from vllmini.engine.llm_engine import LLMEngine, PromptType, RequestState, StepError
from vllmini.engine.outputs import PoolingRequestOutput, RequestOutput
from vllmini.engine.pooling_params import PoolingParams
from vllmini.engine.request_logger import RequestLogger
from vllmini.engine.sampling_params import SamplingParams
from vllmini.engine.structured_outputs import load_xgrammar
from vllmini.lora.request import LoRARequest

logger = logging.getLogger("vllmini")


class AsyncLLMEngine(AsyncAborts, AsyncPause, EngineClient):
    """Request streams over an ``LLMEngine`` stepped on one worker thread (async_aborts.py: abort
    and shutdown; async_pause.py: pause, sleep and collective_rpc; engine_client.py: the other calls
    besides streams)."""

    def __init__(self, engine: LLMEngine, executor: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllmini-step")
        self._lock = threading.Lock()  # guards the inbox of new requests, shared with the worker thread
        self._new: list[RequestState] = []
        self._held: list[RequestState] = []  # added while paused (async_pause.py): admitted at the resume
        self._pause_mode: str | None = None
        self._aborts: list[_Abort] = []  # taken by the step loop, on the event loop's thread
        self._streams: dict[str, asyncio.Queue] = {}
        self._wakeup: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None  # set by the step loop when it finds nothing to run
        self._loop_task: asyncio.Task | None = None
        self._dead = False
        self._shutdown_task: asyncio.Task | None = None
        self._executor_closed = False
        self._rate = GenerationRate(engine.num_generated_tokens)
        self._request_logger = RequestLogger(engine.args.max_log_len) if engine.args.enable_log_requests else None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLMEngine:
        """Builds the engine on the worker thread that will step it. torch's OpenMP thread
        pool is per calling thread: loading on one thread and stepping on another leaves two
        pools on the machine's cores, and on a 2-core CPU that cost ~10-15% of step time
        (measured: 64 x 64-token offline run, 195 vs 225 tok/s)."""
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllmini-step")
        try:
            engine = executor.submit(LLMEngine.from_engine_args, engine_args).result()
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, executor)

    # ---- lifecycle ------------------------------------------------------------------------
    @property
    def _loop_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def __aenter__(self) -> AsyncLLMEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wakeup, self._idle = asyncio.Event(), asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="vllmini-engine-loop")

    # ---- requests ------------------------------------------------------------------------
    def _prompt(self, prompt: PromptType | list[dict[str, str]]) -> PromptType:
        """Chat messages go through the chat template; other prompt forms pass through."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return render_chat(self.engine.tokenizer, prompt, add_generation_prompt=True)
        return prompt

    async def generate(
        self,
        prompt: PromptType | list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (cumulative, delta or final per ``output_kind``).
        ``priority`` (lower first) needs ``scheduling_policy="priority"``, as in vLLM;
        ``lora_request`` an engine started with ``enable_lora``."""
        stream = await self.add_request(request_id, prompt, sampling_params, priority=priority, lora_request=lora_request)
        try:
            async for out in stream:
                yield out
        finally:  # closing this generator leaves the loop without closing ``stream``: close it here,
            await stream.aclose()  # so that the abort is done (the id free) when aclose() returns

    def beam_search(
        self, prompt: PromptType, request_id: str, params: BeamSearchParams, lora_request: LoRARequest | None = None
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """vLLM's ``EngineClient.beam_search`` (engine/async_beam_search.py): checked now, then
        ``async for`` gives one final RequestOutput holding the best ``beam_width`` beams."""
        return start_beam_search(self, prompt, request_id, params, lora_request)

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's ``encode`` on an engine with ``runner="pooling"``: one ``PoolingRequestOutput``
        (finished, ``.outputs.data`` the pooled vector) once the prompt is computed. ``pooling_params``
        None: the engine's PoolerConfig. Leaving early aborts the request, as ``generate``."""
        stream = await self.add_request(request_id, prompt, pooling_params or PoolingParams(), priority=priority,
                                        lora_request=lora_request)  # fmt: skip
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def add_request(
        self,
        request_id: str | None,
        prompt: PromptType | list[dict[str, str]],
        sampling_params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's name: validate and queue a request now (a bad one raises ValueError here and
        nothing is queued) and return its output stream, for callers that must know a request
        is accepted before its first output (a server answering 400 or 200). Read the stream to
        its end, close it, or ``abort()`` the request: until then it holds its id. PoolingParams:
        a pooling request (``encode``)."""
        (stream,) = await self.add_requests([request_id], [prompt], sampling_params, priority=priority,
                                            lora_request=lora_request)  # fmt: skip
        return stream

    async def add_requests(
        self,
        request_ids: list[str | None],
        prompts: list[PromptType | list[dict[str, str]]],
        sampling_params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """``add_request`` for several prompts (one request each, the same params), every one checked
        before any is queued, as vLLM's server checks a request's prompts before it schedules one: a
        bad one raises ValueError and none is queued (none aborted, none counted in the metrics)."""
        await self.check_health()
        if getattr(sampling_params, "structured_outputs", None) is not None:
            await asyncio.to_thread(load_xgrammar)  # its first import (~1.5 s) off the event loop
        adapter = None  # loaded off the event loop, and held: prepare_request finds it even if evicted since
        if lora_request is not None and self.engine.lora_manager is not None:
            adapter = await asyncio.to_thread(self.engine.lora_manager.get, lora_request)
        states: list[RequestState] = []
        taken: set[str] = set()  # the ids of this call's requests so far
        try:
            for request_id, prompt in zip(request_ids, prompts, strict=True):
                if request_id is not None and (str(request_id) in self._streams or str(request_id) in taken):
                    raise ValueError(f"request_id {request_id!r} is already in use")
                if request_id is None:  # an id no caller's request holds
                    request_id = self.engine.new_request_id(self._streams)
                states.append(self.engine.prepare_request(request_id, self._prompt(prompt), sampling_params,
                                                          priority=priority, lora_request=lora_request))  # fmt: skip
                taken.add(states[-1].request_id)
        except BaseException:
            for state in states:
                if state.grammar is not None:  # (refused: no need to compile its grammar)
                    state.grammar.cancel()
            raise
        del adapter
        streams = [self._queue(state, lora_request) for state in states]
        with self._lock:  # (all at once: the step loop takes them into one step)
            (self._held if self._pause_mode is not None else self._new).extend(states)
        self._ensure_loop()
        self._wakeup.set()
        for stream in streams:  # started: a generator closed before it started would skip its finally (no abort)
            await anext(stream)
        return streams

    def _queue(self, state: RequestState, lora_request: LoRARequest | None) -> AsyncIterator[RequestOutput]:
        """The stream of a checked request, its id now held."""
        rid = state.request_id
        if self._request_logger is not None:
            self._request_logger.log_inputs(rid, state.prompt, state.prompt_token_ids, state.params, lora_request)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        return self._outputs(rid, queue)

    async def _outputs(self, rid: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            yield None  # (taken by add_request) from here on, closing the stream aborts the request
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # not ours any more: abort() has ended the request and freed the id, which a newer
            # request may hold now (aborts go by id: that one must not be aborted)
            mine = self._streams.get(rid) is queue
            if finished or self._dead or not self._loop_running:
                if mine:
                    del self._streams[rid]
                if mine and not finished and not self._dead:  # the step loop is gone (asyncio.run ending): abort all the same
                    await self._abort_without_loop([rid])
            elif mine:  # as vLLM: once the stream is closed, the old request is gone and its id free
                await self._abort([rid], closing=queue)

    def get_stats(self) -> EngineStats:
        bm, sched = self.engine.block_manager, self.engine.scheduler
        return EngineStats(len(sched.running), len(sched.waiting), bm.usage, bm.num_free_blocks, self._rate.per_second())

    # ---- the step loop -------------------------------------------------------------------
    def _step_once(
        self, new: list[RequestState], aborts: list[str]
    ) -> tuple[list[RequestOutput], dict[str, BaseException]]:
        """Runs on the worker thread: admit, abort, one step (none while paused in "keep" mode, or
        asleep)."""
        errors: dict[str, BaseException] = {}
        for state in new:
            try:
                self.engine.enqueue(state)
            except ValueError as exc:
                errors[state.request_id] = exc
        outputs = self.engine.abort_request(aborts)
        if self._pause_mode == "keep" or self.engine.is_sleeping():
            return outputs, errors
        try:
            outputs += self.engine.step()
        except StepError as exc:
            errors.update({rid: exc for rid in exc.request_ids})
        errors.update(self.engine.failed)
        self.engine.failed.clear()
        return outputs, errors

    def _has_work(self) -> bool:
        with self._lock:
            pending = bool(self._new)
        frozen = self._pause_mode == "keep" or self.engine.is_sleeping()
        return pending or bool(self._aborts) or (self.engine.has_unfinished_requests() and not frozen)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._dead:
            if not self._has_work():
                self._wakeup.clear()
                if not self._has_work():
                    self._idle.set()
                    await self._wakeup.wait()
                continue
            aborts, self._aborts = self._aborts, []
            # aborts go by id: one whose stream has already ended (its request finished or aborted, its
            # id free and maybe taken by a newer request since) has nothing left to abort. The new requests
            # are taken here, with that check: one that takes a freed id once the step is handed to the
            # worker waits for the next step, so that an abort of the old request cannot end it
            ids = [a.request_id for a in aborts if a.queue is None or self._streams.get(a.request_id) is a.queue]
            with self._lock:
                new, self._new = self._new, []
            try:
                outputs, errors = await loop.run_in_executor(self._executor, self._step_once, new, ids)
            except Exception as exc:  # a bug in the engine itself: fail its requests, keep the loop alive
                logger.exception("engine step failed")
                with self._lock:  # requests submitted during the step are still in _new, untouched: they go on
                    untouched = {state.request_id for state in self._new}
                outputs, errors = [], {rid: exc for rid in list(self._streams) if rid not in untouched}
                try:  # their requests leave the engine too (no one reads them; their ids free up)
                    await loop.run_in_executor(self._executor, self.engine.abort_request, list(errors))
                except Exception:
                    logger.exception("aborting the failed requests failed")
            for out in outputs:
                self._deliver(out)
            for rid, exc in errors.items():
                self._deliver(exc, rid)
            for abort in aborts:  # done (or failed with the step: its request got the error)
                self._aborted(abort)
            self._rate.update(self.engine.num_generated_tokens)
            await asyncio.sleep(0)  # let consumers run between steps

    def _deliver(self, item: Any, request_id: str | None = None) -> None:
        queue = self._streams.get(request_id or item.request_id)
        if queue is not None:
            queue.put_nowait(item)
