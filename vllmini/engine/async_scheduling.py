"""Async scheduling (vLLM's ``async_scheduling``): launch the next decode step before this
step's sampled tokens reach the host.

A synchronous step is: schedule, launch the forward and the sampler, wait for the tokens,
then append them, check stops and build outputs. On a GPU the device idles during the
host's part and the host idles during the device's. When every running sequence just
sampled a token and no request can be admitted (the queue is empty, or every slot stays
taken), the next step is known without those tokens' values: each sequence decodes one
more token at the next position. So the engine
launches that *continuation* first (its input ids are the sampled tokens, copied on the
device) and only then waits for and processes the previous tokens, which the host does
while the GPU computes the continuation.

What the continuation cannot know yet is handled after the fact: a sequence that stopped
on the token it is continuing from (EOS, a stop id or string) had one extra token
computed, which is discarded; its blocks were freed when it stopped, and any later step
that reuses them runs after the continuation on the same stream. Sequences that will stop
by length are left out. Penalties count the token in flight without the host reading it: the
engine writes it into the sampler's output-token tensor on the device. Anything that needs
the host to see the tokens first (bad words of several tokens, which match them on the host;
a free slot and a queue to admit from; n > 1 forks; custom logits processors; a sequence mid-prompt; no free block for
a new slot) makes the step synchronous instead. A sequence stopping on a
token while others wait delays their admission by one step.
"""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllmini.engine import sample_step
from vllmini.engine.errors import StepError
from vllmini.engine.model_runner import FlatBatch
from vllmini.engine.outputs import RequestOutput
from vllmini.engine.sample_step import LaunchedStep
from vllmini.engine.sampling_tensors import to_device
from vllmini.kv.hybrid_block_manager import KVBlockManager
from vllmini.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from vllmini.engine.llm_engine import LLMEngine


@dataclass
class Continuation:
    """The next decode step: ``flat`` (input ids are placeholders) and, for each of its rows,
    the row of the previous step whose sampled token is its input."""

    flat: FlatBatch
    seqs: list[Sequence]
    source_rows: list[int]


def plan_continuation(
    prev: LaunchedStep, running: Seq[Sequence], num_waiting: int, block_manager: KVBlockManager,
    max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
    matches_output: Callable[[Sequence], bool] = lambda seq: False,
) -> Continuation | None:  # fmt: skip
    """The decode step that follows ``prev`` whatever its tokens are, or None when the next
    step needs them (see the module docstring). ``matches_output``: the sequence's sampling
    depends on its last tokens' values (multi-token bad words). Allocates the new slots only
    when it returns a continuation (all or nothing)."""
    if prev.forked or not prev.seqs or len(prev.seqs) != len(running):
        return None
    if {id(s) for s in prev.seqs} != {id(s) for s in running}:
        return None  # a running sequence was not sampled last step (e.g. mid-prompt)
    keep = []
    for row, seq in enumerate(prev.seqs):
        if matches_output(seq):
            return None  # multi-token bad words match the tokens on the host
        # the token in flight is output number num_output_tokens + 1, at position num_tokens
        if seq.num_output_tokens + 1 >= seq.max_tokens or seq.num_tokens + 1 >= max_model_len:
            continue  # stops by length on that token
        keep.append(row)
    if not keep or len(keep) > max_num_batched_tokens:
        return None
    if num_waiting and len(keep) < max_num_seqs:
        return None  # a slot is (or may be) free: the scheduler admits from the queue first
    bs = block_manager.block_size
    seqs = [prev.seqs[row] for row in keep]
    if sum(1 for s in seqs if s.num_tokens % bs == 0) * block_manager.num_groups > block_manager.num_free_blocks:
        return None
    for seq in seqs:  # slot for position num_tokens; only known tokens get hashed
        if not block_manager.allocate(seq.seq_id, seq.token_ids, 1):  # (counted above: never; not an assert, which -O drops)
            raise RuntimeError(f"no KV slot for the continuation of sequence {seq.seq_id} after counting one free")
    tables = [block_manager.block_table(s.seq_id) for s in seqs]
    positions = [s.num_tokens for s in seqs]
    n = len(seqs)
    flat = FlatBatch(
        ids=[0] * n, positions=positions,
        slots=[t[p // bs] * bs + p % bs for t, p in zip(tables, positions)],
        query_lens=[1] * n, seq_lens=[p + 1 for p in positions], block_tables=tables,
        logits_rows=list(range(n)), sample_indices=list(range(n)), loras=[s.lora for s in seqs],
    )  # fmt: skip
    flat.add_groups([s.seq_id for s in seqs], block_manager, bs)
    flat.add_states([s.seq_id for s in seqs], block_manager)
    return Continuation(flat, seqs, keep)


def step_async(engine: LLMEngine) -> list[RequestOutput]:
    """``LLMEngine.step`` with async scheduling: launch the continuation of the step in flight
    (if it has one) before processing that step's tokens, so the host works while the device
    computes. The scheduler only runs when no step is in flight."""
    prev, engine._in_flight = engine._in_flight, None
    if prev is None:
        sched = engine.scheduler.schedule()
        if sched.is_empty:
            return []
        prev = engine._launch(sched)
        if prev is None:
            return []
    nxt = engine._launch_continuation(prev)  # (a method: tests spy on it)
    outputs = sample_step.complete(engine, prev)
    engine._in_flight = nxt
    return outputs


def launch_continuation(engine: LLMEngine, prev: LaunchedStep) -> LaunchedStep | None:
    """The decode step after ``prev`` launched now (plan_continuation), or None."""
    if engine.logits_processors is not None:  # custom processors read the output token lists on the host
        return None

    def matches_output(seq: Sequence) -> bool:
        """Whether sampling this sequence reads its last tokens' values (a bad word of several
        tokens, a grammar, a thinking budget); a one-token bad word is banned whatever came before."""
        state = engine.requests.get(seq.request_id)
        if state is None:
            return False
        if seq.params.thinking_token_budget is not None and engine.thinking is not None:
            return True
        return state.matchers is not None or any(len(word) > 1 for word in state.bad_words_token_ids)

    args, scheduler = engine.args, engine.scheduler
    plan = plan_continuation(
        prev, scheduler.running, len(scheduler.waiting), engine.block_manager,
        engine.max_model_len, args.max_num_batched_tokens, scheduler.config.max_num_seqs, matches_output,
    )  # fmt: skip
    if plan is None:
        return None
    for seq in plan.seqs:  # their input (the token in flight) is computed by this launch
        seq.num_computed_tokens += 1
    tokens = prev.sampled.out.token_ids
    if plan.source_rows == list(range(len(plan.source_rows))):
        token_ids = tokens[: len(plan.source_rows)]
    else:
        token_ids = tokens[to_device(torch.tensor(plan.source_rows), tokens.device)]
    try:
        logits = engine.runner.run_flat(plan.flat, token_ids)
        return LaunchedStep(plan.seqs, sample_step.sample(engine, logits, plan.seqs, in_flight=token_ids))
    except Exception as exc:  # these requests fail (reported through ``failed``); the others go on
        for rid in dict.fromkeys(s.request_id for s in plan.seqs):
            engine.abort_request(rid)
            engine.failed[rid] = StepError([rid], exc)
        engine.block_manager.reset_prefix_cache()  # (as in LLMEngine._launch)
        return None
