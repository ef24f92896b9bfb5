"""How much memory the KV cache gets, decided once at start-up.

CPU: ``EngineArgs.kv_cache_memory`` (default 1 GiB). CUDA: what ``gpu_memory_utilization``
of the device leaves after the weights, the activation peak of one forward at the largest
step (measured by running it, ``ModelRunner.warmup``) and, with CUDA graphs, their reserve.
Graphs are captured after the cache exists (they bake in its address), so their memory is
measured first and set aside: one static decode forward at the largest padded batch plus the
shared logits buffer (``DecodeGraphRunner.activation_bytes``) and the padding rows' block.
"""
from __future__ import annotations

import logging

import torch

from vllmini.config import EngineArgs
from vllmini.engine.cuda_graph import PAD_BLOCKS, DecodeGraphRunner
from vllmini.engine.model_runner import ModelRunner
from vllmini.kv.cache import DEFAULT_CPU_KV_BYTES, KVCacheSpec, cuda_kv_budget

logger = logging.getLogger("vllmini")


def kv_cache_budget(
    model: torch.nn.Module, spec: KVCacheSpec, args: EngineArgs, max_model_len: int, device: torch.device,
    use_graphs: bool,
) -> int:  # fmt: skip
    """Bytes for the KV cache (``kv_cache_memory`` wins wherever it is set)."""
    if device.type != "cuda" or args.kv_cache_memory is not None:
        return args.kv_cache_memory or DEFAULT_CPU_KV_BYTES
    graph_reserve = 0
    if use_graphs:
        shape = (1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        graph_reserve = DecodeGraphRunner.activation_bytes(
            model, shape, spec.dtype, spec.num_layers, args.max_num_seqs, max_model_len, device
        ) + PAD_BLOCKS * spec.bytes_per_block
    torch.cuda.reset_peak_memory_stats(device)
    ModelRunner.warmup(model, args.max_num_batched_tokens, max_model_len, device)
    logger.info("CUDA graph memory reserve: %.1f MiB", graph_reserve / 2**20)
    return cuda_kv_budget(device, args.gpu_memory_utilization) - graph_reserve
