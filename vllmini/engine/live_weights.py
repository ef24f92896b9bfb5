"""``model.load_weights`` on a serving engine: what an RL trainer calls (through
``LLM.collective_rpc`` / ``apply_model``) to push new weights into the rollout engine in place.

The model classes' own ``load_weights`` fills a freshly built model at start-up. A live model
differs in three ways, which this wrapper (installed as the model's ``load_weights``) takes care of:

- on a CPU with oneDNN its linears are prepacked (models/packed_linear.py): their dense weight
  is gone. Each linear an update touches is unpacked (``to_dense``, exact) into a plain
  ``nn.Linear`` for the copy and packed again after; a tied ``lm_head`` is repacked when the
  embedding changes (its packed copy would be stale otherwise); prepacked experts
  (models/packed_experts.py) are unpacked to their stacked ``w13`` / ``w2`` and packed again;
- with ``enable_lora`` the adapted projections are wrapped (lora/layers.py): the wrapper steps
  aside for the copy, so the checkpoint names reach the base linear;
- a bad name or shape must not leave half the weights new: the update is checked first, in full,
  on a twin of the model on the meta device (no memory), and only then copied.

Copies are in place (``copy_``, with the dtype cast), so the CUDA graphs' captured addresses stay
valid; an update that replaces a parameter (a tied model given an ``lm_head.weight`` that differs
from its embedding is untied, as at load time) recaptures them. As in vLLM, the prefix cache is
left alone: cached blocks hold K/V of the old weights until ``reset_prefix_cache()``.
"""
from __future__ import annotations

import contextlib
import copy
import logging
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn

from vllmini.lora.layers import LoRALinear
from vllmini.models.moe import ExpertWeights
from vllmini.models.packed_experts import pack_experts, unpack_experts
from vllmini.models.packed_linear import PackedLinear, pack_weight

if TYPE_CHECKING:
    from vllmini.engine.worker import Worker

logger = logging.getLogger("vllmini")
EMBED = "model.embed_tokens.weight"


class LiveWeights:
    """The live model's ``load_weights(weights) -> set[str]`` (HF checkpoint names, as at load)."""

    def __init__(self, model: nn.Module, worker: Worker) -> None:
        self.model, self.worker = model, worker
        self._twin: nn.Module | None = None

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.worker.weights_discarded:
            raise RuntimeError("the weights were discarded by sleep(level=2): call wake_up(tags=['weights']) "
                               "before load_weights")  # fmt: skip
        items = list(weights)
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and torch.is_tensor(item[1])):
                raise TypeError(f"load_weights takes (name, tensor) pairs, got {type(item).__name__}: {item!r:.80}")
            name, tensor = item  # (checked here: the meta twin would take these, and the copy fail halfway)
            if tensor.is_meta or not tensor.is_floating_point():
                what = "is on the meta device (no data)" if tensor.is_meta else f"has dtype {tensor.dtype}"
                raise TypeError(f"checkpoint tensor {name!r} {what}: load_weights takes floating-point weights")
        touched = self._check(items)
        model, ptrs = self.model, _data_ptrs(self.model)
        paths = self._linear_paths(touched)
        with torch.no_grad(), _plain_linears(model, paths), _dense_experts(model, paths):
            loaded = type(model).load_weights(model, items)  # (the class's: this object shadows it)
        if _data_ptrs(model) != ptrs:  # a parameter was replaced (untied): the graphs hold its old address
            self.worker.recapture_graphs()
        if getattr(model, "tied", False) != getattr(self._twin, "tied", False):
            self._twin = None  # (untied since: the twin must be too)
        return loaded

    def _check(self, items: list[tuple[str, torch.Tensor]]) -> set[str] | None:
        """Run the update on the meta twin: a bad name or shape raises here, before any copy.
        Returns the twin's parameters it writes (None: the model class does not say)."""
        twin = self._meta_twin()
        checked = items
        if getattr(self.model, "tied", False):  # (its lm_head.weight is compared with the embedding: not on meta)
            checked = [(n, t) for n, t in items if n != "lm_head.weight"]
            embed_shape = tuple(twin.get_parameter(EMBED).shape)
            for name, tensor in items:
                if name == "lm_head.weight" and tuple(tensor.shape) != embed_shape:
                    raise ValueError(f"checkpoint tensor 'lm_head.weight' has shape {tuple(tensor.shape)} but "
                                     f"config.json implies {embed_shape}")  # fmt: skip
        loaded = set(twin.load_weights(checked) or ())
        shards = getattr(twin, "_shards_seen", None)  # fused parameters partly written (llama.py)
        if shards is None:
            return None
        touched = loaded | set(shards)
        if len(checked) < len(items):
            touched.add("lm_head.weight")
        return touched

    def _meta_twin(self) -> nn.Module:
        """The model's class built again from (a copy of) its config on the meta device: the same
        parameter names and shapes, no memory."""
        if self._twin is None:
            with torch.device("meta"):
                twin = type(self.model)(copy.deepcopy(self.model.config))
            if getattr(self.model, "lm_head", True) is None:  # the pooling runner's model has no head
                twin.lm_head = None
            if isinstance(score := getattr(self.model, "score", None), nn.Module):
                twin.score = copy.deepcopy(score).to("meta")
            self._twin = twin
        return self._twin

    def _linear_paths(self, touched: set[str] | None) -> list[str]:
        """The modules an update writes into that may be wrapped or packed (None: every one)."""
        wrapped = [name for name, m in self.model.named_modules() if isinstance(m, (PackedLinear, LoRALinear))
                   or isinstance(m, ExpertWeights) and m.prepacked is not None]  # fmt: skip
        if touched is None:
            return wrapped
        paths = {name.rpartition(".")[0] for name in touched}
        if EMBED in touched and getattr(self.model, "tied", False):
            paths.add("lm_head")  # (a packed lm_head is a copy of the embedding)
        return [p for p in wrapped if p in paths]


