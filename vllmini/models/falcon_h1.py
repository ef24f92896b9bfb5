"""TII's Falcon-H1 (``FalconH1ForCausalLM``: Falcon-H1-0.5B / 1.5B / 1.5B-Deep / 3B / 7B / 34B, their
-Instruct, Falcon-H1R): a parallel hybrid. Every layer runs Llama attention AND a Mamba2 mixer
(models/mamba2.py) on the same normed input and adds both outputs to the residual, then a gated
MLP; so every layer has both a paged KV cache and a per-sequence state (models/hybrid.py hands it
the pair).

muP multipliers from config.json, as transformers' modeling_falcon_h1.py applies them:
- ``embedding_multiplier`` on the token embeddings (not on prompt_embeds, which are used as given);
- ``attention_in_multiplier`` / ``ssm_in_multiplier`` on the normed input of attention / Mamba2;
- ``key_multiplier`` on the keys: the scores are linear in k, so it joins the attention scale;
- ``ssm_multipliers`` (five: z, x, B, C, dt) on the parts of Mamba2's ``in_proj`` output;
- ``attention_out_multiplier`` / ``ssm_out_multiplier`` on the two outputs before their sum;
- ``mlp_multipliers`` (gate, down): the gate projection's output before SiLU, the MLP's output;
- ``lm_head_multiplier`` on the logits.

Mamba2's width is ``mamba_d_ssm`` (or ``mamba_expand * hidden_size``); its gated RMSNorm is used only
with ``mamba_rms_norm`` (else ``y * silu(z)``), normalising before the gate when
``mamba_norm_before_gate``; ``out_proj`` has a bias with ``projectors_bias``. Checkpoint names are
transformers' (and the releases'): ``feed_forward.*``, ``pre_ff_layernorm``, ``model.final_layernorm``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllmini.models.attention import KVCache
from vllmini.models.base import AttentionMetadata
from vllmini.models.hybrid import StatefulHybrid
from vllmini.models.layers import GatedMLP
from vllmini.models.llama import DecoderLayer, DecoderVariant, LlamaForCausalLM
from vllmini.models.mamba2 import Mamba2Mixer, MambaState

# (checkpoint's, ours): transformers' Falcon-H1 names onto the shared decoder's
FALCON_H1_RENAMES: tuple[tuple[str, str], ...] = (
    (".feed_forward.", ".mlp."),
    (".pre_ff_layernorm.", ".post_attention_layernorm."),
    ("model.final_layernorm.", "model.norm."),
)


def _multipliers(config: Any, field: str, count: int) -> list[float]:
    values = getattr(config, field, None)
    if values is None:
        return [1.0] * count
    if len(values) != count:
        raise ValueError(f"{field} must have {count} values, got {list(values)}")
    return [float(v) for v in values]


class FalconH1MLP(GatedMLP):
    """The gated MLP with ``mlp_multipliers``: the gate projection's output scaled before SiLU, the output after."""

    def __init__(self, config: Any) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, bool(getattr(config, "mlp_bias", False)),
                         getattr(config, "hidden_act", "silu"))  # fmt: skip
        self.gate_multiplier, self.down_multiplier = _multipliers(config, "mlp_multipliers", 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate * self.gate_multiplier) * up) * self.down_multiplier


class FalconH1DecoderLayer(DecoderLayer):
    """Attention and Mamba2 side by side on ``input_layernorm``'s output, summed into the residual;
    then ``pre_ff_layernorm`` (our ``post_attention_layernorm``) and the MLP."""

    def __init__(self, config: Any, variant: DecoderVariant, mlp: nn.Module, use_rope: bool = True,
                 window: int | None = None) -> None:  # fmt: skip
        super().__init__(config, variant, mlp, use_rope, window)
        self.self_attn.attn.scale *= float(getattr(config, "key_multiplier", 1.0))
        zxbcdt = _multipliers(config, "ssm_multipliers", 5)
        self.mamba = Mamba2Mixer(config, in_multiplier=float(getattr(config, "ssm_in_multiplier", 1.0)),
                                 proj_multipliers=None if zxbcdt == [1.0] * 5 else zxbcdt,
                                 out_proj_bias=bool(getattr(config, "projectors_bias", False)),
                                 gated_norm=bool(getattr(config, "mamba_rms_norm", False)),
                                 norm_before_gate=bool(getattr(config, "mamba_norm_before_gate", True)))  # fmt: skip
        self.attention_in_multiplier = float(getattr(config, "attention_in_multiplier", 1.0))
        self.attention_out_multiplier = float(getattr(config, "attention_out_multiplier", 1.0))
        self.ssm_out_multiplier = float(getattr(config, "ssm_out_multiplier", 1.0))

    @property
    def state_mixer(self) -> nn.Module:
        return self.mamba

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                caches: tuple[KVCache | None, MambaState | None]) -> torch.Tensor:  # fmt: skip
        kv_cache, state = caches
        h = self.input_layernorm(x)
        ssm = self.mamba(h, meta, state) * self.ssm_out_multiplier
        attn = self.self_attn(h * self.attention_in_multiplier, cos_sin, meta, kv_cache) * self.attention_out_multiplier
        x = x + (ssm + attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class FalconH1ForCausalLM(StatefulHybrid, LlamaForCausalLM):
    state_layers_name = "Mamba2 layers"
    variant = DecoderVariant()  # (biases from attention_bias / mlp_bias, as transformers' Falcon-H1)
    layer_cls = FalconH1DecoderLayer
    checkpoint_renames = FALCON_H1_RENAMES

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return FalconH1MLP(self.config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As the shared decoder's; a ``mamba.mup_vector`` some exports save is skipped (transformers
        holds it as a buffer it never loads: it comes from ``ssm_multipliers``)."""
        return super().load_weights((name, t) for name, t in weights if not name.endswith(".mamba.mup_vector"))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * float(getattr(self.config, "embedding_multiplier", 1.0))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().forward(*args, **kwargs) * float(getattr(self.config, "lm_head_multiplier", 1.0))
