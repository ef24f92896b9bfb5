"""Async scheduling (EngineArgs.async_scheduling): the next decode step is launched before the
previous step's tokens are read. Whatever the mix (stops on tokens and strings, length limits,
seeds, n > 1, penalties, a queue, preemption, aborts, a failing launch), the outputs equal the
synchronous engine's and nothing leaks. On a CPU every op completes before the host goes on,
so this checks the bookkeeping; what it buys (overlap) only shows on a GPU."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM as HFLlama

from helpers import save_tiny_model, tiny_llama_config
from test_engine import assert_no_leaks, kv_bytes
from vllmini import LLM, SamplingParams
from vllmini.engine import sample_step

CONFIG = tiny_llama_config(vocab_size=49152, initializer_range=0.05)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, default_model_dir):
    torch.manual_seed(0)
    hf = HFLlama(CONFIG).eval()
    return save_tiny_model(hf, tmp_path_factory.mktemp("tiny"), default_model_dir)


def make(tiny_dir, async_scheduling: bool, **kw) -> LLM:
    kw = {"kv_cache_memory": 2**22, "max_num_seqs": 8, **kw}
    return LLM(model=str(tiny_dir), async_scheduling=async_scheduling, **kw)


def count_continuations(llm: LLM) -> list[int]:
    """Spy: how many continuation steps were launched (one list entry each, its row count)."""
    eng, launched = llm.llm_engine, []
    real = eng._launch_continuation

    def launch(prev):
        nxt = real(prev)
        if nxt is not None:
            launched.append(len(nxt.seqs))
        return nxt

    eng._launch_continuation = launch
    return launched


def prompts(n: int, lo: int = 3, hi: int = 40) -> list[dict]:
    g = torch.Generator().manual_seed(n)
    return [{"prompt_token_ids": torch.randint(100, 4000, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                               generator=g).tolist()} for _ in range(n)]  # fmt: skip


def results(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob) for c in o.outputs] for o in outs]


def both(tiny_dir, batch, params, expect_async_steps: bool = True, **kw):
    sync_llm, async_llm = make(tiny_dir, False, **kw), make(tiny_dir, True, **kw)
    launched = count_continuations(async_llm)
    want = sync_llm.generate(batch, params, use_tqdm=False)
    got = async_llm.generate(batch, params, use_tqdm=False)
    assert results(got) == results(want)
    assert bool(launched) == expect_async_steps, launched
    assert_no_leaks(async_llm)
    assert async_llm.llm_engine._in_flight is None or not async_llm.llm_engine._in_flight.seqs or all(
        s.status.finished for s in async_llm.llm_engine._in_flight.seqs)  # fmt: skip
    return want, launched


def test_greedy_lengths_and_stop_tokens(tiny_dir):
    batch = prompts(12)
    plain = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(12)]
    want, launched = both(tiny_dir, batch, plain)
    assert max(launched) > 1
    # stop on a token the sequences really produce (mid-stream), and on the tokenizer's EOS
    produced = torch.tensor([t for o in want for t in o.outputs[0].token_ids[2:]])
    common = torch.bincount(produced).topk(4).indices.tolist()
    stops = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=common, ignore_eos=i % 2 == 0)
             for i in range(12)]  # fmt: skip
    want, _ = both(tiny_dir, batch, stops)
    assert sum(o.outputs[0].finish_reason == "stop" for o in want) >= 2


def test_stop_strings_seeds_min_tokens_and_logprobs(tiny_dir):
    batch = prompts(10)
    probe = make(tiny_dir, False).generate(batch, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                           use_tqdm=False)  # fmt: skip
    stop = probe[0].outputs[0].text[6:9]
    params = []
    for i in range(10):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_k=50, seed=i, max_tokens=12 + i, min_tokens=5, logprobs=2))
        else:
            params.append(SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=15))
    want, _ = both(tiny_dir, batch, params)
    assert want[0].outputs[0].finish_reason == "stop" and want[0].outputs[0].stop_reason == stop


def test_n_penalties_queue_and_prefix_cache(tiny_dir):
    shared = list(range(500, 540))
    batch = [{"prompt_token_ids": shared + p["prompt_token_ids"]} for p in prompts(14)]
    params = [SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=9, ignore_eos=True)]
    params += [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(12)]
    params += [SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3, ignore_eos=True)]
    # 15 sequences through 4 slots: admissions between steps, continuations while every slot is taken
    sync_llm, async_llm = make(tiny_dir, False, max_num_seqs=4), make(tiny_dir, True, max_num_seqs=4)
    eng, queued = async_llm.llm_engine, []
    real = eng._launch_continuation
    eng._launch_continuation = lambda prev: (lambda nxt: queued.append(bool(nxt and eng.scheduler.waiting)) or nxt)(real(prev))
    assert results(async_llm.generate(batch, params, use_tqdm=False)) == results(
        sync_llm.generate(batch, params, use_tqdm=False))  # fmt: skip
    assert any(queued)  # some continuations ran with requests waiting
    assert_no_leaks(async_llm)

def test_penalties_count_the_token_in_flight(tiny_dir):
    """Penalties need every output token, including the one a continuation starts from: the
    engine writes it into the sampler's tensors on the device. Strong penalties make each
    token depend on the previous ones, so a continuation that missed it would diverge."""
    kinds = [dict(presence_penalty=1.5), dict(frequency_penalty=1.0), dict(repetition_penalty=1.8),
             dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5)]  # fmt: skip
    penalised = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw) for kw in kinds]
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True, **kw) for i, kw in enumerate(kinds)]
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2
    want, launched = both(tiny_dir, prompts(10), penalised + seeded + plain, max_num_seqs=10)
    assert max(launched) == 10  # every row, penalised ones included, was continued
    # the penalties did change the tokens (else the test could not tell them apart)
    unpenalised = make(tiny_dir, False).generate(prompts(10)[:4], plain[0], use_tqdm=False)
    assert all(w.outputs[0].token_ids != u.outputs[0].token_ids for w, u in zip(want[:4], unpenalised))


def test_preemption_under_a_tight_cache(tiny_dir):
    # 30 blocks of 4 tokens for 8 sequences that grow to ~40 tokens: preemptions and recomputes
    kw = {"max_num_seqs": 8, "block_size": 4, "kv_cache_memory": kv_bytes(CONFIG, 30, block_size=4)}
    batch = prompts(8, 10, 20)
    params = [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True) for i in range(8)]
    sync_llm = make(tiny_dir, False, **kw)
    want = sync_llm.generate(batch, params, use_tqdm=False)
    assert sync_llm.llm_engine.scheduler.stats.num_preemptions > 0
    async_llm = make(tiny_dir, True, **kw)
    launched = count_continuations(async_llm)
    assert results(async_llm.generate(batch, params, use_tqdm=False)) == results(want) and launched
    assert_no_leaks(async_llm)


def test_abort_between_steps_and_a_failing_continuation(tiny_dir):
    llm = make(tiny_dir, True)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts(4)):
        eng.add_request(f"r{i}", p, params)
    eng.step()
    eng.step()
    assert eng._in_flight is not None  # a continuation is running while we abort
    eng.abort_request("r1")
    real = eng.runner.run_flat
    calls = {"n": 0}

    def run_flat(flat, token_ids=None):
        calls["n"] += 1
        if token_ids is not None and calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real(flat, token_ids)

    eng.runner.run_flat = run_flat
    finished, failed = {}, {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        failed.update(eng.failed)
        eng.failed.clear()
    assert "r1" not in finished and set(failed) == {"r0", "r2", "r3"} - set(finished)
    assert all(isinstance(e, Exception) for e in failed.values()) and failed
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not eng.scheduler.running


def test_flag_is_validated(tiny_dir):
    with pytest.raises(ValueError, match="async_scheduling must be True or False"):
        LLM(model=str(tiny_dir), async_scheduling="yes")


def test_through_the_graph_runner(tiny_dir):
    """Decode steps replayed the way a CUDA graph would (padded static buffers): a continuation's
    input ids are copied into the graph's input buffer from the previous step's samples."""
    from test_cuda_path import route_decodes_through_graph_runner

    batch = prompts(6)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=5 + 2 * i, ignore_eos=True) for i in range(6)]
    outs = {}
    for flag in (False, True):
        llm = make(tiny_dir, flag, max_model_len=128)
        calls = route_decodes_through_graph_runner(llm, max_num_seqs=8, max_model_len=128)
        launched = count_continuations(llm)
        outs[flag] = results(llm.generate(batch, params, use_tqdm=False))
        assert calls and bool(launched) == flag
        assert_no_leaks(llm)
    assert outs[True] == outs[False]


def test_a_token_stop_while_others_wait(tiny_dir, monkeypatch):
    """With every slot taken and a queue, a sequence that stops on a token was continued once
    (that token is discarded) and the queued request is admitted one step later than the
    synchronous engine would. Batches then differ from the synchronous run (so fp32 rounding
    may too): check the bookkeeping, not token equality."""
    batch = prompts(10)
    probe = make(tiny_dir, False).generate(batch, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                           use_tqdm=False)  # fmt: skip
    produced = torch.tensor([t for o in probe for t in o.outputs[0].token_ids[2:]])
    stop = torch.bincount(produced).topk(3).indices.tolist()
    params = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=stop, ignore_eos=True)
    llm = make(tiny_dir, True, max_num_seqs=3)
    discarded = []
    real = sample_step.complete
    monkeypatch.setattr(sample_step, "complete", lambda engine, launched: discarded.extend(
        s for s in launched.seqs if s.status.finished) or real(engine, launched))  # fmt: skip
    outs = llm.generate(batch, params, use_tqdm=False)
    assert len(outs) == 10 and discarded
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason in ("stop", "length") and 1 <= len(c.token_ids) <= 20
        assert (c.finish_reason == "stop") == (c.token_ids[-1] in stop)
        assert not any(t in stop for t in c.token_ids[:-1])  # nothing was appended after a stop
    assert_no_leaks(llm)
