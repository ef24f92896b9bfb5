"""Prefix-cache block hashes: a full block's key chains the hash of every block before it.

Two sequences share a block's KV only when their tokens agree up to the end of that block
and the K/V were computed the same way (the same LoRA adapter, or none), so the key is a
SHA-256 over the parent block's digest and the block's token ids, rooted per adapter (and
per cache salt).
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Parent "hash" of a sequence's first block.
ROOT_HASH = hashlib.sha256(b"vllmini/prefix-cache/v1").digest()


def prefix_root(lora_key: int = 0, cache_salt: str | None = None) -> bytes:
    """The parent hash of a sequence's first block. The same tokens give different K/V under a
    LoRA adapter (its q/k/v deltas), so each adapter's blocks (``Sequence.lora_key``) hash apart
    from the base model's and from each other's. A request's ``cache_salt`` (vLLM's) roots its
    blocks apart too: only requests with the same salt share them, so a tenant cannot learn
    from another's cache hits (their timing) what that tenant's prompts were."""
    if not lora_key and cache_salt is None:
        return ROOT_HASH
    salt = b"" if cache_salt is None else b"salt:" + cache_salt.encode()
    return hashlib.sha256(ROOT_HASH + struct.pack("<q", lora_key) + salt).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: a block's KV depends on every token before it, so the
    key covers the whole prefix (through the parent's digest), not just the block's tokens."""
    return hashlib.sha256(parent_hash + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def chain_hashes(token_ids: Sequence[int], root: bytes, num_blocks: int, block_size: int) -> list[bytes]:
    """The chained hashes of the first ``num_blocks`` full blocks of ``token_ids``."""
    hashes, parent = [], root
    for i in range(num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
