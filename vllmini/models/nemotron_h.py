"""NVIDIA Nemotron-H hybrids (``NemotronHForCausalLM``: Nemotron-H 8B / 47B / 56B,
NVIDIA-Nemotron-Nano-9B-v2 / 12B-v2, Nemotron-3-Nano-30B-A3B).

Every layer is ONE block, ``x + mixer(norm(x))`` with a single RMSNorm, of the kind ``layer_types``
names (transformers' ``layers_block_type``; older configs' ``hybrid_override_pattern``, one letter a
layer, which transformers turns into it):
- "linear_attention" / ``M``: Mamba2 (models/mamba2.py, a fixed-size state per sequence; its width is
  ``mamba_num_heads * mamba_head_dim``, whatever ``expand`` says; gated norm over ``n_groups`` groups);
- "full_attention" / ``*``: attention without RoPE or biases (the only layers with a paged KV cache);
- "mlp" / ``-``: ``down(relu(up(x))^2)``, no gate;
- "moe" / ``E``: ``n_routed_experts`` such MLPs behind DeepSeek-V3's router (sigmoid scores, choice on
  the scores plus ``e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups,
  weights renormalised and scaled by ``routed_scaling_factor``), run in ``moe_latent_size`` when set
  (``fc1_latent_proj`` in, ``fc2_latent_proj`` out), plus an always-on ``shared_experts`` MLP.
MLP and MoE layers have no cache of any kind (models/hybrid.py). Norms multiply their weight in
float32 before the cast back. The lm_head is never tied (transformers ties nothing here).
Checkpoint names: ``backbone.embeddings``, ``backbone.layers.N.{norm,mixer.*}``, ``backbone.norm_f``,
``lm_head``; experts one tensor each (``mixer.experts.K.up_proj.weight``) or stacked
(``mixer.experts.up_proj``); multi-token-prediction layers (``mtp.*``) are skipped.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllmini.models.base import AttentionMetadata
from vllmini.models.decoder_weights import copy_into
from vllmini.models.deepseek import RouterGate
from vllmini.models.hybrid import StatefulHybrid
from vllmini.models.layers import RMSNorm
from vllmini.models.llama import DecoderAttention, DecoderVariant, LlamaForCausalLM
from vllmini.models.mamba2 import Mamba2Mixer
from vllmini.models.moe import _grouped_linear, grouped_topk

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
_VARIANT = DecoderVariant(qkv_bias=False, o_bias=False, mlp_bias=False)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(mixer|mamba|self_attn|mlp)\.(.+)$")


def layer_kinds(config: Any) -> list[str]:
    """Each layer's block kind: ``layer_types`` (``layers_block_type``), else ``hybrid_override_pattern``."""
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if not kinds:
        pattern = getattr(config, "hybrid_override_pattern", None) or ""
        if set(pattern) - set(PATTERN):
            raise ValueError(f"hybrid_override_pattern may hold only M, *, - and E, got {pattern!r}")
        kinds = [PATTERN[c] for c in pattern]
    kinds = list(kinds)
    if not kinds or set(kinds) - {MAMBA, ATTENTION, MLP, MOE}:
        raise ValueError(f"layer_types (layers_block_type) must name {MAMBA!r}, {ATTENTION!r}, {MLP!r} or {MOE!r} "
                         f"for each layer, got {kinds}")  # fmt: skip
    if ATTENTION not in kinds:
        raise ValueError("layer_types (layers_block_type) has no 'full_attention' layer; vllmini needs at least one")
    return kinds


