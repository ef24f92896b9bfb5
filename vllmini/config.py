"""EngineArgs (what a user passes) and their validation/resolution.

Every field is checked here so that a bad value fails at start-up with a message
naming the field and what is accepted, instead of deep inside a forward.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any

import torch

from vllmini.config_fields import config_fields  # noqa: F401  (re-exported: other configs read theirs with it)
from vllmini.engine.profiler import ProfilerConfig
from vllmini.engine.structured_outputs import StructuredOutputsConfig
from vllmini.engine.thinking_budget import ReasoningConfig
from vllmini.kv.cache_dtype import check_kv_cache_dtype
from vllmini.kv.state_cache import STATE_DTYPES
from vllmini.runner_config import _TASK_CONVERTS, _TASK_RUNNERS, CONVERTS, RUNNERS, PoolerConfig, resolve_runner  # noqa: F401  (re-exported)
from vllmini.vllm_args import VllmEngineArgs, parse_hf_overrides, resolve_kv_cache_memory

logger = logging.getLogger("vllmini")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` = CUDA when available, else CPU."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    return dev


def resolve_dtype(
    dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: str | torch.dtype | None = None
) -> torch.dtype:
    """``auto`` = float32 on CPU; on CUDA the checkpoint's 16-bit dtype (config.json's ``dtype``),
    as vLLM does (a float16 model such as Llama 2 runs in float16, not in bfloat16's coarser
    mantissa), else bfloat16. float32 stays the CPU default because it is the
    precision the HF-parity tests hold to and because bf16 matmuls are slow on CPUs without native
    bf16 (AVX512-BF16 / AMX); where the CPU has it, ``bfloat16`` is the faster opt-in (prepacked
    bf16 linears, a bf16 KV cache read by the cpu attention kernel: README, "bfloat16 on the CPU")."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype}")
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a string such as 'auto' or 'float32', got {dtype!r}")
    if dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = _DTYPES.get(checkpoint_dtype.removeprefix("torch.").lower())
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(
            f"dtype={dtype!r} is not supported; accepted: auto, float32, bfloat16, float16"
        ) from None


# config.json keys that state a model's context length, as vLLM reads them (the smallest one present wins)
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_target_positions",
                 "max_sequence_length", "model_max_length")  # fmt: skip
DEFAULT_MAX_MODEL_LEN = 2048  # vLLM's too, for a config that states none


def resolve_max_model_len(requested: int | None, hf_config: Any, window_cap: int | None = None) -> int:
    """``max_model_len``: the model's context length when unset; a longer one is refused, as vLLM does.

    The context length is derived as vLLM derives it: the smallest length key of config.json, times
    the factor of a linear or dynamic rope scaling, whose ``max_position_embeddings`` is the unscaled
    length (Vicuna-v1.5-16k: 4096 with factor 4); YaRN's ``original_max_position_embeddings`` times
    its factor (Qwen3 with 32768 x 4); llama3 and LongRoPE configs, and Gemma 3, already state the scaled one."""
    from vllmini.models.rotary import rope_parameters, scaled_context_len

    values = [getattr(hf_config, key, None) for key in _MAX_LEN_KEYS]
    lengths = [int(v) for v in values if isinstance(v, (int, float)) and v > 0]
    if lengths:
        derived, source = min(lengths), "config.json"
    else:
        derived, source = DEFAULT_MAX_MODEL_LEN, "default"
        if requested is None:
            logger.warning("config.json states no context length (%s); assuming %d tokens",
                           ", ".join(_MAX_LEN_KEYS), DEFAULT_MAX_MODEL_LEN)  # fmt: skip
    scaled, why = scaled_context_len(rope_parameters(hf_config), derived)
    # (as vLLM: Gemma 3's max_position_embeddings is the context its full layers' rope scaling gives)
    if why and "gemma3" not in (getattr(hf_config, "model_type", None) or ""):
        derived, source = scaled, f"{source}, {why}"
    if window_cap is not None and window_cap < derived:  # disable_sliding_window, as vLLM caps it
        derived, source = window_cap, "the sliding window, as disable_sliding_window caps it"
    chunk = attention_chunk_cap(hf_config)
    if chunk is not None and chunk < derived:
        derived, source = chunk, "attention_chunk_size: chunked local attention is not built, one chunk is causal"
        if requested is None:
            logger.info("max_model_len %d: Llama 4's attention_chunk_size (chunked local attention is not built "
                        "here; within one chunk it is plain causal attention)", chunk)  # fmt: skip
    if requested is None:
        return derived
    if requested > derived:
        raise ValueError(f"max_model_len={requested} exceeds the model's context length {derived} ({source})")
    return requested


