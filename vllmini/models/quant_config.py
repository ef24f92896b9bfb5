"""A model config's ``quantization_config``, read one way for every quantized format (models/fp8.py,
models/gptq_awq.py, models/mxfp4.py, models/int8.py, models/nvfp4.py) and for vLLM's ``quantization`` argument.

NVIDIA ModelOpt exports before 0.31 keep theirs in ``hf_quant_config.json`` beside config.json
(``{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": ...}}``): as vLLM 0.32 does
(transformers_utils/config.py), that file is read when config.json has none, and given
``quant_method: "modelopt"`` (model_arch_config_convertor.py names it after its producer)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

HF_QUANT_CONFIG = "hf_quant_config.json"


def quantization_config(config: Any, model_dir: Path | str | None = None) -> dict | None:
    """``config``'s ``quantization_config`` as a dict: from config.json's dict or transformers' config
    (where it may be a quantization-config object), else ``model_dir``'s hf_quant_config.json; None
    when there is none, or it is no mapping."""
    quant = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if hasattr(quant, "to_dict"):
        quant = quant.to_dict()
    if quant is None and model_dir is not None and (Path(model_dir) / HF_QUANT_CONFIG).is_file():
        path = Path(model_dir) / HF_QUANT_CONFIG
        try:
            quant = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(quant, dict):
        return None
    nested = quant.get("quantization")
    if not quant.get("quant_method") and ((quant.get("producer") or {}).get("name") == "modelopt"
                                          or isinstance(nested, dict) and "modelopt_quant_config" in nested):  # fmt: skip
        quant = {**quant, "quant_method": "modelopt"}
    return quant


def with_quantization_config(config: Any, model_dir: Path | str | None) -> dict | None:
    """A config for the format readers (each takes a config and reads its ``quantization_config``):
    ``{"quantization_config": ...}`` as :func:`quantization_config` finds it; None when there is none."""
    quant = quantization_config(config, model_dir)
    return None if quant is None else {"quantization_config": quant}


def modelopt_settings(quant: dict) -> tuple[str, int | None, list, str | None]:
    """A ModelOpt ``quantization_config``'s (quant_algo upper-cased, group_size, excluded modules,
    kv_cache_quant_algo), read from either layout, as vLLM 0.32's ModelOptQuantConfigBase.from_config:
    hf_quant_config.json's nested ``quantization`` (``exclude_modules``) or config.json's flat one (``ignore``)."""
    nested = quant.get("quantization")
    if isinstance(nested, dict):
        algo, group, exclude, kv = (nested.get("quant_algo"), nested.get("group_size"), nested.get("exclude_modules", []),
                                    nested.get("kv_cache_quant_algo"))  # fmt: skip
    else:
        scheme = quant.get("kv_cache_scheme")
        kv = "FP8" if isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8 else None
        algo, group, exclude = quant.get("quant_algo"), quant.get("group_size"), quant.get("ignore", [])
    if not algo or not isinstance(algo, str):
        raise ValueError(f"quantization_config (ModelOpt) has no quant_algo (got {algo!r})")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise ValueError(f"quantization_config (ModelOpt) group_size must be a positive integer, got {group!r}")
    if not isinstance(exclude, list):
        raise ValueError(f"quantization_config (ModelOpt) exclude_modules / ignore must be a list, got {exclude!r}")
    return algo.upper(), group, exclude, kv.upper() if isinstance(kv, str) else None


def gather_parts(weights: Iterator[tuple[str, torch.Tensor]], leaves: dict[str, str], needed: set[str],
                 make: Callable[[str, dict[str, torch.Tensor]], torch.Tensor], what: str,
                 dropped: tuple[str, ...] = (), is_part: Callable[[str, torch.Tensor], bool] | None = None,
                 ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """A checkpoint's (name, tensor) pairs with each quantized linear's parts (``<module>.<leaf>``,
    ``leaves``: leaf -> part) gathered, in any order and from any shard, and given as one dense
    ``<module>.weight`` (``make(module, parts)``) once the ``needed`` parts have come; tensors whose leaf
    is in ``dropped`` (activation and KV scales) are dropped; the rest (a layer left unquantized:
    ``is_part`` says which tensors of a quantized leaf's name are its parts) pass as they come. A linear
    left without a part is an error naming it and the part."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: set[str] = set()
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if leaf in dropped:
            continue
        part = leaves.get(leaf)
        if part is None or (is_part is not None and not is_part(part, tensor)):
            yield name, tensor
            continue
        if module in done:  # (a part not needed, after the weight was made)
            continue
        parts = pending.setdefault(module, {})
        parts[part] = tensor
        if needed <= parts.keys():
            del pending[module]
            done.add(module)
            yield f"{module}.weight", make(module, parts)
    names = {part: leaf for leaf, part in leaves.items()}
    lone = sorted(f"{m} ({', '.join(names[p] for p in sorted(needed - parts.keys()))} missing)" for m, parts in pending.items())
    if lone:
        raise ValueError(f"{what} checkpoint: {', '.join(lone[:5])}" + (f", ... ({len(lone)} in all)" if len(lone) > 5 else ""))
