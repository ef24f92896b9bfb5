"""CUDA graphs for decode steps: capture once per padded batch size, replay per step.

A decode step is small (one token per sequence) and, for a model of this size, mostly
kernel-launch and Python overhead; replaying a captured graph removes both. A graph
replays fixed shapes at fixed addresses, so:

- inputs live in static device buffers (``StaticDecodeBuffers``) that each step copies
  into; shapes are padded to the next captured batch size (1, 2, 4, 8, then every 16);
- padding rows are real rows as far as kernels know: token 0 at position 0, context
  length 1, writing their K/V into a reserved pad block that no sequence owns; their
  logits rows are dropped;
- block tables are padded to the most blocks a sequence can have (``max_model_len``), and
  ``max_seqlen_k`` is that bound, so the attention call has the same shape every step;
- attention reads only device tensors (``AttentionMetadata.static_decode``) and nothing in
  the forward syncs with the host.

Without ``use_graphs`` (the tests, on CPU) the runner runs the same padded static forward
eagerly: that is exactly what a graph would replay, so its equality with the unpadded eager
forward is checked on every machine, and on CUDA replay == this forward. (The engine builds a
runner only when graphs are on: on a CPU its decode steps take the plain eager path.)
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllmini.models.base import AttentionMetadata, block_table_tensor

if TYPE_CHECKING:
    from vllmini.engine.model_runner import FlatBatch
    from vllmini.kv.kv_groups import KVCacheLayout

logger = logging.getLogger("vllmini")
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
PAD_BLOCKS = 1  # the KV cache holds this many blocks beyond the block manager's, for padding rows


@functools.lru_cache(maxsize=None)
def graph_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream that every decode-graph warm-up and capture runs on (one per device
    and process). cuBLAS keeps a workspace per (handle, stream), taken from torch's caching
    allocator on the stream's first matmul and never given back (32 MiB on sm_90, see torch's
    CublasHandlePool.cpp): a fresh stream per captured size would hold one workspace each (20
    sizes at max_num_seqs=256: 640 MiB) beyond the KV budget, which ``activation_bytes`` makes
    room for by running its forward on this same stream first."""
    return torch.cuda.Stream(device)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every 16, up to the first size that
    holds ``max_num_seqs`` (so every decode step has a graph)."""
    sizes = []
    for size in (1, 2, 4, 8):
        sizes.append(size)
        if size >= max_num_seqs:
            return sizes
    return sizes + list(range(16, -(-max_num_seqs // 16) * 16 + 1, 16))


@dataclass
class StaticDecodeBuffers:
    """Device inputs of the largest padded batch; batch size ``b`` uses the first ``b`` rows."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slot_mapping: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32, 0..B (one token per row)
    cu_seqlens_k: torch.Tensor  # [B+1] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    # KV cache groups 1.. of a hybrid model (kv/kv_groups.py): their slots and tables, as the two above
    group_slot_mapping: torch.Tensor  # [groups - 1, B] int64
    group_block_tables: torch.Tensor  # [groups - 1, B, max_blocks] int32

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device, num_groups: int = 1) -> StaticDecodeBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_batch, dtype=torch.long),
            positions=zeros(max_batch, dtype=torch.long),
            slot_mapping=zeros(max_batch, dtype=torch.long),
            seq_lens=zeros(max_batch),
            cu_seqlens_q=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            cu_seqlens_k=zeros(max_batch + 1),
            block_tables=zeros(max_batch, max_blocks),
            group_slot_mapping=zeros(num_groups - 1, max_batch, dtype=torch.long),
            group_block_tables=zeros(num_groups - 1, max_batch, max_blocks),
        )

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def metadata(self, batch: int, block_size: int, layout: KVCacheLayout | None = None) -> AttentionMetadata:
        meta = AttentionMetadata.for_static_decode(
            self.cu_seqlens_q[: batch + 1], self.cu_seqlens_k[: batch + 1], self.seq_lens[:batch],
            self.slot_mapping[:batch], self.block_tables[:batch], self.max_blocks * block_size,
        )  # fmt: skip
        if layout is None:
            return meta
        return meta.with_groups(layout, list(self.group_slot_mapping[:, :batch]), list(self.group_block_tables[:, :batch]))

    def fill(self, flat: FlatBatch | None, batch: int, pad_block: int, block_size: int) -> None:
        """Copy one step's rows in and pad to ``batch`` rows (``flat=None``: padding only).
        Host lists are assembled first, then one host->device copy per buffer."""
        ids, positions, slots, lens, tables = ([], [], [], [], []) if flat is None else (
            flat.ids, flat.positions, flat.slots, flat.seq_lens, flat.block_tables
        )  # fmt: skip
        pad = batch - len(ids)
        lens = list(lens) + [1] * pad
        cu_k = [0]
        for n in lens:
            cu_k.append(cu_k[-1] + n)

        def put(dst: torch.Tensor, values: list, dtype: torch.dtype) -> None:
            dst.copy_(torch.tensor(values, dtype=dtype), non_blocking=True)

        put(self.input_ids[:batch], list(ids) + [0] * pad, torch.long)
        put(self.positions[:batch], list(positions) + [0] * pad, torch.long)
        put(self.slot_mapping[:batch], list(slots) + [pad_block * block_size] * pad, torch.long)
        put(self.seq_lens[:batch], lens, torch.int32)
        put(self.cu_seqlens_k[: batch + 1], cu_k, torch.int32)
        self.block_tables[:batch].copy_(block_table_tensor(tables, self.max_blocks, batch, pad_block), non_blocking=True)
        for g in range(self.group_block_tables.shape[0]):
            group_slots, group_tables = ([], []) if flat is None else (flat.group_slots[g], flat.group_tables[g])
            put(self.group_slot_mapping[g, :batch], list(group_slots) + [pad_block * block_size] * pad, torch.long)
            self.group_block_tables[g, :batch].copy_(block_table_tensor(group_tables, self.max_blocks, batch, pad_block),
                                                     non_blocking=True)  # fmt: skip


