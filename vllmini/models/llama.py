"""Llama-family decoder (Llama 2/3/3.1/3.2, SmolLM2/3, Mistral, Phi-3), also the body of Qwen2, Qwen3,
Gemma 2/3, Granite and OLMo 2/3.

q/k/v and gate/up are fused into one matmul each at load time; ``load_weights``
(models/decoder_weights.py) maps HF checkpoint names onto the fused parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from vllmini.models.attention import Attention, KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.layers import GatedMLP, RMSNorm
from vllmini.models.rotary import RotaryEmbedding, apply_rotary, rope_parameters
from vllmini.models.decoder_weights import SHARDS, DecoderWeights
from vllmini.models.moe import FusedMoE, grouped_mm_supported

@dataclass(frozen=True)
class DecoderVariant:
    """What a Llama-family architecture changes in the shared decoder."""

    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    qk_norm_all_heads: bool = False  # with qk_norm: one RMSNorm over all heads' q (and one over k's) (OLMo 2/3)
    qk_norm_after_rope: bool = False  # with qk_norm: the per-head norms applied to the rotated q/k (Hunyuan)
    # Biases: None reads the config (attention_bias for q/k/v and o_proj, mlp_bias), as Llama and
    # SmolLM3 do; architectures whose transformers class fixes them ignore those keys.
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = None
    # Sliding-window attention, as the transformers class reads the config: "none" (Llama ignores
    # sliding_window), "every_layer" (Mistral, Phi-3: every layer once sliding_window is set) or
    # "layer_types" (Qwen2/3, SmolLM3: with use_sliding_window, the layers layer_types marks) or
    # "by_layer_type" (Gemma 2/3: the layers layer_types marks, with no use_sliding_window switch)
    sliding: str = "none"
    norm: type[RMSNorm] = RMSNorm  # every RMSNorm of the decoder (Gemma's: the weight is an offset from 1)
    query_pre_attn_scalar: bool = False  # Gemma: scores scaled by query_pre_attn_scalar**-0.5, not head_dim**-0.5
    attention_multiplier: bool = False  # Granite: scores scaled by config.attention_multiplier itself
    attn_softcapping: bool = False  # Gemma 2: scores capped by attn_logit_softcapping (Gemma 3's config has the key unused)
    bias_key: str | None = None  # one config key for every bias the fields above leave to the config (ERNIE 4.5: use_bias)
    rope_interleaved: bool = False  # RoPE turns pairs of adjacent dims (GPT-J / GLM style: ERNIE 4.5), not the two halves
    attn_sinks: bool = False  # a learned logit per query head joins each softmax, its column dropped (gpt-oss's sinks)

    def bias(self, fixed: bool | None, config: Any, key: str) -> bool:
        return bool(getattr(config, self.bias_key or key, False)) if fixed is None else fixed


class DecoderAttention(nn.Module):
    """Projections, optional per-head q/k RMSNorm (Qwen3), RoPE, then the attention core."""

    def __init__(self, config: Any, variant: DecoderVariant, use_rope: bool = True, window: int | None = None) -> None:
        super().__init__()
        self.use_rope = use_rope  # False: a NoPE layer (SmolLM3's no_rope_layers)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias = variant.bias(variant.qkv_bias, config, "attention_bias")
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=variant.bias(variant.o_bias, config, "attention_bias"))
        self.qk_norm_all_heads, self.rope_interleaved = variant.qk_norm_all_heads, variant.rope_interleaved
        self.norm_after_rope = variant.qk_norm_after_rope
        q_width, k_width = (self.q_size, self.kv_size) if variant.qk_norm_all_heads else (self.head_dim, self.head_dim)
        self.q_norm = variant.norm(q_width, config.rms_norm_eps) if variant.qk_norm else None
        self.k_norm = variant.norm(k_width, config.rms_norm_eps) if variant.qk_norm else None
        scale = (config.query_pre_attn_scalar if variant.query_pre_attn_scalar else self.head_dim) ** -0.5
        if variant.attention_multiplier:
            scale = float(config.attention_multiplier)
        softcap = getattr(config, "attn_logit_softcapping", None) if variant.attn_softcapping else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale, window, softcap)
        # the checkpoint's ``self_attn.sinks`` [num_heads]: handed to the backend at every call
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if variant.attn_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.qk_norm_all_heads and not self.norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rotary(q, *cos_sin, self.rope_interleaved), apply_rotary(k, *cos_sin, self.rope_interleaved)
        if self.norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, meta, kv_cache, self.sinks))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, variant: DecoderVariant, mlp: nn.Module, use_rope: bool = True,
                 window: int | None = None) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = variant.norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DecoderAttention(config, variant, use_rope, window)
        self.post_attention_layernorm = variant.norm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp  # a GatedMLP, or a mixture of experts (models/moe.py)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def layer_windows(config: Any, sliding: str) -> list[int | None]:
    """Each layer's sliding attention window (None: full attention) per ``DecoderVariant.sliding``."""
    window, n = getattr(config, "sliding_window", None), config.num_hidden_layers
    if sliding == "none" or not window:
        return [None] * n
    if sliding == "every_layer":
        return [int(window)] * n
    if sliding == "layer_types" and not getattr(config, "use_sliding_window", False):
        return [None] * n
    types = getattr(config, "layer_types", None) or ["sliding_attention"] * n
    return [int(window) if kind == "sliding_attention" else None for kind in types]


