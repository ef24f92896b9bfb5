"""Stateless batched sampler.

Each step the engine builds one ``SamplingTensors`` from the sequences it
samples, in the order of the logits' rows, and calls the sampler::

    rows = [SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids,
                        eos_token_id=tokenizer.eos_token_id, seed_offset=seq.index) for seq in batch]
    out = sampler(logits, SamplingTensors.from_rows(rows, logits.shape[-1], logits.device))
    # out.token_ids[i], out.logprobs[i], out.top_logprobs[0/1][i, :params.logprobs], out.invalid[i]

Every row may use different parameters; the whole batch goes through tensor
ops, the only Python loop being the one-number draw of each seeded row.

Order of operations (as vLLM): logit_bias, then allowed_token_ids and the
bans (bad_words, min_tokens) set to -inf, then the custom logits processors if the engine has
any (engine/logits_processor.py), then penalties (repetition
over prompt + output tokens, presence/frequency over output tokens), then
greedy rows take the argmax; random rows go
through temperature, then min-p and top-k, then top-p over what those leave (vLLM
v1's order; each a per-row threshold on the logits) and are drawn by inverse CDF: one uniform per row against the row's
cumulative sum. Last, a row with a forced token (a thinking budget's end
string: engine/thinking_budget.py) takes it in place of the one it drew; its
logprobs are that token's. A seeded row draws its uniform from a generator seeded with a
hash of (seed, seed_offset, number of output tokens so far), so its tokens do
not depend on the batch it lands in or on its row index.

Why inverse CDF rather than the exponential race (argmax p / Exp(1)): the race
needs V exponentials per row (~260 ms for 256 x 49152 on 2 CPU cores) where the
cumsum costs ~25 ms, and it gives the same batch invariance. Only row-local ops
are used on the token path (max, topk, sort, softmax, cumsum); ``sum`` is not,
because torch splits a single long row across threads and rounds differently.
Cost of the fp32 CDF: a token's probability is off by at most ~1e-7 absolute.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from vllmini.engine.sampling_tensors import SamplingRow, SamplingTensors, row_seed

__all__ = ["LOGPROBS_MODES", "Sampler", "SamplerOutput", "SamplingRow", "SamplingTensors", "apply_penalties", "row_seed"]

_NEG_INF = float("-inf")
_FMAX = torch.finfo(torch.float32).max


@dataclass
class SamplerOutput:
    """Tokens (and logprobs) for one step.

    ``invalid`` marks rows whose logits held NaN or +inf, or no finite value at all:
    their token is meaningless and the engine should finish them with an error.
    Logprob tensors are present for every row when any row asked for logprobs;
    the engine keeps each row's own top ``params.logprobs`` columns."""

    token_ids: Tensor  # [B] long
    logprobs: Tensor | None  # [B] float32: the chosen token's logprob
    top_logprobs: tuple[Tensor, Tensor] | None  # (values [B, N], ids [B, N]), sorted descending
    invalid: Tensor  # [B] bool
    ranks: Tensor | None = None  # [B] long: how many tokens have a logprob >= the chosen one's (vLLM's rank)
    # logprob_token_ids: (logprobs [B, K], ranks [B, K]) of each row's ids (SamplingTensors.logprob_ids)
    id_logprobs: tuple[Tensor, Tensor] | None = None


def apply_penalties(x: Tensor, t: SamplingTensors) -> Tensor:
    """vLLM's penalties on fp32 logits, returned as a new [B, V] tensor (a view).

    Repetition: tokens seen in the prompt or the output are divided by the penalty
    when positive and multiplied by it otherwise. Frequency subtracts penalty x
    count and presence subtracts penalty x (count > 0), over output tokens only.
    Only the seen tokens are touched (gather / scatter over the id tensors), so
    the cost is one copy of the logits; the pad id ``V`` lands in a spare column."""
    B, V = x.shape
    out = t.output_token_ids
    assert out is not None
    ids = out if t.prompt_token_ids is None else torch.cat([t.prompt_token_ids, out], dim=1)
    y = torch.empty(B, V + 1, dtype=torch.float32, device=x.device)
    y[:, :V] = x
    y[:, V] = 0.0
    g = y.gather(1, ids)
    finite = g > _NEG_INF  # (banned tokens stay banned)
    srt = out.sort(dim=-1).values
    count = (torch.searchsorted(srt, ids, right=True) - torch.searchsorted(srt, ids)).to(torch.float32)
    if t.do_repetition:  # every id in ``ids`` was seen in the prompt or the output
        r = t.repetition_penalty[:, None]
        g = torch.where(g > 0, g / r, g * r)
    g = g - t.frequency_penalty[:, None] * count - t.presence_penalty[:, None] * (count > 0)
    # duplicates of an id all carry the same value, so the scatter is deterministic. A finite
    # logit stays finite: an overflow to +inf would turn into NaN later, one to -inf would ban
    # the token (and a row whose other tokens are banned would fall back to its raw logits).
    y.scatter_(1, ids, torch.where(finite, g.clamp(-_FMAX, _FMAX), _NEG_INF))
    return y[:, :V]


