"""From sampled tokens to what callers see: stop checks, logprobs, text, RequestOutputs.

The engine core samples one token per sequence; everything after that (appending it,
deciding whether the sequence stops and why, detokenizing, holding back text a stop
string may still cut, and building the step's ``RequestOutput`` per ``output_kind``)
lives here, so that ``llm_engine`` reads as schedule -> forward -> sample.
"""
from __future__ import annotations

import os
from collections.abc import Sequence as _Seq
from dataclasses import dataclass, field
from typing import Any

from vllmini.engine.detokenizer import FFFD, UTF8_MAX_BYTES, IncrementalDetokenizer
from vllmini.engine.outputs import CompletionOutput, Logprob, LogprobsEntry, RequestMetrics, RequestOutput
from vllmini.engine.sampler import SamplerOutput
from vllmini.engine.sampling_params import SamplingParams
from vllmini.engine.thinking_budget import Marks
from vllmini.scheduler.scheduler import Scheduler
from vllmini.scheduler.sequence import Sequence, SequenceStatus


@dataclass
class RequestState:
    """A request and its n sequences (one per completion)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # what the outputs show (the sequences hold their own list; None: prompt_embeds)
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    arrival_time: float
    pending: list[Sequence] = field(default_factory=list)  # n > 1 siblings waiting to fork
    sent: list[tuple[int, int]] = field(default_factory=list)  # per sequence: (text chars, tokens) reported
    finish_sent: set[int] = field(default_factory=set)  # delta outputs: sequences whose end was reported
    logprobs: list[list[LogprobsEntry]] = field(default_factory=list)
    cumulative_logprobs: list[float] = field(default_factory=list)
    # prompt_logprobs: [None, entry for prompt token 1, ...], filled as the prompt is prefilled
    prompt_logprobs: list[LogprobsEntry | None] | None = None
    prompt_logprobs_sent: bool = False  # delta outputs carry them once
    stream_interval: int = 1  # streamed outputs every this many new tokens (the first and last at once)
    bad_words_token_ids: list[tuple[int, ...]] = field(default_factory=list)  # params.bad_words, tokenized
    # structured outputs (engine/structured_outputs.py): the grammar's compile (a Future), then
    # one xgrammar matcher per sequence once it is compiled
    grammar: Any = None
    matchers: list[Any] | None = None
    reasoning_ended: set[int] = field(default_factory=set)  # sequence indices whose grammar has begun
    # the reasoning strings (engine/thinking_budget.py: a thinking_token_budget, a grammar after the
    # reasoning): per sequence index, its tokens' Marks so far
    thinking_marks: dict[int, Marks] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        return seqs[0].status.finished if len(seqs) == 1 else all(s.status.finished for s in seqs)


class OutputProcessor:
    """Applies one sampled token to a sequence and reports requests; finishing a sequence
    goes through the scheduler, which frees its blocks at once."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: tuple[int, ...], max_model_len: int, tokenizer: Any) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        # vLLM treats the generation config's other EOS ids as stop ids: they are the stop_reason
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # decoded_token of logprobs, per token id

    def token_text(self, token: int) -> str:
        """A token's text on its own (special tokens included), as logprobs' decoded_token."""
        if (text := self._token_texts.get(token)) is None:
            text = self._token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def token_text_in_context(self, token: int, context: _Seq[int]) -> str:
        """``token_text``, except that a token whose text ends in U+FFFD (a piece of a multi-byte
        character) gets, as in vLLM, what it adds after the tokens before it (``context``: the
        position's preceding tokens, oldest first): the whole character on the token that
        completes it ("" on the ones before), "" if the last few tokens complete nothing (so
        always "" for the first sampled token or the second prompt token, which have none)."""
        text = self.token_text(token)
        if not text.endswith(FFFD):
            return text
        context = list(context[-UTF8_MAX_BYTES:])
        for k in range(1, len(context) + 1):
            ctx = context[-k:]
            joined = self.tokenizer.decode(ctx + [token], skip_special_tokens=False)
            if joined.endswith(FFFD):
                continue
            clean = len(ctx)  # context tokens that are themselves pieces belong to this character
            while clean and self.token_text(ctx[clean - 1]).endswith(FFFD):
                clean -= 1
            before = self.tokenizer.decode(ctx[:clean], skip_special_tokens=False) if clean else ""
            common = len(os.path.commonprefix([before, joined]))
            return joined[common:]
        return ""

    def logprob_entry(
        self, state: RequestState, token: int, value: float, rank: int, top_values: list[float], top_ids: list[int],
        context: _Seq[int] = (), top_ranks: list[int] | None = None,
    ) -> LogprobsEntry:
        """vLLM's shape of one position's logprobs: the actual token first, then the top-N
        (the actual token appears once, so the dict has N or N + 1 entries). Each top-N entry's
        rank is its place in the top-N, the actual token's too when it is among them (vLLM writes
        the top-N over it): with ties, ``rank`` (how many tokens are at least as likely) may be
        larger than that place, and one entry per rank 1..N keeps the ranking consistent.
        ``context``: the tokens before this position that vLLM reads a split character's pieces
        against (the sampled tokens before it, or the prompt tokens after the first).
        ``top_ranks``: the listed tokens' own ranks (``logprob_token_ids``: given tokens, not a
        top-N, so each keeps its true rank)."""
        text = (lambda t: self.token_text_in_context(t, context)) if state.params.detokenize else (lambda t: None)
        top_ids = [int(t) for t in top_ids]
        ranks = top_ranks if top_ranks is not None else range(1, len(top_ids) + 1)
        if token in top_ids and top_ranks is None:
            rank = top_ids.index(token) + 1
        entry = {token: Logprob(value, rank, text(token))}
        for v, t, r in zip(top_values, top_ids, ranks):
            if t not in entry:
                entry[t] = Logprob(float(v), int(r), text(t))
        return entry

    def append_token(
        self, state: RequestState, seq: Sequence, row: int, token: int, out: SamplerOutput, grammar_ended: bool = False
    ) -> None:
        """The sequence's new token: logprobs first, then the stop checks. ``grammar_ended``: its
        structured-output grammar took this token as its end (an EOS), which stops it even
        before ``min_tokens`` (the grammar allows nothing else)."""
        seq.append_token(token)
        if out.logprobs is not None:
            self.record_logprobs(state, seq, row, token, out)
        self.check_stop(state, seq, grammar_ended)

    def record_logprobs(self, state: RequestState, seq: Sequence, row: int, token: int, out: SamplerOutput) -> None:
        assert out.logprobs is not None and out.ranks is not None
        state.cumulative_logprobs[seq.index] += float(out.logprobs[row])
        params = state.params
        if params.logprobs is None and not params.logprob_token_ids:
            return
        top_values: list[float] = []
        top_ids: list[int] = []
        top_ranks = None
        if params.logprob_token_ids:  # these tokens instead of the top-N (vLLM's rule when both are given)
            assert out.id_logprobs is not None
            top_ids, k = params.logprob_token_ids, len(params.logprob_token_ids)
            top_values, top_ranks = out.id_logprobs[0][row, :k].tolist(), out.id_logprobs[1][row, :k].tolist()
        elif out.top_logprobs is not None:
            values, ids = out.top_logprobs
            top_values, top_ids = values[row, : params.logprobs].tolist(), ids[row, : params.logprobs].tolist()
        context = seq.output_token_ids[-1 - UTF8_MAX_BYTES : -1]  # the sampled tokens before this one
        entry = self.logprob_entry(
            state, token, float(out.logprobs[row]), int(out.ranks[row]), top_values, top_ids, context, top_ranks
        )
        state.logprobs[seq.index].append(entry)

    def check_stop(self, state: RequestState, seq: Sequence, grammar_ended: bool = False) -> None:
        params, token = state.params, seq.token_ids[-1]
        past_min = seq.num_output_tokens >= params.min_tokens
        if (past_min or grammar_ended) and not params.ignore_eos and token in self.eos_token_ids:
            self.finish(state, seq, SequenceStatus.FINISHED_STOPPED, None if token == self.eos_token_id else token)
            return
        if past_min and token in params.stop_token_ids:
            self.finish(state, seq, SequenceStatus.FINISHED_STOPPED, token)
            return
        detok = state.detoks[seq.index]
        old_len = len(detok.text)
        if params.detokenize:
            detok.step(seq.token_ids)
        # vLLM's rule: stop strings count once more than min_tokens tokens are out
        past_min_text = seq.num_output_tokens > params.min_tokens
        if past_min_text and params.stop and (stop := self._find_stop_string(detok, params, old_len)) is not None:
            self.finish(state, seq, SequenceStatus.FINISHED_STOPPED, stop)
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(state, seq, SequenceStatus.FINISHED_LENGTH, None)
        elif past_min and (rd := params.repetition_detection) is not None and rd.detects(seq.output_token_ids):
            self.finish(state, seq, SequenceStatus.FINISHED_REPETITION, "repetition_detected")  # (vLLM's reason)

    @staticmethod
    def _find_stop_string(detok: IncrementalDetokenizer, params: SamplingParams, old_len: int) -> str | None:
        """Find a stop string that ends in the text added this step (it may start in earlier
        text) and cut the text there, keeping it when include_stop_str_in_output. As vLLM, the
        stop strings are tried in the order given and the first one found wins (not the one that
        starts first: with stop=["\\n", "."] and a new token ".\\n", the text keeps its ".").
        Searching only the tail keeps the check O(new text) per step."""
        text = detok.text
        for stop in params.stop:
            pos = text.find(stop, max(0, old_len - len(stop) + 1))
            if pos != -1:
                detok.text = text[: pos + len(stop)] if params.include_stop_str_in_output else text[:pos]
                return stop
        return None

    def finish(self, state: RequestState, seq: Sequence, status: SequenceStatus, reason: int | str | None) -> None:
        """End the sequence. A sequence stopped by a token (EOS or a stop id) leaves that token's
        text out unless include_stop_str_in_output (vLLM's rule; the token stays in token_ids);
        one stopped by a stop string was already cut. As in vLLM, the text is not flushed: a
        character still incomplete at the end (max_tokens cut it, or EOS came after part of it)
        is left out rather than shown as U+FFFD (token_ids keep its pieces)."""
        stopped = status is SequenceStatus.FINISHED_STOPPED
        if state.params.detokenize and stopped and not isinstance(reason, str) and state.params.include_stop_str_in_output:
            state.detoks[seq.index].step(seq.token_ids)  # the stop token's own text (check_stop returned before it)
        self.scheduler.finish(seq, status, reason)

    @staticmethod
    def _visible_text_len(state: RequestState, seq: Sequence) -> int:
        """How much text may be shown now: while a stop string could still complete, its
        possible beginning (the last ``len(longest stop) - 1`` characters) is held back, so
        streamed text never contains a piece of a stop string that is later cut. With
        include_stop_str_in_output nothing is cut before the stop string's end, which lies in
        new text, so nothing is held back (as vLLM)."""
        text_len = len(state.detoks[seq.index].text)
        if seq.status.finished or not state.params.stop or state.params.include_stop_str_in_output:
            return text_len  # (a kept stop string cuts nothing already shown: vLLM holds nothing back)
        held = max(map(len, state.params.stop)) - 1
        return max(state.sent[seq.index][0], text_len - held)

    def make_output(self, state: RequestState) -> RequestOutput | None:
        """The request's output for this step per ``output_kind``: cumulative text and tokens,
        only what is new ("delta": with n > 1, only the completions that changed, as vLLM, so a
        finished one is reported once), or nothing until the end ("final")."""
        finished = state.finished
        kind = state.params.output_kind
        if kind == "final" and not finished:
            return None
        if state.stream_interval > 1 and not finished and any(sent for _, sent in state.sent):  # (not the first)
            if max(len(seq.output_token_ids) - sent for seq, (_, sent) in zip(state.seqs, state.sent)) < state.stream_interval:
                return None  # (its tokens come with the next output)
        outputs = []
        for seq, detok in zip(state.seqs, state.detoks):
            text_end, tokens = self._visible_text_len(state, seq), seq.output_token_ids
            text_start, token_start = state.sent[seq.index] if kind == "delta" else (0, 0)
            if kind == "delta" and len(state.seqs) > 1:
                if (text_start, token_start) == (text_end, len(tokens)) and (
                    not seq.status.finished or seq.index in state.finish_sent
                ):
                    continue  # nothing new
                if seq.status.finished:
                    state.finish_sent.add(seq.index)
            state.sent[seq.index] = (text_end, len(tokens))
            wants_logprobs = state.params.logprobs is not None or bool(state.params.logprob_token_ids)
            outputs.append(
                CompletionOutput(
                    index=seq.index,
                    text=detok.text[text_start:text_end],
                    token_ids=tokens[token_start:],
                    cumulative_logprob=state.cumulative_logprobs[seq.index] if wants_logprobs else None,
                    logprobs=state.logprobs[seq.index][token_start:] if wants_logprobs else None,
                    finish_reason=seq.status.value if seq.status.finished else None,
                    stop_reason=seq.stop_reason,
                )
            )
        if not outputs and not finished:
            return None
        metrics = RequestMetrics.of(state.seqs, state.arrival_time, state.finished)
        return RequestOutput(
            state.request_id, state.prompt, state.prompt_token_ids, self._prompt_logprobs(state), outputs, finished,
            metrics, None if state.seqs[0].lora is None else state.seqs[0].lora.request,
            num_cached_tokens=metrics.num_cached_tokens,
        )  # fmt: skip

    @staticmethod
    def _prompt_logprobs(state: RequestState) -> list[LogprobsEntry | None] | None:
        """Once the whole prompt is scored: in every output, or only the first for "delta"
        (the later ones get [], as vLLM's: None stays the answer of a request that did not ask)."""
        recorded = state.prompt_logprobs
        if recorded is None or len(recorded) < state.seqs[0].num_prompt_tokens:
            return None
        if state.params.output_kind == "delta":
            if state.prompt_logprobs_sent:
                return []
            state.prompt_logprobs_sent = True
        return recorded
