"""Reading a model folder's tensors: its safetensors files (an index's shards, or every file), one
tensor at a time, each checked (checkpoint_checks.py); a quantized checkpoint's tensors dequantized on
the way (FP8, GPTQ/AWQ, compressed-tensors int and NVFP4, ModelOpt FP8 and NVFP4, MXFP4). Pickle checkpoints are refused: loading one can run code."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from vllmini.files import foreign_file_hint
from vllmini.models import checkpoint_checks
from vllmini.models.fp8 import dequantize_fp8_weights, fp8_format
from vllmini.models.gptq_awq import dequantize_wna16_weights, wna16_format
from vllmini.models.int8 import dequantize_int_weights, int_format
from vllmini.models.multimodal import checkpoint_mapper
from vllmini.models.mxfp4 import dequantize_mxfp4_weights, is_mxfp4
from vllmini.models.nvfp4 import dequantize_nvfp4_weights, nvfp4_format
from vllmini.models.quant_config import with_quantization_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
INDEX_FILE = "model.safetensors.index.json"


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files to read, all checked to exist before any tensor is loaded."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))  # unique, in order
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from exc
        for name in names:
            if not isinstance(name, str) or Path(name).name != name:
                raise ValueError(f"{index} lists shard {name!r}, which is not a plain file name")
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard file(s) missing from {model_dir}: {', '.join(missing)}")
        return [model_dir / n for n in names]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    others = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if others:
        return others
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickles)}); vllmini refuses them because "
            "loading a pickle can execute arbitrary code. Only safetensors (or GGUF) weights are accepted: convert "
            "it once in a trusted environment, e.g. transformers' model.save_pretrained(dir, safe_serialization=True)"
        )
    raise FileNotFoundError(f"{model_dir} has no *.safetensors weights (a model folder holds them in one file, or in "
                            f"shards listed by {INDEX_FILE})")  # fmt: skip


def checkpoint_weights(model_dir: Path, config: PretrainedConfig | dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The folder's (HF name, tensor) pairs as the model loads them, float tensors all: FP8 and
    MXFP4, GPTQ and AWQ, int8 and NVFP4 ones dequantized (models/fp8.py, models/mxfp4.py, models/gptq_awq.py,
    models/int8.py, models/nvfp4.py). ``config``: the folder's config (read from its config.json when None;
    a folder without one, a trainer's, holds float weights); its quantization_config, else the folder's
    hf_quant_config.json (ModelOpt's), says how the weights are stored."""
    if config is None and (Path(model_dir) / "config.json").is_file():
        config = json.loads((Path(model_dir) / "config.json").read_text())
    mapper = checkpoint_mapper(config)  # a multimodal checkpoint's language model (models/multimodal.py)
    skip = mapper.skip if mapper is not None else None
    config = with_quantization_config(config if config is not None else {}, model_dir)
    if config is None:
        weights = iter_weights(model_dir, skip=skip)
    elif is_mxfp4(config):
        weights = dequantize_mxfp4_weights(iter_weights(model_dir, "mxfp4", skip))
    elif (nvfp4 := nvfp4_format(config)) is not None:
        weights = dequantize_nvfp4_weights(iter_weights(model_dir, "nvfp4", skip), nvfp4)
    elif (fp8 := fp8_format(config)) is not None:
        weights = dequantize_fp8_weights(iter_weights(model_dir, "fp8", skip), fp8)
    elif (wna16 := wna16_format(config)) is not None:
        weights = dequantize_wna16_weights(iter_weights(model_dir, "wna16", skip), wna16)
    elif (int8 := int_format(config)) is not None:
        weights = dequantize_int_weights(iter_weights(model_dir, "int8", skip), int8)
    else:
        weights = iter_weights(model_dir, skip=skip)
    return mapper(weights) if mapper is not None else weights  # (renamed after dequantizing: its lists name the originals)


def iter_weights(model_dir: Path, quant: str | None = None, skip: Callable[[str], bool] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """(HF name, CPU tensor) pairs, one tensor at a time from mmap'd safetensors files.

    Each tensor is a zero-copy view of its own short-lived mapping: the file is reopened
    per tensor (~0.3 ms each) so that pages already copied into the model are unmapped
    as soon as the caller drops the tensor, instead of staying resident until the whole
    file has been read (that would double peak RSS). A tensor in two files (a stale shard beside
    new ones) is refused: which one the checkpoint means is unknown; so is a non-float one (but
    a quantized checkpoint's packed tensors, with ``quant``: checkpoint_checks.check_tensor).
    ``skip``: names never read (a multimodal checkpoint's vision tower: models/multimodal.py).
    """
    from safetensors import SafetensorError, safe_open

    seen: dict[str, Path] = {}
    for path in _weight_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                names = list(f.keys())
            for name in names:
                if skip is not None and skip(name):
                    continue
                if name in seen:
                    raise ValueError(f"{path} and {seen[name]} both hold tensor {name!r}; a checkpoint holds each "
                                     "tensor once (a stale shard left beside new ones?)")  # fmt: skip
                seen[name] = path
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    tensor = f.get_tensor(name)
                checkpoint_checks.check_tensor(path, name, tensor, quant)
                yield name, tensor
                del tensor
        except SafetensorError as exc:
            with open(path, "rb") as f:
                hint = foreign_file_hint(f.read(512)) or "corrupted header or data?"
            raise ValueError(f"{path} is not a valid safetensors file ({hint}): {exc}") from exc
