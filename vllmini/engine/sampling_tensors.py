"""What the sampler reads each step: one ``SamplingTensors`` built from the rows it samples.

``SamplingRow`` is what the engine knows about one sequence; ``SamplingTensors.from_rows``
turns a batch of them into per-row tensors (two host->device copies for the parameters) plus
the flags and index lists that let the sampler skip work no row needs. Seeded rows carry a
per-step seed (``row_seed``), so the tensors hold no generator state and can be reused.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vllmini.engine.sampling_params import SamplingParams

_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def row_seed(seed: int, seed_offset: int, step: int) -> int:
    """The generator seed of a seeded row at one step: a hash of its inputs only.

    ``seed_offset`` separates the n sequences of one request (n > 1), ``step`` is
    the number of tokens the sequence has generated so far. Seeds are taken
    modulo 2**64."""
    h = _splitmix64(seed & _M64)
    h = _splitmix64(h ^ (seed_offset & _M64))
    return _splitmix64(h ^ (step & _M64))


@dataclass(frozen=True)
class SamplingRow:
    """What the engine knows about one sequence it samples this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_id: int | Sequence[int] | None = None
    seed_offset: int = 0  # index of the sequence within its request when n > 1
    bad_words_token_ids: Sequence[Sequence[int]] = ()  # params.bad_words, tokenized by the engine
    forced_token_id: int | None = None  # the token this row must sample (a thinking budget's end: engine/thinking_budget.py)


def banned_tokens(row: SamplingRow, vocab_size: int) -> list[int]:
    """The tokens min_tokens and bad_words ban for one row at this step (they depend on the
    output so far)."""
    p, out = row.params, row.output_token_ids
    if len(out) >= p.min_tokens and not row.bad_words_token_ids:
        return []  # the common row
    banned: set[int] = set()
    if len(out) < p.min_tokens:
        banned.update(p.stop_token_ids)
        if not p.ignore_eos and row.eos_token_id is not None:
            eos = row.eos_token_id
            banned.update([eos] if isinstance(eos, int) else eos)
    for word in row.bad_words_token_ids:
        # the output ends with all of the word but its last token (nothing to match for one token)
        head = len(word) - 1
        if head == 0 or (len(out) >= head and list(out[len(out) - head :]) == list(word[:head])):
            banned.add(word[-1])
    return sorted(t for t in banned if 0 <= t < vocab_size)


def to_device(t: Tensor, device: torch.device | str) -> Tensor:
    """A host tensor on ``device``. On CUDA the copy goes through pinned memory and does not
    wait for the GPU: the step's forward may still be running while the sampler's inputs (and
    the engine's row indices) are built, and a plain copy from pageable memory would stall the
    host until it ends."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _padded(seqs: list[Sequence[int]], pad: int, device: torch.device | str) -> Tensor:
    """[B, L] long tensor padded with ``pad``; ids outside [0, pad) become ``pad``."""
    width = max(1, max(len(s) for s in seqs))
    t = torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)
    return to_device(torch.where((t < 0) | (t > pad), pad, t), device)


def _disallowed(params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str) -> Tensor | None:
    """[B, V] bool, True for the tokens a row's allowed_token_ids leave out (None: no row has them)."""
    limited = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not limited:
        return None
    pairs = [(i, t) for i in limited for t in params[i].allowed_token_ids if 0 <= t < vocab_size]
    # one copy: the limited rows, then the (row, token) pairs they keep
    idx = to_device(torch.tensor(limited + [i for i, _ in pairs] + [t for _, t in pairs], dtype=torch.long), device)
    rows, keep_rows, keep_ids = idx.split([len(limited), len(pairs), len(pairs)])
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    mask[rows] = True
    mask[keep_rows, keep_ids] = False
    return mask