# top-p looks for the nucleus among this many best tokens, then (rows it did not settle) among more,
# then in the whole sorted row: topk's cost grows with k (64 rows of 49152: 5.5 ms for 64, 23 ms for
# 1024, 176 ms to sort), and SmolLM2's chat nuclei at top_p 0.9-0.95 hold at most 64 tokens 93-97% of the time
_TOP_P_PREFIXES = (64, 1024)
_TOP_P_PREFIX = _TOP_P_PREFIXES[-1]  # a top-k prefix up to this long is used as it is


def _nucleus(vals: Tensor, probs: Tensor, top_p: Tensor, complete: bool) -> tuple[Tensor, Tensor]:
    """Logit threshold of the smallest sorted prefix with mass >= top_p.

    ``vals``/``probs``: a row's best logits (descending) and their probabilities.
    Returns (threshold, settled); a row is unsettled when its nucleus may extend
    past the prefix. cumsum is prefix-stable, so a longer prefix gives the same answer."""
    hit = probs.cumsum(-1) >= top_p[:, None]
    found = hit.any(-1)
    last = vals.gather(1, hit.int().argmax(-1, keepdim=True)).squeeze(1)  # argmax: first hit
    settled = found | (vals[:, -1] == _NEG_INF) | complete
    return torch.where(found, last, _NEG_INF), settled  # not found but settled: rounding, keep all


