"""What an engine loads before it can size its KV cache: the model folder, its config, the
dtype, the weights (prepacked for oneDNN on a CPU that has it) and the tokenizer.

Kept apart from the engine core so that ``LLMEngine.__init__`` reads as the list of parts it
builds; the rules for each piece live where they are named (config.py, models/)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllmini.config import EngineArgs, resolve_dtype, resolve_max_model_len, resolve_runner
from vllmini.models import checkpoint_checks, registry
from vllmini.models.packed_experts import prepack_experts
from vllmini.models.packed_linear import packing_available, prepack_linears
from vllmini.models.seq_cls_from_lm import resolve_score_from_tokens
from vllmini.models.weight_loader import load_config, load_model, load_tokenizer, resolve_model_dir
from vllmini.runner_config import resolve_convert
from vllmini.spec_decode.config import SpeculativeConfig
from vllmini.vllm_args import apply_hf_overrides

logger = logging.getLogger("vllmini")


@dataclass
class LoadedModel:
    model_dir: Path
    model: Any  # a CausalLM (models/base.py)
    hf_config: Any  # transformers' PretrainedConfig
    dtype: torch.dtype
    tokenizer: Any  # None with skip_tokenizer_init
    runner: str = "generate"  # or "pooling": the model has no lm_head then
    convert: str = "none"  # how a pooling model was adapted: "embed" or "classify" (runner_config.py)
    max_model_len: int = 0  # resolved before the model is built: its rope may depend on it (models/rotary.py)


def load_for_engine(args: EngineArgs, device: torch.device) -> LoadedModel:
    """Load ``args.model`` (a folder, a hub id, a GGUF file or "default") on ``device``."""
    t0 = time.perf_counter()
    if args.trust_remote_code:
        logger.warning("trust_remote_code=True is ignored: vllmini runs only its built-in architectures, "
                       "never code shipped with a model")  # fmt: skip
    model_dir = resolve_model_dir(args.model, args.cache_dir, args.revision, args.download_dir)
    config = apply_hf_overrides(load_config(model_dir), args.hf_overrides)
    checkpoint_checks.check_quantization(args.quantization, config, model_dir)
    runner = resolve_runner(args, config.architectures)
    convert = resolve_convert(args, config.architectures, runner)
    if convert == "classify" and not registry.is_classifier_architecture(config.architectures):
        config.architectures = [registry.classifier_architecture(config.architectures)]
    score_from_tokens = resolve_score_from_tokens(config) if runner == "pooling" else None
    checkpoint_dtype = getattr(config, "dtype", None)
    dtype = resolve_dtype(args.dtype, device, checkpoint_dtype)
    if args.dtype == "auto" and checkpoint_dtype not in (None, dtype):
        name = str(checkpoint_dtype).removeprefix("torch.")
        logger.info("dtype auto: %s on %s (config.json says %s; pass dtype= to choose)",
                    str(dtype).removeprefix("torch."), device.type, name)  # fmt: skip
    window = disable_sliding_window(config) if args.disable_sliding_window else None
    max_model_len = resolve_max_model_len(args.max_model_len, config, window)  # (refused before the weights load)
    if args.tokenizer_revision is not None and (args.tokenizer is None or Path(args.tokenizer).expanduser().exists()):
        logger.warning("tokenizer_revision=%r is ignored: the tokenizer is read from a folder (%s), not a hub id",
                       args.tokenizer_revision, args.tokenizer or model_dir)  # fmt: skip
    tokenizer = None  # skip_tokenizer_init: token ids in and out (engine/skip_tokenizer.py)
    if not args.skip_tokenizer_init or score_from_tokens is not None:  # (the head's tokens are read with it)
        tokenizer = load_tokenizer(args.tokenizer or model_dir, args.tokenizer_revision, args.download_dir)
    if score_from_tokens is not None:
        score_from_tokens.resolve_token_ids(tokenizer, config.vocab_size)
        logger.info("score head from lm_head rows of %s (ids %s, %s)", score_from_tokens.tokens,
                    score_from_tokens.token_ids, score_from_tokens.method)  # fmt: skip
    model, hf_config = load_model(model_dir, dtype, device, config, pooling=runner == "pooling",
                                  max_model_len=max_model_len, score_from_tokens=score_from_tokens)  # fmt: skip
    if packing_available(device, dtype):  # (after load_model: its missing-tensor checks read the dense weights)
        linears, experts = prepack_linears(model), prepack_experts(model)
        logger.info("CPU linears: %d prepacked for oneDNN%s", linears,
                    f", and {experts} expert matrices" if experts else "")  # fmt: skip
    if args.skip_tokenizer_init:
        tokenizer = None
    logger.info("loaded %s (%s, %s) in %.1fs", model_dir, dtype, device, time.perf_counter() - t0)
    return LoadedModel(model_dir, model, hf_config, dtype, tokenizer, runner, convert, max_model_len)


def disable_sliding_window(config: Any) -> int | None:
    """vLLM's ``disable_sliding_window``: the model's window, as its architecture reads the config
    (None: its attention does not slide), removed from ``config`` so every layer attends to all
    earlier tokens; max_model_len is then capped at it, where both attentions agree."""
    from vllmini.models.llama import layer_windows

    sliding = getattr(getattr(registry.get_model_class(config.architectures), "variant", None), "sliding", "none")
    windows = [w for w in layer_windows(config, sliding) if w is not None]
    if not windows:
        return None
    config.sliding_window = None
    logger.info("disable_sliding_window: full attention in every layer, max_model_len at most %d", min(windows))
    return min(windows)


def load_draft_model(draft: str, args: EngineArgs, device: torch.device, target: LoadedModel, max_model_len: int) -> Any:
    """The draft model of ``speculative_config`` (method "draft_model"), loaded as the target is
    (same dtype and device), after checking that it can draft for it: a generating model of the
    target's vocabulary (and tokenizer, where the draft folder has one), with no window in every
    layer (the shared blocks behind it would be released), covering ``max_model_len``. A ValueError
    names ``speculative_config.model`` and what differs."""
    field = f"speculative_config.model={draft!r}"
    model_dir = resolve_model_dir(draft, args.cache_dir, download_dir=args.download_dir)
    config = load_config(model_dir)
    if resolve_runner(EngineArgs(model=draft), config.architectures) != "generate":
        raise ValueError(f"{field}: {config.architectures} has no language-model head to draft tokens with")
    if config.vocab_size != target.hf_config.vocab_size:
        raise ValueError(f"{field}: its vocabulary has {config.vocab_size} tokens, the target's "
                         f"{target.hf_config.vocab_size}; a draft model must share the target's tokenizer")  # fmt: skip
    tokenizer_files = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if target.tokenizer is not None and any((model_dir / name).is_file() for name in tokenizer_files):
        if load_tokenizer(model_dir).get_vocab() != target.tokenizer.get_vocab():
            raise ValueError(f"{field}: its tokenizer's vocabulary differs from the target's (same size, other "
                             "tokens); a draft model must share the target's tokenizer")  # fmt: skip
    if resolve_max_model_len(None, config) < max_model_len:
        raise ValueError(f"{field}: its context ({resolve_max_model_len(None, config)} tokens) is shorter than "
                         f"max_model_len={max_model_len}; pass a smaller max_model_len")  # fmt: skip
    # (kv_window: a window in every layer, whose blocks behind it are released; sliding and full
    # layers mixed, as Gemma 2/3: the draft shares the full-attention KV group's blocks, which stay)
    unsupported = ("has sliding-window attention in every layer, which speculative decoding with a draft model does "
                   "not support here (the KV blocks behind a window are released, and the two caches share them)")  # fmt: skip
    if target.model.kv_window is not None:
        raise ValueError(f"{field}: the target model {unsupported}")
    model, _ = load_model(model_dir, target.dtype, device, config, max_model_len=max_model_len)
    if model.kv_window is not None:
        raise ValueError(f"{field}: the draft model {unsupported}")
    if packing_available(device, target.dtype):
        prepack_linears(model)
        prepack_experts(model)
    logger.info("draft model %s loaded (%d layers)", model_dir, config.num_hidden_layers)
    return model


def load_speculative(
    args: EngineArgs, device: torch.device, target: LoadedModel, max_model_len: int
) -> tuple[SpeculativeConfig | None, Any]:
    """``args.speculative_config`` checked, and its draft model (method "draft_model") loaded,
    before the KV cache is sized (its weights take memory too); (None, None) without one."""
    if args.speculative_config is None:
        return None, None
    if target.runner == "pooling":
        raise ValueError("speculative_config: a pooling engine (embeddings) generates no tokens to draft")
    if hasattr(target.model, "state_shapes"):
        raise ValueError("speculative_config: not supported for a model with linear-attention layers "
                         f"({target.hf_config.architectures[0]}): their state cannot take back a rejected token")
    config = SpeculativeConfig.parse(args.speculative_config)
    draft_model = None if config.model is None else load_draft_model(config.model, args, device, target, max_model_len)
    logger.info("speculative decoding: %s", config)
    return config, draft_model