def attention_chunk_cap(hf_config: Any) -> int | None:
    """Llama 4's ``attention_chunk_size`` where some layer attends in chunks (its RoPE layers), else None:
    chunked local attention is not built, so no sequence may outgrow one chunk."""
    chunk = getattr(hf_config, "attention_chunk_size", None)
    chunked = "chunked_attention" in (getattr(hf_config, "layer_types", None) or [])
    return int(chunk) if chunk and chunked else None


# a block is the unit of KV allocation and of the attention kernels' tiles: CPU uses 16, CUDA 256
# (flash-attn's paged kernels need a multiple of 256); far larger blocks only waste memory
MAX_BLOCK_SIZE = 1024


@dataclass
class EngineArgs(VllmEngineArgs):
    """Engine settings, with vLLM's names (and, keyword-only, vLLM's that name a choice vllmini does
    not have: vllm_args.py)."""

    model: str = "default"
    tokenizer: str | None = None
    revision: str | None = None  # a hub id's branch, tag or commit (None: main); local paths ignore it, as in vLLM
    tokenizer_revision: str | None = None  # vLLM's: the same for a hub-id tokenizer (None: main)
    download_dir: str | None = None  # vLLM's: the Hugging Face cache hub models are looked up in and fetched to
    # vLLM's: every layer attends to all earlier tokens, and max_model_len is capped at the sliding window
    # (so no sequence outgrows it); for a backend or a measurement without windows
    disable_sliding_window: bool = False
    # vLLM's: one block table for every layer even when sliding-window and full-attention layers mix
    # (Gemma 2/3): nothing is released behind the windows (the default groups the layers: kv/kv_groups.py)
    disable_hybrid_kv_cache_manager: bool = False
    # accepted for vLLM's sake, never acted on: only built-in architectures run, and no model's code
    trust_remote_code: bool = False
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # vLLM's: > 0 caps the tokens one sequence computes in a step (long prompts prefill in chunks of
    # at most this many, leaving the step's budget to other prompts too); 0: no cap
    long_prefill_token_threshold: int = 0
    # "fcfs", or "priority": requests carry a priority (lower first) that orders the queue and
    # picks whom to preempt (vLLM's scheduling_policy; scheduler/scheduler.py)
    scheduling_policy: str = "fcfs"
    block_size: int | None = None  # auto: 16 on CPU, 256 on CUDA
    kv_cache_memory: int | None = None  # bytes for the KV cache on CPU (auto: 1 GiB)
    # vLLM's: this many KV blocks, whatever the memory budget gives (a test's knob: preemption on demand)
    num_gpu_blocks_override: int | None = None
    # what the cache stores (vLLM's names): "auto" (the model's dtype), "fp8" / "fp8_e4m3", "fp8_e5m2"
    # (one byte an element, scale 1.0), "bfloat16" (a float32 model's cache halved) (kv/cache_dtype.py)
    kv_cache_dtype: str = "auto"
    # the per-sequence states of linear-attention / Mamba / short-convolution layers (kv/state_cache.py), vLLM's
    # names: a convolution's window ("auto": the model's dtype) and a recurrent state ("auto": float32 here,
    # vLLM's auto is the window's dtype); or "float32", "bfloat16", "float16"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # launch the next decode step before this one's tokens reach the host (engine/async_scheduling.py)
    async_scheduling: bool = False
    # the largest logprobs / prompt_logprobs a request may ask for (-1: the vocabulary size), as in vLLM:
    # one request's top-N is computed for every row of its step, so an unbounded N slows every request
    max_logprobs: int = 20
    # what logprobs hold (vLLM's): "raw_logprobs" (the model's, before any processing), "processed_logprobs"
    # (of the distribution sampled from: after bias, bans, penalties, temperature, top-k/p), or the logits
    # themselves at either point ("raw_logits", "processed_logits") (engine/sampler.py)
    logprobs_mode: str = "raw_logprobs"
    # default sampling parameters for requests without any: "auto" (the model's generation_config.json,
    # as vLLM), "vllm" (SamplingParams' own defaults) or a folder holding a generation_config.json
    generation_config: str = "auto"
    # vLLM's: generation config fields set over that source's ({"temperature": 0.5, "max_new_tokens": 256});
    # with generation_config="vllm" they are the only defaults; a dict or its JSON text (engine/input_processor.py)
    override_generation_config: dict[str, Any] | str | None = None
    attention_backend: str | None = None  # None: auto (models/backend_select.py): cpu, torch, flash_attn, torch_varlen, triton
    cache_dir: str | None = None  # where converted models live (default: $VLLMINI_CACHE)
    # LoRA adapters (vllmini/lora/): requests bring a LoRARequest; at most max_loras adapters run in a
    # step (the model's slots), each of rank <= max_lora_rank; max_cpu_loras stay loaded (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # speculative decoding, vLLM's dict (or its JSON text): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": 5, "prompt_lookup_min": 5}, or a draft model: {"model": path, "num_speculative_tokens": k}
    # (method "draft_model") (spec_decode/)
    speculative_config: dict[str, Any] | str | None = None
    # vLLM's: prompts may be given as embeddings ({"prompt_embeds": tensor [L, hidden]}) instead of tokens
    # (engine/prompt_embeds.py)
    enable_prompt_embeds: bool = False
    # "generate", "pooling" (embeddings: LLM.embed / encode, /v1/embeddings; engine/pooler.py) or
    # "auto" (vLLM's default: pooling for a *Model or *ForSequenceClassification architecture, else
    # generate); ``task`` is vLLM's older spelling ("embed", "classify", "score" = runner "pooling");
    # ``convert`` (vLLM's): "embed" pools a causal LM's hidden states, "classify" runs it under a score
    # head (its checkpoint's, or built by config.json's / hf_overrides' classifier_from_token), "none"
    # as it is, "auto" (runner_config.py); ``pooler_config``: PoolerConfig, a dict or JSON
    runner: str = "auto"
    task: str | None = None
    convert: str = "auto"
    pooler_config: PoolerConfig | dict | str | None = None
    # the name clients send as ``model`` to the server and the metrics' model_name label (None: model)
    served_model_name: str | None = None
    # the engine keeps Prometheus metrics (metrics/stat_logger.py: the server's /metrics,
    # LLM.get_metrics()) unless this is set; LLM sets it unless told otherwise, as vLLM's does
    disable_log_stats: bool = False
    # custom logits processors (engine/logits_processor.py): LogitsProcessor subclasses or their
    # qualified names ("package.module.Class"; the CLI's one string may list several, comma-separated)
    logits_processors: list[str | type] | str | None = None
    # streamed outputs (output_kind "delta"/"cumulative") come every this many new tokens (the first
    # and the last at once), as vLLM's --stream-interval; a request's SamplingParams.stream_interval may raise it
    stream_interval: int = 1
    # what opens and closes a reasoning section, for SamplingParams.thinking_token_budget, as vLLM's:
    # {"reasoning_parser": "qwen3"} or {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
    # (engine/thinking_budget.py); the server's --reasoning-parser sets it when it is not given
    reasoning_config: ReasoningConfig | dict | str | None = None
    # vLLM's StructuredOutputsConfig (a dict or its JSON): {"enable_in_reasoning": true} makes a grammar bind
    # the reasoning too (by default it starts after the reasoning's end string); {"reasoning_parser": "qwen3"}
    # gives reasoning_config when that is not set
    structured_outputs_config: StructuredOutputsConfig | dict | str | None = None
    # vLLM's ProfilerConfig (a dict or its JSON): {"profiler": "torch", "torch_profiler_dir": DIR} lets
    # start_profile()/stop_profile() write torch profiler traces there (engine/profiler.py); None:
    # $VLLMINI_TORCH_PROFILER_DIR when set, else off
    profiler_config: ProfilerConfig | dict | str | None = None
    # vLLM's AsyncEngineArgs: the async engine logs each request it accepts (prompt, token ids and params,
    # each cut to max_log_len; None: whole) and each abort, at INFO (engine/request_logger.py)
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # vLLM's: config.json fields to change before the model is built ({"max_position_embeddings": 4096}; a
    # dict-valued field such as rope_scaling is updated key by key); a dict or its JSON text (vllm_args.py)
    hf_overrides: dict[str, Any] | str | None = None

    def __post_init__(self) -> None:
        self.kv_cache_memory = self.kv_cache_memory_bytes = resolve_kv_cache_memory(
            self.kv_cache_memory, self.kv_cache_memory_bytes
        )

    def resolved_reasoning_config(self) -> ReasoningConfig | None:
        """``reasoning_config``, else the one ``structured_outputs_config.reasoning_parser`` names."""
        if self.reasoning_config is None:
            parser = StructuredOutputsConfig.coerce(self.structured_outputs_config).reasoning_parser
            return ReasoningConfig.coerce({"reasoning_parser": parser}) if parser else None
        return ReasoningConfig.coerce(self.reasoning_config)

    def get_served_model_name(self) -> str:
        """The name the server answers to and the metrics' model_name label (vLLM's rule: the
        served_model_name, else the model as given): the one source both read."""
        return self.served_model_name or self.model

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def validate(self) -> None:
        def positive_int(name: str, value: object, allow_none: bool = False) -> None:
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be 'default', a local path or a hub id, got {self.model!r}")
        self.check_vllm_args()
        from vllmini.engine.skip_tokenizer import check_engine_args

        check_engine_args(self)
        parse_hf_overrides(self.hf_overrides)
        from vllmini.engine.input_processor import generation_overrides

        generation_overrides(self.override_generation_config)
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        positive_int("max_model_len", self.max_model_len, allow_none=True)
        positive_int("block_size", self.block_size, allow_none=True)
        if self.block_size is not None and self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE} tokens, got {self.block_size}")
        positive_int("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override, allow_none=True)
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0 (0: no cap), got {threshold!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if getattr(self, name) not in STATE_DTYPES:
                raise ValueError(f"{name} must be one of {list(STATE_DTYPES)}, got {getattr(self, name)!r}")
        positive_int("max_log_len", self.max_log_len, allow_none=True)
        for name in ("revision", "tokenizer_revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a hub branch, tag or commit (or None), got {value!r}")
        if self.download_dir is not None and (not isinstance(self.download_dir, str) or not self.download_dir):
            raise ValueError(f"download_dir must be a folder path (or None), got {self.download_dir!r}")
        positive_int("max_loras", self.max_loras)
        positive_int("stream_interval", self.stream_interval)
        positive_int("max_lora_rank", self.max_lora_rank)
        positive_int("max_cpu_loras", self.max_cpu_loras, allow_none=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        for flag in ("enable_prefix_caching", "enforce_eager", "async_scheduling", "trust_remote_code", "enable_lora",
                     "enable_log_requests", "enable_sleep_mode", "disable_hybrid_kv_cache_manager"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer >= 0, or -1 for no limit, got {self.max_logprobs!r}")
        from vllmini.engine.sampler import LOGPROBS_MODES

        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.speculative_config is not None:
            from vllmini.spec_decode.config import SpeculativeConfig

            SpeculativeConfig.parse(self.speculative_config)
            if self.async_scheduling:
                raise ValueError("async_scheduling cannot be combined with speculative_config (a step's drafts "
                                 "come from the tokens the previous step sampled)")  # fmt: skip
            if self.logits_processors:  # (as vLLM: a draft's row would need the processors' state after it)
                raise ValueError("logits_processors cannot be combined with speculative_config")
            if self.enable_prompt_embeds:  # (drafts need the prompt's tokens, or a draft model fed the embeddings)
                raise ValueError("enable_prompt_embeds cannot be combined with speculative_config")
        from vllmini.engine.logits_processor_state import load_logits_processors

        load_logits_processors(self.logits_processors)
        StructuredOutputsConfig.coerce(self.structured_outputs_config)
        ProfilerConfig.coerce(self.profiler_config)
        self.resolved_reasoning_config()
        from vllmini.models.backend_select import BACKEND_NAMES

        if self.attention_backend is not None and self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not one of {list(BACKEND_NAMES)} (or None: auto)")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {list(RUNNERS)}, got {self.runner!r}")
        if self.task is not None and self.task not in _TASK_RUNNERS:
            raise ValueError(f"task={self.task!r} is not supported; accepted: {sorted(_TASK_RUNNERS)} (or None), "
                             "or runner='generate' / 'pooling'")  # fmt: skip
        if self.task is not None and self.runner not in ("auto", _TASK_RUNNERS[self.task]):
            raise ValueError(f"task={self.task!r} means runner={_TASK_RUNNERS[self.task]!r}, but runner={self.runner!r} "
                             "was given")  # fmt: skip
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {list(CONVERTS)}, got {self.convert!r}")
        if self.task is not None and self.convert not in ("auto", _TASK_CONVERTS.get(self.task, "none")):
            raise ValueError(f"task={self.task!r} and convert={self.convert!r} disagree; give one of them")
        if self.runner == "generate" and self.convert in ("embed", "classify"):
            raise ValueError(f"convert={self.convert!r} adapts a model to runner='pooling', not runner='generate'")
        PoolerConfig.coerce(self.pooler_config)
        device = resolve_device(self.device)
        resolve_dtype(self.dtype, device)


# vLLM's name for the async engine's arguments (``vllm.AsyncEngineArgs``): the same fields here
AsyncEngineArgs = EngineArgs
