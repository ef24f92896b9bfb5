"""Draft-model proposals (vLLM's method "draft_model"): a smaller model of the same vocabulary
guesses the next ``k`` tokens greedily, and the target verifies them as it does n-gram drafts.

The draft model keeps its own per-layer KV cache, indexed by the target's block ids: a token's
draft K/V lives at the same slot as its target K/V, so the block manager's allocation, prefix
cache, preemption, forks and rollbacks hold for both caches at once (the caches only differ in
layer count and head shape). Two passes keep it filled:

* ``propose`` (each step, after scheduling, before the target's forward): for every decode
  with drafts scheduled, one batched forward per draft position, from its last token at the
  next position on. The scheduler has allocated those slots for the verification, so the draft
  writes only slots its sequence owns in this step.
* ``mirror`` (after the target's forward, in the same step): the draft computes the K/V of every
  token the target computed that it has not already (prefill chunks, recomputes after
  preemption, decodes without drafts, a verification's last draft). So the draft's K/V is valid
  wherever the target's is; rejected drafts' slots are rolled back or overwritten later, like
  the target's. Prefill thus runs on the same chunks as the target's, with no state of its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllmini.models.base import AttentionMetadata, slot_of

if TYPE_CHECKING:
    from vllmini.engine.model_runner import FlatBatch


@dataclass
class DraftRequest:
    """One decode to draft for: its last token (not computed yet) at ``position``, its block
    table (covering ``position + num_drafts`` slots), and how many drafts the step verifies."""

    last_token: int
    position: int
    block_table: list[int]
    num_drafts: int


class DraftModelProposer:
    def __init__(
        self, model: Any, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int, device: torch.device
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        """Each request's drafts (argmax), ``num_drafts`` long: forward j feeds every request
        still drafting its previous token at ``position + j`` (query length 1) and reads its
        next one."""
        drafts: list[list[int]] = [[] for _ in requests]
        inputs = [r.last_token for r in requests]
        for j in range(max((r.num_drafts for r in requests), default=0)):
            live = [i for i, r in enumerate(requests) if r.num_drafts > j]
            positions = [requests[i].position + j for i in live]
            tables = [requests[i].block_table for i in live]
            meta = AttentionMetadata.paged(
                [1] * len(live), [p + 1 for p in positions], [slot_of(t, p, self.block_size) for t, p in zip(tables, positions)],
                tables, None, self.device,
            )  # fmt: skip
            ids = torch.tensor([inputs[i] for i in live], dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            tokens = self.model(ids, pos, meta, self.kv_caches).argmax(dim=-1).tolist()
            for i, token in zip(live, tokens):
                drafts[i].append(token)
                inputs[i] = token
        return drafts

    @torch.inference_mode()
    def mirror(self, flat: FlatBatch, drafted: set[int]) -> None:
        """Write the draft K/V of the target's step ``flat``. For a sequence in ``drafted``
        (indices into the step's scheduled list) ``propose`` already wrote all but its last
        token: its last draft, whose K/V a full acceptance needs."""
        keep: list[int] = []  # flat rows to compute
        query_lens: list[int] = []
        start = 0
        for i, q in zip(flat.seq_indices, flat.query_lens):
            first = start + q - 1 if i in drafted else start
            keep.extend(range(first, start + q))
            query_lens.append(start + q - first)
            start += q
        slots = [flat.slots[r] for r in keep]
        meta = AttentionMetadata.paged(query_lens, flat.seq_lens, slots, flat.block_tables, [], self.device)
        as_long = {"dtype": torch.long, "device": self.device}
        ids = torch.tensor([flat.ids[r] for r in keep], **as_long)
        self.model.hidden_states(ids, torch.tensor([flat.positions[r] for r in keep], **as_long), meta, self.kv_caches)
