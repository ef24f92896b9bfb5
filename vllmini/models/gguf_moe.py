"""Mixture-of-experts GGUF files, as llama.cpp writes them: ``qwen3moe`` (Qwen3-30B-A3B),
``qwen2moe`` (plus a shared expert) and Mixtral, which llama.cpp writes as ``llama`` with
``llama.expert_count`` set.

Why this is its own step of the conversion: llama.cpp stacks each layer's experts into one
tensor per projection (``blk.N.ffn_gate_exps.weight``, numpy shape ``[E, I, H]``; files from
before April 2024 hold one tensor per expert, ``blk.N.ffn_gate.E.weight``) where HF checkpoints
keep one tensor per expert, and transformers' GGUF config reader leaves out the experts' widths
and knows no Mixtral. The checks here run before anything is written, so a file with a missing
expert or an impossible top-k fails with the tensor or key named instead of at load time.
"""
from __future__ import annotations

import re
from pathlib import Path

# GGUF architecture -> HF architecture, for the ones that are MoE by name
MOE_ARCHITECTURES = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
MIXTRAL = "MixtralForCausalLM"  # a ``llama`` file with experts

# where each architecture keeps its experts in HF names, and its names of gate, up and down
_EXPERT_LAYOUT = {
    "llama": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# the router and the shared expert: merged into gguf_convert's per-architecture block names
MOE_BLOCK_NAMES = {
    "llama": {"ffn_gate_inp": "block_sparse_moe.gate"},
    "qwen2moe": {"ffn_gate_inp": "mlp.gate", **_SHARED_EXPERT_NAMES},
    "qwen3moe": {"ffn_gate_inp": "mlp.gate"},
}
_PROJECTIONS = ("gate", "up", "down")
_STACKED_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_SPLIT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


def is_stacked(gguf_name: str) -> bool:
    """Whether a tensor holds every expert of one layer's projection (split on conversion)."""
    return _STACKED_RE.match(gguf_name) is not None


def expert_hf_name(gguf_name: str, arch: str, expert: int | None = None) -> str | None:
    """HF name of one expert's projection: of a per-expert tensor (its expert is in its name), or
    of expert ``expert`` of a stacked one. None for other tensors and for architectures without experts."""
    if arch not in _EXPERT_LAYOUT:
        return None
    if m := _SPLIT_RE.match(gguf_name):
        layer, proj, expert = m[1], m[2], int(m[3])
    elif (m := _STACKED_RE.match(gguf_name)) and expert is not None:
        layer, proj = m[1], m[2]
    else:
        return None
    block, names = _EXPERT_LAYOUT[arch]
    return f"model.layers.{layer}.{block}.experts.{expert}.{names[_PROJECTIONS.index(proj)]}.weight"


def hf_shape(hf_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """llama.cpp stores the shared expert's gate ``[1, H]`` as a vector; HF keeps the row."""
    return (1, shape[-1]) if hf_name.endswith(".shared_expert_gate.weight") else shape


def field_value(reader, key: str):
    """A metadata key's value, None when the file lacks it."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def numpy_shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first


def _expert_counts(reader, gguf_path: Path, arch: str) -> tuple[int, int] | None:
    """``(expert_count, expert_used_count)``; None for a dense file."""
    count, used = field_value(reader, f"{arch}.expert_count"), field_value(reader, f"{arch}.expert_used_count")
    if not count:
        if arch in MOE_ARCHITECTURES:
            raise ValueError(f"{gguf_path}: {arch}.expert_count is missing")
        experts = [t.name for t in reader.tensors if t.name.split(".")[2:3] == ["ffn_gate_inp"]
                   or expert_hf_name(t.name, arch, 0) is not None]  # fmt: skip
        if experts:
            raise ValueError(f"{gguf_path}: tensor {experts[0]!r} is an expert's, but {arch}.expert_count is not set")
        return None
    if used is None or not 0 < int(used) <= int(count):
        raise ValueError(
            f"{gguf_path}: {arch}.expert_used_count ({used}) must be in 1..{arch}.expert_count ({count})"
        )
    return int(count), int(used)


def _expert_width(reader, arch: str, tensors: dict) -> int:
    """The experts' intermediate size: the key llama.cpp writes (``llama``: feed_forward_length),
    else the first layer's gate tensor (qwen2moe files from before June 2024 lack the key)."""
    key = "feed_forward_length" if arch == "llama" else "expert_feed_forward_length"
    if (width := field_value(reader, f"{arch}.{key}")) is not None:
        return int(width)
    gate = tensors.get("blk.0.ffn_gate_exps.weight") or tensors.get("blk.0.ffn_gate.0.weight")
    return numpy_shape(gate)[-2] if gate is not None else 0


def _shared_width(reader, tensors: dict) -> int:
    if (width := field_value(reader, "qwen2moe.expert_shared_feed_forward_length")) is not None:
        return int(width)
    gate = tensors.get("blk.0.ffn_gate_shexp.weight")
    return numpy_shape(gate)[0] if gate is not None else 0


def check_experts(reader, gguf_path: Path, arch: str) -> None:
    """Every layer has its router and every expert's gate/up/down (stacked or one tensor per
    expert), each of the shape the keys say; no expert beyond ``expert_count``."""
    counts = _expert_counts(reader, gguf_path, arch)
    if counts is None:
        return
    count = counts[0]
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(field_value(reader, f"{arch}.embedding_length"))
    width = _expert_width(reader, arch, tensors)
    split: set[tuple[str, str]] = set()  # (layer, projection) held as one tensor per expert
    for name in tensors:
        if m := _SPLIT_RE.match(name):
            if int(m[3]) >= count:
                raise ValueError(f"{gguf_path}: tensor {name!r} is expert {m[3]}, but {arch}.expert_count is {count}")
            split.add((m[1], m[2]))
    shared = _shared_width(reader, tensors) if arch == "qwen2moe" else 0
    for layer in range(int(field_value(reader, f"{arch}.block_count"))):
        need = {f"blk.{layer}.ffn_gate_inp.weight": (count, hidden)}
        for proj in _PROJECTIONS:
            shape = (hidden, width) if proj == "down" else (width, hidden)
            if (str(layer), proj) in split:
                need |= {f"blk.{layer}.ffn_{proj}.{e}.weight": shape for e in range(count)}
            else:
                need[f"blk.{layer}.ffn_{proj}_exps.weight"] = (count, *shape)
        if arch == "qwen2moe":
            need |= {f"blk.{layer}.ffn_gate_inp_shexp.weight": (hidden,), f"blk.{layer}.ffn_gate_shexp.weight":
                     (shared, hidden), f"blk.{layer}.ffn_up_shexp.weight": (shared, hidden),
                     f"blk.{layer}.ffn_down_shexp.weight": (hidden, shared)}  # fmt: skip
        for name, shape in need.items():
            if name not in tensors:
                raise ValueError(f"{gguf_path}: expert tensor {name!r} is missing ({arch}.expert_count={count})")
            got = numpy_shape(tensors[name])
            if got != shape and not (name.endswith(".ffn_gate_inp_shexp.weight") and got == (1, hidden)):
                raise ValueError(f"{gguf_path}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                                 f"({arch}.expert_count={count}, expert width {width}, hidden size {hidden})")  # fmt: skip


def moe_config(config, reader, gguf_path: Path, arch: str):
    """``config`` (transformers' reading of the GGUF metadata) with the experts' fields it leaves
    out; a ``llama`` file with experts becomes a MixtralConfig. Dense files pass through."""
    counts = _expert_counts(reader, gguf_path, arch)
    if counts is None:
        return config
    count, used = counts
    tensors = {t.name: t for t in reader.tensors}
    width = _expert_width(reader, arch, tensors)
    if arch == "llama":
        from transformers import MixtralConfig

        known = set(MixtralConfig().to_dict()) - {"model_type", "architectures", "transformers_version", "sliding_window"}
        fields = {k: v for k, v in config.to_dict().items() if k in known}
        return MixtralConfig(**{**fields, "num_local_experts": count, "num_experts_per_tok": used,
                                "intermediate_size": width, "architectures": [MIXTRAL]})  # fmt: skip
    config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size = count, used, width
    config.norm_topk_prob = arch == "qwen3moe"  # as llama.cpp's graphs do (build_moe_ffn's norm_w); Mixtral always
    config.decoder_sparse_step, config.mlp_only_layers = 1, []  # llama.cpp: experts in every layer
    if arch == "qwen2moe":
        config.shared_expert_intermediate_size = _shared_width(reader, tensors)
    return config
