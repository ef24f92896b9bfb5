"""How much memory the KV cache gets, decided once at start-up.

CPU: ``EngineArgs.kv_cache_memory`` (default 1 GiB). CUDA: what ``gpu_memory_utilization``
of the device leaves after the weights, the peak of the largest step (measured by running
it: one forward at ``max_num_batched_tokens`` projecting the most logits rows a step can,
``max_num_seqs`` sampled plus the prompt-logprob cap, then the sampler on the former with its
most costly parameters and prompt-logprob scoring on the latter) and, with CUDA graphs, their
reserve.
Graphs are captured after the cache exists (they bake in its address), so their memory is
measured first and set aside: one static decode forward at the largest padded batch plus the
shared logits buffer (``DecodeGraphRunner.activation_bytes``) and the padding rows' block.
"""
from __future__ import annotations

import logging

import torch

from vllmini.config import EngineArgs
from vllmini.engine import prompt_logprobs
from vllmini.engine.cuda_graph import PAD_BLOCKS, DecodeGraphRunner
from vllmini.engine.model_runner import ModelRunner
from vllmini.engine.sampler import Sampler, SamplingRow, SamplingTensors
from vllmini.engine.sampling_params import SamplingParams
from vllmini.kv.cache import DEFAULT_CPU_KV_BYTES, KVCacheSpec, check_cpu_budget, cuda_kv_budget

logger = logging.getLogger("vllmini")


def kv_cache_budget(
    model: torch.nn.Module, spec: KVCacheSpec, args: EngineArgs, max_model_len: int, device: torch.device,
    use_graphs: bool, max_prompt_logits_rows: int, pooling: bool = False,
) -> int:  # fmt: skip
    """Bytes for the KV cache (``kv_cache_memory`` wins wherever it is set). ``pooling``: the
    pooling runner's step (hidden states of every scheduled row at most, no logits) is measured."""
    if device.type != "cuda" or args.kv_cache_memory is not None:
        budget = args.kv_cache_memory or DEFAULT_CPU_KV_BYTES
        if device.type == "cpu":
            check_cpu_budget(budget)
        return budget
    graph_reserve = 0
    if use_graphs:
        shape = (1, spec.block_size, spec.num_kv_heads, spec.head_dim)
        graph_reserve = DecodeGraphRunner.activation_bytes(
            model, shape, spec.dtype, model.config.num_hidden_layers, args.max_num_seqs, max_model_len, device
        ) + PAD_BLOCKS * spec.bytes_per_block
    torch.cuda.reset_peak_memory_stats(device)
    if pooling:
        tokens = args.max_num_batched_tokens
        ModelRunner.warmup(model, tokens, max_model_len, device, tokens, hidden=True)
    else:
        warm_up_step(model, args, max_model_len, max_prompt_logits_rows, device)
    logger.info("CUDA graph memory reserve: %.1f MiB", graph_reserve / 2**20)
    return cuda_kv_budget(device, args.gpu_memory_utilization) - graph_reserve


@torch.inference_mode()
def warm_up_step(
    model: torch.nn.Module, args: EngineArgs, max_model_len: int, max_prompt_logits_rows: int, device: torch.device
) -> None:
    """Run the most memory a step can take: the forward at the largest step size, the sampler
    over ``max_num_seqs`` rows with every costly option on (top-p on flat logits, which sorts
    whole rows; penalties; an allowed-tokens mask, on one row: its mask covers the batch; the
    most logprobs), and prompt-logprob scoring on the capped rows. With speculative decoding a
    decode samples a row per draft too: up to ``max_num_seqs * (1 + k)`` rows (within the budget)."""
    num_sampled = args.max_num_seqs
    if args.speculative_config is not None:
        from vllmini.spec_decode.config import SpeculativeConfig

        k = SpeculativeConfig.parse(args.speculative_config).num_speculative_tokens
        num_sampled = min(args.max_num_batched_tokens, args.max_num_seqs * (1 + k))
    logits = ModelRunner.warmup(
        model, args.max_num_batched_tokens, max_model_len, device, num_sampled + max_prompt_logits_rows
    )
    vocab = logits.shape[-1]
    num_logprobs = vocab if args.max_logprobs == -1 else min(args.max_logprobs, vocab)
    costly = dict(temperature=0.8, top_p=0.9, min_p=0.01, repetition_penalty=1.1, presence_penalty=0.1,
                  frequency_penalty=0.1, logprobs=num_logprobs)  # fmt: skip
    params = [SamplingParams(**costly, allowed_token_ids=[0])] + [SamplingParams(**costly)] * (num_sampled - 1)
    rows = [SamplingRow(p, [0] * 16, [0] * 16) for p in params[: logits.shape[0]]]
    sampled = logits[: len(rows)].zero_()  # flat: no top-p prefix holds the nucleus
    Sampler()(sampled, SamplingTensors.from_rows(rows, vocab, device))
    prompt = logits[len(rows) :]
    if prompt.shape[0]:
        prompt_logprobs.score_rows(prompt, [0] * prompt.shape[0], num_logprobs)