class DecoderModel(nn.Module):
    def __init__(self, config: Any, variant: DecoderVariant, build_mlp: Callable[[int], nn.Module],
                 layer_cls: type[DecoderLayer] = DecoderLayer) -> None:  # fmt: skip
        super().__init__()
        # uninitialised (_weight): the checkpoint fills it, and a random init on the meta device
        # (weight_loader) imports torch._dynamo, and with it triton, for nothing
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        # SmolLM3: no_rope_layers[i] == 0 marks a layer without rotary embedding
        rope = getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers
        windows = layer_windows(config, variant.sliding)
        self.layers = nn.ModuleList(
            layer_cls(config, variant, build_mlp(i), bool(rope[i]), windows[i]) for i in range(config.num_hidden_layers)
        )
        self.norm = variant.norm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters(config), variant.rope_interleaved)


class LlamaForCausalLM(DecoderWeights, nn.Module):
    """Flat varlen batch in, logits of each sequence's last scheduled token out (its checkpoint
    loading: models/decoder_weights.py)."""

    variant = DecoderVariant()
    layer_cls = DecoderLayer  # (Gemma: norms on both sides of attention and MLP)

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self._shards_seen = {}  # fused parameter -> shard indices loaded (load_weights)
        self.model = DecoderModel(config, self.variant, self.build_mlp, self.layer_cls)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_mlp(self, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s MLP; the mixture-of-experts models return experts in some layers."""
        config = self.config
        bias = self.variant.bias(self.variant.mlp_bias, config, "mlp_bias")
        return GatedMLP(config.hidden_size, config.intermediate_size, bias, getattr(config, "hidden_act", "silu"))

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    @property
    def sliding_window(self) -> int | None:
        """The attention window of the layers that have one (None: every layer attends to all
        earlier tokens)."""
        return next((layer.self_attn.attn.window for layer in self.model.layers if layer.self_attn.attn.window), None)

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window (None: it attends to every earlier token)."""
        return [layer.self_attn.attn.window for layer in self.model.layers]

    @property
    def kv_window(self) -> int | None:
        """The window when every layer has the same one (None otherwise): then no layer reads
        the KV behind it, and the cache can release those blocks as a sequence advances (mixed
        windows: kv/kv_groups.py)."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def logits_soft_cap(self) -> float | None:
        """The cap on attention scores (Gemma 2's attn_logit_softcapping), which backend_select.py
        needs a backend to apply (flash-attn < 2.6 and torch's varlen_attn cannot); None: uncapped."""
        return self.model.layers[0].self_attn.attn.softcap

    @property
    def attention_sinks(self) -> bool:
        """Whether the attention softmax has a learned sink logit per head (gpt-oss), which
        backend_select.py needs a backend to apply."""
        return self.model.layers[0].self_attn.sinks is not None

    @property
    def num_kv_heads(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    def lora_targets(self) -> list[tuple[str, list[str], list[int]]]:
        """The linears a LoRA adapter may adapt: (our module path, the checkpoint projections its
        output is made of, their output sizes). A PEFT adapter names checkpoint projections
        (``q_proj``); ours are fused (``qkv_proj``), so each fused shard is adapted on its own."""
        targets = []
        for i, layer in enumerate(self.model.layers):
            attn, prefix, dense = layer.self_attn, f"model.layers.{i}", isinstance(layer.mlp, GatedMLP)
            fused = [(f"{prefix}.self_attn.qkv_proj", SHARDS["qkv_proj"], [attn.q_size, attn.kv_size, attn.kv_size])]
            if dense:  # (experts take no adapter: an adapter naming them is refused as an unknown target)
                fused.append((f"{prefix}.mlp.gate_up_proj", SHARDS["gate_up_proj"], [layer.mlp.intermediate_size] * 2))
            for path, shards, sizes in fused:
                if self.fused_checkpoint:  # (Phi-3) adapters target the fused projection itself
                    targets.append((path, [path], [sum(sizes)]))
                else:
                    targets.append((path, [f"{path.rpartition('.')[0]}.{s}" for s in shards], sizes))
            targets.append((f"{prefix}.self_attn.o_proj", [f"{prefix}.self_attn.o_proj"], [attn.o_proj.out_features]))
            if dense:
                targets.append((f"{prefix}.mlp.down_proj", [f"{prefix}.mlp.down_proj"], [layer.mlp.down_proj.out_features]))
        return targets

    def cuda_graph_blocker(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this model's decode steps cannot be captured in a CUDA graph (None: they can)."""
        experts = any(isinstance(m, FusedMoE) for m in self.modules())
        if experts and not grouped_mm_supported(device, dtype):
            return (f"a mixture of experts runs without host syncs only in bfloat16 with torch >= 2.10 "
                    f"(F.grouped_mm); this engine runs {dtype}")
        return None

    def set_attention_backend(self, backend: Callable[..., torch.Tensor]) -> None:
        for layer in self.model.layers:
            layer.self_attn.attn.backend = backend

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache] | None = None,
        inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, positions, attn_metadata, kv_caches, inputs_embeds))

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[KVCache] | None = None,
        inputs_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states of the rows in ``logits_indices`` (every row when None):
        what ``forward`` projects to logits, and what the pooling runner pools (engine/pooler.py).
        ``inputs_embeds``: (rows, values) whose input embeddings replace the table's (prompt_embeds)."""
        x = self.embed(input_ids)
        if inputs_embeds is not None:
            rows, values = inputs_embeds
            x = x.index_copy(0, rows, values.to(x.dtype))
        for i, (layer, cos_sin) in enumerate(zip(self.model.layers, self.rope_tables(positions))):
            x = layer(x, cos_sin, *attn_metadata.for_layer(i, kv_caches))
        if attn_metadata.logits_indices is not None:
            x = x.index_select(0, attn_metadata.logits_indices)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (Gemma scales them; prompt_embeds replace these)."""
        return self.model.embed_tokens(input_ids)

    def rope_tables(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's rotary cos/sin: one table for all here (Gemma 3's sliding layers have their own base)."""
        return [self.model.rotary_emb.cos_sin(positions)] * len(self.model.layers)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layers without biases (transformers' Mistral ignores attention_bias / mlp_bias),
    sliding in every layer when sliding_window is set (Mistral 7B v0.1)."""

    variant = DecoderVariant(qkv_bias=False, o_bias=False, mlp_bias=False, sliding="every_layer")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's layers without biases, sliding in every layer (Phi-3-mini-4k: 2047 keys); its
    checkpoints hold qkv_proj / gate_up_proj already fused."""

    variant = DecoderVariant(qkv_bias=False, o_bias=False, mlp_bias=False, sliding="every_layer")
    fused_checkpoint = True


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Llama's layers, every ``no_rope_layer_interval``-th without RoPE (``no_rope_layers``)."""

    variant = DecoderVariant(sliding="layer_types")
