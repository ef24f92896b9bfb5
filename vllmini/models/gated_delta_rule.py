"""The gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5's linear attention; its short causal
convolution: models/causal_conv.py), over one sequence or a batch of single-token decode rows, in float32.

Per value head the layer keeps a matrix state ``S [Dk, Dv]``. Each token decays it by
``exp(g)``, then writes its value where its key points with a learning rate ``beta`` (the delta
rule: only what the state does not already predict is written), and reads with its query:

    S = exp(g) * S;   S = S + beta * k (v - k^T S);   o = q^T S

One token at a time that is a loop (decode: one step for the whole batch at once). A prompt is
cut into chunks of ``CHUNK`` tokens: inside a chunk the writes are solved together (a triangular
solve, the UT transform of the DeltaNet paper), and only the chunk-to-chunk state is sequential,
so a prefill costs a few matmuls per chunk instead of one small step per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x`` over its L2 norm on the last dim (eps inside the root, as the FLA kernels)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``[..., Hk, Dk]`` as the rule reads them: float32, L2-normalised, each
    key head serving ``Hv / Hk`` consecutive value heads, queries scaled by ``Dk ** -0.5``."""
    q, k = l2_normalized(q.float()), l2_normalized(k.float())
    repeat = num_v_heads // q.shape[-2]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=-2), k.repeat_interleave(repeat, dim=-2)
    return q * q.shape[-1] ** -0.5, k


def delta_rule_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: ``q, k [B, H, Dk]`` (prepared), ``v [B, H, Dv]``, ``g, beta [B, H]``,
    ``state [B, H, Dk, Dv]`` float32. Returns the output ``[B, H, Dv]`` and the new state."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    state = state + k[..., :, None] * ((v.float() - predicted) * beta.float()[..., None])[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence: ``q, k [T, H, Dk]`` (prepared), ``v [T, H, Dv]``, ``g, beta [T, H]``, starting
    from ``state [H, Dk, Dv]`` (None: zeros). Returns the output ``[T, H, Dv]`` (float32) and the
    state after the last token."""
    length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -length % chunk
    # heads first, the sequence cut into [n, chunk] (zero padding: beta 0 writes nothing, g 0 keeps the state)
    q, k, v = (F.pad(x.float().transpose(0, 1), (0, 0, 0, pad)).reshape(heads, -1, chunk, x.shape[-1])
               for x in (q, k, v))  # fmt: skip
    g, beta = (F.pad(x.float().t(), (0, pad)).reshape(heads, -1, chunk) for x in (g, beta))
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay between positions j <= i of a chunk (0 above the diagonal)
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # the writes of a chunk solved together: (I + strictly-lower(beta K K^T decay)) W = beta V (and the
    # decayed keys that read the state before the chunk)
    system = (k_beta @ k.transpose(-1, -2) * between).tril(-1) + torch.eye(chunk, device=q.device)
    values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    old_keys = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    inner = q @ k.transpose(-1, -2) * between  # the chunk's own query-key products, decayed
    q_read = q * decay.exp()[..., None]  # queries reading the state from the chunk's start
    k_write = k * (decay[..., -1:] - decay).exp()[..., None]  # keys decayed to the chunk's end
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    s = q.new_zeros(heads, dk, dv) if state is None else state.float()
    out = torch.empty_like(values)
    for c in range(values.shape[1]):
        new = values[:, c] - old_keys[:, c] @ s  # what the state does not already predict
        out[:, c] = q_read[:, c] @ s + inner[:, c] @ new
        s = s * chunk_decay[:, c] + k_write[:, c].transpose(-1, -2) @ new
    return out.reshape(heads, -1, dv)[:, :length].transpose(0, 1), s
