"""Hypothesis strategies for property tests of the sampler and of logits processors.

The sampler is stateless: a batch of logits and one ``SamplingRow`` per row (its parameters and
token history) go in, tokens and logprobs come out, so properties can be checked on drawn
batches without a model or an engine::

    from hypothesis import given
    from vllmini.engine.sampler import Sampler, SamplingTensors
    from vllmini.testing import sampler_batches

    @given(sampler_batches())
    def test_tokens_are_in_the_vocabulary(batch):
        logits, rows = batch
        out = Sampler()(logits, SamplingTensors.from_rows(rows, logits.shape[1]))
        assert ((0 <= out.token_ids) & (out.token_ids < logits.shape[1])).all()

Every drawn row keeps at least one finite logit (a row with none is refused by the sampler as
``invalid``, a different property). Plain logits lie on a 1/8 grid in [-20, 20], which float32,
bfloat16 and float16 all hold exactly, so a float64 reference can be compared with a small slack;
``extreme=True`` draws anything a dtype holds (huge, tiny, its max, -inf) for robustness properties.
Needs ``hypothesis`` (the ``testing`` extra), which vllmini itself does not depend on.
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from vllmini.engine.sampling_params import SamplingParams
from vllmini.engine.sampling_tensors import SamplingRow

__all__ = ["DTYPES", "logits", "sampler_batches", "sampling_params"]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INF = float("inf")


@st.composite
def logits(
    draw: st.DrawFn, *, max_rows: int = 6, max_vocab: int = 48, dtypes: tuple[torch.dtype, ...] = DTYPES,
    extreme: bool = False,
) -> torch.Tensor:  # fmt: skip
    """A ``[rows, vocab]`` logits tensor of one of ``dtypes``, each row with a finite value."""
    dtype = draw(st.sampled_from(dtypes))
    rows, vocab = draw(st.integers(1, max_rows)), draw(st.integers(1, max_vocab))
    if extreme:
        big = torch.finfo(dtype).max
        value = st.one_of(st.floats(-big, big, width=32), st.sampled_from([big, -big, 1e-30, -1e-30, 0.0, 1e4]),
                          st.integers(-20, 20).map(float), st.just(-_INF))  # fmt: skip
    else:
        value = st.one_of(st.integers(-160, 160).map(lambda i: i / 8), st.integers(-3, 3).map(float), st.just(-_INF))
    values = draw(st.lists(st.lists(value, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows))
    for row in values:
        if all(x == -_INF for x in row):
            row[draw(st.integers(0, vocab - 1))] = 0.0
    return torch.tensor(values, dtype=torch.float32).to(dtype)


def sampling_params(*, seeded: bool = True, greedy: bool = True) -> st.SearchStrategy[SamplingParams]:
    """SamplingParams over what the sampler reads: temperature (0, greedy, only with ``greedy``),
    top-k/top-p/min-p (off and on), a seed (with ``seeded``; else none), logprobs and the three
    penalties."""
    temperatures = st.sampled_from([0.05, 0.5, 1.0, 2.0]) | st.floats(0.05, 3.0)
    if greedy:
        temperatures = temperatures | st.just(0.0)
    return st.builds(
        SamplingParams,
        temperature=temperatures,
        top_k=st.sampled_from([0, -1, 1, 2, 3, 5, 50]),
        top_p=st.sampled_from([1.0, 0.5, 0.9]) | st.floats(0.01, 1.0),
        min_p=st.sampled_from([0.0, 0.1]) | st.floats(0.0, 1.0),
        seed=st.integers(0, 2**40) if seeded else st.none(),
        logprobs=st.none() | st.integers(0, 5),
        repetition_penalty=st.sampled_from([1.0, 1.3, 0.7]),
        presence_penalty=st.sampled_from([0.0, 0.5, -1.0]),
        frequency_penalty=st.sampled_from([0.0, 0.3, -0.5]),
    )


@st.composite
def sampler_batches(
    draw: st.DrawFn, *, params: st.SearchStrategy[SamplingParams] | None = None, max_history: int = 6, **logits_kwargs
) -> tuple[torch.Tensor, list[SamplingRow]]:  # fmt: skip
    """``(logits, rows)``: ``logits(**logits_kwargs)`` and one ``SamplingRow`` per row, its
    parameters from ``params`` (default ``sampling_params()``) and prompt and output tokens
    (what the penalties read) drawn from the vocabulary."""
    batch = draw(logits(**logits_kwargs))
    vocab = batch.shape[1]
    history = st.lists(st.integers(0, vocab - 1), max_size=max_history)
    params = params if params is not None else sampling_params()
    rows = [SamplingRow(draw(params), draw(history), draw(history)) for _ in range(batch.shape[0])]
    return batch, rows
