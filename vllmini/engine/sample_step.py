"""A generating step's second half: sample the forward's logits, then append each sequence's
token(s), check its stops and report the requests that changed.

``LLMEngine._launch`` runs the forward and calls :func:`sample`; the synchronous step and
async scheduling (engine/async_scheduling.py) then call :func:`complete` once the tokens are
wanted on the host. Structured outputs mask the logits before the sampler and take each
token after it; speculative decoding (spec_decode/speculator.py) gives a sequence one row per
draft, and a sequence keeps the tokens that agree with its drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllmini.engine.output_processor import RequestState
from vllmini.engine.outputs import RequestOutput
from vllmini.engine.sampler import SamplerOutput, SamplingRow, SamplingTensors
from vllmini.scheduler.sequence import Sequence, SequenceStatus
from vllmini.spec_decode.speculator import outputs_with_drafts

if TYPE_CHECKING:
    from vllmini.engine.llm_engine import LLMEngine


class SampledTokens:
    """A step's sampled token ids (and logprobs) on their way to the host. On CUDA the copies go
    into pinned memory without blocking, and ``wait`` waits for that step only (an event), not
    for work launched after it; elsewhere the tensors are already computed. ``out`` stays on
    the device (the next step's input ids); ``host`` holds the host copies of its logprobs,
    which the engine reads row by row (on the device each read would be a sync)."""

    def __init__(self, out: SamplerOutput) -> None:
        self.out = self.host = out
        self.event: torch.cuda.Event | None = None
        if out.token_ids.is_cuda:
            self.tokens, self.invalid = _to_host(out.token_ids), _to_host(out.invalid)
            if out.logprobs is not None:
                top, ids = out.top_logprobs, out.id_logprobs
                self.host = SamplerOutput(
                    out.token_ids, _to_host(out.logprobs), None if top is None else (_to_host(top[0]), _to_host(top[1])),
                    out.invalid, None if out.ranks is None else _to_host(out.ranks),
                    None if ids is None else (_to_host(ids[0]), _to_host(ids[1])),
                )  # fmt: skip
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.tokens, self.invalid = out.token_ids, out.invalid

    def wait(self) -> tuple[list[int], list[bool]]:
        if self.event is not None:
            self.event.synchronize()
        return self.tokens.tolist(), self.invalid.tolist()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``t``, filled without blocking (valid once the step's event is done)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass
class LaunchedStep:
    """A step whose forward and sampler are launched: ``seqs`` in logits-row order."""

    seqs: list[Sequence]
    sampled: SampledTokens
    forked: bool = False  # n > 1 siblings were forked in this step
    # speculative decoding: first row of a sequence verifying drafts -> its drafts (its rows are
    # that one and the next len(drafts), all holding the same sequence)
    drafts: dict[int, list[int]] = field(default_factory=dict)


def sample(
    engine: LLMEngine, logits: torch.Tensor, seqs: list[Sequence], in_flight: torch.Tensor | None = None,
    drafts: dict[int, list[int]] | None = None,
) -> SampledTokens:  # fmt: skip
    """Launch the sampler over ``logits`` (row i = ``seqs[i]``). ``in_flight`` (async
    scheduling): each sequence's token still on the device, one more than it holds; it counts
    for min_tokens and seeds, and penalties read it on the device (the host never does).
    ``drafts`` (speculative decoding): a draft's row samples after the drafts before it
    (spec_decode/speculator.py's ``outputs_with_drafts``)."""
    if in_flight is not None:
        outputs = [[*s.output_token_ids, -1] for s in seqs]
    else:
        outputs = outputs_with_drafts([s.output_token_ids for s in seqs], drafts or {})
    states = [engine.requests[s.request_id] for s in seqs]
    matchers = [engine.structured.matcher(state, s) for s, state in zip(seqs, states)]
    rows = [SamplingRow(s.params, s.known_prompt_ids, out, engine.eos_token_ids, s.index, state.bad_words_token_ids,
                        None if matcher is not None else _forced_token(engine, s, out, state))
            for s, out, state, matcher in zip(seqs, outputs, states, matchers)]  # fmt: skip
    if any(m is not None for m in matchers):  # structured outputs: the grammars' masks, before the sampler
        logits = engine.structured.mask(logits, matchers, drafts)
    tensors = SamplingTensors.from_rows(rows, logits.shape[-1], logits.device)
    if in_flight is not None and tensors.output_token_ids is not None:  # only penalties read it
        tensors.put_in_flight(in_flight, [len(s.output_token_ids) for s in seqs])
    # async on a GPU: no host sync inside the sampler, so the next step can be launched first
    sync_free = engine.args.async_scheduling and logits.is_cuda
    processors = None if engine.logits_processors is None else engine.logits_processors.prepare(seqs)
    return SampledTokens(engine.sampler(logits, tensors, sync_free=sync_free, processors=processors))


def _forced_token(engine: LLMEngine, seq: Sequence, output: list[int], state: RequestState) -> int | None:
    """The token a thinking budget forces on this row (engine/thinking_budget.py), if any. (Not
    asked while a structured-output grammar decides the row's tokens: it starts after the
    reasoning, unless ``enable_in_reasoning``, and a forced end it does not allow would only
    fail the request.)"""
    budget, rule = seq.params.thinking_token_budget, engine.thinking
    if budget is None or rule is None:
        return None
    # the sequence's own tokens are scanned once, on from the last step's Marks; ``output`` may
    # go on past them (drafts)
    return rule.forced_token(seq.known_prompt_ids, output, budget, rule.seq_marks(seq, state.thinking_marks))


def complete(engine: LLMEngine, launched: LaunchedStep) -> list[RequestOutput]:
    """Wait for the step's tokens, append them, check stops and report the requests."""
    touched: dict[str, RequestState] = {}
    seqs = launched.seqs
    tokens, invalid = launched.sampled.wait()
    row = 0
    while row < len(seqs):
        seq, drafts = seqs[row], launched.drafts.get(row, [])
        first, row = row, row + 1 + len(drafts)
        state = engine.requests.get(seq.request_id)
        if state is None or seq.status.finished:  # failed earlier in this loop, or (async) stopped already
            continue
        touched[seq.request_id] = state
        before = seq.last_token_time
        _append_tokens(engine, state, seq, first, tokens, invalid, launched.sampled.host, drafts)
        if engine.stat_logger is not None:
            engine.stat_logger.record_tokens(seq, before)
        if engine.speculator is not None:  # count the accepted drafts, roll back the rest, propose anew
            engine.speculator.update(state, seq, drafts, tokens[first:row], len(engine.requests))
        if seq.status.finished and seq.request_id not in engine.requests:  # aborted (e.g. a detokenizer
            touched.pop(seq.request_id, None)  # failure): not reported
    return [out for state in touched.values() if (out := engine._report(state)) is not None]


def _append_tokens(
    engine: LLMEngine, state: RequestState, seq: Sequence, first: int, tokens: list[int], invalid: list[bool],
    out: SamplerOutput, drafts: list[int],
) -> None:  # fmt: skip
    """Append the sequence's token of row ``first`` and, while each agrees with the draft it
    was sampled after, the next rows' (speculative decoding), until one stops it."""
    matcher = engine.structured.matcher(state, seq)
    reasoning = matcher is None and state.matchers is not None  # a grammar waiting for the reasoning's end
    for j in range(len(drafts) + 1):
        row, token = first + j, tokens[first + j]
        if invalid[row]:  # NaN/inf logits: this sequence ends, the others go on
            engine.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, "invalid logits (NaN or inf)")
            return
        grammar_ended = False
        if matcher is not None:  # structured outputs: the grammar takes the token
            if not engine.structured.accept(matcher, token):
                engine.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR, "token refused by the structured output grammar")
                return
            grammar_ended = matcher.is_terminated()
        engine.num_generated_tokens += 1
        try:
            engine.output_processor.append_token(state, seq, row, token, out, grammar_ended)
        except Exception as exc:  # e.g. a detokenizer failure: only this request fails
            engine.abort_request(seq.request_id)
            engine.failed[seq.request_id] = exc
            return
        if seq.status.finished or j == len(drafts) or token != drafts[j]:
            return
        if reasoning and engine.structured.matcher(state, seq) is not None:
            return  # the reasoning ended here: the next rows were sampled without the grammar