def mamba_config(config: Any) -> SimpleNamespace:
    """Nemotron-H's Mamba2 settings under the names models/mamba2.py reads (Granite 4.0's)."""
    heads, groups = int(config.mamba_num_heads), int(config.n_groups)
    if groups <= 0 or heads % groups:
        raise ValueError(f"n_groups ({groups}) must divide mamba_num_heads ({heads})")
    act = getattr(config, "mamba_hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"mamba_hidden_act {act!r} is not supported; supported: silu")
    return SimpleNamespace(hidden_size=config.hidden_size, mamba_n_heads=heads, mamba_d_head=int(config.mamba_head_dim),
                           mamba_n_groups=groups, mamba_d_state=int(config.ssm_state_size), mamba_expand=config.expand,
                           hidden_act=act, mamba_chunk_size=int(config.chunk_size), mamba_d_conv=int(config.conv_kernel),
                           time_step_limit=getattr(config, "time_step_limit", None),
                           mamba_proj_bias=bool(getattr(config, "use_bias", False)),
                           mamba_conv_bias=bool(getattr(config, "use_conv_bias", True)),
                           rms_norm_eps=float(config.layer_norm_epsilon))  # fmt: skip


class NemotronHRMSNorm(RMSNorm):
    """The weight multiplied in float32, then the cast back (Llama's RMSNorm casts first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight.float() * self.normalize(x)).to(x.dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class ReluSquaredMLP(nn.Module):
    """``down_proj(relu(up_proj(x))^2)``: Nemotron-H's MLP layers and shared experts (no gate)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class ReluSquaredExperts(nn.Module):
    """The routed experts stacked: ``up_proj [E, I, D]``, ``down_proj [E, D, I]`` (``D``: the latent size or hidden)."""

    def __init__(self, num_experts: int, dim: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, dim), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate_size), requires_grad=False)

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert, ``counts[e]`` of them for expert ``e``, each through its expert."""
        return _grouped_linear(relu2(_grouped_linear(xs, self.up_proj, counts)), self.down_proj, counts)


class NemotronHMoE(nn.Module):
    """The MoE block (checkpoint names under ``mixer.``: ``gate``, ``experts``, ``shared_experts``,
    ``fc1_latent_proj`` / ``fc2_latent_proj``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, bool(getattr(config, "mlp_bias", False))
        self.num_experts, self.top_k = int(config.n_routed_experts), int(config.num_experts_per_tok)
        self.n_group, self.topk_group = int(getattr(config, "n_group", 1) or 1), int(getattr(config, "topk_group", 1) or 1)
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..n_routed_experts ({self.num_experts}), got {self.top_k}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide n_routed_experts ({self.num_experts}) and "
                             f"topk_group ({self.topk_group}) be in 1..n_group")  # fmt: skip
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        self.routed_scaling_factor = float(getattr(config, "routed_scaling_factor", None) or 1.0)
        latent = getattr(config, "moe_latent_size", None)
        if latent is not None and int(latent) <= 0:
            raise ValueError(f"moe_latent_size must be positive (or null), got {latent}")
        self.gate = RouterGate(hidden, self.num_experts, correction_bias=True)
        self.experts = ReluSquaredExperts(self.num_experts, int(latent or hidden), int(config.moe_intermediate_size))
        self.shared_experts = ReluSquaredMLP(hidden, int(config.moe_shared_expert_intermediate_size), bias)
        self.fc1_latent_proj = nn.Linear(hidden, int(latent), bias=bias) if latent else None
        self.fc2_latent_proj = nn.Linear(int(latent), hidden, bias=bias) if latent else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k experts ``[T, k]`` and their weights (float32)."""
        scores = self.gate(x).sigmoid()
        ids = grouped_topk(scores, self.top_k, self.n_group, self.topk_group, self.gate.e_score_correction_bias)
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        rows = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        ys = self.experts(h.index_select(0, rows), counts)
        ys = ys * weights.flatten().index_select(0, order)[:, None].to(ys.dtype)
        routed = torch.zeros_like(h).index_add_(0, rows, ys)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class NemotronHLayer(nn.Module):
    """One block: ``norm``, then its one mixer (``mamba``, ``self_attn`` or ``mlp``), added to the residual."""

    def __init__(self, config: Any, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = NemotronHRMSNorm(config.hidden_size, float(config.layer_norm_epsilon))
        self.self_attn = DecoderAttention(config, _VARIANT, use_rope=False) if kind == ATTENTION else None
        self.mamba: Mamba2Mixer | None = None
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(mamba_config(config), int(config.mamba_num_heads) * int(config.mamba_head_dim))
        self.mlp: nn.Module | None = None
        if kind == MLP:
            self.mlp = ReluSquaredMLP(config.hidden_size, int(config.intermediate_size), bool(getattr(config, "mlp_bias", False)))
        elif kind == MOE:
            self.mlp = NemotronHMoE(config)

    @property
    def state_mixer(self) -> nn.Module | None:
        return self.mamba

    def forward(self, x: torch.Tensor, cos_sin: Any, meta: AttentionMetadata, cache: Any) -> torch.Tensor:
        h = self.norm(x)
        if self.mamba is not None:
            return x + self.mamba(h, meta, cache)
        if self.self_attn is not None:
            return x + self.self_attn(h, cos_sin, meta, cache)
        return x + self.mlp(h)


class NemotronHModel(nn.Module):
    def __init__(self, config: Any, kinds: list[str]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))  # fmt: skip
        self.layers = nn.ModuleList(NemotronHLayer(config, kind) for kind in kinds)
        self.norm = NemotronHRMSNorm(config.hidden_size, float(config.layer_norm_epsilon))


class NemotronHForCausalLM(StatefulHybrid, LlamaForCausalLM):
    state_layers_name = "Mamba2 layers"

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)  # (not Llama's body: Nemotron-H's blocks are its own)
        kinds = layer_kinds(config)
        act = getattr(config, "mlp_hidden_act", "relu2")
        if act != "relu2" and {MLP, MOE} & set(kinds):
            raise ValueError(f"mlp_hidden_act {act!r} is not supported; supported: relu2")
        self.config, self.kinds = config, kinds
        self._shards_seen = {}
        self.model = NemotronHModel(config, kinds)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def tied(self) -> bool:
        return False

    def rope_tables_for(self, positions: torch.Tensor) -> None:
        return None  # (no RoPE anywhere)

    # -- checkpoint names --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Experts into their stacks here; everything else, renamed to ours, through the shared loader
        (which fuses q/k/v)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        self._experts_seen: dict[str, set[int]] = {}

        def rest() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(("mtp.", "backbone.mtp.", "model.mtp.")):
                    continue
                ours = self._our_name(name)
                hit = re.match(r"^(.+\.mlp\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$", ours)
                if hit is not None:
                    target, expert = f"{hit[1]}.{hit[3]}", int(hit[2])
                    param = self._param(params, target, name)
                    if not 0 <= expert < param.shape[0]:
                        raise ValueError(f"checkpoint has expert {expert} but config.json says n_routed_experts={param.shape[0]}")
                    copy_into(param.data[expert], tensor, name)
                    seen = self._experts_seen.setdefault(target, set())
                    seen.add(expert)
                    if len(seen) == param.shape[0]:
                        loaded.add(target)
                elif ".mlp." in ours:  # (our names: kept from the shared loader's q/k/v / gate/up fusing)
                    copy_into(self._param(params, ours, name).data, tensor, name)
                    loaded.add(ours)
                else:
                    yield ours, tensor

        return super().load_weights(rest()) | loaded

    def _our_name(self, name: str) -> str:
        for prefix in ("backbone.", "model.backbone."):  # (the second: a pooling runner's ``model.`` added)
            if name.startswith(prefix):
                name = "model." + name[len(prefix) :]
        name = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"}.get(name, name)
        hit = _LAYER.match(name)
        if hit is None or hit[2] != "mixer" or not int(hit[1]) < len(self.kinds):
            return name
        mixer = {MAMBA: "mamba", ATTENTION: "self_attn"}.get(self.kinds[int(hit[1])], "mlp")
        return f"model.layers.{hit[1]}.{mixer}.{hit[3]}"

    def checkpoint_names(self, param: str) -> list[str]:
        """The released names of the tensors that would fill ``param``."""
        hit = re.match(r"^(.+\.mlp\.experts)\.(up_proj|down_proj)$", param)
        if hit is not None:
            seen = getattr(self, "_experts_seen", {}).get(param, set())
            names = [f"{hit[1]}.{e}.{hit[2]}.weight" for e in range(self.get_parameter(param).shape[0]) if e not in seen]
        else:
            names = super().checkpoint_names(param)
        return [_checkpoint_name(name) for name in names]


def _checkpoint_name(ours: str) -> str:
    """Our parameter name as the releases spell it (``backbone.``, ``mixer.``)."""
    ours = {"model.embed_tokens.weight": "model.embeddings.weight", "model.norm.weight": "model.norm_f.weight"}.get(ours, ours)
    hit = _LAYER.match(ours)
    if hit is not None:
        ours = f"model.layers.{hit[1]}.mixer.{hit[3]}"
    return "backbone." + ours[len("model.") :] if ours.startswith("model.") else ours
