"""Turns one scheduled step into one forward: flat batch + explicit AttentionMetadata.

The runner owns the model and the KV cache tensors; it knows sequences only through
the scheduler's output (token ids, computed counts, block tables).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from vllmini.engine.cuda_graph import DecodeGraphRunner
from vllmini.engine.prompt_embeds import stacked
from vllmini.kv.block_manager import SeqId
from vllmini.kv.cache_dtype import indexable
from vllmini.kv.hybrid_block_manager import KVBlockManager
from vllmini.kv.kv_groups import KVCacheLayout
from vllmini.kv.state_cache import StatefulBlockManager
from vllmini.lora.manager import LoRAManager
from vllmini.models.base import AttentionMetadata, block_table_tensor, slot_of
from vllmini.scheduler.scheduler import ScheduledSeq, SchedulerOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    sample_indices: list[int]  # indices into scheduler_output.scheduled that get a logits row, in row order
    inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None = None  # prompt_embeds: (rows, [n, hidden]) replacing theirs


@dataclass
class FlatBatch:
    """One step's scheduled chunks as host lists, before any device copy. The eager path and
    the CUDA-graph path build their device inputs from this same object."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]  # the sampled rows first, then the prompt-logprob rows
    sample_indices: list[int]  # scheduled sequences that sample, in logits-row order
    # prompt_logprobs: (index into scheduled, first position, count); their logits rows follow
    # the sampled ones, in this order
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)
    loras: list[Any] = field(default_factory=list)  # each sequence's LoRA adapter (None: the base model)
    seq_indices: list[int] = field(default_factory=list)  # each sequence's index into scheduled, in row order
    # prompts given as embeddings (engine/prompt_embeds.py): (first row, [n, hidden]) per chunk, whose
    # rows' input embeddings these replace
    embeds: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # KV cache groups 1.. of a hybrid model (kv/kv_groups.py), each as ``slots`` / ``block_tables`` are
    # for group 0; empty with one group
    group_slots: list[list[int]] = field(default_factory=list)
    group_tables: list[list[list[int]]] = field(default_factory=list)
    # linear-attention layers (kv/state_cache.py): each sequence's state slot, in row order; empty without them
    state_slots: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_sample_rows(self) -> int:
        """The logits rows sampled: one per sampling sequence, but k + 1 for a decode verifying k
        speculative drafts (its last token's row, then each draft's, one after another)."""
        return len(self.logits_rows) - sum(count for _, _, count in self.prompt_rows)

    @property
    def is_decode_only(self) -> bool:
        """Every row is one new token whose logits are sampled (what a decode graph computes)."""
        return not self.prompt_rows and not self.embeds and len(self.logits_rows) == len(self.query_lens) == len(self.ids)

    def add_groups(self, seq_ids: list[SeqId], block_manager: KVBlockManager, block_size: int) -> None:
        """Fill ``group_slots`` / ``group_tables`` for the sequences ``seq_ids`` (in row order) from
        their tables in KV groups 1..; nothing with one group."""
        if block_manager.num_groups == 1:
            return
        self.group_slots = [[] for _ in range(block_manager.num_groups - 1)]
        self.group_tables = [[] for _ in range(block_manager.num_groups - 1)]
        row = 0
        for seq_id, num_rows in zip(seq_ids, self.query_lens):
            positions = self.positions[row : row + num_rows]
            for slots, tables, table in zip(self.group_slots, self.group_tables, block_manager.block_tables(seq_id)[1:]):
                tables.append(table)
                slots.extend(slot_of(table, p, block_size) for p in positions)
            row += num_rows

    def add_states(self, seq_ids: list[SeqId], block_manager: KVBlockManager) -> None:
        """Fill ``state_slots`` for the sequences ``seq_ids`` (in row order): nothing without linear layers."""
        if isinstance(block_manager, StatefulBlockManager):
            self.state_slots = [block_manager.state_slot(seq_id) for seq_id in seq_ids]

    def to_model_input(self, device: torch.device, layout: KVCacheLayout | None = None) -> ModelInput:
        meta = AttentionMetadata.paged(
            self.query_lens, self.seq_lens, self.slots, self.block_tables, self.logits_rows, device
        )
        if layout is not None:
            width = max(map(len, self.block_tables))
            meta.with_groups(layout, [torch.tensor(s, dtype=torch.long, device=device) for s in self.group_slots],
                             [block_table_tensor(t, width).to(device) for t in self.group_tables])  # fmt: skip
        as_long = {"dtype": torch.long, "device": device}
        if self.state_slots:
            meta.state_indices = torch.tensor(self.state_slots, **as_long)
        embeds = stacked(self.embeds, device) if self.embeds else None
        return ModelInput(
            torch.tensor(self.ids, **as_long), torch.tensor(self.positions, **as_long), meta, self.sample_indices, embeds
        )