@dataclass
class SamplingTensors:
    """Per-row sampling state for one step; build it with ``from_rows``.

    Greedy rows hold temperature 1 and disabled filters (they take the argmax).
    Token-id tensors are padded with ``vocab_size``, a bin the penalties drop.
    The ``do_*`` flags and index lists let the sampler skip work no row needs;
    skipping never changes a row's result. Nothing in it is consumed by a call
    (seeded rows hold seeds, not generators), so it may be sampled again.
    ``generator`` (unseeded rows) must live on ``device``; seeded draws are
    reproducible per device type (CPU and CUDA generators differ)."""

    vocab_size: int
    greedy: Tensor  # [B] bool
    temperature: Tensor  # [B] float32
    top_k: Tensor  # [B] long, 0 = off, else clamped to vocab_size
    top_p: Tensor  # [B] float32
    log_min_p: Tensor  # [B] float32, log(min_p) taken in double (a min_p that float32 rounds to 0 still filters); -inf = off
    repetition_penalty: Tensor  # [B] float32
    presence_penalty: Tensor  # [B] float32
    frequency_penalty: Tensor  # [B] float32
    prompt_token_ids: Tensor | None  # [B, Lp] long; only when a row has repetition_penalty != 1
    output_token_ids: Tensor | None  # [B, Lo] long; only when a row has any penalty
    bias_rows: Tensor | None  # [K] long: logits[bias_rows[k], bias_ids[k]] += bias_values[k] (logit_bias)
    bias_ids: Tensor | None  # [K] long
    bias_values: Tensor | None  # [K] float32
    ban_rows: Tensor | None  # [K'] long: logits[ban_rows[k], ban_ids[k]] = -inf (min_tokens, bad_words)
    ban_ids: Tensor | None  # [K'] long
    disallowed: Tensor | None  # [B, V] bool: True where a row's allowed_token_ids leave a token out
    seeds: list[int | None]  # [B] per-step generator seeds (row_seed); seeded random rows only
    random_rows: list[int]  # indices of non-greedy rows
    top_p_rows: list[int]  # positions within random_rows whose top_p < 1
    top_p_rows_have_top_k: bool  # every top-p row also has top-k (its nucleus lies in the top-k prefix)
    max_top_k: int  # largest enabled top_k among random rows (0 = none)
    do_penalties: bool
    do_repetition: bool
    do_min_p: bool
    do_temperature: bool  # some random row has temperature != 1
    num_logprobs: int | None  # max logprobs over rows; None = no row asked
    generator: torch.Generator | None = None  # for unseeded rows; None = torch's default
    # random_rows and top_p_rows on the device (built with the rest, so that indexing with them
    # never copies from the host mid-sampler, which on a GPU waits for the forward)
    random_idx: Tensor | None = None  # only when some rows are greedy and some not
    top_p_idx: Tensor | None = None
    # logprob_token_ids: each row's ids, padded with 0 ([B, K] long), and the rows that asked
    logprob_ids: Tensor | None = None
    logprob_id_rows: Tensor | None = None
    # rows whose token is decided already (forced_token_id): [2, K] long, their rows then their tokens
    forced: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seeds)

    def put_in_flight(self, tokens: Tensor, columns: list[int]) -> None:
        """Async scheduling: row i's last output token (``tokens[i]``, still on the device) is
        written at ``columns[i]`` of ``output_token_ids``, where the row holds a placeholder,
        so that penalties count it without the host waiting for it."""
        if self.output_token_ids is None:
            return  # no row has a penalty
        idx = to_device(torch.tensor([list(range(len(columns))), columns], dtype=torch.long), tokens.device)
        self.output_token_ids.index_put_((idx[0], idx[1]), tokens)

    @classmethod
    def from_rows(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> SamplingTensors:
        """Build the step's tensors; ``vocab_size`` is the logits' last dimension."""
        if not rows:
            raise ValueError("from_rows needs at least one row")
        V = vocab_size
        ps = [r.params for r in rows]
        greedy = [p.is_greedy for p in ps]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        temperature = [1.0 if g else p.temperature for p, g in zip(ps, greedy)]
        top_k = [0 if g or p.top_k <= 0 else min(p.top_k, V) for p, g in zip(ps, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(ps, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(ps, greedy)]
        rep = [p.repetition_penalty for p in ps]
        pres = [p.presence_penalty for p in ps]
        freq = [p.frequency_penalty for p in ps]
        do_repetition = any(r != 1.0 for r in rep)
        do_penalties = do_repetition or any(pres) or any(freq)

        ban_rows: list[int] = []
        ban_ids: list[int] = []
        bias_rows: list[int] = []
        biases: list[tuple[int, float]] = []
        for i, r in enumerate(rows):
            banned = banned_tokens(r, V)
            ban_rows += [i] * len(banned)
            ban_ids += banned
            row_bias = [(t, b) for t, b in (r.params.logit_bias or {}).items() if 0 <= t < V]
            bias_rows += [i] * len(row_bias)
            biases += row_bias

        seeds = [
            None if g or r.params.seed is None
            else row_seed(r.params.seed, r.seed_offset, len(r.output_token_ids))
            for r, g in zip(rows, greedy)
        ]

        asked = [p.logprobs for p in ps if p.logprobs is not None]
        id_lists = [p.logprob_token_ids or [] for p in ps]
        id_rows = [i for i, ids in enumerate(id_lists) if ids]
        if id_rows:  # their chosen token's logprob too
            asked.append(0)
        top_p_rows = [j for j, i in enumerate(random_rows) if top_p[i] < 1.0]
        forced = [(i, r.forced_token_id) for i, r in enumerate(rows) if r.forced_token_id is not None]

        # per-row parameters in two copies (one per dtype), not one per field
        log_min_p = [math.log(m) if m > 0 else -math.inf for m in min_p]
        floats = to_device(
            torch.tensor([temperature, top_p, log_min_p, rep, pres, freq], dtype=torch.float32), device
        )
        ints = to_device(torch.tensor([top_k, greedy], dtype=torch.long), device)
        bans = to_device(torch.tensor([ban_rows, ban_ids], dtype=torch.long), device) if ban_rows else None
        bias_idx = to_device(torch.tensor([bias_rows, [t for t, _ in biases]], dtype=torch.long), device) if biases else None
        return cls(
            vocab_size=V,
            greedy=ints[1].bool(),
            temperature=floats[0],
            top_k=ints[0],
            top_p=floats[1],
            log_min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            prompt_token_ids=_padded([r.prompt_token_ids for r in rows], V, device) if do_repetition else None,
            output_token_ids=_padded([r.output_token_ids for r in rows], V, device) if do_penalties else None,
            bias_rows=None if bias_idx is None else bias_idx[0],
            bias_ids=None if bias_idx is None else bias_idx[1],
            bias_values=to_device(torch.tensor([b for _, b in biases], dtype=torch.float32), device) if biases else None,
            ban_rows=None if bans is None else bans[0],
            ban_ids=None if bans is None else bans[1],
            disallowed=_disallowed(ps, V, device),
            seeds=seeds,
            random_rows=random_rows,
            top_p_rows=top_p_rows,
            top_p_rows_have_top_k=all(top_k[i] > 0 for i in random_rows if top_p[i] < 1.0),
            max_top_k=max((top_k[i] for i in random_rows), default=0),
            do_penalties=do_penalties,
            do_repetition=do_repetition,
            do_min_p=any(min_p[i] > 0.0 for i in random_rows),
            do_temperature=any(temperature[i] != 1.0 for i in random_rows),
            num_logprobs=min(max(asked), V) if asked else None,
            generator=generator,
            random_idx=to_device(torch.tensor(random_rows), device) if 0 < len(random_rows) < len(rows) else None,
            top_p_idx=to_device(torch.tensor(top_p_rows), device) if top_p_rows else None,
            logprob_ids=_padded(id_lists, V, device).clamp_(max=V - 1) if id_rows else None,
            logprob_id_rows=to_device(torch.tensor(id_rows), device) if id_rows else None,
            forced=to_device(torch.tensor(forced, dtype=torch.long).T.contiguous(), device) if forced else None,
        )
