"""Iteration-level continuous batching with chunked prefill and preemption.

Each step (vLLM v1 style, one token budget for everything):
1. running sequences first, oldest first: a decode takes 1 token of the budget (plus its
   speculative drafts, when there are some and room for them), a sequence still prefilling
   (a chunked or recomputed prompt) takes what is left of it;
2. then waiting sequences are admitted in queue order while the budget and ``max_num_seqs``
   allow, a long prompt getting only a chunk of the budget (its rest comes next steps).
Prefill chunks and decodes go into the same forward. When the block pool cannot give
a running sequence its slot, a running sequence is preempted: its blocks are freed and
it goes back to the queue to be recomputed.
Policies, as vLLM's ``scheduling_policy``: "fcfs" queues by arrival and preempts the most
recently admitted; "priority" queues by (priority, arrival), lower first, and preempts the
running sequence that comes last in that order (even one already scheduled this step,
which is then taken out of the step). Neither preempts to admit a waiting request.
The scheduler counts tokens and blocks; it never sees a tensor.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from vllmini.kv.block_hash import prefix_root
from vllmini.kv.hybrid_block_manager import KVBlockManager
from vllmini.scheduler.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # prompt_logprobs: at most this many prompt positions projected to logits per step (each is
    # a vocabulary-wide row; None: no cap), so a long prompt is scored in several steps
    max_prompt_logits_rows: int | None = None
    policy: str = "fcfs"  # or "priority"
    # enable_lora: at most this many LoRA adapters among the running sequences (the model's slots);
    # a waiting sequence whose adapter would exceed it is passed over for those behind it
    max_loras: int | None = None
    # vLLM's long_prefill_token_threshold: > 0 caps the tokens one sequence computes in a step (so
    # one long prompt cannot take the whole token budget from the others' prefills); 0: no cap
    long_prefill_token_threshold: int = 0

    def cap(self, num_tokens: int) -> int:
        """A sequence's tokens for this step, at most the threshold when there is one."""
        limit = self.long_prefill_token_threshold
        return min(num_tokens, limit) if limit > 0 else num_tokens


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens (drafts included)
    # speculative decoding: a decode's drafted tokens, computed after its last token (their
    # slots are allocated; only the accepted ones stay, engine/spec_decode)
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.spec_token_ids) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_chunked_prefills: int = 0  # prefill chunks that did not reach the end of their prompt
    num_prefill_tokens: int = 0  # prompt tokens actually computed (prefix-cache hits excluded)
    num_cached_prompt_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: KVBlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.config.policy == "priority":
            self._queue_by_priority(seq)
        else:
            self.waiting.append(seq)

    def _queue_by_priority(self, seq: Sequence) -> None:
        """Insert in (priority, arrival) order, after its equals: a preempted sequence, which
        arrived earlier, goes back before those that arrived after it."""
        keys = [_priority_key(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _priority_key(seq)), seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose KV is already in place (forked from a sibling): it decodes from the next step."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """Finish or abort a sequence wherever it is, freeing its blocks now."""
        seq.finish(status, stop_reason)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.seq_id)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        rows_left = self.config.max_prompt_logits_rows

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(self.config.cap(seq.num_tokens - seq.num_computed_tokens), budget)
            if rows_left is not None and seq.prompt_logits_from is not None:
                num_new = seq.cap_prompt_logits_rows(seq.num_computed_tokens, num_new, rows_left)
                if num_new == 0:  # this step's logits rows are spent: its next chunk waits a step
                    i += 1
                    continue
            drafts: list[int] = []
            if seq.spec_token_ids and num_new == 1 == seq.num_tokens - seq.num_computed_tokens:
                drafts = seq.spec_token_ids[: budget - 1]  # a decode verifies its drafts in the same row
                num_new += len(drafts)
                if not self.block_manager.allocate(seq.seq_id, seq.token_ids, num_new):
                    num_new, drafts = 1, []  # drafts never preempt anyone: verify none this step
                else:
                    out.scheduled.append(ScheduledSeq(seq, num_new, drafts))
                    budget -= num_new
                    i += 1
                    continue
            while not self.block_manager.allocate(seq.seq_id, seq.token_ids, num_new):
                victim = self._pick_victim()
                j = self.running.index(victim)
                del self.running[j]
                if j < i:  # (priority only) already scheduled this step: take it out of the step
                    i -= 1
                    budget, rows_left = self._unschedule(victim, out, budget, rows_left)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, drafts))
                budget -= num_new
                if rows_left is not None:  # (charged once in the step: a sequence preempted instead holds none)
                    rows_left -= seq.prompt_logits_rows(seq.num_computed_tokens, num_new)
                i += 1

        # Admit new work only when nothing had to be preempted this step.
        loras = {s.lora_key for s in self.running} - {0} if self.config.max_loras else set()
        w = 0  # the queue position looked at: sequences passed over for their adapter stay where they are
        while not out.preempted and w < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[w]
            if seq.lora_key and seq.lora_key not in loras and len(loras) >= (self.config.max_loras or 0):
                w += 1
                continue
            root = prefix_root(seq.lora_key, seq.cache_salt)
            # (prompt_logits_from: a cache hit computes no logits, so the hit stays below the positions still wanted)
            cached_blocks, num_cached = ([], 0) if seq.skip_reading_prefix_cache else \
                self.block_manager.find_cached_prefix(seq.token_ids, root, seq.prompt_logits_from)  # fmt: skip
            num_new = min(self.config.cap(seq.num_tokens - num_cached), budget)
            if rows_left is not None and seq.prompt_logits_from is not None:
                num_new = seq.cap_prompt_logits_rows(num_cached, num_new, rows_left)
                if num_new == 0:
                    break
            if not self.block_manager.allocate(seq.seq_id, seq.token_ids, num_new, cached_blocks, root):
                break
            del self.waiting[w]
            if seq.lora_key:
                loras.add(seq.lora_key)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            cached_prompt = min(num_cached, seq.num_prompt_tokens)  # a recompute's hit may cover outputs too
            if seq.first_scheduled_time is None:  # as vLLM: the request's hit is its first admission's
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_tokens = cached_prompt
            self.stats.num_cached_prompt_tokens += cached_prompt
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            if rows_left is not None and seq.prompt_logits_from is not None:
                rows_left -= seq.prompt_logits_rows(num_cached, num_new)

        for s in out.scheduled:
            prompt_left = s.seq.num_prompt_tokens - s.seq.num_computed_tokens
            if prompt_left > 0:  # (decode rows have none: most rows, skipped cheaply)
                self.stats.num_prefill_tokens += min(s.num_new_tokens, prompt_left)
            if not s.completes:
                self.stats.num_chunked_prefills += 1
        return out

    def _pick_victim(self) -> Sequence:
        """fcfs: the most recently admitted; priority: the last in (priority, arrival) order."""
        if self.config.policy == "priority":
            return max(reversed(self.running), key=_priority_key)  # (ties: the most recently admitted)
        return self.running[-1]

    def _unschedule(self, seq: Sequence, out: SchedulerOutput, budget: int, rows_left: int | None) -> tuple[int, int | None]:
        """Take ``seq`` out of this step; the budget and logits rows it held are given back.
        (A sequence passed over for want of logits rows is not in the step.) Its slots were
        allocated, and the blocks they fill registered in the prefix cache, but no forward will
        write them: those hashes are dropped before its blocks are freed, or a later prompt
        with the same prefix would read K/V that was never computed."""
        entry = next((s for s in out.scheduled if s.seq is seq), None)
        if entry is None:
            return budget, rows_left
        out.scheduled.remove(entry)
        self.block_manager.forget_unwritten(seq.seq_id, seq.num_computed_tokens)
        if rows_left is not None:
            rows_left += seq.prompt_logits_rows(seq.num_computed_tokens, entry.num_new_tokens)
        return budget + entry.num_new_tokens, rows_left

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free the sequence's blocks and requeue it at the front; it will be recomputed
        (prompt + what it generated so far) when admitted again."""
        self.block_manager.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        if self.config.policy == "priority":
            self._queue_by_priority(seq)
        else:
            self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def preempt_running(self) -> int:
        """Preempt every running sequence (vLLM's ``reset_prefix_cache(reset_running_requests=True)``):
        their blocks are freed and they are recomputed when admitted again, in their order.
        Returns how many."""
        out = SchedulerOutput()
        while self.running:  # (the last first: each goes to the queue's front)
            self._preempt(self.running.pop(), out)
        return len(out.preempted)

    def update_computed(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens now have their K/V in the cache."""
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens


def _priority_key(seq: Sequence) -> tuple[int, float]:
    return seq.priority, seq.arrival_time
