"""Property-based tests of the stateless batched sampler (hypothesis).

Filter properties (top-k/top-p/min-p) use logits on a 1/8 grid in [-20, 20] so that
fp32/bf16/fp16 hold them exactly and a float64 reference can be compared with a
small slack; robustness properties use huge/tiny/-inf logits in every dtype.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllmini.engine.sampler import Sampler, SamplingRow, SamplingTensors, apply_penalties, row_seed
from vllmini.engine.sampling_params import SamplingParams
from vllmini.testing import logits as logits_st
from vllmini.testing import sampling_params as params_st

INF = float("inf")
FAST = settings(deadline=None, max_examples=40)


def rows_for(params, prompts=None, outputs=None, eos=None, offsets=None):
    return [
        SamplingRow(p, prompts[i] if prompts else [], outputs[i] if outputs else [],
                    eos[i] if eos else None, offsets[i] if offsets else 0)
        for i, p in enumerate(params)
    ]  # fmt: skip


def run(logits, params, *, mode="raw", gen=None, **kw):
    t = SamplingTensors.from_rows(rows_for(params, **kw), logits.shape[1], generator=gen)
    return Sampler(mode)(logits, t)


def ref_keep(z: list[float], k: int, p: float, min_p: float) -> set[int]:
    """float64 reference of the kept set in vLLM v1's order: min-p (p >= min_p * max p) and
    top-k (ties kept), then the top-p nucleus (ties kept) of what they leave, renormalized."""
    idx = [i for i, v in enumerate(z) if v > -INF]
    m = max(z[i] for i in idx)
    idx = [i for i in idx if math.exp(z[i] - m) >= min_p]  # p / max p
    if k > 0:
        kth = sorted((z[i] for i in idx), reverse=True)[min(k, len(idx)) - 1]
        idx = [i for i in idx if z[i] >= kth]
    w = {i: math.exp(z[i] - m) for i in idx}
    s = sum(w.values())
    probs = {i: w[i] / s for i in idx}
    if p < 1:
        cum, last = 0.0, None
        for i in sorted(idx, key=lambda i: -probs[i]):
            if cum >= p:
                break
            cum, last = cum + probs[i], probs[i]
        idx = [i for i in idx if probs[i] >= last]
    return set(idx)


def test_min_p_applies_before_top_p_as_in_vllm_v1():
    """vLLM v1 drops the tokens under min_p first, and top-p's nucleus is taken on what is left,
    renormalized: here {1, 2} have mass 0.69 < 0.7 before min-p removes token 0, 1.0 after."""
    z = [0.0, 0.125, 1.25]
    assert ref_keep(z, 0, 0.7, 0.3) == {2}
    for seed in range(40):
        out = run(torch.tensor([z]), [SamplingParams(top_p=0.7, min_p=0.3, seed=seed)])
        assert out.token_ids.item() == 2


# ---------------------------------------------------------------- greedy


@FAST
@given(logits_st(extreme=True))
def test_greedy_is_argmax_any_logits(logits):
    out = run(logits, [SamplingParams(temperature=0)] * logits.shape[0])
    assert torch.equal(out.token_ids, logits.float().argmax(-1))
    assert not out.invalid.any()


@FAST
@given(logits_st(), st.sampled_from([1e-3, 2e-5, 0.0099]), st.integers(0, 2**32))
def test_a_temperature_under_001_samples_as_001(logits, temp, seed):
    """vLLM raises a temperature in (0, 0.01) to 0.01 (dividing by less overflows): such a row
    draws what a 0.01 row with its seed draws, and is not greedy."""
    n = logits.shape[0]
    low = run(logits, [SamplingParams(temperature=temp, seed=seed + i) for i in range(n)])
    hundredth = run(logits, [SamplingParams(temperature=0.01, seed=seed + i) for i in range(n)])
    assert torch.equal(low.token_ids, hundredth.token_ids)
    assert not SamplingParams(temperature=temp).is_greedy


@FAST
@given(logits_st(), st.integers(0, 2**32))
def test_top_k_1_is_greedy(logits, seed):
    out = run(logits, [SamplingParams(top_k=1, temperature=1.5, seed=seed + i) for i in range(logits.shape[0])])
    x = logits.float()
    assert torch.equal(x.gather(1, out.token_ids[:, None]).squeeze(1), x.amax(-1))


# ---------------------------------------------------------------- filters


@settings(deadline=None, max_examples=80)
@given(logits_st(), st.data())
def test_sampled_token_satisfies_top_k_top_p_min_p(logits, data):
    b = logits.shape[0]
    ps = [data.draw(params_st(seeded=data.draw(st.booleans()), greedy=False)) for _ in range(b)]
    ps = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed)
          for p in ps]  # fmt: skip
    out = run(logits, ps, gen=torch.Generator().manual_seed(0))
    x = logits.double()
    for i, p in enumerate(ps):
        z = ((x[i] - x[i].max()) / p.temperature).tolist()
        # slack: the reference's nucleus is a bit larger and its min-p a bit lower than asked
        allowed = ref_keep(z, p.top_k, min(1.0, p.top_p + 1e-3), p.min_p * (1 - 1e-3))
        assert int(out.token_ids[i]) in allowed


@FAST
@given(logits_st(extreme=True), st.data())
def test_masked_tokens_never_drawn(logits, data):
    b = logits.shape[0]
    ps = [data.draw(params_st(seeded=data.draw(st.booleans()))) for _ in range(b)]
    out = run(logits, ps, outputs=[[0, 0]] * b, prompts=[[0]] * b)
    x = logits.float()
    assert not out.invalid.any()
    assert ((out.token_ids >= 0) & (out.token_ids < x.shape[1])).all()
    assert (x.gather(1, out.token_ids[:, None]) > -INF).all()
    if out.logprobs is not None:
        assert torch.isfinite(out.logprobs).all()


def test_top_k_and_top_p_keep_ties_and_the_top_token():
    logits = torch.tensor([[3.0, 3.0, 3.0, 0.0]] * 400)
    out = run(logits, [SamplingParams(top_k=1)] * 400, gen=torch.Generator().manual_seed(1))
    assert set(out.token_ids.tolist()) == {0, 1, 2}  # all three tie with the 1st largest
    logits = torch.tensor([[5.0, 1.0, 0.0]] * 50)
    out = run(logits, [SamplingParams(top_p=1e-6)] * 50, gen=torch.Generator().manual_seed(1))
    assert set(out.token_ids.tolist()) == {0}
    # probs ~ [.45, .16, .16, .16, .06]: the nucleus for 0.5 ends inside the tied group, which is kept whole
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]] * 2000)
    ps = [SamplingParams(top_p=0.5, logprobs=5)] * 2000
    out = run(logits, ps, gen=torch.Generator().manual_seed(1), mode="processed")
    assert set(out.token_ids.tolist()) == {0, 1, 2, 3}
    assert torch.equal(out.top_logprobs[0][0] > -INF, torch.tensor([True] * 4 + [False]))


# ---------------------------------------------------------------- batches, seeds


@FAST
@given(logits_st(max_rows=5), st.data())
def test_each_row_equals_sampling_it_alone(logits, data):
    b = logits.shape[0]
    ps = [data.draw(params_st()) for _ in range(b)]
    prompts = [data.draw(st.lists(st.integers(0, 60), max_size=4)) for _ in range(b)]
    outputs = [data.draw(st.lists(st.integers(0, 60), max_size=4)) for _ in range(b)]
    mode = data.draw(st.sampled_from(["raw", "processed"]))
    out = run(logits, ps, prompts=prompts, outputs=outputs, mode=mode)
    for i in range(b):
        one = run(logits[i : i + 1], [ps[i]], prompts=[prompts[i]], outputs=[outputs[i]], mode=mode)
        assert int(one.token_ids[0]) == int(out.token_ids[i])
        if ps[i].logprobs is not None:
            assert torch.allclose(one.logprobs[0], out.logprobs[i], atol=1e-6, equal_nan=True)


@FAST
@given(logits_st(max_rows=5), st.data())
def test_seeded_rows_are_batch_invariant(logits, data):
    b, v = logits.shape
    ps = [data.draw(params_st()) for _ in range(b)]
    out = run(logits, ps)
    # shuffle the rows and mix in unrelated rows (other logits, unseeded params)
    perm = data.draw(st.permutations(range(b)))
    extra = data.draw(st.integers(0, 3))
    other = torch.randn(extra, v, generator=torch.Generator().manual_seed(extra)).to(logits.dtype)
    logits2 = torch.cat([logits[list(perm)], other])
    ps2 = [ps[j] for j in perm] + [data.draw(params_st(seeded=False)) for _ in range(extra)]
    order = data.draw(st.permutations(range(b + extra)))
    out2 = run(logits2[list(order)], [ps2[j] for j in order])
    pos = {orig: order.index(perm.index(orig)) for orig in range(b)}
    for i in range(b):
        assert int(out2.token_ids[pos[i]]) == int(out.token_ids[i])


def test_batch_invariance_large_vocab():
    # long rows are where torch's reductions may split one row across threads
    v = 50_000
    logits = torch.randn(6, v, generator=torch.Generator().manual_seed(5)) * 3
    logits[1, :40] += 12  # a peaked row: its nucleus lies in the top-1024 prefix
    ps = [SamplingParams(seed=1, top_p=0.95), SamplingParams(seed=2, top_p=0.9, logprobs=3), SamplingParams(seed=3),
          SamplingParams(seed=4, top_k=40, top_p=0.7, temperature=0.7), SamplingParams(temperature=0),
          SamplingParams(seed=6, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.5)]  # fmt: skip
    kw = dict(prompts=[[1, 2, 3]] * 6, outputs=[[4, 5, 5]] * 6)
    out = run(logits, ps, **kw)
    for i in range(6):
        one = run(logits[i : i + 1], [ps[i]], prompts=[[1, 2, 3]], outputs=[[4, 5, 5]])
        assert one.token_ids[0] == out.token_ids[i]
    perm = [3, 5, 0, 4, 2, 1]
    out2 = run(logits[perm], [ps[j] for j in perm], **kw)
    assert out2.token_ids.tolist() == out.token_ids[perm].tolist()


def test_top_p_prefix_and_full_sort_paths_match_reference(monkeypatch):
    """Nuclei found in the best 64 tokens, in the best 1024 (a row of ~300), and only by a
    full sort (a flat row of ~1500), in one batch: each stage runs on the rows the last left."""
    import vllmini.engine.sampler as sampler_module

    widths, real_nucleus = [], sampler_module._nucleus
    monkeypatch.setattr(sampler_module, "_nucleus", lambda vals, *a: widths.append(tuple(vals.shape)) or real_nucleus(vals, *a))
    v = 3000
    g = torch.Generator().manual_seed(7)
    flat = torch.randn(v, generator=g) * 0.5  # nucleus of ~1500 tokens: beyond the prefixes, sorted in full
    peaked = torch.randn(v, generator=g) * 2
    peaked[:30] += 10
    medium = torch.randn(v, generator=g) * 0.5
    medium[:300] += 6  # a nucleus of a few hundred: found among the best 1024
    logits = torch.stack([flat, peaked, flat, peaked, flat, medium])
    ps = [SamplingParams(top_p=0.8), SamplingParams(top_p=0.9), SamplingParams(top_k=2000, top_p=0.6),
          SamplingParams(top_k=20, top_p=0.8), SamplingParams(top_k=5, top_p=0.95, min_p=0.3), SamplingParams(top_p=0.9)]  # fmt: skip
    ps = [SamplingParams(top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=1, logprobs=v) for p in ps]
    out = run(logits, ps, mode="processed")
    assert widths == [(6, 64), (3, 1024), (1, v)]  # every top-p row, the three flatter ones, the flattest
    vals, ids = out.top_logprobs
    for i, p in enumerate(ps):
        z = (logits[i].double() - logits[i].double().max()).tolist()
        support = set(ids[i][vals[i] > -INF].tolist())
        assert support <= ref_keep(z, p.top_k, p.top_p + 1e-4, p.min_p * (1 - 1e-4))
        assert support >= ref_keep(z, p.top_k, p.top_p - 1e-4, p.min_p * (1 + 1e-4))
        assert int(out.token_ids[i]) in support


def test_same_seed_same_tokens_and_steps_differ():
    logits = torch.zeros(1, 1000)
    p = SamplingParams(seed=1234)
    first = [int(run(logits, [p], outputs=[[7] * s]).token_ids[0]) for s in range(12)]
    again = [int(run(logits, [p], outputs=[[7] * s]).token_ids[0]) for s in range(12)]
    assert first == again
    assert len(set(first)) > 6  # the generator moves on with the step
    other = [int(run(logits, [SamplingParams(seed=99)], outputs=[[7] * s]).token_ids[0]) for s in range(12)]
    assert other != first
    sib = [int(run(logits, [p], outputs=[[7] * s], offsets=[1]).token_ids[0]) for s in range(12)]
    assert sib != first  # n > 1 siblings differ


def test_sampling_tensors_reusable_and_sampler_stateless():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    t = SamplingTensors.from_rows(rows_for([SamplingParams(seed=s) for s in (1, 2, 3)]), 500)
    s = Sampler()
    a = s(logits, t).token_ids
    s(torch.randn(5, 500), SamplingTensors.from_rows(rows_for([SamplingParams()] * 5), 500))
    assert torch.equal(a, s(logits, t).token_ids) and torch.equal(a, Sampler()(logits, t).token_ids)
    assert vars(s) == {"logprobs_mode": "raw_logprobs"}


def test_row_seed_mixes_all_inputs():
    base = row_seed(5, 0, 3)
    assert base == row_seed(5, 0, 3)
    assert len({base, row_seed(6, 0, 3), row_seed(5, 1, 3), row_seed(5, 0, 4), row_seed(-5, 0, 3)}) == 5
    assert 0 <= row_seed(-(2**70), 2**65, 10**30) < 2**64


# ---------------------------------------------------------------- penalties, min_tokens


def ref_penalize(z, prompt, output, rep, pres, freq):
    z = list(z)
    for tok in set(prompt) | set(output):
        z[tok] = z[tok] / rep if z[tok] > 0 else z[tok] * rep
    for tok, c in Counter(output).items():
        z[tok] -= freq * c + pres
    return z


@FAST
@given(logits_st(), st.data())
def test_penalties_match_reference(logits, data):
    b, v = logits.shape
    ps = [SamplingParams(repetition_penalty=data.draw(st.floats(0.1, 3)), presence_penalty=data.draw(st.floats(-2, 2)),
                         frequency_penalty=data.draw(st.floats(-2, 2))) for _ in range(b)]  # fmt: skip
    prompts = [data.draw(st.lists(st.integers(0, v - 1), max_size=6)) for _ in range(b)]
    outputs = [data.draw(st.lists(st.integers(0, v - 1), max_size=8)) for _ in range(b)]
    t = SamplingTensors.from_rows(rows_for(ps, prompts=prompts, outputs=outputs), v)
    x = logits.float()
    got = apply_penalties(x, t)
    for i, p in enumerate(ps):
        want = ref_penalize(x[i].tolist(), prompts[i], outputs[i], p.repetition_penalty, p.presence_penalty,
                            p.frequency_penalty)  # fmt: skip
        touched = set(prompts[i]) | set(outputs[i])
        for tok in range(v):
            if tok not in touched:
                assert got[i, tok].item() == x[i, tok].item()  # untouched tokens are exactly unchanged
            elif want[tok] == -INF:
                assert got[i, tok].item() == -INF
            else:
                assert got[i, tok].item() == pytest.approx(want[tok], rel=1e-5, abs=1e-5)


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1]])
    assert run(logits, [SamplingParams(temperature=0)], outputs=[[0]]).token_ids.item() == 0
    assert run(logits, [SamplingParams(temperature=0, presence_penalty=0.2)], outputs=[[0]]).token_ids.item() == 1
    assert run(logits, [SamplingParams(temperature=0, frequency_penalty=0.06)], outputs=[[0, 0]]).token_ids.item() == 1
    # repetition counts the prompt too, and multiplies negative logits
    assert run(logits, [SamplingParams(temperature=0, repetition_penalty=1.1)], prompts=[[0]]).token_ids.item() == 1
    neg = torch.tensor([[-1.0, -1.05]])
    assert run(neg, [SamplingParams(temperature=0, repetition_penalty=1.2)], prompts=[[0]]).token_ids.item() == 1
    # presence/frequency ignore the prompt
    assert run(logits, [SamplingParams(temperature=0, presence_penalty=2)], prompts=[[0]]).token_ids.item() == 0


def test_a_penalty_overflow_stays_finite():
    """A penalty pushing a logit past float32's range clamps it to +-max: an overflow to -inf
    would ban the token (here the only allowed one, and the row would fall back to its raw
    logits), one to +inf would make NaN. A token banned before the penalties stays banned."""
    fmax = torch.finfo(torch.float32).max
    logits = torch.tensor([[5.0, -1e30, 3e30]])
    p = SamplingParams(temperature=0, repetition_penalty=1e20, allowed_token_ids=[1])
    assert run(logits, [p], prompts=[[1]]).token_ids.item() == 1
    t = SamplingTensors.from_rows(rows_for([SamplingParams(repetition_penalty=1e20)], prompts=[[0, 1, 2]]), 3)
    assert apply_penalties(logits, t)[0, 1].item() == -fmax
    t = SamplingTensors.from_rows(rows_for([SamplingParams(repetition_penalty=1e-20)], prompts=[[2]]), 3)
    assert apply_penalties(logits, t)[0, 2].item() == fmax
    t = SamplingTensors.from_rows(rows_for([SamplingParams(repetition_penalty=2.0, frequency_penalty=-2.0)],
                                           outputs=[[0, 1]]), 2)  # fmt: skip
    assert apply_penalties(torch.tensor([[-INF, 1.0]]), t)[0, 0].item() == -INF


@FAST
@given(st.integers(0, 5), st.integers(0, 5), st.booleans(), st.booleans())
def test_min_tokens_masks_eos_and_stop_ids(min_tokens, generated, ignore_eos, greedy):
    # token 3 is EOS and token 2 a stop id; both dominate the logits
    logits = torch.tensor([[0.0, 0.5, 9.0, 10.0, -INF, 1.0]])
    p = SamplingParams(temperature=0 if greedy else 1, top_k=0 if greedy else 2, min_tokens=min_tokens,
                       stop_token_ids=[2], ignore_eos=ignore_eos, seed=1)  # fmt: skip
    tok = run(logits, [p], outputs=[[1] * generated], eos=[3]).token_ids.item()
    if generated >= min_tokens:
        assert tok in (2, 3)
    elif ignore_eos:
        assert tok == 3
    else:
        assert tok == 5 if greedy else tok in (1, 5)


def test_fully_masked_row_falls_back_to_raw_argmax():
    logits = torch.tensor([[-INF, 1.0, -INF], [0.0, 1.0, 2.0]])
    ps = [SamplingParams(min_tokens=3, stop_token_ids=[1], seed=0), SamplingParams(temperature=0)]
    out = run(logits, ps, eos=[None, None])
    assert out.token_ids.tolist() == [1, 2] and not out.invalid.any()


# ---------------------------------------------------------------- logprobs


@FAST
@given(logits_st(extreme=True), st.data())
def test_raw_logprobs(logits, data):
    b, v = logits.shape
    ps = [data.draw(params_st()) for _ in range(b)]
    n = data.draw(st.integers(0, v + 2))
    ps[0] = SamplingParams(temperature=ps[0].temperature, seed=1, logprobs=n, repetition_penalty=2.0, min_tokens=1)
    # penalties and min_tokens act, but raw logprobs ignore them
    out = run(logits, ps, prompts=[[0]] * b, outputs=[[v - 1, v - 1]] * b, eos=[0] * b)
    lsm = logits.float().log_softmax(-1)
    assert torch.equal(out.logprobs, lsm.gather(1, out.token_ids[:, None]).squeeze(1))
    assert torch.isfinite(out.logprobs).all() and (out.logprobs <= 0).all()
    assert torch.allclose(lsm.logsumexp(-1), torch.zeros(b), atol=1e-5)
    k = max(p.logprobs for p in ps if p.logprobs is not None)
    if min(k, v) == 0:
        assert out.top_logprobs is None
    else:
        vals, ids = out.top_logprobs
        assert vals.shape == (b, min(k, v))
        assert (vals[:, :-1] >= vals[:, 1:]).all()
        assert torch.equal(vals, lsm.gather(1, ids))
        assert torch.equal(vals[:, 0], lsm.amax(-1))


@FAST
@given(logits_st(), st.data())
def test_processed_logprobs_are_the_sampled_distribution(logits, data):
    b, v = logits.shape
    ps = [data.draw(params_st()) for _ in range(b)]
    ps = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed,
                         logprobs=v) for p in ps]  # fmt: skip
    out = run(logits, ps, mode="processed")
    vals, ids = out.top_logprobs  # the whole distribution, sorted
    assert torch.allclose(vals.logsumexp(-1), torch.zeros(b), atol=1e-4)
    assert torch.isfinite(out.logprobs).all() and (out.logprobs <= 0).all()
    for i, p in enumerate(ps):
        if p.is_greedy:
            assert torch.allclose(vals[i], logits[i].float().log_softmax(-1)[ids[i]], atol=1e-6, equal_nan=True)
            continue
        z = ((logits[i].double() - logits[i].double().max()) / p.temperature).tolist()
        support = set(ids[i][vals[i] > -INF].tolist())
        assert support <= ref_keep(z, p.top_k, min(1.0, p.top_p + 1e-3), p.min_p * (1 - 1e-3))
        assert support >= ref_keep(z, p.top_k, max(1e-9, p.top_p - 1e-3), min(1.0, p.min_p * (1 + 1e-3) + 1e-9))


@FAST
@given(logits_st(), st.data())
def test_the_four_logprobs_modes_are_one_draw_seen_at_two_points(logits, data):
    """vLLM's logprobs_mode: the same tokens in every mode; raw_logits are the model's logits and
    raw_logprobs their log_softmax; processed_logprobs are processed_logits normalized, and a
    random row's processed logits are its logits over its temperature where kept, -inf elsewhere
    (no penalties here, so the processing is temperature and filtering)."""
    b, v = logits.shape
    drawn = [data.draw(params_st()) for _ in range(b)]
    ps = [SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=p.seed,
                         logprobs=v) for p in drawn]  # fmt: skip
    outs = {m: run(logits, ps, mode=m) for m in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")}
    for out in outs.values():
        assert torch.equal(out.token_ids, outs["raw_logprobs"].token_ids)

    def full(out):  # each row's values over the whole vocabulary, by token id
        vals, ids = out.top_logprobs
        return torch.empty_like(vals).scatter_(1, ids, vals)

    x = logits.float()
    x = x.masked_fill(~torch.isfinite(x.amax(-1))[:, None], 0.0)  # (a row without a finite max reads as zeros)
    assert torch.equal(full(outs["raw_logits"]), x)
    assert torch.allclose(full(outs["raw_logprobs"]), x.log_softmax(-1), atol=1e-5)
    pl, pp = full(outs["processed_logits"]), full(outs["processed_logprobs"])
    assert torch.allclose(pp, pl - pl.logsumexp(-1, keepdim=True), atol=1e-4, equal_nan=True)
    for i, p in enumerate(ps):
        if p.is_greedy:
            assert torch.equal(pl[i], x[i])
        else:
            kept = pl[i] > -INF
            assert kept[outs["raw_logprobs"].token_ids[i]]
            assert torch.allclose(pl[i][kept], x[i][kept] / p.temperature, rtol=1e-5, atol=1e-5)
        for mode in ("raw_logits", "processed_logits"):  # the sampled token's value is its own
            assert outs[mode].logprobs[i] == full(outs[mode])[i, outs[mode].token_ids[i]]


# ---------------------------------------------------------------- bad input, API edges


@pytest.mark.parametrize("u,want", [(0.0, [1, 2]), (1.0, [3, 2])])
def test_inverse_cdf_edges_never_pick_masked_tokens(monkeypatch, u, want):
    # u = 0 must skip leading zero-probability tokens; u = 1 (outside [0, 1)) must not run past the last kept one
    monkeypatch.setattr(Sampler, "_uniforms", staticmethod(lambda t, n, device: torch.full((n,), u)))
    logits = torch.tensor([[-INF, 0.0, 1.0, 0.5, -INF], [-INF, -INF, 5.0, -INF, -INF]])
    out = run(logits, [SamplingParams(), SamplingParams(top_k=3)])
    assert out.token_ids.tolist() == want



def test_invalid_rows_are_flagged_and_others_unaffected():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    logits[1, 7] = float("nan")
    logits[2, 9] = INF
    logits[3] = -INF
    ps = [SamplingParams(seed=i, logprobs=2, top_p=0.9) for i in range(5)]
    out = run(logits, ps)
    assert out.invalid.tolist() == [False, True, True, True, False]
    for i in (0, 4):
        assert out.token_ids[i] == run(logits[i : i + 1], [ps[i]]).token_ids[0]
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.top_logprobs[0]).all()


def test_input_logits_not_modified_and_shape_checked():
    logits = torch.randn(4, 30)
    copy = logits.clone()
    ps = [SamplingParams(temperature=0.7, top_k=3, top_p=0.8, min_p=0.1, repetition_penalty=1.5, min_tokens=2, seed=1)]
    run(logits, ps * 4, outputs=[[1, 2]] * 4, prompts=[[3]] * 4, eos=[0] * 4)
    assert torch.equal(logits, copy)
    t = SamplingTensors.from_rows(rows_for(ps * 4), 30)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.randn(4, 31), t)
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler("sorted")


def test_from_rows_flags_and_clamps():
    ps = [SamplingParams(temperature=0, top_k=5, logprobs=3), SamplingParams(top_k=99, logprobs=50), SamplingParams()]
    t = SamplingTensors.from_rows(rows_for(ps, prompts=[[1, 99, -1]] * 3, outputs=[[]] * 3), 10)
    assert t.random_rows == [1, 2] and t.greedy.tolist() == [True, False, False]
    assert t.top_k.tolist() == [0, 10, 0] and t.max_top_k == 10 and t.num_logprobs == 10
    assert not t.do_penalties and t.output_token_ids is None and t.top_p_rows == [] and not t.do_min_p
    assert t.seeds == [None, None, None] and t.bias_rows is None and t.ban_rows is None and t.disallowed is None
    t = SamplingTensors.from_rows(rows_for([SamplingParams(repetition_penalty=2.0, seed=4)], prompts=[[1, 99, -1]]), 10)
    assert t.prompt_token_ids.tolist() == [[1, 10, 10]] and t.seeds[0] is not None  # out-of-vocab ids dropped
    with pytest.raises(ValueError):
        SamplingTensors.from_rows([], 10)


# ---------------------------------------------------------------- distribution


LOGITS = [2.0, 1.5, 1.0, 0.2, -0.5, -1.0]
N = 20000
BOUND = 30.0  # chi-square, df <= 5: p ~ 1e-5


def ref_dist(z, temp, k, p, min_p):
    z = [v / temp for v in z]
    keep = ref_keep(z, k, p, min_p)
    w = {i: math.exp(z[i]) for i in keep}
    s = sum(w.values())
    return [w.get(i, 0.0) / s for i in range(len(z))]


def chi2(counts, probs):
    return sum((c - N * q) ** 2 / (N * q) for c, q in zip(counts, probs) if q > 0)


@pytest.mark.parametrize(
    "temp,k,p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (2.5, 0, 1.0, 0.0), (1.0, 3, 1.0, 0.0), (0.7, 0, 0.8, 0.0),
     (1.0, 0, 1.0, 0.3), (1.3, 4, 0.9, 0.1)],
)  # fmt: skip
def test_empirical_distribution_matches_softmax(temp, k, p, min_p):
    params = SamplingParams(temperature=temp, top_k=k, top_p=p, min_p=min_p)
    logits = torch.tensor([LOGITS]).expand(N, -1)
    out = run(logits, [params] * N, gen=torch.Generator().manual_seed(42))
    counts = torch.bincount(out.token_ids, minlength=len(LOGITS)).tolist()
    want = ref_dist(LOGITS, temp, k, p, min_p)
    assert all(c == 0 for c, q in zip(counts, want) if q == 0)  # truncated tokens never drawn
    assert chi2(counts, want) < BOUND
    # the test has power: plain softmax (T = 1, no truncation) would be rejected
    plain = ref_dist(LOGITS, 1.0, 0, 1.0, 0.0)
    if plain != want:
        assert chi2(counts, plain) > 100


def test_min_p_below_float32_range_still_filters():
    """min_p = 5e-324 (hypothesis found it) rounds to 0 in float32, which would switch the filter
    off; its log is taken in double instead, so tokens below it stay out of the support."""
    logits = torch.tensor([[0.0, 17.375, -20.0, 0.0]])
    p = SamplingParams(temperature=0.05, min_p=5e-324, seed=0, logprobs=4)
    out = run(logits, [p], mode="processed")
    vals, ids = out.top_logprobs
    support = set(ids[0][vals[0] > -INF].tolist())
    z = ((logits[0].double() - logits[0].double().max()) / p.temperature).tolist()
    assert support == ref_keep(z, 0, 1.0, 5e-324) == {0, 1, 3}  # z(token 2) = -747.5 < log(5e-324) = -744.4