def top_p_threshold(z: Tensor, floor: Tensor | None, top_p: Tensor,
                    prefix: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Top-p on the distribution of rows ``z`` (max 0) renormalized over the tokens >= ``floor``
    (what top-k and min-p left), as a logit threshold.

    ``prefix``: (values, ids) of each row's best tokens, descending, when already
    known (from top-k); else the best ``_TOP_P_PREFIXES`` tokens are tried in turn, each
    on the rows the last did not settle (cumsum is prefix-stable: the same threshold)."""
    if floor is not None:
        z = z.masked_fill(z < floor[:, None], _NEG_INF)
    probs = z.softmax(-1)
    V = z.shape[1]
    tau = torch.full(z.shape[:1], _NEG_INF, device=z.device)
    rows: Tensor | None = None  # the rows not settled yet (None: all)

    def pick(v: Tensor) -> Tensor:
        return v if rows is None else v[rows]

    # (on a GPU topk is cheap at any of these k, and each stage's check is a sync: the longest only)
    ks = _TOP_P_PREFIXES if z.device.type == "cpu" else _TOP_P_PREFIXES[-1:]
    tries = [prefix] if prefix is not None else [k for k in ks if k < V]
    for attempt in [*tries, None]:  # None: the whole row, sorted
        if attempt is None:
            vals, ids = pick(z).sort(dim=-1, descending=True)
        else:
            vals, ids = attempt if isinstance(attempt, tuple) else pick(z).topk(attempt, dim=-1)
        if floor is not None:
            vals = vals.masked_fill(vals < pick(floor)[:, None], _NEG_INF)
        found, settled = _nucleus(vals, pick(probs).gather(1, ids), pick(top_p), attempt is None or vals.shape[1] == V)
        tau = found if rows is None else tau.index_copy(0, rows, found)
        if bool(settled.all()):
            break
        left = (~settled).nonzero().squeeze(1)  # flatter distributions: look further
        rows = left if rows is None else rows[left]
    return tau


def truncation_threshold(z: Tensor, top_k: Tensor, top_p: Tensor, log_min_p: Tensor, t: SamplingTensors) -> Tensor:
    """Per-row logit threshold: top-k, top-p and min-p keep exactly the tokens with z >= it.

    ``z`` is temperature-scaled with row max 0, so the max always survives. vLLM v1's
    order: min-p keeps p >= min_p * max p, i.e. z >= log(min_p), and top-k every token
    >= the k-th largest (ties kept); both keep a prefix of the sorted row, so their order
    does not matter. Top-p then keeps the smallest prefix of the distribution they leave,
    renormalized, whose mass reaches top_p, plus ties of its last token."""
    tau = torch.full(z.shape[:1], _NEG_INF, device=z.device)
    best = None
    if t.max_top_k > 0:
        best = z.topk(t.max_top_k, dim=-1)
        kth = best.values.gather(1, (top_k.clamp(min=1) - 1)[:, None]).squeeze(1)
        tau = torch.where(top_k > 0, kth, _NEG_INF)
    if t.do_min_p:
        tau = torch.maximum(tau, log_min_p)
    if t.top_p_rows:
        idx = t.top_p_idx
        assert idx is not None
        reuse = best is not None and t.top_p_rows_have_top_k and t.max_top_k <= _TOP_P_PREFIX
        prefix = (best.values[idx], best.indices[idx]) if reuse else None
        floor = tau[idx] if best is not None or t.do_min_p else None
        tau_p = top_p_threshold(z[idx], floor, top_p[idx], prefix)
        tau = tau.index_copy(0, idx, torch.maximum(tau[idx], tau_p))
    return tau


LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class Sampler:
    """Samples one token per row; keeps no state between calls.

    What the logprobs hold, vLLM's ``logprobs_mode``: ``"raw_logprobs"`` (default, like
    vLLM) is ``log_softmax`` of the model's logits, before bias, bans, penalties,
    temperature and filtering. ``"processed_logprobs"``: logprobs of the distribution the
    token was drawn from (after all of those; filtered tokens are -inf); for greedy rows
    that is ``log_softmax`` of the penalized logits at temperature 1. The ``*_logits``
    modes give the logits themselves at those two points (a random row's processed logits
    are divided by its temperature). ``"raw"`` and ``"processed"`` are short for the
    logprobs modes.

    Rows whose every token is masked (allowed_token_ids, bans, min_tokens) fall back
    to the raw logits (those constraints then cannot all hold)."""

    def __init__(self, logprobs_mode: LogprobsMode | Literal["raw", "processed"] = "raw_logprobs") -> None:
        mode = {"raw": "raw_logprobs", "processed": "processed_logprobs"}.get(logprobs_mode, logprobs_mode)
        if mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = mode

    def __call__(
        self, logits: Tensor, t: SamplingTensors, sync_free: bool = False,
        processors: Callable[[Tensor, bool], Tensor] | None = None,
    ) -> SamplerOutput:  # fmt: skip
        """``sync_free``: never wait for the device to decide whether to mask (NaN rows, rows
        with every token masked): mask unconditionally instead, so that on a GPU the host can
        return before the logits exist (async scheduling). Same result either way.
        ``processors``: custom logits processors (engine/logits_processor_state.py), called
        with the logits after the bias and bans (a copy they may change) and whether every row
        is greedy; they run before the penalties, as vLLM's non-argmax-invariant ones."""
        if logits.dim() != 2 or logits.shape != (t.batch_size, t.vocab_size):
            raise ValueError(
                f"logits must be [{t.batch_size}, {t.vocab_size}] to match the SamplingTensors, "
                f"got {tuple(logits.shape)}"
            )
        raw = logits.to(torch.float32)  # never modified in place: it may alias the caller's tensor
        invalid = ~torch.isfinite(raw.amax(-1))  # NaN, +inf, or no finite value
        if sync_free or bool(invalid.any()):
            raw = raw.masked_fill(invalid[:, None], 0.0)
        x, owned = raw, False  # owned: x may be written in place
        # vLLM's order: logit_bias, allowed_token_ids and bans (min_tokens, bad_words), then penalties.
        # Bans and the allowed mask are written after the bias, so no bias can lift them.
        if t.bias_rows is not None:
            x, owned = x.index_put((t.bias_rows, t.bias_ids), t.bias_values, accumulate=True), True
            x.clamp_(max=_FMAX)  # a large bias must not make +inf (then NaN)
        if t.disallowed is not None:
            x, owned = x.masked_fill(t.disallowed, _NEG_INF), True
        if t.ban_rows is not None:
            x, owned = (x if owned else x.clone()), True
            x.index_put_((t.ban_rows, t.ban_ids), torch.full((), _NEG_INF, device=x.device))
        if processors is not None:
            x, owned = processors(x if owned else x.clone(), not t.random_rows), True
        if t.do_penalties:
            x, owned = apply_penalties(x, t), True
        if owned:
            dead = ~(x.amax(-1) > _NEG_INF)  # every token masked (or NaN, which must never be sampled)
            if sync_free or bool(dead.any()):
                x = torch.where(dead[:, None], raw, x)

        B = x.shape[0]
        R = len(t.random_rows)
        tokens = x.max(-1).indices if R < B else None  # (argmax's first maximum too; 12 against 17 ms for 256 x 49152 here)
        processed = None
        if R:
            every = R == B
            ridx = t.random_idx

            def sub(v: Tensor) -> Tensor:
                return v if every else v[ridx]

            xr = sub(x)
            shift = xr.amax(-1, keepdim=True)
            z = xr - shift
            if t.do_temperature:
                z = z.div_(sub(t.temperature)[:, None])
                shift = shift / sub(t.temperature)[:, None]
            if t.max_top_k > 0 or t.top_p_rows or t.do_min_p:
                tau = truncation_threshold(z, sub(t.top_k), sub(t.top_p), sub(t.log_min_p), t)
                z = z.masked_fill_(z < tau[:, None], _NEG_INF)
            processed_mode = t.num_logprobs is not None and self.logprobs_mode.startswith("processed")
            # the weights exp(z) / sum, through softmax: on a CPU torch.exp takes a slow path for inputs
            # that underflow (the -inf of filtered tokens, anything below -87), 10-50x slower over a vocabulary
            # than softmax's own exp (19 against 2 ms for 64 rows of 49152 here)
            cdf = z.softmax(-1).cumsum_(-1)
            total = cdf[:, -1:]  # ~1
            u = self._uniforms(t, R, x.device)[:, None] * total
            u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
            sampled = torch.searchsorted(cdf, u, right=True).squeeze(1)
            tokens = sampled if every else tokens.index_copy(0, ridx, sampled)
            if processed_mode:  # (the logits as drawn from: z shifted back by the row max / temperature)
                processed = z + shift if self.logprobs_mode == "processed_logits" else z.log_softmax(-1)
        assert tokens is not None
        if t.forced is not None:  # sampled all the same, so that every row draws as it would otherwise
            tokens = tokens.index_put((t.forced[0],), t.forced[1])

        logprobs = top = ranks = id_logprobs = None
        if t.num_logprobs is not None:
            values = self.logprobs_mode.endswith("logits")
            if self.logprobs_mode.startswith("raw"):
                lp = raw if values else raw.log_softmax(-1)
            else:
                lp = x if values else x.log_softmax(-1)
                if processed is not None:
                    lp = processed if R == B else lp.index_copy(0, t.random_idx, processed)
            logprobs = lp.gather(1, tokens[:, None]).squeeze(1)
            ranks = (lp >= logprobs[:, None]).sum(-1, dtype=torch.int32).long()  # (int32 sums: 35 against 63 ms at 256 rows)
            if t.num_logprobs > 0:
                v, i = lp.topk(t.num_logprobs, dim=-1)
                top = (v, i)
            if t.logprob_ids is not None:
                id_logprobs = self._id_logprobs(lp, t.logprob_ids, t.logprob_id_rows)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs, top_logprobs=top, invalid=invalid, ranks=ranks,
                             id_logprobs=id_logprobs)  # fmt: skip

    @staticmethod
    def _id_logprobs(lp: Tensor, ids: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The logprobs of each row's ``logprob_token_ids`` and their true ranks (how many tokens
        are at least as likely), found by one sort of the rows that asked."""
        values = lp.gather(1, ids)
        ascending = lp.index_select(0, rows).sort(dim=-1).values
        ranks = torch.zeros_like(ids)
        ranks[rows] = lp.shape[-1] - torch.searchsorted(ascending, values.index_select(0, rows).contiguous())
        return values, ranks

    @staticmethod
    def _uniforms(t: SamplingTensors, n: int, device: torch.device) -> Tensor:
        """U[0, 1) per random row: seeded rows from their own generator, others shared."""
        seeded = [(j, s) for j, i in enumerate(t.random_rows) if (s := t.seeds[i]) is not None]
        if len(seeded) < n:
            u = torch.rand(n, generator=t.generator, device=device)
        else:
            u = torch.empty(n, device=device)
        for j, s in seeded:  # a fresh generator per call keeps the SamplingTensors reusable
            g = torch.Generator(device=device).manual_seed(s)
            u[j] = torch.rand(1, generator=g, device=device)[0]
        return u
