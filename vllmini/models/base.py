"""The contract between models and the rest of the engine.

A model sees a *flat* batch: the new tokens of many sequences laid end to end
(``input_ids[T]``, ``positions[T]``) plus one explicit :class:`AttentionMetadata`
that says where each sequence starts, how long its context is and where its
keys/values live. Models know nothing about requests, schedulers or sampling.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from vllmini.kv.kv_groups import KVCacheLayout


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The flat KV-cache slot of token ``position`` of a sequence with ``block_table``: the
    paged layout every writer of ``slot_mapping`` uses."""
    return block_table[position // block_size] * block_size + position % block_size


def block_table_tensor(tables: list[list[int]], width: int, rows: int | None = None, pad_block: int = 0) -> torch.Tensor:
    """Host ``[rows, width]`` int32 block tables, each row zero-padded; rows past ``tables``
    (graph padding) get ``pad_block`` first. Built through one flat NumPy copy: 3-4x faster
    than a nested ``torch.tensor`` (~0.6 vs 2.1 ms for 256 tables of 125 blocks)."""
    rows = len(tables) if rows is None else rows
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum()))
    out = np.zeros((rows, width), dtype=np.int32)
    out[: len(tables)][np.arange(width)[None, :] < lens[:, None]] = flat
    out[len(tables) :, 0] = pad_block
    return torch.from_numpy(out)


@dataclass
class AttentionMetadata:
    """Everything attention needs for one forward over a varlen batch.

    Sequence ``i`` owns query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; those rows are
    the *last* ``q_len`` positions of a context of ``seq_lens[i]`` tokens (earlier
    tokens are already in the KV cache). Without a cache (``slot_mapping is None``)
    every sequence is a whole prompt, so ``q_len == seq_len``.
    """

    cu_seqlens_q: torch.Tensor  # [B+1] int32, prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int32, context length (cached + new) per sequence
    max_seqlen_q: int
    max_seqlen_k: int
    # Host copies: the CPU backend plans its work with them without a device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Paged KV cache (None = contiguous, no cache).
    slot_mapping: torch.Tensor | None = None  # [T] int64, flat slot for each new token's K/V
    cu_seqlens_k: torch.Tensor | None = None  # [B+1] int32, prefix sums of seq_lens (flash-attn)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32
    # Rows of the flat hidden states to project to logits (one per sequence).
    logits_indices: torch.Tensor | None = None  # [B] int64
    # Filled by the attention backend at the first layer and reused by the others
    # (how the batch splits into decode and prefill work), so each step plans once.
    backend_plan: Any = None
    # A padded decode step with fixed shapes (what a CUDA graph replays): every row is one
    # token, ``block_tables`` spans the longest possible context, ``max_seqlen_k`` is that
    # bound and the host lists are NOT per-step values, so backends must read the tensors only.
    static_decode: bool = False
    # Several KV cache groups (sliding and full layers mixed: kv/kv_groups.py): which group and cache
    # tensor pair each layer uses, and the metadata of groups 1.. (their slots and block tables; this
    # object is group 0's). None: one table serves every layer, and layer i's cache is kv_caches[i].
    kv_layout: KVCacheLayout | None = None
    group_metas: list[AttentionMetadata] = dataclasses.field(default_factory=list)
    # Linear-attention layers (Qwen3.5's Gated DeltaNet: models/gated_deltanet.py): each sequence's slot
    # in the fixed-size state tensors, and those tensors (a tuple per stateful layer, kv/state_cache.py).
    # None: no state kept, every sequence starts from zeros. ``state_plan``: made by the first such layer.
    state_indices: torch.Tensor | None = None  # [B] int64
    state_caches: list[tuple[torch.Tensor, ...]] | None = None
    state_plan: Any = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def for_layer(self, i: int, kv_caches: list[Any] | None) -> tuple[AttentionMetadata, Any]:
        """Layer ``i``'s metadata and KV cache: its group's, when the cache is grouped."""
        layout = self.kv_layout
        if layout is None:
            return self, None if kv_caches is None else kv_caches[i]
        group = layout.layer_groups[i]
        meta = self if group == 0 else self.group_metas[group - 1]
        return meta, None if kv_caches is None else kv_caches[layout.layer_slots[i]]

    def with_groups(
        self, layout: KVCacheLayout, slot_mappings: list[torch.Tensor], block_tables: list[torch.Tensor]
    ) -> AttentionMetadata:
        """This (group 0's) metadata given groups 1..'s slots and tables: the rest is shared."""
        self.kv_layout = layout
        self.group_metas = [dataclasses.replace(self, slot_mapping=slots, block_tables=tables, kv_layout=None,
                                                group_metas=[], backend_plan=None)
                            for slots, tables in zip(slot_mappings, block_tables)]  # fmt: skip
        return self

    @classmethod
    def paged(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        slot_mapping: list[int],
        block_tables: list[list[int]],
        logits_rows: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata for a step over the paged cache, from host lists (one copy each).
        ``logits_rows`` default: the last row of every sequence."""
        cu_q, cu_k = [0], [0]
        for q, k in zip(query_lens, seq_lens):
            cu_q.append(cu_q[-1] + q)
            cu_k.append(cu_k[-1] + k)

        def tensor(x: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype, device=device)

        return cls(
            cu_seqlens_q=tensor(cu_q, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            slot_mapping=tensor(slot_mapping, torch.long),
            cu_seqlens_k=tensor(cu_k, torch.int32),
            block_tables=block_table_tensor(block_tables, max(map(len, block_tables))).to(device),
            logits_indices=tensor([c - 1 for c in cu_q[1:]] if logits_rows is None else logits_rows, torch.long),
        )

    @classmethod
    def for_static_decode(
        cls,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        seq_lens: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        max_seqlen_k: int,
    ) -> AttentionMetadata:
        """Metadata over preallocated device buffers (views) for a padded decode batch: built
        once per padded batch size and reused by every replay, so nothing here is per-step."""
        batch = seq_lens.shape[0]
        return cls(
            cu_seqlens_q=cu_seqlens_q,
            seq_lens=seq_lens,
            max_seqlen_q=1,
            max_seqlen_k=max_seqlen_k,
            query_lens_cpu=[1] * batch,
            seq_lens_cpu=[max_seqlen_k] * batch,  # upper bounds only (see static_decode)
            slot_mapping=slot_mapping,
            cu_seqlens_k=cu_seqlens_k,
            block_tables=block_tables,
            logits_indices=None,  # every row is a sequence's last token
            static_decode=True,
        )

    @classmethod
    def for_prompts(cls, lengths: list[int], device: torch.device | str = "cpu") -> AttentionMetadata:
        """Metadata for whole prompts run without a KV cache (tests, parity checks)."""
        if not lengths or min(lengths) < 1:
            raise ValueError(f"prompt lengths must be >= 1, got {lengths}")
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        return cls(
            cu_seqlens_q=cu.to(device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            max_seqlen_q=max(lengths),
            max_seqlen_k=max(lengths),
            query_lens_cpu=list(lengths),
            seq_lens_cpu=list(lengths),
            logits_indices=(cu[1:].long() - 1).to(device),
        )


class CausalLM(Protocol):
    """What every model class provides (see models/llama.py, models/qwen3.py)."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` for the rows in ``attn_metadata.logits_indices``; ``inputs_embeds``
        (rows, values): those rows' input embeddings instead of their tokens' (engine/prompt_embeds.py)."""
        ...

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states ``[B, hidden]`` of those rows (before the lm_head)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; return the names loaded."""
        ...
