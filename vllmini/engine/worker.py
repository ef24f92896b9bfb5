"""The worker, as vLLM names it: the object that holds the model runner and that
``collective_rpc`` reaches (a method name is one of its methods; a callable gets it as its first
argument). vllmini runs one worker in the engine's process, so ``collective_rpc`` returns a list
of one result, as vLLM's does with one GPU.

It also owns sleep mode (``EngineArgs.enable_sleep_mode``): ``sleep(level)`` gives back the KV
cache's memory (every layer's tensors dropped; on CUDA also handed back to the driver) and, at
level 1, keeps the weights (a CUDA engine moves them to the CPU; on the CPU they are where they
would be offloaded to) or, at level 2, discards them: after ``wake_up`` they are zeros until the
caller loads weights (``load_weights``, ``reload_weights``). ``wake_up(tags)`` brings back
``"weights"``, ``"kv_cache"`` or both (None); the decode CUDA graphs, which hold the old
addresses, are captured again once both are back.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from vllmini.engine.live_weights import LiveWeights
from vllmini.engine.model_runner import ModelRunner
from vllmini.kv.cache import zeros
from vllmini.models.packed_experts import PackedExperts
from vllmini.models.packed_linear import PackedLinear, pack_weight

logger = logging.getLogger("vllmini")
SLEEP_TAGS = ("weights", "kv_cache")


class Worker:
    """The model runner, the model, sleep / wake_up, and what an RL trainer calls on them."""

    def __init__(self, model_runner: ModelRunner, device: torch.device, model_dir: Path | None = None) -> None:
        self.model_runner, self.device, self.model_dir = model_runner, device, model_dir
        self.sleeping_tags: set[str] = set()
        self.sleep_level = 0
        self._kv_shapes: list[list[list[TensorShape]]] = []  # each cache list's layers' tensors, asleep
        self._discarded: list[tuple[Any, ...]] = []  # level 2: what each discarded weight was
        model = model_runner.model
        model.load_weights = LiveWeights(model, self)  # (shadows the class's, which fills a new model)

    # ---- the model ------------------------------------------------------------------------------
    def get_model(self) -> nn.Module:
        return self.model_runner.model

    def apply_model(self, func: Callable[[nn.Module], Any]) -> Any:
        """vLLM's: ``func(model)``; ``LLM.apply_model`` collects the results."""
        return func(self.get_model())

    def load_weights(self, weights: Any) -> set[str]:
        """HF-named (name, tensor) pairs copied into the live model (engine/live_weights.py)."""
        return self.get_model().load_weights(weights)

    def reload_weights(self, weights_path: str | None = None) -> set[str]:
        """vLLM's: read the weights again from the model's folder, or from ``weights_path`` (an HF
        folder of safetensors files: a trainer's checkpoint), into the live model."""
        from vllmini.models.checkpoint_reader import checkpoint_weights

        if weights_path is not None and not isinstance(weights_path, (str, Path)):
            raise ValueError(f"reload_weights: weights_path must be a folder's path, got {type(weights_path).__name__}")
        folder = Path(weights_path) if weights_path is not None else self.model_dir
        if folder is None or not folder.is_dir():
            raise ValueError(f"reload_weights: {folder} is not a folder of safetensors files")
        try:
            return self.load_weights(checkpoint_weights(folder))
        except FileNotFoundError as exc:  # (no safetensors there: a bad argument, as vLLM's 400)
            raise ValueError(f"reload_weights: {exc}") from None

    @property
    def weights_discarded(self) -> bool:
        return self.sleep_level == 2 and "weights" in self.sleeping_tags

    # ---- sleep mode ----------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (keep the weights) or 2 (discard them), got {level!r}")
        if self.sleeping_tags:
            logger.warning("sleep(level=%d): the engine is already sleeping (%s)", level, sorted(self.sleeping_tags))
            return
        self._drop_graphs()
        runner = self.model_runner
        self._kv_shapes = [[layer_shapes(layer) for layer in caches]
                           for caches in (runner.kv_caches, runner.draft_kv_caches, runner.state_caches)]  # fmt: skip
        runner.kv_caches.clear()  # (in place: the graph runner and the drafter share these lists)
        runner.draft_kv_caches.clear()
        runner.state_caches.clear()  # (linear-attention states: kv/state_cache.py)
        if level == 2:
            self._discard_weights()
        elif self.device.type == "cuda":
            self._move_weights(torch.device("cpu"))
        self.sleep_level, self.sleeping_tags = level, set(SLEEP_TAGS)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.info("sleeping (level %d): KV cache freed, weights %s", level,
                    "discarded" if level == 2 else "kept")  # fmt: skip

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is not None and (unknown := [t for t in tags if t not in SLEEP_TAGS]):
            raise ValueError(f"wake_up tags must be among {list(SLEEP_TAGS)}, got {unknown}")
        wanted = set(SLEEP_TAGS) if tags is None else set(tags)
        if not self.sleeping_tags:
            logger.warning("wake_up: the engine is not sleeping")
            return
        if "weights" in wanted & self.sleeping_tags:
            if self.sleep_level == 2:
                self._restore_discarded()
            elif self.device.type == "cuda":
                self._move_weights(self.device)
        if "kv_cache" in wanted & self.sleeping_tags:
            runner = self.model_runner
            for caches, layers in zip((runner.kv_caches, runner.draft_kv_caches, runner.state_caches), self._kv_shapes):
                caches.extend(layer_zeros(layer, self.device) for layer in layers)
            self._kv_shapes = []
        self.sleeping_tags -= wanted
        if not self.sleeping_tags:
            self.sleep_level = 0
            self.recapture_graphs()

    def recapture_graphs(self) -> None:
        """Capture the decode graphs again (they replay fixed addresses: the KV cache's and every
        weight's); a capture that fails leaves decode steps eager, as at start-up."""
        graphs = self.model_runner.decode_graphs
        if graphs is None or not graphs.use_graphs or self.sleeping_tags:
            return
        self._drop_graphs()
        try:
            graphs.capture()
        except Exception as exc:
            logger.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly", type(exc).__name__, exc)
            self.model_runner.decode_graphs = None

    def _drop_graphs(self) -> None:
        graphs = self.model_runner.decode_graphs
        if graphs is not None:
            graphs.graphs.clear()  # (their memory pool goes with them)
            graphs.logits = None

    def _move_weights(self, device: torch.device) -> None:
        """Level 1 on CUDA: every parameter and buffer to ``device`` (the CPU while asleep)."""
        model = self.get_model()
        for tensor in [*model.parameters(), *model.buffers()]:
            tensor.data = tensor.data.to(device)

    def _discard_weights(self) -> None:
        """Level 2: every parameter (and packed linear or experts) left empty; its shape kept for wake_up.
        Buffers (rotary tables, LoRA slots) are small and stay."""
        model = self.get_model()
        for module in model.modules():
            if isinstance(module, PackedLinear):
                self._discarded.append((module, module.packed.dtype, module.bias is not None))
                module.packed = torch.empty(0, dtype=module.packed.dtype)
                module.bias = None if module.bias is None else module.bias.new_empty(0)
            elif isinstance(packed := getattr(module, "prepacked", None), PackedExperts):  # (ExpertWeights)
                packed.discard()
                self._discarded.append((packed,))
        for param in model.parameters():
            self._discarded.append((param, param.shape, param.dtype))
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _restore_discarded(self) -> None:
        """Zeros where the discarded weights were (the caller loads weights next)."""
        for entry in self._discarded:
            if isinstance(entry[0], PackedExperts):
                entry[0].zero()
            elif isinstance(entry[0], PackedLinear):
                module, dtype, bias = entry
                module.packed = pack_weight(torch.zeros(module.out_features, module.in_features, dtype=dtype))
                module.bias = torch.zeros(module.out_features, dtype=dtype) if bias else None
            else:
                param, shape, dtype = entry
                param.data = torch.zeros(shape, dtype=dtype, device=self.device)
        self._discarded = []


