"""``POST /v1/completions``: one or several prompts (text or token ids), n completions each,
answered whole or streamed as server-sent events. Choice ``index`` is ``prompt * n +
completion``, as in vLLM."""
from __future__ import annotations

from typing import Any, AsyncIterator

from vllmini.engine.outputs import CompletionOutput, LogprobsEntry, RequestOutput
from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.protocol import CompletionRequest
from vllmini.entrypoints.openai.skip_tokenizer import check_completion
from vllmini.entrypoints.openai.serving_engine import (
    RESPONSE_NULLS, EventStream, OpenAIServing, RequestGroup, Usage, json_logprob, off_loop, sse,
)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> dict[str, Any] | EventStream:
        """The whole response, or (``stream``) its events; raises ValueError for a bad request
        before anything is generated."""
        lora_request = self.check_model(request.model)
        request.check()
        prompts = request.prompts()
        if self.tokenizer is None:  # skip_tokenizer_init: token ids in and out
            check_completion(request, prompts)
        params = request.sampling_params(self.defaults, 1 if request.echo_only else request.max_tokens, request.logprobs)
        self.check_max_tokens(params.max_tokens)
        prompts = await off_loop(self._tokenized, prompts, params, request.add_special_tokens)
        if request.echo and request.logprobs is not None and request.prompt_logprobs is None:
            params = params.clone(prompt_logprobs=request.logprobs)  # the prompt's logprobs come back with it (vLLM's)
        request_id = self.new_id("cmpl", request.request_id)
        # (a beam also stops where the context ends)
        beam = request.beam_search_params(params.max_tokens or self.max_model_len, self.max_logprobs)
        group = await RequestGroup.start(self.engine, request_id, prompts, params, request.priority, lora_request,
                                         request.cache_salt, beam)  # fmt: skip
        if request.stream:
            return EventStream(self._stream(request, request_id, group), group)
        return await self._whole(request, request_id, group)

    def _tokenized(self, prompts: list[Any], params: SamplingParams, add_special_tokens: bool) -> list[Any]:
        """(On the tokenizer thread.) The text prompts as the engine's ids, the text kept beside them
        (echo reads it), truncated as the engine would; without ``add_special_tokens``, no BOS/EOS."""
        if not add_special_tokens:
            prompts = [{"prompt": p, "prompt_token_ids": self.tokenizer(p, add_special_tokens=False).input_ids}
                       if isinstance(p, str) else p for p in prompts]  # fmt: skip
        return [self.engine.engine.input_processor.pretokenize(p, params) for p in prompts]

    async def _whole(self, request: CompletionRequest, request_id: str, group: RequestGroup) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in group:
            finals[i] = out
        usage, choices = Usage(self.prompt_tokens_details), []
        for i in sorted(finals):
            usage.add(i, finals[i])
            for c in sorted(finals[i].outputs, key=lambda c: c.index):
                text, logprobs = self._echoed(request, finals[i], c, None, finals[i].prompt_logprobs)
                choice = self._choice(request, i * request.n + c.index, text, logprobs, c, finals[i], True)
                # (asked for, or echo with logprobs: vLLM's)
                choice["prompt_logprobs"] = self.prompt_logprobs(finals[i].prompt_logprobs)
                choices.append({**choice, "routed_experts": None})
        return {**self.header(request_id, "text_completion", request.model), "choices": choices, "service_tier": None,
                "system_fingerprint": self.system_fingerprint, "usage": usage.body(), **RESPONSE_NULLS}  # fmt: skip

    def _stream(self, request: CompletionRequest, request_id: str, group: RequestGroup) -> AsyncIterator[str]:
        usage = Usage(self.prompt_tokens_details)
        head = self.header(request_id, "text_completion", request.model)
        return self.events(self._chunks(request, head, group, usage), head, usage, request.stream_options)

    async def _chunks(
        self, request: CompletionRequest, head: dict[str, Any], group: RequestGroup, usage: Usage
    ) -> AsyncIterator[str]:
        """Each chunk holds one choice's new text, in the engine's order, as vLLM's (with
        ``continuous_usage_stats``, its own usage: its prompt's tokens and those it has so far;
        a choice's last chunk, unless a usage chunk follows, the fingerprint); a step before the
        choice's first token (of a prefill) sends nothing, unless it is echoed."""
        sent: dict[int, int] = {}  # each choice's text length so far
        prompt_logprobs: dict[int, list] = {}  # per prompt: delta outputs carry them in the first only
        continuous = self.stream_usage(request.stream_options)[1]
        async for i, out in group:
            usage.add(i, out)  # (delta outputs: the new tokens only)
            if out.prompt_logprobs:  # for the choices that start in a later output
                prompt_logprobs[i] = out.prompt_logprobs
            for c in out.outputs:
                index = i * request.n + c.index
                first = index not in sent
                started = usage.choice_tokens.get((i, c.index)) or (first and request.echo)
                if not c.text and not c.token_ids and not started:
                    continue  # (no token yet, nothing to echo: a prefill step sends nothing, as vLLM's)
                text, logprobs = self._echoed(request, out, c, sent.get(index), prompt_logprobs.get(i))
                sent[index] = sent.get(index, 0) + len(text)
                counts = {"usage": usage.choice(i, c.index)} if continuous else {}
                choice = self._choice(request, index, text, logprobs, c, out, first)
                if first and request.echo:  # (vLLM's: the echoed chunk carries the prompt's ids)
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                last = self.finishing(choice, request.stream_options)
                yield sse({**head, "choices": [choice], **counts, **last})

    @staticmethod
    def _choice(
        request: CompletionRequest, index: int, text: str, logprobs: dict | None, c: CompletionOutput,
        out: RequestOutput, first: bool,
    ) -> dict[str, Any]:  # fmt: skip
        """One choice (or a streamed chunk of it: ``first`` is its first), with ``return_token_ids``
        its token ids (a chunk's new ones) and, at first, the prompt's, as vLLM's (null otherwise)."""
        ids = request.return_token_ids
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, "prompt_token_ids": list(out.prompt_token_ids) if ids and first else None,
                "token_ids": list(c.token_ids) if ids else None}  # fmt: skip

    def _echoed(
        self, request: CompletionRequest, out: RequestOutput, c: CompletionOutput, offset: int | None,
        prompt_logprobs: list[LogprobsEntry | None] | None,
    ) -> tuple[str, dict[str, Any] | None]:
        """The choice's text and logprobs, the prompt's (with ``prompt_logprobs``) before them
        when echoed (in its first chunk: ``offset`` None, else the length of the choice's text
        already sent)."""
        token_ids, entries, text = list(c.token_ids), list(c.logprobs or []), c.text
        if request.echo_only:  # (its one generated token is not returned)
            token_ids, entries, text = [], [], ""
        echoed = 0  # prompt positions before the sampled ones
        if request.echo and offset is None:
            prompt = out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)
            text = prompt + text
            token_ids = list(out.prompt_token_ids) + token_ids
            entries = list(prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
            echoed = len(out.prompt_token_ids)
        if request.logprobs is None and not request.logprob_token_ids:
            return text, None
        return text, self._logprobs(token_ids, entries, request.logprobs or 0, offset or 0, request.logprob_token_ids,
                                    echoed, self.tokens_as_ids(request))  # fmt: skip

    def _logprobs(
        self, token_ids: list[int], entries: list[LogprobsEntry | None], num: int, offset: int,
        listed: list[int] | None = None, echoed: int = 0, as_ids: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """OpenAI's legacy completion logprobs: each token's text and place in the choice's text,
        its logprob (None for the prompt's first token, which has none) and, after the token itself,
        the ``num`` most likely tokens there (``listed``: a request's ``logprob_token_ids``, at the sampled
        positions, those after the first ``echoed`` prompt positions, which have their top-N); ``as_ids``:
        tokens named "token_id:<id>"."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for i, (token, entry) in enumerate(zip(token_ids, entries)):
            text = self.token_text(token, entry, as_ids)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if entry is None:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(json_logprob(entry[token]))
            # the token itself first, then the top ones: up to num + 1 (OpenAI's legacy API, vLLM's)
            top = [(token, json_logprob(entry[token])), *self.top(entry, num, listed if i >= echoed else None)]
            top_logprobs.append({self.token_text(t, entry, as_ids): lp for t, lp in top})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}  # fmt: skip
