"""vLLM's scheduling_policy="priority": the queue is ordered by (priority, arrival), lower
first, and a preemption takes the running sequence that comes last in that order, even one
already scheduled this step; "fcfs" is unchanged. Outputs stay exact and nothing leaks."""
from __future__ import annotations

import asyncio

import pytest
from test_engine import assert_no_leaks, kv_bytes
from transformers import AutoConfig

from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.kv.block_manager import BlockManager
from vllmini.scheduler.scheduler import Scheduler, SchedulerConfig
from vllmini.scheduler.sequence import Sequence


def seq(i: int, n_tokens: int, priority: int = 0) -> Sequence:
    tokens = list(range(100 * i, 100 * i + n_tokens))  # (no two share a cached block)
    return Sequence(i, f"r{i}", tokens, None, 8, arrival_time=float(i), priority=priority)


def test_the_queue_is_ordered_by_priority_then_arrival():
    sched = Scheduler(SchedulerConfig(8, 1000, 512, policy="priority"), BlockManager(64, 4))
    for s in (seq(0, 5, 2), seq(1, 5, 0), seq(2, 5, 1), seq(3, 5, 0), seq(4, 5, -1)):
        sched.add(s)
    assert [s.seq_id for s in sched.waiting] == [4, 1, 3, 2, 0]
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [4, 1, 3, 2, 0]  # admitted in that order
    fcfs = Scheduler(SchedulerConfig(8, 1000, 512), BlockManager(64, 4))
    for s in (seq(0, 5, 2), seq(1, 5, 0)):
        fcfs.add(s)
    assert [s.seq_id for s in fcfs.waiting] == [0, 1]


@pytest.mark.parametrize("policy, victim", [("priority", 0), ("fcfs", 2)])
def test_preemption_takes_the_least_urgent_even_if_already_scheduled(policy, victim):
    """The least urgent sequence (priority 9) is admitted first, the others a step later; then
    each needs a new block and the pool has one. Under "priority" the first takes it, the second
    finds none and preempts the first, which is taken out of the step (its budget given back)
    and whose freed blocks serve the others. Under "fcfs" the most recently admitted one goes."""
    bm = BlockManager(7, 4)  # 28 slots
    sched = Scheduler(SchedulerConfig(8, 100, 512, policy=policy), bm)
    seqs = [seq(0, 8, 9), seq(1, 8, 0), seq(2, 8, 1)]  # two full blocks each
    sched.add(seqs[0])
    sched.update_computed(sched.schedule())
    sched.add(seqs[1])
    sched.add(seqs[2])
    sched.update_computed(sched.schedule())
    assert [s.seq_id for s in sched.running] == [0, 1, 2] and bm.num_free_blocks == 1
    for s in seqs:
        s.append_token(1)  # each needs a third block now
    out = sched.schedule()
    assert [p.seq_id for p in out.preempted] == [victim]
    assert sorted(s.seq.seq_id for s in out.scheduled) == sorted({0, 1, 2} - {victim})
    assert [s.seq_id for s in sched.waiting] == [victim] and seqs[victim].num_computed_tokens == 0
    assert out.num_batched_tokens == 2  # one decode token each: the victim's was given back
    bm.check_invariants()


