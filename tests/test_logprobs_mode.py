"""vLLM's ``EngineArgs.logprobs_mode`` through the engine, against transformers' logits of the
same tiny model: ``raw_logits`` are the model's logits, ``raw_logprobs`` (the default) their
log_softmax, ``processed_*`` the values the token was drawn from (a sampled request's logits
over its temperature, only its top-k kept; a greedy request's logits after its repetition
penalty, which transformers' own processor applies in the reference)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from vllmini import LLM, BeamSearchParams, EngineArgs, SamplingParams

PROMPT = [504, 3108, 30, 17, 2211]
SAMPLED = SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=6, logprobs=5, ignore_eos=True)
GREEDY = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6, logprobs=5, ignore_eos=True)
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@pytest.fixture(scope="module")
def runs(tiny_dir):
    """Each mode's two outputs (sampled, greedy), generated in one batch."""
    out = {}
    for mode in MODES:
        llm = LLM(str(tiny_dir), logprobs_mode=mode)
        out[mode] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": PROMPT}] * 2, [SAMPLED, GREEDY], use_tqdm=False)]
        del llm
    return out


@pytest.fixture(scope="module")
def hf_logits(tiny_dir, runs):
    """transformers' logits at each output position of the two outputs (the tokens are the same in every mode)."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    logits = []
    for c in runs["raw_logprobs"]:
        with torch.no_grad():
            full = hf(torch.tensor([PROMPT + list(c.token_ids)])).logits[0]
        logits.append(full[len(PROMPT) - 1 : -1])
    return logits


def expected(mode: str, which: int, logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """The values logprobs_mode says, per output position, over the whole vocabulary."""
    if mode.startswith("processed"):
        if which == 0:  # sampled: temperature, then top-k
            logits = logits / SAMPLED.temperature
            kth = logits.topk(SAMPLED.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        else:  # greedy: the repetition penalty over prompt + output so far
            penalty = RepetitionPenaltyLogitsProcessor(GREEDY.repetition_penalty)
            logits = torch.cat([penalty(torch.tensor([PROMPT + tokens[:j]]), logits[j : j + 1].clone())
                                for j in range(len(tokens))])  # fmt: skip
    return logits if mode.endswith("logits") else logits.log_softmax(-1)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_reports_the_values_it_names(runs, hf_logits, mode):
    for which, (c, logits) in enumerate(zip(runs[mode], hf_logits)):
        tokens = list(c.token_ids)
        assert tokens == list(runs["raw_logprobs"][which].token_ids)  # the mode changes what is reported only
        want = expected(mode, which, logits, tokens)
        for j, (token, entry) in enumerate(zip(tokens, c.logprobs)):
            top = want[j].topk(5)
            for value, tid in zip(top.values.tolist(), top.indices.tolist()):
                assert entry[tid].logprob == pytest.approx(value, abs=2e-4), (mode, which, j)
            assert entry[token].logprob == pytest.approx(want[j, token].item(), abs=2e-4)
        assert c.cumulative_logprob == pytest.approx(sum(c.logprobs[j][t].logprob for j, t in enumerate(tokens)), abs=1e-3)
    if mode == "processed_logprobs":  # (the sampled row's values are those of its five kept tokens only)
        assert all(len([e for e in entry.values() if e.logprob > float("-inf")]) <= 6 for entry in runs[mode][0].logprobs)


def test_a_bad_mode_is_refused_and_beam_search_needs_logprobs(tiny_dir):
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of \['raw_logprobs'"):
        EngineArgs(model=str(tiny_dir), logprobs_mode="raw").validate()
    llm = LLM(str(tiny_dir), logprobs_mode="raw_logits")
    with pytest.raises(ValueError, match="beam search needs logprobs: this engine's logprobs_mode is 'raw_logits'"):
        llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=2))
    from vllmini.cli import _engine_args, build_parser

    assert _engine_args(build_parser().parse_args(["serve", "--logprobs-mode", "processed_logits"])).logprobs_mode == "processed_logits"
