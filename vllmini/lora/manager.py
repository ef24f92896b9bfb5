"""The engine's LoRA adapters: which are loaded (an LRU of ``max_cpu_loras``), which sit in the
model's ``max_loras`` slots, and each step's token -> slot mapping.

A request's adapter is loaded (and checked) when the request is added, on the caller's
thread; the scheduler then keeps at most ``max_loras`` adapters among the running sequences,
so :meth:`LoRAManager.prepare` always finds a slot for each adapter of a step.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from vllmini.lora.adapter import LoRAAdapter, load_adapter
from vllmini.lora.layers import LoRALinear, LoRAStepState
from vllmini.lora.request import LoRARequest

logger = logging.getLogger("vllmini")


class LoRAManager:
    def __init__(self, model: Any, max_loras: int, max_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.state = LoRAStepState(max_loras, max_rank)
        self.max_rank, self.max_cpu_loras, self.dtype, self.device = max_rank, max_cpu_loras, dtype, device
        self.layers: list[tuple[LoRALinear, list[str]]] = []  # each layer and its shards' checkpoint names
        for path, shard_names, shard_sizes in model.lora_targets():
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            layer = LoRALinear(getattr(parent, attr), shard_sizes, self.state, dtype, device)
            setattr(parent, attr, layer)
            self.layers.append((layer, list(shard_names)))
        # what an adapter may target: checkpoint module path -> (in_features, out_features)
        self.targets = {name: (layer.in_features, size)
                        for layer, names in self.layers for name, size in zip(names, layer.shard_sizes)}  # fmt: skip
        self._slots: list[LoRAAdapter | None] = [None] * max_loras
        self._slot_last_used = [0] * max_loras
        self._steps = 0
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter, least recent first
        self._lock = threading.Lock()  # _loaded: requests are added on callers' threads
        self._keys: dict[tuple[int, str, str], int] = {}  # LoRAAdapter.key of each adapter ever loaded
        # every adapter still referenced (by a request, a slot, a caller), loaded set or not: asked
        # for again, it is taken from here rather than read again
        self._live: weakref.WeakValueDictionary[tuple[int, str, str], LoRAAdapter] = weakref.WeakValueDictionary()

    # ---- adapters (any thread) --------------------------------------------------------------
    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter of ``request``, loaded now unless it is already (or is still held by a
        request or a slot since it left the loaded set); ValueError when it cannot be used."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        ident = (request.lora_int_id, request.lora_name, request.lora_path)
        with self._lock:
            adapter = self._loaded_as(ident)
            if adapter is None and (adapter := self._live.get(ident)) is not None:
                self._remember(adapter)
            if adapter is not None:
                self._loaded.move_to_end(request.lora_int_id)
                return adapter
        adapter = load_adapter(request, self.targets, self.max_rank, self.dtype, self.device)
        with self._lock:
            if (loaded := self._loaded_as(ident) or self._live.get(ident)) is not None:  # another thread was quicker
                return loaded
            adapter.key = self._keys.setdefault(ident, len(self._keys) + 1)
            self._live[ident] = adapter
            self._remember(adapter)
        logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s", request.lora_name, request.lora_int_id,
                    adapter.rank, request.lora_path)  # fmt: skip
        return adapter

    def _loaded_as(self, ident: tuple[int, str, str]) -> LoRAAdapter | None:
        """The loaded adapter with ``ident``'s id (the caller holds the lock); ValueError when
        that id is loaded as another adapter."""
        adapter = self._loaded.get(ident[0])
        if adapter is None:
            return None
        known = adapter.request
        if ident != (known.lora_int_id, known.lora_name, known.lora_path):
            raise ValueError(f"lora_request.lora_int_id {ident[0]} is already the adapter {known.lora_name!r} "
                             f"({known.lora_path}); give {ident[1]!r} another id, or remove_lora() first")  # fmt: skip
        return adapter

    def _remember(self, adapter: LoRAAdapter) -> None:
        """Into the loaded set (the caller holds the lock), the least recent one out past max_cpu_loras."""
        self._loaded[adapter.request.lora_int_id] = adapter
        while len(self._loaded) > self.max_cpu_loras:
            self._loaded.popitem(last=False)

    def remove(self, lora_int_id: int) -> bool:
        with self._lock:
            return self._loaded.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        with self._lock:
            return set(self._loaded)

    # ---- one step (the engine's thread) ---------------------------------------------------------
    def prepare(self, adapters: list[LoRAAdapter | None], query_lens: list[int]) -> None:
        """Put the step's adapters in slots and map its rows (``query_lens[i]`` rows of sequence
        ``i``, which runs with ``adapters[i]``) to them."""
        self._steps += 1
        if not any(a is not None for a in adapters):
            self.state.set([], [])
            return
        step = {a.key: a for a in adapters if a is not None}
        slot_of = {key: self._slot_for(adapter, step) for key, adapter in step.items()}
        self.state.set([-1 if a is None else slot_of[a.key] for a in adapters], query_lens)

    def _slot_for(self, adapter: LoRAAdapter, step: dict[int, LoRAAdapter]) -> int:
        """The slot holding ``adapter`` (by key: a reload of the same files is the same adapter),
        written now into the least recently used slot that this step's adapters do not hold."""
        for i, held in enumerate(self._slots):
            if held is not None and held.key == adapter.key:
                self._slot_last_used[i] = self._steps
                return i
        free = [i for i, held in enumerate(self._slots) if held is None or held.key not in step]
        if not free:
            raise RuntimeError(f"a step holds more than max_loras={len(self._slots)} adapters (scheduler bug)")
        i = min(free, key=lambda j: (self._slots[j] is not None, self._slot_last_used[j]))
        for layer, names in self.layers:
            layer.set_slot(i, [adapter.weights.get(name) for name in names])
        self._slots[i], self._slot_last_used[i] = adapter, self._steps
        return i