def flatten_step(sched: SchedulerOutput, block_manager: KVBlockManager, block_size: int) -> FlatBatch:
    """Lay the scheduled chunks end to end: token ids, positions, KV slots, block tables."""
    flat = FlatBatch([], [], [], [], [], [], [], [])
    prompt_logits_rows: list[int] = []
    order: Iterable[int] = range(len(sched.scheduled))
    if any(s.seq.lora is not None for s in sched.scheduled):  # each adapter's rows together (lora/layers.py)
        order = sorted(order, key=lambda i: sched.scheduled[i].seq.lora_key)
    for i in order:
        s = sched.scheduled[i]
        seq, start = s.seq, s.seq.num_computed_tokens
        end = start + s.num_new_tokens
        table = block_manager.block_table(seq.seq_id)
        if end == seq.num_tokens == start + 1 and seq.prompt_logits_from is None and \
                (seq.prompt_embeds is None or start >= seq.num_prompt_tokens):  # a decode row: the common case
            flat.logits_rows.append(len(flat.ids))
            flat.sample_indices.append(i)
            flat.ids.append(seq.token_ids[start])
            flat.positions.append(start)
            flat.slots.append(slot_of(table, start, block_size))
            flat.query_lens.append(1)
            flat.seq_lens.append(end)
            flat.block_tables.append(table)
            flat.loras.append(seq.lora)
            flat.seq_indices.append(i)
            continue
        if seq.prompt_logits_from is not None:  # position p's logits give prompt token p + 1's logprob
            first, last = max(start, seq.prompt_logits_from), min(end, seq.num_prompt_tokens - 1)
            if first < last:
                flat.prompt_rows.append((i, first, last - first))
                row0 = len(flat.ids) - start
                prompt_logits_rows.extend(range(row0 + first, row0 + last))
        if seq.prompt_embeds is not None and start < seq.num_prompt_tokens:  # its rows take these embeddings
            flat.embeds.append((len(flat.ids), seq.prompt_embeds[start : min(end, seq.num_prompt_tokens)]))
        if s.spec_token_ids:  # a decode and its drafts: every position is sampled
            flat.logits_rows.extend(range(len(flat.ids), len(flat.ids) + s.num_new_tokens))
            flat.sample_indices.append(i)
            flat.ids.extend([seq.token_ids[start], *s.spec_token_ids])
        else:
            flat.ids.extend(seq.token_ids[start:end])
        flat.positions.extend(range(start, end))
        flat.slots.extend(slot_of(table, p, block_size) for p in range(start, end))
        flat.query_lens.append(s.num_new_tokens)
        flat.seq_lens.append(end)
        flat.block_tables.append(table)
        flat.loras.append(seq.lora)
        flat.seq_indices.append(i)
        if s.completes and not s.spec_token_ids:
            flat.logits_rows.append(len(flat.ids) - 1)
            flat.sample_indices.append(i)
    flat.logits_rows.extend(prompt_logits_rows)
    seq_ids = [sched.scheduled[i].seq.seq_id for i in flat.seq_indices]
    flat.add_groups(seq_ids, block_manager, block_size)
    flat.add_states(seq_ids, block_manager)
    return flat


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        decode_graphs: DecodeGraphRunner | None = None,
        lora: LoRAManager | None = None,
        kv_layout: KVCacheLayout | None = None,
    ) -> None:
        self.model = model
        self.kv_layout = kv_layout  # several KV groups: kv_caches holds kv_layout.group_size tensor pairs
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.decode_graphs = decode_graphs  # None: every step runs eagerly (CPU, enforce_eager)
        self.lora = lora  # enable_lora: puts each step's adapters in the model's slots
        # speculative decoding with a draft model: its KV cache, on the same block ids (copied on fork too)
        self.draft_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # linear-attention layers' per-sequence states (kv/state_cache.py), handed to the model in the metadata
        self.state_caches: list[tuple[torch.Tensor, ...]] = []

    @staticmethod
    @torch.inference_mode()
    def warmup(
        model: torch.nn.Module, num_tokens: int, max_model_len: int, device: torch.device, num_logits_rows: int = 1,
        hidden: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """One forward at the largest step size (no cache), projecting ``num_logits_rows`` rows
        to logits (the most a step projects), so that the activation peak is known before the KV
        cache takes what memory is left. Returns the logits, for a warm-up of what reads them.
        ``hidden``: the pooling runner's forward instead, those rows' hidden states."""
        lengths = [max_model_len] * (num_tokens // max_model_len) + ([num_tokens % max_model_len] if num_tokens % max_model_len else [])
        meta = AttentionMetadata.for_prompts(lengths, device)
        meta.logits_indices = torch.arange(min(num_logits_rows, num_tokens), device=device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        return (model.hidden_states if hidden else model)(ids, positions, meta)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-fork: duplicate partially filled blocks for n > 1 sequences (in the draft
        model's cache too, which shares the block ids); fp8 caches as their bytes (``indexable``)."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in [indexable(c) for layer in [*self.kv_caches, *self.draft_kv_caches] for c in layer]:
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def copy_state(self, src: int, dst: int) -> None:
        """A forked sequence's linear-attention state: its parent's slot copied into its own."""
        for tensor in (t for layer in self.state_caches for t in layer):
            tensor[dst] = tensor[src]

    def with_states(self, inp: ModelInput) -> ModelInput:
        """``inp`` with the state tensors its sequences' slots index (nothing to add without them)."""
        if self.state_caches:
            inp.attn_metadata.state_caches = self.state_caches
        return inp

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_manager: KVBlockManager) -> tuple[torch.Tensor, FlatBatch]:
        """Run the step's forward; returns the logits of ``flat.logits_rows``: first one row per
        sequence that completed its scheduled chunk (``flat.sample_indices`` into
        ``sched.scheduled``), then the prompt-logprob rows (``flat.prompt_rows``)."""
        flat = flatten_step(sched, block_manager, self.block_size)
        return self.run_flat(flat), flat

    @torch.inference_mode()
    def execute_pooling(
        self, sched: SchedulerOutput, block_manager: KVBlockManager, wanted: Callable[[ScheduledSeq], tuple[int, int]]
    ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The pooling runner's forward: the final-normed hidden states of the rows ``wanted``
        asks of each scheduled chunk ((first row in the chunk, count), engine/pooler.py), and per
        chunk (index into ``sched.scheduled``, its first row in the result, count)."""
        flat = flatten_step(sched, block_manager, self.block_size)
        rows: list[int] = []
        spans = []
        chunk_start = 0
        for i, num_new in zip(flat.seq_indices, flat.query_lens):
            first, count = wanted(sched.scheduled[i])
            spans.append((i, len(rows), count))
            rows.extend(range(chunk_start + first, chunk_start + first + count))
            chunk_start += num_new
        flat.logits_rows = rows
        if self.lora is not None:
            self.lora.prepare(flat.loras, flat.query_lens)
        inp = self.with_states(flat.to_model_input(self.device, self.kv_layout))
        return self.model.hidden_states(inp.input_ids, inp.positions, inp.attn_metadata, self.kv_caches), spans

    @torch.inference_mode()
    def run_flat(self, flat: FlatBatch, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``flat``'s logits rows. ``token_ids``: the input ids already on the device
        (async scheduling: the previous step's samples), replacing ``flat.ids``."""
        if self.lora is not None:
            self.lora.prepare(flat.loras, flat.query_lens)
        if self.decode_graphs is not None and self.decode_graphs.can_run(flat):
            return self.decode_graphs.run(flat, token_ids)
        inp = self.with_states(flat.to_model_input(self.device, self.kv_layout))
        if token_ids is not None:
            inp.input_ids.copy_(token_ids)
        if inp.inputs_embeds is not None:
            return self.model(inp.input_ids, inp.positions, inp.attn_metadata, self.kv_caches, inp.inputs_embeds)
        return self.model(inp.input_ids, inp.positions, inp.attn_metadata, self.kv_caches)