def run_method(worker: Worker, method: str | Callable[..., Any], args: tuple = (), kwargs: dict | None = None) -> Any:
    """vLLM's ``collective_rpc`` on one worker: ``worker.<method>(*args, **kwargs)``, or
    ``method(worker, *args, **kwargs)`` for a callable."""
    kwargs = kwargs or {}
    if isinstance(method, str):
        fn = None if method.startswith("_") else getattr(worker, method, None)
        if not callable(fn):
            public = sorted(n for n in dir(worker) if not n.startswith("_") and callable(getattr(worker, n)))
            raise NotImplementedError(f"collective_rpc: the worker has no method {method!r} (it has {public})")
        return fn(*args, **kwargs)
    if callable(method):
        return method(worker, *args, **kwargs)
    raise TypeError(f"collective_rpc: method must be a method name or a callable, got {type(method).__name__}")


TensorShape = tuple[torch.Size, torch.dtype, "int | None"]  # shape, dtype, the earlier tensor of its layer it is


def layer_shapes(layer: tuple[torch.Tensor, ...]) -> list[TensorShape]:
    """A cache layer's tensors as sleep keeps them: shape, dtype, and which earlier one a tensor is
    (an MLA layer's K and V are one latent tensor: it must wake as one)."""
    return [(t.shape, t.dtype, next((j for j in range(i) if layer[j] is t), None)) for i, t in enumerate(layer)]


def layer_zeros(shapes: list[TensorShape], device: torch.device) -> tuple[torch.Tensor, ...]:
    tensors: list[torch.Tensor] = []
    for shape, dtype, alias in shapes:
        tensors.append(tensors[alias] if alias is not None else zeros(tuple(shape), dtype, device))
    return tuple(tensors)
