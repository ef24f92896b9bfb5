"""``llm.model_config`` / ``llm.llm_engine.model_config``: what vLLM 0.32's ``ModelConfig`` gives
the user code that reads it (the model, its context, dtype, HF config, sizes...), read from the
loaded engine. vLLM's other fields (multimodal, parallelism, compilation...) are not here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllmini.models.nvfp4 import nvfp4_format
from vllmini.models.quant_config import quantization_config

if TYPE_CHECKING:
    from vllmini.engine.llm_engine import LLMEngine


@dataclass
class ModelConfig:
    model: str  # as given (a path, a hub id, a .gguf file or "default")
    tokenizer: str
    served_model_name: str
    dtype: torch.dtype
    max_model_len: int
    hf_config: Any  # the transformers config
    runner_type: str  # "generate" or "pooling"
    convert_type: str  # "none", "embed" or "classify"
    quantization: str | None  # the checkpoint's method ("fp8", "gptq", "awq", "compressed-tensors"...; ModelOpt's
    # NVFP4 "modelopt_fp4", vLLM's name for it) or None
    seed: int
    max_logprobs: int
    revision: str | None
    tokenizer_revision: str | None
    tokenizer_mode: str
    trust_remote_code: bool
    enforce_eager: bool
    skip_tokenizer_init: bool
    enable_prompt_embeds: bool
    logprobs_mode: str
    generation_config: str
    disable_sliding_window: bool
    sliding_window: int | None
    diff_sampling_param: dict[str, Any] = field(repr=False)
    pooler_config: Any = None
    hf_overrides: Any = None
    is_multimodal_model: bool = False
    is_encoder_decoder: bool = False

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> ModelConfig:
        args, hf = engine.args, engine.hf_config
        quant = quantization_config(hf, engine.model_dir) or {}  # (ModelOpt's may sit in hf_quant_config.json)
        method = quant.get("quant_method")
        if method == "modelopt" and nvfp4_format({"quantization_config": quant}) is not None:
            method = "modelopt_fp4"
        return cls(
            model=str(args.model), tokenizer=str(args.tokenizer or args.model),
            served_model_name=args.get_served_model_name(),
            dtype=engine.dtype, max_model_len=engine.max_model_len, hf_config=hf, runner_type=engine.runner_type,
            convert_type=engine.convert_type, quantization=method or args.quantization,
            seed=args.seed, max_logprobs=args.max_logprobs, revision=args.revision,
            tokenizer_revision=args.tokenizer_revision, tokenizer_mode=args.tokenizer_mode,
            trust_remote_code=bool(args.trust_remote_code), enforce_eager=bool(args.enforce_eager),
            skip_tokenizer_init=bool(args.skip_tokenizer_init), enable_prompt_embeds=bool(args.enable_prompt_embeds),
            logprobs_mode=args.logprobs_mode, generation_config=str(args.generation_config),
            disable_sliding_window=bool(args.disable_sliding_window),
            sliding_window=getattr(engine.model, "sliding_window", None),
            diff_sampling_param=_diff_sampling_param(engine), pooler_config=getattr(engine.pooler, "config", None),
            hf_overrides=args.hf_overrides or {},
            is_multimodal_model=getattr(hf, "multimodal_architecture", None) is not None,
        )  # fmt: skip

    @property
    def hf_text_config(self) -> Any:
        return self.hf_config  # (a multimodal checkpoint's is its text_config: models/multimodal.py)

    @property
    def architectures(self) -> list[str]:
        """The checkpoint's, as vLLM reports them (``Gemma3ForConditionalGeneration`` for a multimodal
        checkpoint served text-only, not the text model vllmini runs)."""
        outer = getattr(self.hf_config, "multimodal_architecture", None)
        return [outer] if outer else list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def architecture(self) -> str | None:
        return self.architectures[0] if self.architectures else None

    def get_vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def get_hidden_size(self) -> int:
        return self.hf_config.hidden_size

    def get_inputs_embeds_size(self) -> int:
        return self.hf_config.hidden_size

    def get_head_size(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return head_dim or self.hf_config.hidden_size // self.hf_config.num_attention_heads

    def get_sliding_window(self) -> int | None:
        return self.sliding_window

    def get_total_num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    def get_total_num_hidden_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    # vLLM's take the parallel config, whose tensor / pipeline split divides them: one device here
    def get_num_attention_heads(self, parallel_config: Any = None) -> int:
        return self.hf_config.num_attention_heads

    def get_num_kv_heads(self, parallel_config: Any = None) -> int:
        return self.get_total_num_kv_heads()

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return self.hf_config.num_hidden_layers

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """vLLM's: the model's generation config's sampling fields that differ from SamplingParams'
        defaults (what ``get_default_sampling_params`` starts from)."""
        return dict(self.diff_sampling_param)


def _diff_sampling_param(engine: LLMEngine) -> dict[str, Any]:
    from vllmini.engine.sampling_params import SamplingParams

    defaults, own = engine.get_default_sampling_params(), SamplingParams()
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
    return {name: getattr(defaults, name) for name in names if getattr(defaults, name) != getattr(own, name)}
