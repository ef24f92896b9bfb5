"""Prompt logprobs (``SamplingParams.prompt_logprobs``): how likely the model found each prompt token.

The logits at prompt position p score token p + 1, so a prompt of L tokens has L - 1 entries
(the first token has none: ``None``, as in vLLM). They are computed chunk by chunk as the
prompt is prefilled: the runner projects those positions to logits next to the sampled rows
(``FlatBatch.prompt_rows``), and this module turns them into the per-token dicts. The
scheduler takes no prefix-cache hit over positions still wanted (a cache hit computes
nothing), and a prompt recomputed after preemption is scored only from where it stopped.
A step projects at most ``max_rows_per_step`` such positions (the scheduler cuts the chunk),
so a long prompt's logits never take more memory than the CUDA warm-up measured.
"""
from __future__ import annotations

import torch

from vllmini.engine.detokenizer import UTF8_MAX_BYTES
from vllmini.engine.output_processor import OutputProcessor, RequestState
from vllmini.scheduler.scheduler import SchedulerOutput
from vllmini.scheduler.sequence import Sequence

# rows per log_softmax: bounds the fp32 copy of a long chunk's logits (rows x vocab)
ROWS_PER_SLICE = 512
# logits (rows x vocab) a step may project for prompt_logprobs: with Qwen3's 151936-token
# vocabulary 441 rows, 134 MB in bfloat16 (the scheduler splits longer prompts over steps)
MAX_PROMPT_LOGITS_ELEMENTS = 1 << 26


def max_rows_per_step(vocab_size: int, max_num_batched_tokens: int) -> int:
    """The scheduler's cap on prompt positions scored per step (``max_prompt_logits_rows``)."""
    return max(1, min(max_num_batched_tokens, MAX_PROMPT_LOGITS_ELEMENTS // vocab_size))


def score_rows(
    logits: torch.Tensor, targets: list[int], num_top: int
) -> list[tuple[float, int, list[float], list[int]]]:
    """Per row: ``targets[i]``'s raw logprob under ``logits[i]``, its rank, and the top ``num_top``
    (values, ids)."""
    scored: list[tuple[float, int, list[float], list[int]]] = []
    for lo in range(0, len(targets), ROWS_PER_SLICE):
        lp = logits[lo : lo + ROWS_PER_SLICE].float().log_softmax(dim=-1)
        tgt = torch.tensor(targets[lo : lo + ROWS_PER_SLICE], dtype=torch.long, device=lp.device)
        chosen = lp.gather(1, tgt[:, None])
        ranks = (lp >= chosen).sum(-1, dtype=torch.int32).tolist()  # (a bool sum's int64 default copies every row first)
        if num_top > 0:
            values, ids = (x.tolist() for x in lp.topk(min(num_top, lp.shape[-1]), dim=-1))
        else:
            values = ids = [[] for _ in ranks]
        scored.extend(zip(chosen.squeeze(1).tolist(), ranks, values, ids))
    return scored


def start(state: RequestState) -> None:
    """Mark a new request's first sequence (the one that prefills the prompt) as wanting logits."""
    if state.params.prompt_logprobs is None:
        return
    state.prompt_logprobs = [None]
    if len(state.prompt_token_ids) > 1:
        state.seqs[0].prompt_logits_from = 0


def record(
    sched: SchedulerOutput, prompt_rows: list[tuple[int, int, int]], logits: torch.Tensor,
    requests: dict[str, RequestState], output_processor: OutputProcessor,
) -> None:  # fmt: skip
    """Append the entries of this step's prompt rows (``logits``: their logits, in order) to
    each request's ``prompt_logprobs`` and advance its sequence's ``prompt_logits_from``."""
    offset = 0
    for index, first, count in prompt_rows:
        seq: Sequence = sched.scheduled[index].seq
        rows, offset = logits[offset : offset + count], offset + count
        state = requests.get(seq.request_id)
        if state is None or state.prompt_logprobs is None or seq.status.finished:
            continue
        recorded = state.prompt_logprobs
        # rows start at prompt_logits_from (flatten_step), so a recomputed prompt scores nothing twice
        assert first == len(recorded) - 1, f"prompt logprobs at {first}, {len(recorded) - 1} recorded"
        targets = seq.prompt_token_ids[first + 1 : first + 1 + count]
        prompt = seq.prompt_token_ids
        for i, (token, scored) in enumerate(zip(targets, score_rows(rows, targets, state.params.prompt_logprobs))):
            pos = first + 1 + i  # vLLM's context: the prompt tokens before, from the second (the first has no entry)
            recorded.append(output_processor.logprob_entry(state, token, *scored, context=prompt[max(1, pos - UTF8_MAX_BYTES) : pos]))
        end = first + count
        seq.prompt_logits_from = None if end >= seq.num_prompt_tokens - 1 else end
