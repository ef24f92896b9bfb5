"""KV cache tensors and their sizing.

Per layer, K and V are ``[num_blocks, block_size, num_kv_heads, head_dim]`` (one shared tensor for
multi-head latent attention, ``KVCacheSpec.use_mla``): a block
is a page of ``block_size`` consecutive token slots, so slot = block * block_size + offset.
The number of blocks always comes from a memory budget, never a constant.
"""
from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("vllmini")

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB when EngineArgs.kv_cache_memory is not set


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    # multi-head latent attention (models/mla.py): a layer's K and V are one tensor (the latent), not two
    use_mla: bool = False

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        tensors = 1 if self.use_mla else 2
        return tensors * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def block_id_bytes(spec: KVCacheSpec, draft: KVCacheSpec | None = None) -> int:
    """What one block id costs: ``draft``, a draft model's cache (speculative decoding), shares
    the ids of ``spec``'s, so a block id holds a block of both."""
    return spec.bytes_per_block + (draft.bytes_per_block if draft is not None else 0)


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int, draft: KVCacheSpec | None = None) -> int:
    """The block ids ``budget_bytes`` buys (``block_id_bytes``)."""
    per_block = block_id_bytes(spec, draft)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes is smaller than one block "
            f"({per_block} bytes for block_size={spec.block_size}); raise kv_cache_memory"
        )
    return num_blocks


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """Bytes left for the KV cache on a GPU after the weights and a warm-up forward's peak
    (the caller resets the peak statistics, runs the warm-up at the largest step first, and
    subtracts what CUDA graphs will hold: they are captured after the cache is allocated)."""
    free, total = torch.cuda.mem_get_info(device)
    used_by_us = torch.cuda.max_memory_allocated(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    return int(total * gpu_memory_utilization) - used_by_us - used_by_others


def physical_memory() -> tuple[int | None, int | None]:
    """(total, available now) bytes of RAM, from /proc/meminfo (Linux); None where unknown."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None, None
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    kib = {key: int(fields[key].split()[0]) * 1024 for key in ("MemTotal", "MemAvailable") if key in fields}
    return kib.get("MemTotal"), kib.get("MemAvailable")


def check_cpu_budget(budget: int) -> None:
    """Refuse a CPU cache larger than the machine's RAM, and warn about one larger than what is
    free now: the cache is committed as it fills (``zeros``), so without this a budget that cannot
    fit would start fine and run out of memory later, under load."""
    total, available = physical_memory()
    if total is not None and budget >= total:
        raise ValueError(f"kv_cache_memory={budget} bytes is not less than this machine's RAM ({total} bytes); "
                         "lower it")  # fmt: skip
    if available is not None and budget > available:
        logger.warning("kv_cache_memory=%d bytes is more than the RAM available now (%d bytes): the cache fills "
                       "as it is used, and the machine may run out of memory under load", budget, available)  # fmt: skip


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU its memory is an anonymous mapping, which the OS hands out
    zero-filled and backs page by page on first touch: a cache is ready at once and costs RAM
    only as it fills (``torch.zeros`` writes every byte up front, ~0.6 s per GiB here). Zeros,
    not garbage, because backends read whole blocks and mask what lies past a sequence's end:
    stale bits could be NaN, which a zero weight does not cancel."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    private = getattr(mmap, "MAP_PRIVATE", None)  # (POSIX; elsewhere torch.zeros)
    if device.type != "cpu" or private is None or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private, not shared: plain process memory, as malloc's large blocks are (shared anonymous
    # memory is shmem-backed); the tensor keeps the mapping alive
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=private), dtype=dtype).view(shape)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V); with ``spec.use_mla`` both are the one latent tensor (backends see MQA whose
    values are its keys: models/mla.py)."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    caches = []
    for _ in range(spec.num_layers):
        k = zeros(shape, spec.dtype, device)
        caches.append((k, k if spec.use_mla else zeros(shape, spec.dtype, device)))
    logger.info(
        "KV cache: %d blocks x %d tokens = %d token slots of %d layers, %.1f MiB (%s, %s)",
        num_blocks, spec.block_size, num_blocks * spec.block_size, spec.num_layers,
        num_blocks * spec.bytes_per_block / 2**20, spec.dtype, device,
    )  # fmt: skip
    return caches
