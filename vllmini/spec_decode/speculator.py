"""The engine's side of speculative decoding, in one object: ``LLMEngine`` calls it at the few
points of a step where drafts matter, and otherwise treats a decode's drafts as extra tokens
of its row.

* after a sequence's tokens are appended (``update``): count the drafts the sampler agreed
  with, give back the rejected drafts' K/V slots, and propose the next step's drafts
  (``propose_draft_token_ids``: n-gram lookup, or placeholders that the draft model fills);
* after scheduling, before the target's forward (``draft``): the draft model's tokens replace
  the placeholders, in the slots the scheduler allocated for their verification;
* after the target's forward (``execute`` runs both): the draft model computes its K/V of the
  same tokens.

The sampler side (a draft's row samples as if the drafts before it were out) is
``rows_with_drafts`` and ``outputs_with_drafts``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllmini.engine.structured_outputs import StructuredOutputManager
from vllmini.spec_decode.config import SpeculativeConfig
from vllmini.spec_decode.draft_model import DraftModelProposer, DraftRequest
from vllmini.spec_decode.ngram_proposer import NgramProposer
from vllmini.spec_decode.stats import SpecDecodingStats

if TYPE_CHECKING:
    import torch

    from vllmini.engine.model_runner import FlatBatch, ModelRunner
    from vllmini.engine.output_processor import RequestState
    from vllmini.kv.hybrid_block_manager import KVBlockManager
    from vllmini.scheduler.scheduler import SchedulerOutput
    from vllmini.scheduler.sequence import Sequence

# a draft model's drafts are made after scheduling: until then the scheduler counts these
DRAFT_PLACEHOLDER = -1


class Speculator:
    """Built from the ``SpeculativeConfig`` and, for method "draft_model", the drafter that
    engine/engine_setup.py gave a KV cache on the target's blocks."""

    def __init__(
        self, config: SpeculativeConfig, drafter: DraftModelProposer | None, block_manager: KVBlockManager,
        max_model_len: int, structured: StructuredOutputManager,
    ) -> None:  # fmt: skip
        self.config = config
        self.drafter = drafter  # method "draft_model"
        self.proposer: NgramProposer | None = None  # method "ngram"
        if config.method == "ngram":
            self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                          config.prompt_lookup_max)  # fmt: skip
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.structured = structured  # a grammar's matcher cuts drafts to what it takes
        self.stats = SpecDecodingStats()

    def propose_draft_token_ids(self, state: RequestState, seq: Sequence, num_unfinished: int) -> list[int]:
        """The drafts for the sequence's next step, as many as its max_tokens and max_model_len
        leave room to accept; under a grammar (structured outputs), only as many as it takes (a
        refused draft could never be accepted). None while more than ``disable_by_batch_size``
        requests are unfinished."""
        room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        if room <= 0:
            return []
        limit = self.config.disable_by_batch_size
        if limit is not None and num_unfinished > limit:
            return []
        if self.proposer is None:  # a draft model drafts once its slots are scheduled (draft): placeholders
            return [DRAFT_PLACEHOLDER] * min(self.config.num_speculative_tokens, room)
        drafts = self.proposer.propose(seq.token_ids, room)
        if drafts and (matcher := self.structured.matcher(state, seq)) is not None:
            drafts = StructuredOutputManager.valid_prefix(matcher, drafts)
        return drafts

    def draft(self, sched: SchedulerOutput, requests: Mapping[str, RequestState]) -> set[int]:
        """Draft model: replace the placeholders of each scheduled decode by the draft model's
        tokens (its draft K/V goes into the slots just allocated for their verification); under
        a grammar, only the drafts it takes stay, and the slots of the others are given back.
        Returns the indices into ``sched.scheduled`` of the decodes that verify drafts."""
        todo = [s for s in sched.scheduled if s.spec_token_ids]
        if not todo or self.drafter is None:
            return set()
        bm = self.block_manager
        draft_requests = [DraftRequest(s.seq.token_ids[-1], s.seq.num_computed_tokens, bm.block_table(s.seq.seq_id),
                                       len(s.spec_token_ids)) for s in todo]  # fmt: skip
        for s, drafts in zip(todo, self.drafter.propose(draft_requests)):
            matcher = self.structured.matcher(requests[s.seq.request_id], s.seq)
            if matcher is not None:
                kept = StructuredOutputManager.valid_prefix(matcher, drafts)
                if len(kept) < len(drafts):
                    s.num_new_tokens -= len(drafts) - len(kept)
                    bm.rollback(s.seq.seq_id, bm.num_tokens(s.seq.seq_id) - (len(drafts) - len(kept)))
                    drafts = kept
            s.spec_token_ids = drafts
        return {i for i, s in enumerate(sched.scheduled) if s.spec_token_ids}

    def execute(
        self, runner: ModelRunner, sched: SchedulerOutput, requests: Mapping[str, RequestState]
    ) -> tuple[torch.Tensor, FlatBatch]:  # fmt: skip
        """The target's forward of the step (``ModelRunner.execute``'s logits and batch), with a
        draft model's two passes around it: ``draft`` before, and after, its K/V of every token
        the target computed that it has not (``DraftModelProposer.mirror``)."""
        drafted = self.draft(sched, requests)
        logits, flat = runner.execute(sched, self.block_manager)
        if self.drafter is not None:
            self.drafter.mirror(flat, drafted)
        return logits, flat

    def update(
        self, state: RequestState, seq: Sequence, drafts: list[int], sampled: list[int], num_unfinished: int
    ) -> None:  # fmt: skip
        """After the step's tokens of ``seq`` were appended (``sampled``: its rows' tokens, one
        per draft plus one): count the drafts the sampler agreed with (even when a stop among
        them ended the sequence, as vLLM's acceptance counts); for a sequence still running,
        drop the K/V of the drafts it did not append (the rejected ones, and those after a
        reasoning's end that a grammar starting there must see again) and propose anew."""
        accepted = next((j for j, d in enumerate(drafts) if sampled[j] != d), len(drafts))
        if drafts:
            self.stats.observe(len(drafts), accepted)
        if seq.status.finished:
            return
        if drafts:
            seq.num_computed_tokens = seq.num_tokens - 1  # (the last token's K/V comes with the next step)
            self.block_manager.rollback(seq.seq_id, seq.num_computed_tokens)
        seq.spec_token_ids = self.propose_draft_token_ids(state, seq, num_unfinished)


def rows_with_drafts(sched: SchedulerOutput, sample_idx: list[int]) -> tuple[list[Sequence], dict[int, list[int]]]:
    """The sampler's rows of a step: each sampled sequence once, then once per draft it
    verifies; and first row -> drafts for the sequences with drafts."""
    seqs: list[Sequence] = []
    drafts: dict[int, list[int]] = {}
    for i in sample_idx:
        if spec := sched.scheduled[i].spec_token_ids:
            drafts[len(seqs)] = spec
        seqs.extend([sched.scheduled[i].seq] * (1 + len(spec)))
    return seqs, drafts


def outputs_with_drafts(outputs: list[Any], drafts: dict[int, list[int]]) -> list[Any]:
    """Each row's output tokens as its sampling sees them: a draft's row holds the drafts
    before it as sampled already (penalties, min_tokens and seeds read them), which is what
    makes the verified tokens those plain decoding would give."""
    outputs = list(outputs)
    for first, spec in drafts.items():
        for j in range(1, len(spec) + 1):
            outputs[first + j] = [*outputs[first], *spec[:j]]
    return outputs
