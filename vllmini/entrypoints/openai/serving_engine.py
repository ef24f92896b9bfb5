"""What the completion and chat endpoints share: the model name check (and the LoRA adapter it
names), the engine requests behind one API request, usage, logprobs and the server-sent-event
framing."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import msgspec

from vllmini.engine.async_engine import AsyncLLMEngine
from vllmini.engine.beam_search import BeamSearchParams
from vllmini.engine.errors import VLLMValidationError
from vllmini.engine.outputs import LogprobsEntry, RequestOutput
from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.protocol import StreamOptions
from vllmini.entrypoints.openai.serving_models import OpenAIServingModels
from vllmini.lora.request import LoRARequest

MIN_LOGPROB = -9999.0  # JSON has no -inf: vLLM reports a token that cannot occur with this
# the routes' tokenizing (a long prompt: seconds) runs here, one at a time, as vLLM's async tokenizer:
# on the event loop it held every stream meanwhile
_TOKENIZER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllmini-tokenize")
T = TypeVar("T")
# what vLLM 0.32 sends as null where vllmini has nothing to give (OpenAI's fields and vLLM's own):
# a client that reads them finds them, as from vLLM
MESSAGE_NULLS: dict[str, Any] = {"refusal": None, "annotations": None, "audio": None, "function_call": None}
RESPONSE_NULLS: dict[str, Any] = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the tokenizer thread, its exception raised here."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, functools.partial(fn, *args))


def json_logprob(logprob: float) -> float:
    """A logprob as the API writes it: a plain float, -inf as ``MIN_LOGPROB``."""
    return max(float(logprob), MIN_LOGPROB)


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape, which its client raises from (``BadRequestError`` for 400...);
    ``param``: the request field at fault, where known (vLLM's VLLMValidationError.parameter)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def refusal_endpoint(message: str, kind: str, status: int) -> Callable[[Any], Awaitable[Any]]:
    """A route's endpoint that answers every request with this error (OpenAI's shape)."""
    from starlette.responses import Response

    async def endpoint(request: Any) -> Response:
        return Response(msgspec.json.encode(error_body(message, kind, status)), status_code=status,
                        media_type="application/json")  # fmt: skip

    return endpoint


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event, as the OpenAI API streams them."""
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return f"data: {data}\n\n"


def salted(prompt: Any, cache_salt: str) -> dict[str, Any]:
    """A prompt (text, token ids or a prompt dict) as a prompt dict with ``cache_salt``."""
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": cache_salt}
    return {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt, "cache_salt": cache_salt}


