"""What an engine builds around its loaded model: the attention backend, LoRA slots, the KV
cache sized from what memory is left, the block manager, the scheduler, CUDA graphs and the
model runner. Kept apart from ``LLMEngine`` so that the engine reads as the request lifecycle."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from vllmini.config import EngineArgs
from vllmini.engine import prompt_logprobs
from vllmini.engine.cuda_graph import PAD_BLOCKS, capture_decode_graphs
from vllmini.engine.kv_budget import kv_cache_budget
from vllmini.engine.model_runner import ModelRunner
from vllmini.engine.pooler import Pooler
from vllmini.kv.block_manager import BlockManager
from vllmini.kv.cache import KVCacheSpec, allocate_kv_cache, block_id_bytes, check_cpu_budget, num_blocks_for_budget
from vllmini.kv.cache_dtype import resolve_kv_cache_dtype
from vllmini.kv.hybrid_block_manager import HybridBlockManager, KVBlockManager
from vllmini.kv.kv_groups import plan_kv_layout
from vllmini.kv.state_cache import StateDtypes, StatefulBlockManager, allocate_state_cache, state_slots_for_budget
from vllmini.lora.manager import LoRAManager
from vllmini.models.backend_check import start_backend
from vllmini.scheduler.scheduler import Scheduler, SchedulerConfig
from vllmini.spec_decode.draft_model import DraftModelProposer

logger = logging.getLogger("vllmini")


@dataclass
class EngineRuntime:
    attention_backend: str
    lora_manager: LoRAManager | None
    num_blocks: int
    block_manager: KVBlockManager
    scheduler: Scheduler
    runner: ModelRunner
    drafter: DraftModelProposer | None = None  # speculative decoding with a draft model


def build_runtime(
    args: EngineArgs, model: Any, hf_config: Any, device: torch.device, dtype: torch.dtype, max_model_len: int,
    pooler: Pooler | None, draft_model: Any = None,
) -> EngineRuntime:  # fmt: skip
    """Everything between the loaded model and the first step, in the order memory needs:
    adapter slots and the warm-up peak first, then the KV cache takes what is left.
    ``draft_model`` (speculative decoding, loaded already): it gets a KV cache of its own on the
    same block ids, so each block costs both caches' bytes."""
    kv_window = model.kv_window  # every layer's window, if they share one: blocks behind it are released
    # sliding and full layers mixed: a KV group per kind (kv/kv_groups.py), unless turned off or a draft model
    # shares the block ids (its cache would need a table that no group is)
    layout = None if args.disable_hybrid_kv_cache_manager else plan_kv_layout(model.layer_windows)
    if layout is not None and draft_model is not None and layout.group_windows[0] is not None:
        # a draft model's cache takes the first group's block ids (its table covers every position
        # only when that group attends to all of them: full attention)
        logger.info("hybrid KV cache off: no full-attention layer group for the draft model's cache to share")
        layout = None
    block_size = args.block_size or (256 if device.type == "cuda" else 16)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    attention_backend, backend = start_backend(
        args.attention_backend, device, dtype, block_size,
        hf_config.num_attention_heads, model.num_kv_heads, model.head_dim, model.sliding_window, cache_dtype,
        model.logits_soft_cap, model.attention_sinks,
    )  # fmt: skip
    model.set_attention_backend(backend)
    lora_manager: LoRAManager | None = None
    linear_states = model.state_shapes() if hasattr(model, "state_shapes") else None  # kv/state_cache.py
    if args.enable_lora:  # (before the KV budget: the adapter slots take memory too)
        lora_manager = LoRAManager(model, args.max_loras, args.max_lora_rank, args.max_cpu_loras or args.max_loras,
                                   dtype, device)  # fmt: skip
        logger.info("LoRA: %d adapter slots of rank <= %d", args.max_loras, args.max_lora_rank)
    # the decode graphs capture no LoRA mapping: an engine with enable_lora runs every step eagerly
    # (a pooling engine runs no decode step)
    use_graphs = device.type == "cuda" and not args.enforce_eager and not args.enable_lora and pooler is None
    if use_graphs and (blocker := model.cuda_graph_blocker(device, dtype)) is not None:
        logger.warning("CUDA graphs off: %s", blocker)
        use_graphs = False
    logger.info(
        "attention backend: %s (block size %d, %s, KV cache %s, CUDA graphs %s)",
        attention_backend, block_size, dtype, cache_dtype, "on" if use_graphs else "off",
    )  # fmt: skip
    # layers a block id holds (a hybrid linear-attention model pages only its full-attention layers)
    cache_layers = getattr(model, "num_kv_cache_layers", hf_config.num_hidden_layers) if layout is None else layout.group_size
    spec = KVCacheSpec(cache_layers, model.num_kv_heads, model.head_dim, block_size, cache_dtype,
                       getattr(model, "use_mla", False))  # fmt: skip
    max_prompt_rows = prompt_logprobs.max_rows_per_step(hf_config.vocab_size, args.max_num_batched_tokens)
    budget = kv_cache_budget(model, spec, args, max_model_len, device, use_graphs, max_prompt_rows,
                             pooling=pooler is not None)  # fmt: skip
    draft_spec = None
    if draft_model is not None:
        try:  # (the same attention_backend: a forced one the draft cannot run is refused as the draft's)
            draft_backend = start_backend(
                args.attention_backend, device, dtype, block_size, draft_model.config.num_attention_heads,
                draft_model.num_kv_heads, draft_model.head_dim, draft_model.sliding_window, cache_dtype,
                draft_model.logits_soft_cap, draft_model.attention_sinks,
            )[1]  # fmt: skip
        except ValueError as exc:
            raise ValueError(f"the draft model (speculative_config.model): {exc}") from exc
        draft_model.set_attention_backend(draft_backend)
        draft_spec = KVCacheSpec(draft_model.config.num_hidden_layers, draft_model.num_kv_heads, draft_model.head_dim,
                                 block_size, cache_dtype, getattr(draft_model, "use_mla", False))  # fmt: skip
    max_num_seqs = args.max_num_seqs  # (a model with linear-attention layers: at most one per state slot)
    if linear_states:
        state_dtypes = StateDtypes.resolve(dtype, args.mamba_cache_dtype, args.mamba_ssm_cache_dtype)
        max_num_seqs, budget = state_slots_for_budget(linear_states, state_dtypes, args.max_num_seqs, budget)
    num_blocks = num_blocks_for_budget(spec, budget, draft_spec)
    if args.num_gpu_blocks_override is not None:  # (vLLM's: the budget is measured, then overridden)
        logger.info("num_gpu_blocks_override: %d KV blocks instead of the %d the budget gives",
                    args.num_gpu_blocks_override, num_blocks)  # fmt: skip
        num_blocks = args.num_gpu_blocks_override
        if device.type == "cpu":
            check_cpu_budget(num_blocks * block_id_bytes(spec, draft_spec))
    # the KV cache holds blocks beyond the pool: with graphs, PAD_BLOCKS for padding rows' K/V;
    # then, with a window to release blocks behind, a zeroed null block for released entries
    pad = PAD_BLOCKS if use_graphs else 0
    null = 1 if kv_window or layout else 0
    # MEAN and CLS pooling read positions that a prefix-cache hit skips (as vLLM, no prefix caching then)
    prefix_caching = args.enable_prefix_caching and (pooler is None or pooler.pooling_type == "LAST")
    if prefix_caching and linear_states:  # (a cached prefix's K/V without the linear layers' state there)
        logger.info("prefix caching off: %s keeps a linear-attention state per sequence, not per block",
                    hf_config.architectures[0])  # fmt: skip
        prefix_caching = False
    block_manager: KVBlockManager
    if layout is None:
        block_manager = BlockManager(num_blocks, block_size, prefix_caching, kv_window, null_block=num_blocks + pad)
    else:
        block_manager = HybridBlockManager(num_blocks, block_size, prefix_caching, layout.group_windows,
                                           null_block=num_blocks + pad)  # fmt: skip
        logger.info("hybrid KV cache: %d groups of %d layers (windows %s), one pool of %d blocks",
                    layout.num_groups, layout.group_size, list(layout.group_windows), num_blocks)  # fmt: skip
    if linear_states:
        block_manager = StatefulBlockManager(block_manager, max_num_seqs)
    held = block_manager.blocks_held(max_model_len, args.max_num_batched_tokens)
    logger.info("KV cache: room for %.2fx requests of max_model_len (%d tokens), %d blocks each at most",
                num_blocks / held, max_model_len, held)  # fmt: skip
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs, args.max_num_batched_tokens, max_model_len, max_prompt_rows,
                        args.scheduling_policy, args.max_loras if args.enable_lora else None,
                        args.long_prefill_token_threshold),  # fmt: skip
        block_manager,
    )
    kv_caches = allocate_kv_cache(spec, num_blocks + pad + null, device)
    graphs = None
    if use_graphs:
        graphs = capture_decode_graphs(model, kv_caches, block_size, args.max_num_seqs, max_model_len, num_blocks, device,
                                       layout)  # fmt: skip
    runner = ModelRunner(model, kv_caches, block_size, device, graphs, lora_manager, layout)
    if linear_states:
        runner.state_caches = allocate_state_cache(linear_states, max_num_seqs, state_dtypes, device)
    drafter = None
    if draft_model is not None and draft_spec is not None:
        runner.draft_kv_caches = allocate_kv_cache(draft_spec, num_blocks + pad + null, device)
        drafter = DraftModelProposer(draft_model, runner.draft_kv_caches, block_size, device)
    return EngineRuntime(attention_backend, lora_manager, num_blocks, block_manager, scheduler, runner, drafter)
