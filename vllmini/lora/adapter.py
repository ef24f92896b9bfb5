"""Reading a PEFT LoRA adapter: ``adapter_config.json`` + ``adapter_model.safetensors``.

The result, a :class:`LoRAAdapter`, holds per target projection ``A [r, in]`` and
``B [out, r]`` with the adapter's scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA)
folded into ``B``, so that a layer adds ``x @ A.T @ B.T``. Every check happens here, when a
request brings the adapter, so that a bad adapter fails its request with a message naming
the field, and never a step.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from vllmini.lora.request import LoRARequest
from vllmini.models.weight_loader import is_hub_id

_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")  # PEFT may keep the adapter name


@dataclass(eq=False)
class LoRAAdapter:
    """One adapter's weights on the engine's device and dtype (see the module docstring)."""

    request: LoRARequest
    rank: int  # the largest rank of its projections
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # checkpoint module path -> (A, scaled B)
    # one per (lora_int_id, lora_name, lora_path) (LoRAManager): what the scheduler counts, the
    # slots hold and the prefix cache is salted with. Not lora_int_id alone: an id freed by
    # remove_lora may come back as another adapter while requests of the old one still run.
    key: int = 0

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id


def adapter_dir(path: str) -> Path:
    """A local adapter folder, or a hub id fetched (adapter files only) through huggingface_hub."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    if local.exists() or not is_hub_id(path):
        raise ValueError(f"lora_request.lora_path {path!r} is not an adapter folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=["adapter_config.json", "*.safetensors"]))
    except Exception as exc:  # offline, missing repo, auth: one error naming the field
        raise ValueError(f"lora_request.lora_path {path!r} is not a folder and could not be fetched as a hub id "
                         f"({type(exc).__name__}: {exc})") from exc  # fmt: skip


def read_config(folder: Path) -> dict:
    """The adapter's PEFT config, refused (naming the key) where it asks for what is not built here."""
    file = folder / "adapter_config.json"
    if not file.is_file():
        raise ValueError(f"lora_request.lora_path {str(folder)!r} has no adapter_config.json (not a PEFT adapter)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{file}: peft_type {config['peft_type']!r} is not supported (only LORA)")
    # target_parameters first: PEFT adds alpha_pattern entries for the parameters it names
    refused = {"target_parameters": "target_parameters (LoRA on parameters, such as a mixture of experts' stacked "
               "weights)", "use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D models)",
               "lora_bias": "lora_bias", "modules_to_save": "modules_to_save (fully trained modules)",
               "alpha_pattern": "alpha_pattern", "layer_replication": "layer_replication"}  # fmt: skip
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(f"{file}: {key}={config[key]!r}: {what} is not supported for LoRA adapters here")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias={config['bias']!r} is not supported (only 'none')")
    for key in ("r", "lora_alpha"):
        if isinstance(config.get(key), bool) or not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise ValueError(f"{file}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def load_adapter(
    request: LoRARequest, targets: dict[str, tuple[int, int]], max_rank: int, dtype: torch.dtype, device: torch.device
) -> LoRAAdapter:
    """Read and check ``request``'s adapter. ``targets``: the projections a LoRA may adapt
    (checkpoint module path -> (in_features, out_features))."""
    from safetensors.torch import load_file

    folder = adapter_dir(request.lora_path)
    config = read_config(folder)
    file = folder / "adapter_model.safetensors"
    if not file.is_file():
        pickled = [p.name for p in folder.glob("adapter_model.*")]
        hint = f" ({', '.join(pickled)} is a pickle: never loaded, convert it to safetensors)" if pickled else ""
        raise ValueError(f"lora_request.lora_path {request.lora_path!r} has no adapter_model.safetensors{hint}")
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # SafetensorError (a truncated download...) is no ValueError: name the file
        raise ValueError(f"lora_request.lora_path {request.lora_path!r}: adapter_model.safetensors is not a readable "
                         f"safetensors file ({type(exc).__name__}: {exc})") from exc  # fmt: skip
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key.removeprefix(_PREFIX))
        if m is None:
            raise ValueError(f"{file}: tensor {key!r} is not a LoRA A/B weight (embedding LoRA, DoRA and "
                             f"modules_to_save are not supported)")  # fmt: skip
        module = m["module"]
        if module not in targets:
            leaf = module.rpartition(".")[2]
            known = sorted({t.rpartition(".")[2] for t in targets})
            raise ValueError(f"{file}: LoRA on {module!r} is not supported: target modules must be among {known} "
                             f"(got {leaf!r})")  # fmt: skip
        pairs.setdefault(module, {})[m["which"]] = tensor
    if not pairs:
        raise ValueError(f"{file}: holds no LoRA weights")
    weights, rank = {}, 0
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{file}: {module!r} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        in_features, out_features = targets[module]
        r = a.shape[0] if a.dim() else 0
        if r < 1:  # (the scaling alpha / r below would divide by zero)
            raise ValueError(f"{file}: {module!r} has lora_A {tuple(a.shape)}: a LoRA rank must be at least 1")
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_features) or tuple(b.shape) != (out_features, r):
            raise ValueError(f"{file}: {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the model "
                             f"needs ({r}, {in_features}) and ({out_features}, {r}) (an adapter of another model?)")  # fmt: skip
        if r > max_rank:
            raise ValueError(f"LoRA rank {r} of {request.lora_path!r} ({module}) is greater than max_lora_rank "
                             f"{max_rank}: start the engine with a larger max_lora_rank")  # fmt: skip
        alpha = float(config["lora_alpha"])
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r  # r: rank_pattern's, as PEFT
        weights[module] = (a.to(device, dtype), (b.float() * scaling).to(device, dtype))
        rank = max(rank, r)
    return LoRAAdapter(request, rank, weights)