class DecodeGraphRunner:
    """Runs decode-only steps through one captured graph per padded batch size.

    ``pad_block`` is a KV block outside the block manager's pool (the cache is allocated with
    ``PAD_BLOCKS`` extra). Graphs share one memory pool and write their logits into one
    shared buffer, so their memory is about one decode forward's activations plus that
    buffer (see ``activation_bytes``, which the engine subtracts from the KV budget)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: KVCaches,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        pad_block: int,
        device: torch.device,
        use_graphs: bool = True,
        kv_layout: KVCacheLayout | None = None,
    ) -> None:
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.pad_block, self.device, self.use_graphs = pad_block, device, use_graphs
        self.kv_layout = kv_layout
        self.sizes = capture_sizes(max_num_seqs)
        num_groups = 1 if kv_layout is None else kv_layout.num_groups
        self.buffers = StaticDecodeBuffers.allocate(self.sizes[-1], -(-max_model_len // block_size), device, num_groups)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max batch, vocab], written by every graph

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def can_run(self, flat: FlatBatch) -> bool:
        return (
            flat.is_decode_only
            and flat.num_seqs <= self.sizes[-1]
            and max(map(len, flat.block_tables)) <= self.buffers.max_blocks
        )

    def _forward(self, batch: int) -> torch.Tensor:
        buf = self.buffers
        meta = buf.metadata(batch, self.block_size, self.kv_layout)
        return self.model(buf.input_ids[:batch], buf.positions[:batch], meta, self.kv_caches)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs then reuse the shared pool).
        Inputs are all padding rows, so capture writes only the pad block."""
        if not self.use_graphs:
            return
        pool = None
        stream = graph_stream(self.device)  # warm-ups off the default stream, as torch advises
        for batch in reversed(self.sizes):
            self.buffers.fill(None, batch, self.pad_block, self.block_size)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                out = self._forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self.logits is None:
                self.logits = torch.empty(self.sizes[-1], out.shape[-1], dtype=out.dtype, device=self.device)
            del out
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):  # the warm-up's stream: no new workspace
                self.logits[:batch].copy_(self._forward(batch))
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, flat: FlatBatch, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` for a decode-only step (rows in ``flat`` order);
        ``token_ids`` (on the device) replace ``flat.ids`` as the input ids."""
        batch = self.padded_size(flat.num_seqs)
        self.buffers.fill(flat, batch, self.pad_block, self.block_size)
        if token_ids is not None:
            self.buffers.input_ids[: flat.num_seqs].copy_(token_ids)
        if not self.use_graphs:
            return self._forward(batch)[: flat.num_seqs]
        self.graphs[batch].replay()
        return self.logits[: flat.num_seqs].clone()  # the buffer is overwritten by the next replay

    @staticmethod
    @torch.inference_mode()
    def activation_bytes(
        model: torch.nn.Module, cache_shape: tuple[int, ...], dtype: torch.dtype, num_layers: int,
        max_num_seqs: int, max_model_len: int, device: torch.device,
    ) -> int:  # fmt: skip
        """Peak memory of one padded static decode forward at the largest captured size (run on
        a one-block scratch cache; the gathers' size depends on the block-table width, not on the
        cache), plus the shared logits buffer: what the graphs keep once captured."""
        scratch = [(torch.zeros((1, *cache_shape[1:]), dtype=dtype, device=device),) * 2 for _ in range(num_layers)]
        runner = DecodeGraphRunner(
            model, scratch, cache_shape[1], max_num_seqs, max_model_len, 0, device, use_graphs=False
        )
        batch = runner.sizes[-1]
        runner.buffers.fill(None, batch, 0, runner.block_size)
        stream = graph_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # a first forward on the captures' stream allocates its cuBLAS workspace, which stays
            # allocated and so counts in the KV budget's warm-up peak; the second is measured
            runner._forward(batch)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            out = runner._forward(batch)
            peak = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.current_stream(device).wait_stream(stream)
        return peak + out.numel() * out.element_size()


def capture_decode_graphs(
    model: torch.nn.Module, kv_caches: KVCaches, block_size: int, max_num_seqs: int, max_model_len: int,
    pad_block: int, device: torch.device, kv_layout: KVCacheLayout | None = None,
) -> DecodeGraphRunner | None:  # fmt: skip
    """A runner with every size captured, or None (decode steps then run eagerly) when capture
    fails: an op that cannot be captured is a slower engine, not one that does not start."""
    t0 = time.perf_counter()
    runner = DecodeGraphRunner(model, kv_caches, block_size, max_num_seqs, max_model_len, pad_block, device,
                               kv_layout=kv_layout)  # fmt: skip
    try:
        runner.capture()
    except Exception as exc:  # e.g. an op that syncs with the host inside the capture
        logger.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(exc).__name__, exc)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return None
    logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
                len(runner.sizes), runner.sizes, time.perf_counter() - t0)  # fmt: skip
    return runner