def test_priority_orders_an_engine_and_preempts_the_least_urgent(tiny_dir):
    """One slot: requests run one at a time in priority order. Under KV pressure, the most
    urgent request, though submitted last (fcfs would preempt it first), is never preempted;
    every output equals the same request run alone."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [100 + 7 * i + j for j in range(10)]} for i in range(4)]
    one = LLM(model=str(tiny_dir), max_num_seqs=1, scheduling_policy="priority", kv_cache_memory=64 << 20)
    outs = one.generate(prompts, params, use_tqdm=False, priority=[3, 1, 2, 0])
    finish = sorted(range(4), key=lambda i: outs[i].metrics.finished_time)
    assert finish == [3, 1, 2, 0]
    alone = [one.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == alone

    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    kv = kv_bytes(AutoConfig.from_pretrained(tiny_dir), 8)  # 128 slots: three 50-token sequences do not fit
    want = [one.generate(p, long, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:3]]
    preempted = {}
    for policy, prio in (("priority", [2, 1, 0]), ("fcfs", [0, 0, 0])):
        llm = LLM(model=str(tiny_dir), scheduling_policy=policy, kv_cache_memory=kv)
        eng = llm.llm_engine
        eng.add_request("0", prompts[0], long, priority=prio[0])
        eng.add_request("1", prompts[1], long, priority=prio[1])
        eng.step()  # admitted before the most urgent one arrives
        eng.add_request("2", prompts[2], long, priority=prio[2])
        finals = {}
        while eng.has_unfinished_requests():
            finals.update({o.request_id: o for o in eng.step() if o.finished})
        assert eng.scheduler.stats.num_preemptions > 0
        preempted[policy] = [finals[r].metrics.num_preemptions for r in "012"]
        assert [finals[r].outputs[0].token_ids for r in "012"] == want
        assert_no_leaks(llm)
    assert preempted["priority"][2] == 0 and preempted["fcfs"][2] > 0


def test_priority_is_refused_without_the_policy_and_checked(tiny_dir):
    llm = LLM(model=str(tiny_dir), kv_cache_memory=64 << 20)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority has 2 entries"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 0])
    with pytest.raises(ValueError, match="priority must be an int"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False, priority=[True])
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(scheduling_policy="lifo").validate()
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])[0].finished
    assert_no_leaks(llm)


def test_async_generate_takes_a_priority(tiny_dir):
    async def main() -> list[str]:
        args = EngineArgs(model=str(tiny_dir), max_num_seqs=1, scheduling_policy="priority", kv_cache_memory=64 << 20)
        order: list[str] = []
        async with AsyncLLMEngine.from_engine_args(args) as engine:
            async def one(rid: str, priority: int) -> None:
                params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, output_kind="final")
                async for out in engine.generate("hello there", params, rid, priority=priority):
                    if out.finished:
                        order.append(rid)

            # whether "first" is admitted alone or with the others, the rest are served by priority
            await asyncio.gather(one("first", -10), one("low", 9), one("high", -3), one("mid", 0))
        return order

    order = asyncio.run(main())
    assert order == ["first", "high", "mid", "low"]


def test_an_unscheduled_victim_leaves_no_unwritten_block_in_the_prefix_cache():
    """The victim's chunk was allocated this step, and the blocks it fills registered in the prefix
    cache, before it was taken out of the step: no forward writes them, so no later prompt may hit
    them. (Its tail block is partial, so the victim's freed full blocks outlive the eviction.)"""
    bm = BlockManager(8, 4)
    sched = Scheduler(SchedulerConfig(8, 16, 512, max_prompt_logits_rows=8, policy="priority"), bm)
    low, high = seq(0, 30, 9), seq(1, 8, 0)
    low.prompt_logits_from = 0  # prompt_logprobs: 8 rows a step leave room for the other's admission
    sched.add(low)
    sched.update_computed(sched.schedule())
    sched.add(high)
    sched.update_computed(sched.schedule())
    assert [s.seq_id for s in sched.running] == [0, 1] and bm.num_free_blocks == 2
    written = low.num_computed_tokens
    high.append_token(7)  # needs a third block; the low one's next chunk takes the last two
    out = sched.schedule()
    assert [p.seq_id for p in out.preempted] == [0] and [s.seq.seq_id for s in out.scheduled] == [1]
    assert bm.find_cached_prefix(low.token_ids)[1] <= written
    bm.check_invariants()


def test_a_sequence_preempting_itself_gives_back_its_prompt_logits_rows():
    """The least urgent running sequence finds no block for its chunk and preempts itself: the
    prompt-logits rows it was to score stay available to the next one, which then runs."""
    bm = BlockManager(2, 4)
    sched = Scheduler(SchedulerConfig(8, 100, 512, max_prompt_logits_rows=4, policy="priority"), bm)
    low, high = seq(0, 12, 9), seq(1, 12, 0)
    for s in (low, high):  # both mid-prompt, one block each: the pool is full
        s.prompt_logits_from = 4
        assert bm.allocate(s.seq_id, s.token_ids, 4)
        s.num_computed_tokens = 4
        sched.add_running(s)
    out = sched.schedule()
    assert [p.seq_id for p in out.preempted] == [0]
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(1, 4)]
    bm.check_invariants()


def test_a_prefix_hit_never_reads_the_unscheduled_victims_blocks(tiny_dir, monkeypatch):
    """Engine-level: a request sharing the victim's prompt prefix, submitted after the victim was
    taken out of a step, gets the same greedy tokens as run alone."""
    import torch

    import vllmini.engine.prompt_logprobs as prompt_logprobs

    cfg = AutoConfig.from_pretrained(tiny_dir)
    monkeypatch.setattr(prompt_logprobs, "MAX_PROMPT_LOGITS_ELEMENTS", cfg.vocab_size * 32)  # 32 rows a step
    g = torch.Generator().manual_seed(0)
    low_p, high_p = (torch.randint(10, 4000, (n,), generator=g).tolist() for n in (120, 32))
    later_p = low_p[:100]

    def greedy(n, **kw):
        return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)

    llm = LLM(model=str(tiny_dir), scheduling_policy="priority", kv_cache_memory=kv_bytes(cfg, 8), block_size=16,
              max_num_batched_tokens=64, max_model_len=512)  # fmt: skip
    eng = llm.llm_engine
    assert eng.scheduler.config.max_prompt_logits_rows == 32
    finals = {}

    def step():
        finals.update({o.request_id: o for o in eng.step() if o.finished})

    eng.add_request("low", {"prompt_token_ids": low_p}, greedy(2, prompt_logprobs=0), priority=9)
    step()
    eng.add_request("high", {"prompt_token_ids": high_p}, greedy(3))
    step()
    step()  # "high" needs a block that "low"'s third chunk took: "low" leaves that step
    assert eng.scheduler.stats.num_preemptions == 1
    eng.add_request("later", {"prompt_token_ids": later_p}, greedy(8))
    while eng.has_unfinished_requests():
        step()
    assert_no_leaks(llm)
    alone = LLM(model=str(tiny_dir), kv_cache_memory=64 << 20, max_model_len=512)
    for rid, p, params in (("low", low_p, greedy(2)), ("high", high_p, greedy(3)), ("later", later_p, greedy(8))):
        want = alone.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids
        assert finals[rid].outputs[0].token_ids == want, rid
