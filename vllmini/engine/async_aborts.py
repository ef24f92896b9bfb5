"""How ``AsyncLLMEngine``'s requests end early: ``abort`` (by id, waited for until the worker has
done it, the ids free again) and ``shutdown`` (every request aborted, the worker stopped).

Kept apart from async_engine.py, whose subject is the streams and the step loop that feeds
them. Both halves share the worker's inbox (``_new``) and the loop's queue of ``_Abort``s; an
abort must reach the engine whether the step loop runs, has not started, or is being torn
down with its event loop, and a closing stream keeps its request id until its abort is done.
"""
from __future__ import annotations

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

from vllmini.engine.llm_engine import LLMEngine, RequestState
from vllmini.engine.outputs import RequestOutput
from vllmini.engine.request_logger import RequestLogger


@dataclass
class _Abort:
    """A request to abort; ``done`` is set once the worker has aborted it. ``queue``: the stream
    being closed, which keeps its request id until then (a new request cannot take the id while
    the old one may still send outputs)."""

    request_id: str
    done: asyncio.Event
    queue: asyncio.Queue | None = None


class AsyncAborts:
    """``AsyncLLMEngine``'s aborts and shutdown; it builds the fields below."""

    engine: LLMEngine
    _executor: ThreadPoolExecutor
    _lock: threading.Lock
    _new: list[RequestState]
    _held: list[RequestState]
    _aborts: list[_Abort]
    _streams: dict[str, asyncio.Queue]
    _wakeup: asyncio.Event | None
    _loop_task: asyncio.Task | None
    _loop_running: bool
    _dead: bool
    _shutdown_task: asyncio.Task | None
    _executor_closed: bool
    _request_logger: RequestLogger | None
    _deliver: Callable[..., None]

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or several and wait until the worker has done it; each open stream
        ends with an output whose finish_reason is "abort", and the ids are free again (a stream
        from ``add_request`` that was never read, too)."""
        many = isinstance(request_id, Iterable) and not isinstance(request_id, str)
        await self._abort([str(r) for r in request_id] if many else [str(request_id)])

    async def _abort(self, request_ids: list[str], closing: asyncio.Queue | None = None) -> None:
        """Queue the aborts and wait for them. Cancelling the wait does not cancel the aborts,
        and a closing stream's id stays taken until its abort is done."""
        if self._dead or not request_ids:
            return  # (shutdown aborts everything)
        if self._request_logger is not None:
            self._request_logger.log_aborts(request_ids)
        with self._lock:  # held while paused: admitted now, so that the step aborts them with an output
            wanted = set(request_ids)
            self._new += [state for state in self._held if state.request_id in wanted]
            self._held = [state for state in self._held if state.request_id not in wanted]
        if not self._loop_running:
            await self._abort_without_loop(request_ids)
            return
        done = asyncio.Event()
        mine = [_Abort(rid, done, self._streams.get(rid) if closing is None else closing) for rid in request_ids]
        self._aborts += mine
        self._wakeup.set()
        waiter = asyncio.ensure_future(done.wait())
        try:  # or until the loop task ends (shutdown, or asyncio.run cancelling every task at exit)
            while not done.is_set() and self._loop_running:
                await asyncio.wait({waiter, self._loop_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if done.is_set() or self._dead:
            return  # done, or shutdown aborts everything
        # The step loop ended without doing them: asyncio.run ending cancels it together with this
        # consumer, in either order, and a step it left in flight has its results dropped.
        self._aborts = [a for a in self._aborts if a.done is not done]
        await self._abort_without_loop(request_ids)
        for abort in mine:
            self._aborted(abort)

    async def _abort_without_loop(self, request_ids: list[str]) -> None:
        """Abort with no step loop running: none started in this event loop yet, or the one that
        ran it is ending (``asyncio.run`` cancels the step loop and the consumers together).
        Without this the request would keep its blocks and its id, and run on unread under the
        next event loop. The worker does it between steps; no stream is told (none is read)."""
        ids = set(request_ids)
        with self._lock:  # not admitted yet: it never will be
            self._new = [state for state in self._new if state.request_id not in ids]
            self._held = [state for state in self._held if state.request_id not in ids]
        try:
            await asyncio.wrap_future(self._executor.submit(self.engine.abort_request, request_ids))
        except RuntimeError:  # the worker is stopped (shutdown): nothing is left to abort
            pass

    def _aborted(self, abort: _Abort) -> None:
        """The request is gone from the engine, its last output (if any) delivered: its id is
        free again (a stream still being read keeps its own queue)."""
        if abort.queue is not None and self._streams.get(abort.request_id) is abort.queue:
            del self._streams[abort.request_id]
        abort.done.set()

    def shutdown(self) -> asyncio.Future | None:
        """Stop the step loop; every open stream ends with a final "abort" output. A plain call,
        as vLLM's: new requests are refused at once. On the step loop's event loop the clean-up
        runs there as a task, returned (``await engine.shutdown()`` waits for it; if the loop
        ends first, e.g. ``asyncio.run`` returning, it is done then). From another thread it
        is run on that loop and waited for; with no loop left it is done here."""
        self._dead = True
        task = self._shutdown_task
        if task is not None and not task.cancelled():
            return task
        engine_loop = None if self._loop_task is None else self._loop_task.get_loop()
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if not self._executor_closed:  # (closed already: nothing is left to do, but something to await)
            if current is not None and engine_loop in (None, current):
                self._shutdown_task = current.create_task(self._shutdown(), name="vllmini-engine-shutdown")
                self._shutdown_task.add_done_callback(lambda t: self._close_now() if t.cancelled() else None)
                return self._shutdown_task
            if engine_loop is not None and engine_loop.is_running():  # the streams live on another thread's loop
                asyncio.run_coroutine_threadsafe(self._shutdown(), engine_loop).result()
            else:  # no loop left to deliver to
                self._close_now()
        if current is None:
            return None
        done = current.create_future()  # done here, but ``await engine.shutdown()`` must still work
        done.set_result(None)
        return done

    async def _shutdown(self) -> None:
        if self._loop_task is not None:
            self._wakeup.set()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        pending, self._aborts = self._aborts, []
        for abort in pending:  # the engine is stopping: everything is aborted below
            self._aborted(abort)
        outs = await asyncio.get_running_loop().run_in_executor(self._executor, self._abort_everything)
        for out in outs:
            self._deliver(out)
        for rid in list(self._streams):  # (a request the engine refused as it was admitted)
            self._deliver(RequestOutput(rid, None, [], None, [], True))
        self._close_now()

    def _abort_everything(self) -> list[RequestOutput]:
        """On the worker: admit what is still in the inbox (so that those requests, too, end with
        a proper "abort" output) and abort every request."""
        with self._lock:
            new, self._new, self._held = self._new + self._held, [], []
        for state in new:
            try:
                self.engine.enqueue(state)
            except ValueError:  # its id is taken: the stream ends without outputs (below)
                pass
        return self.engine.abort_request(list(self.engine.requests))

    def _close_now(self) -> None:
        """Abort everything and stop the worker, blocking (no stream is told)."""
        if not self._executor_closed:
            self._executor_closed = True
            self._executor.submit(self._abort_everything).result()
            self._executor.shutdown(wait=True)
            self.engine.structured.close()  # (its compile thread, if a grammar ever started one)
            # The engine never steps again: its KV cache is freed now, not when the last reference
            # goes (a server's routes and tasks hold the engine in cycles, which only a full
            # collection frees; frozen by a later engine's gc.freeze, never: unfreeze them).
            self.engine.runner.kv_caches.clear()
            self.engine.runner.state_caches.clear()
            gc.unfreeze()
