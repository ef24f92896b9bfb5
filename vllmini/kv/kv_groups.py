"""How a model whose layers attend over different spans lays out its KV cache (vLLM's hybrid
KV cache manager).

Gemma 2/3, OLMo 3, hybrid EXAONE 4 and Qwen2 with ``max_window_layers`` mix sliding-window
layers with full-attention layers. A sliding layer never reads the KV behind its window, so
its blocks can be released as a sequence advances, while a full layer needs every block. With
one block table for all layers nothing could be released; with one per layer the tables
multiply. vLLM's answer, and ours: the layers of one kind are cut into *groups* of the same
size ``G``; every group has its own block table per sequence (a sliding group's releases the
blocks behind its window), all groups draw block ids from one shared pool, and the cache holds
``G`` tensor pairs: layer ``j`` of every group stores its K/V in tensor pair ``j``, at the block
ids of its own group. A block id thus costs ``G`` layers' worth of memory, not every layer's,
and a long sequence holds full-length tables only for the full-attention groups.

``G`` is the smallest kind's layer count (Gemma 3's 4 full layers of 26: one full group and six
sliding groups of 4, the last with two unused slots), as vLLM chooses it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheLayout:
    """Which KV group and which cache tensor pair each layer uses."""

    group_windows: tuple[int | None, ...]  # each group's sliding window (None: full attention), full groups first
    layer_groups: tuple[int, ...]  # layer i's group
    layer_slots: tuple[int, ...]  # layer i's cache tensor pair (its index within its group)
    group_size: int  # cache tensor pairs: the layers one block id holds

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)


def plan_kv_layout(windows: list[int | None]) -> KVCacheLayout | None:
    """The grouped layout for layers with these windows (None: one window or none for all
    layers, which one block table serves: a shared window's blocks are released as they are)."""
    kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # full attention first
    if len(kinds) < 2:
        return None
    members = {kind: [i for i, w in enumerate(windows) if w == kind] for kind in kinds}
    size = min(len(layers) for layers in members.values())
    group_windows: list[int | None] = []
    layer_groups, layer_slots = [0] * len(windows), [0] * len(windows)
    for kind in kinds:
        layers = members[kind]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_groups[layer], layer_slots[layer] = len(group_windows), slot
            group_windows.append(kind)
    return KVCacheLayout(tuple(group_windows), tuple(layer_groups), tuple(layer_slots), size)