class RequestGroup:
    """The engine requests behind one API request (one per prompt, each with the request's n
    completions), read as one stream of (prompt index, output). ``close()`` closes every stream,
    which aborts what has not finished: a client that hangs up frees its KV blocks at the next
    step (a stream aborts only its own request, never a newer one that took a freed id)."""

    def __init__(self, streams: list[AsyncIterator[RequestOutput]]) -> None:
        self.streams = streams
        self.unfinished = set(range(len(streams)))
        self._merged: AsyncIterator[tuple[int, RequestOutput]] | None = None  # the reader, once iterated

    @classmethod
    async def start(
        cls, engine: AsyncLLMEngine, request_id: str, prompts: list[Any], params: SamplingParams, priority: int,
        lora_request: LoRARequest | None = None, cache_salt: str | None = None, beam: BeamSearchParams | None = None,
    ) -> RequestGroup:  # fmt: skip
        """Check every prompt, then queue them all, so that a bad one is refused (ValueError) before
        any answer is sent and with nothing queued, as vLLM's server checks them all before it
        schedules one. ``cache_salt``: a request's (vLLM's), put in each prompt. ``beam``: each
        prompt is a beam search instead (one final output), checked now and run once read."""
        if cache_salt is not None:
            prompts = [salted(prompt, cache_salt) for prompt in prompts]
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        if beam is None:
            return cls(await engine.add_requests(ids, prompts, params, priority=priority, lora_request=lora_request))
        group = cls([])
        try:
            for rid, prompt in zip(ids, prompts):
                group.streams.append(engine.beam_search(prompt, rid, beam, lora_request))
                group.unfinished.add(len(group.streams) - 1)
        except BaseException:
            await group.close()  # (none has started: closing them runs nothing)
            raise
        return group

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        self._merged = self._merge()
        return self._merged

    async def _merge(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as exc:  # (a failed step): the whole API request fails with it
                queue.put_nowait((i, exc))
            queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            while self.unfinished:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    self.unfinished.discard(i)
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close_streams()

    async def close(self) -> None:
        """Stop reading (a reader left mid-way, e.g. by a client that hung up while an event was
        being sent, is closed first: its tasks still read the streams) and close every stream."""
        if self._merged is not None:
            await self._merged.aclose()
        await self._close_streams()

    async def _close_streams(self) -> None:
        """Close every stream (its request is aborted unless it finished; a no-op once closed), all
        at once: their aborts reach the engine in one step (one by one, each waited for its own
        step while the others ran on)."""
        self.unfinished.clear()
        closed = await asyncio.gather(*(stream.aclose() for stream in self.streams), return_exceptions=True)
        if errors := [e for e in closed if isinstance(e, BaseException)]:
            raise errors[0]


class EventStream:
    """A streamed response: its server-sent events and the requests behind them. ``close()``
    runs once the response is sent or the client has hung up (even before the first event)."""

    def __init__(self, events: AsyncIterator[str], group: RequestGroup) -> None:
        self.events, self.group = events, group

    async def close(self) -> None:
        await self.events.aclose()
        await self.group.close()


class Usage:
    """Token counts of one API request, as OpenAI's ``usage``; with ``details`` (vLLM's
    ``--enable-prompt-tokens-details``) also ``prompt_tokens_details.cached_tokens``, the prompt
    tokens served from the prefix cache."""

    def __init__(self, details: bool = False) -> None:
        self.details = details
        self.prompt_tokens: dict[int, int] = {}  # per prompt index
        self.cached_tokens: dict[int, int] = {}
        self.choice_tokens: dict[tuple[int, int], int] = {}  # per (prompt index, completion index)

    @property
    def completion_tokens(self) -> int:
        return sum(self.choice_tokens.values())

    def add(self, i: int, out: RequestOutput) -> None:
        self.prompt_tokens[i] = len(out.prompt_token_ids)
        self.cached_tokens[i] = out.num_cached_tokens or 0
        for c in out.outputs:
            self.choice_tokens[i, c.index] = self.choice_tokens.get((i, c.index), 0) + len(c.token_ids)

    def choice(self, i: int, index: int) -> dict[str, int]:
        """A streamed chunk's usage with ``continuous_usage_stats``, as vLLM's: that choice's own,
        its prompt's tokens and the tokens it has generated so far (not the request's sums)."""
        prompt, completion = self.prompt_tokens.get(i, 0), self.choice_tokens.get((i, index), 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def body(self, nulls: bool = True) -> dict[str, Any]:
        """The request's usage; ``nulls``: with the details it has none of as null (a whole
        response's, as vLLM's; a stream's usage chunk leaves them out)."""
        prompt, completion = sum(self.prompt_tokens.values()), self.completion_tokens
        body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                "total_tokens": prompt + completion}  # fmt: skip
        if self.details:
            body["prompt_tokens_details"] = {"cached_tokens": sum(self.cached_tokens.values())}
        if nulls:
            body.setdefault("prompt_tokens_details", None)
            body["completion_tokens_details"] = None
        return body


def system_fingerprint(engine: AsyncLLMEngine) -> str:
    """vLLM's ``system_fingerprint`` (its default "full" mode): the server's name and version, and 8
    hex digits hashed from what sets the answers (model, dtype, context, quantization, KV cache
    dtype), so a client can tell when the serving setup changed."""
    from vllmini import __version__

    core = engine.engine
    setup = (core.model_dir, core.dtype, core.max_model_len, core.args.quantization, core.args.kv_cache_dtype)
    return f"vllmini-{__version__}-{hashlib.sha256(repr(setup).encode()).hexdigest()[:8]}"


class OpenAIServing:
    """One served model (and its adapters): its name, default sampling parameters and tokenizer."""

    def __init__(
        self, engine: AsyncLLMEngine, model_name: str, models: OpenAIServingModels | None = None
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.models = models if models is not None else OpenAIServingModels(engine, model_name)
        self.tokenizer = engine.tokenizer  # (None: skip_tokenizer_init, entrypoints/openai/skip_tokenizer.py)
        self.defaults = engine.engine.get_default_sampling_params()
        # the model's generation config's max_new_tokens, if it sets one: a chat request without
        # max_tokens otherwise runs to the end of the context, as in vLLM
        own = SamplingParams().max_tokens
        self.model_max_tokens = self.defaults.max_tokens if self.defaults.max_tokens != own else None
        self.max_model_len = engine.engine.max_model_len
        self.max_logprobs = engine.engine.input_processor.max_logprobs
        self.prompt_tokens_details = False  # usage.prompt_tokens_details (build_app's enable_prompt_tokens_details)
        self.return_tokens_as_token_ids = False  # the default of requests that do not say (build_app's)
        self.force_include_usage = False  # a stream's usage chunk even unasked (build_app's enable_force_include_usage)
        self.system_fingerprint = system_fingerprint(engine)

    def stream_usage(self, options: StreamOptions | None) -> tuple[bool, bool]:
        """(a last usage chunk, usage in every chunk) for a stream, as vLLM's ``should_include_usage``:
        ``include_usage`` (or ``--enable-force-include-usage``), and ``continuous_usage_stats`` with it."""
        include = self.force_include_usage or (options is not None and options.include_usage)
        return include, include and options is not None and options.continuous_usage_stats

    def tokens_as_ids(self, request: Any) -> bool:
        """``return_tokens_as_token_ids``: the request's when it says, else the server's
        (vLLM's ``--return-tokens-as-token-ids``)."""
        own = request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if own is None else bool(own)

    def check_max_tokens(self, max_tokens: int | None, name: str = "max_tokens") -> None:
        """A request's max_tokens (the request's ``name`` for it) past max_model_len is a 400 naming
        it, as vLLM's server (0.32) refuses it; one that fits max_model_len but not after the prompt
        is cut to what the prompt leaves (the engine stops it there, "length"), as vLLM's does."""
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise VLLMValidationError(
                f"{name}={max_tokens} cannot be greater than max_model_len={self.max_model_len}. "
                "Please request fewer output tokens.", parameter=name, value=max_tokens,
            )  # fmt: skip

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (None: the base model); ModelNotFoundError (404) for a name not served."""
        return self.models.resolve(model)

    async def events(
        self, chunks: AsyncIterator[str], head: dict[str, Any], usage: Usage, options: StreamOptions | None
    ) -> AsyncIterator[str]:
        """A stream's events: ``chunks``, then the usage chunk (``head``'s fields first, the
        fingerprint last, no nulls: vLLM's) when asked for, and ``[DONE]``; a failed step ends it
        with the error event, as vLLM's."""
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
            if self.stream_usage(options)[0]:
                yield sse({**head, "choices": [], "usage": usage.body(nulls=False),
                           "system_fingerprint": self.system_fingerprint})  # fmt: skip
        except Exception as exc:
            yield sse(error_body(str(exc), type(exc).__name__, 500))
        yield sse("[DONE]")

    def finishing(self, choice: dict[str, Any], options: StreamOptions | None) -> dict[str, Any]:
        """What a streamed chunk adds after its choices: the fingerprint on a choice's last chunk
        (its finish_reason set), unless the usage chunk ends the stream and carries it (vLLM's)."""
        if choice["finish_reason"] is None or self.stream_usage(options)[0]:
            return {}
        return {"system_fingerprint": self.system_fingerprint}

    def header(self, request_id: str, kind: str, model: str | None = None) -> dict[str, Any]:
        """A response's (or a stream's chunks') first fields; ``model`` is the name the request asked
        for. A stream's chunks share one (``created`` too, as vLLM's)."""
        return {"id": request_id, "object": kind, "created": int(time.time()), "model": model or self.model_name}

    @staticmethod
    def new_id(prefix: str, given: str | None) -> str:
        """vLLM's request id, ``<prefix>-<base>`` (``cmpl-``, ``chatcmpl-``, ``embd-``...): the base is
        the request's ``request_id`` (which an ``X-Request-Id`` header overrides: build_app's
        handler puts it there, as vLLM's ``_base_request_id``), else a fresh uuid. The engine runs
        the request under this id, and the response's ``id`` is it."""
        return f"{prefix}-{given or uuid.uuid4().hex}"

    def token_text(self, token_id: int, entry: LogprobsEntry | None = None, as_id: bool = False) -> str:
        """A token as logprobs name it: its text, or (``as_id``: a request's
        ``return_tokens_as_token_ids``, or an engine without a tokenizer) ``"token_id:<id>"``, which
        survives any bytes."""
        if as_id or self.tokenizer is None:
            return f"token_id:{token_id}"
        logprob = entry.get(token_id) if entry else None
        decoded = getattr(logprob, "decoded_token", None)
        return decoded if decoded is not None else self.tokenizer.decode([token_id])

    @staticmethod
    def prompt_logprobs(entries: list[LogprobsEntry | None] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token (None for the first) {token id: {logprob,
        rank, decoded_token}}, the token itself first, then the top-N."""
        if entries is None:
            return None
        return [None if e is None else {str(t): {"logprob": json_logprob(lp), "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for t, lp in e.items()}
                for e in entries]  # fmt: skip

    @staticmethod
    def top(entry: LogprobsEntry, num: int, listed: list[int] | None = None) -> list[tuple[int, float]]:
        """The ``num`` most likely tokens of one position, best first, logprobs clamped for JSON;
        ``listed`` (a request's ``logprob_token_ids``): those tokens instead, in the order given."""
        if listed:
            return [(token, json_logprob(entry[token])) for token in listed]
        ranked = sorted(entry.items(), key=lambda kv: -float(kv[1]))[:num]
        return [(token, json_logprob(lp)) for token, lp in ranked]
