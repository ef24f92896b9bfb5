"""vLLM's scheduler and cache knobs: ``long_prefill_token_threshold`` (a sequence computes at most
that many tokens a step, so one long prompt cannot take a step's whole budget) and
``num_gpu_blocks_override`` (the KV cache has exactly that many blocks: preemption on demand).
Outputs stay exact under both and nothing leaks."""
from __future__ import annotations

import pytest
from test_engine import assert_no_leaks

from vllmini import LLM, EngineArgs, SamplingParams
from vllmini.kv.block_manager import BlockManager
from vllmini.scheduler.scheduler import Scheduler, SchedulerConfig
from vllmini.scheduler.sequence import Sequence

PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 900 + 5 for j in range(n)]} for i, n in enumerate([70, 9, 33, 120])]


def _seq(i: int, n_tokens: int) -> Sequence:
    return Sequence(i, f"r{i}", list(range(100 * i, 100 * i + n_tokens)), None, 8, arrival_time=float(i))


def test_a_long_prompt_leaves_budget_to_the_others():
    """Budget 64: without a threshold the 100-token prompt takes the whole first step; with 16,
    both prompts prefill side by side, 16 tokens each a step, and a decode row is never capped
    below its one token."""
    steps = {}
    for threshold in (0, 16):
        sched = Scheduler(SchedulerConfig(8, 64, 512, long_prefill_token_threshold=threshold), BlockManager(64, 16))
        sched.add(_seq(0, 100))
        sched.add(_seq(1, 20))
        plan = []
        while sched.running or sched.waiting:
            out = sched.schedule()
            plan.append([(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled])
            sched.update_computed(out)
            for s in out.scheduled:
                if s.seq.num_computed_tokens == s.seq.num_tokens:  # prompt done: finish it
                    sched.finish(s.seq, s.seq.status)
        steps[threshold] = plan
    assert steps[0][:2] == [[(0, 64)], [(0, 36), (1, 20)]]
    assert steps[16][:2] == [[(0, 16), (1, 16)], [(0, 16), (1, 4)]]
    assert sum(n for step in steps[16] for i, n in step if i == 0) == 100


def test_outputs_are_unchanged(tiny_dir):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    plain = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    del plain
    capped = LLM(model=str(tiny_dir), kv_cache_memory=1 << 24, long_prefill_token_threshold=8)
    got = capped.generate(PROMPTS, params, use_tqdm=False)
    assert capped.llm_engine.scheduler.stats.num_chunked_prefills >= 70 // 8 + 120 // 8
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-5 for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
                   for t in x)  # fmt: skip
    assert_no_leaks(capped)


def test_num_gpu_blocks_override_sets_the_cache_and_forces_preemption(tiny_dir):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=str(tiny_dir)).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(model=str(tiny_dir), num_gpu_blocks_override=12)  # 192 slots: the 4 sequences need 372
    assert llm.llm_engine.num_blocks == 12 and llm.llm_engine.block_manager.num_blocks == 12
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0
    assert_no_leaks(llm)


@pytest.mark.parametrize("field, value, message", [
    ("long_prefill_token_threshold", -1, r"long_prefill_token_threshold must be an integer >= 0 \(0: no cap\), got -1"),
    ("long_prefill_token_threshold", 2.5, r"long_prefill_token_threshold must be an integer >= 0"),
    ("num_gpu_blocks_override", 0, r"num_gpu_blocks_override must be a positive integer, got 0"),
    ("num_gpu_blocks_override", True, r"num_gpu_blocks_override must be a positive integer, got True"),
])  # fmt: skip
def test_bad_values_are_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**{field: value}).validate()


def test_a_request_larger_than_the_overridden_cache_names_the_override(tiny_dir):
    llm = LLM(model=str(tiny_dir), num_gpu_blocks_override=2)  # 32 slots
    with pytest.raises(ValueError, match=r"more than the whole KV cache \(32 tokens\); raise num_gpu_blocks_override"):
        llm.generate({"prompt_token_ids": list(range(5, 45))}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert_no_leaks(llm)
