"""Mamba2's selective state-space recurrence (the SSD scan), over one sequence or a batch of
single-token decode rows, in float32.

Each head ``h`` keeps a state ``S [P, N]`` (head_dim x d_state). A token with step ``dt > 0``
decays it by ``exp(dt * A_h)`` (``A_h < 0``), writes its input ``x [P]`` along its ``B [N]`` and
reads along its ``C [N]``; ``D_h * x`` skips the state:

    S = exp(dt A) S + dt x B^T;   y = S C + D x

B and C come per group: head ``h`` reads group ``h // (heads / groups)``. One token at a time that
is a loop (decode: one step for the whole batch at once). A prompt is cut into chunks of the
config's ``mamba_chunk_size``: inside a chunk every output is a decayed sum over the chunk's
earlier tokens (a masked matmul), and only the chunk-to-chunk state is sequential.
"""
from __future__ import annotations

import torch


def heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``[..., G, N]`` per group -> ``[..., H, N]`` per head (each group serving ``H/G`` consecutive heads)."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token per row: ``x [R, H, P]``, ``dt [R, H]`` (final: biased, softplus, clamped), ``A, D [H]``,
    ``B, C [R, G, N]``, ``state [R, H, P, N]`` float32. Returns the output ``[R, H, P]`` and the new state."""
    heads = x.shape[1]
    x, dt = x.float(), dt.float()
    B, C = heads_of_groups(B.float(), heads), heads_of_groups(C.float(), heads)
    state = state * (dt * A).exp()[..., None, None] + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return torch.einsum("rhpn,rhn->rhp", state, C) + D[:, None] * x, state


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                state: torch.Tensor | None, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence: ``x [T, H, P]``, ``dt [T, H]``, ``A, D [H]``, ``B, C [T, G, N]``, starting from
    ``state [H, P, N]`` (None: zeros). Returns the output ``[T, H, P]`` (float32) and the state after
    the last token."""
    length, heads, dim = x.shape
    pad = -length % chunk
    x, dt = x.float(), dt.float()
    skip = D[:, None] * x

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [T, K, ...] -> [K, n, chunk, ...], zero padded (dt 0: no write, no decay)
        t = torch.nn.functional.pad(t.movedim(0, -1), (0, pad)).movedim(-1, 1)
        return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])

    groups = B.shape[1]
    per_group = heads // groups

    def by_head(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """A per-group ``[G, n, ...]`` times a per-head ``[H, n, ...]``: each group's heads share it."""
        return (g[:, None] * h.view(groups, per_group, *h.shape[1:])).flatten(0, 1)

    B, C = chunked(B.float()), chunked(C.float())  # [G, n, L, N]
    xdt = chunked(x * dt[..., None])  # [H, n, L, P]: each token's write, scaled by its step
    decay = chunked(dt * A).cumsum(-1)  # [H, n, L]: log of the decay from the chunk's start to each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    between = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    # [H, n, L, L]: how much token j's write reaches token i's read (C B^T once per group)
    inner = by_head(C @ B.transpose(-1, -2), between)
    own = inner @ xdt  # [H, n, L, P]: the chunk's own contribution
    c_read = by_head(C, decay.exp()[..., None])  # reads of the state as it was at the chunk's start
    b_write = by_head(B, (decay[..., -1:] - decay).exp()[..., None])  # writes decayed to the chunk's end
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    s = x.new_zeros(heads, dim, B.shape[-1]) if state is None else state.float()
    out = torch.empty_like(own)
    for c in range(own.shape[1]):
        out[:, c] = own[:, c] + c_read[:, c] @ s.transpose(-1, -2)
        s = s * chunk_decay[:, c] + xdt[:, c].transpose(-1, -2) @ b_write[:, c]
    return out.reshape(heads, -1, dim)[:, :length].transpose(0, 1) + skip, s