@contextlib.contextmanager
def _plain_linears(model: nn.Module, paths: list[str]) -> Iterator[None]:
    """Each module at ``paths`` replaced by a plain ``nn.Linear`` over the same weight (unpacked
    from a PackedLinear, or a LoRA wrapper's base), then put back, packed again from it."""
    swapped: list[tuple[nn.Module, str, nn.Module, nn.Linear, PackedLinear | None]] = []
    tied = getattr(model, "tied", False)
    try:
        for path in paths:
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            original = getattr(parent, attr)
            if isinstance(original, ExpertWeights):
                continue  # (_dense_experts)
            inner = original.base_layer if isinstance(original, LoRALinear) else original
            packed = inner if isinstance(inner, PackedLinear) else None
            if packed is not None:
                weight = model.get_parameter(EMBED) if tied and path == "lm_head" else \
                    nn.Parameter(packed.packed.to_dense(), requires_grad=False)  # fmt: skip
                plain = _linear(weight, packed.bias)
            elif isinstance(inner, nn.Linear):
                plain = inner
            else:
                continue
            setattr(parent, attr, plain)
            swapped.append((parent, attr, original, plain, packed))
        yield
    finally:
        for parent, attr, original, plain, packed in reversed(swapped):
            if packed is not None:
                packed.packed = pack_weight(plain.weight)
                packed.bias = None if plain.bias is None else plain.bias.detach()
            setattr(parent, attr, original)


@contextlib.contextmanager
def _dense_experts(model: nn.Module, paths: list[str]) -> Iterator[None]:
    """The prepacked experts at ``paths`` unpacked to dense ``w13`` / ``w2`` for the copy, then packed again."""
    experts = [m for m in map(model.get_submodule, paths) if isinstance(m, ExpertWeights) and m.prepacked is not None]
    try:
        for module in experts:
            unpack_experts(module)
        yield
    finally:
        for module in experts:
            if module.prepacked is None:
                pack_experts(module)


def _linear(weight: nn.Parameter, bias: torch.Tensor | None) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    linear.weight = weight
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)  # (shares the PackedLinear's storage)
    return linear


def _data_ptrs(model: nn.Module) -> dict[str, Any]:
    return {name: p.data_ptr() for name, p in model.named_parameters(remove_duplicate=False)}
