"""LoRA adapters (vllmini/lora/): greedy outputs equal transformers + PEFT on the same adapter
files, for a batch that mixes the base model and several adapters; max_loras, the prefix cache,
the async engine, bad adapters refused by name with nothing leaked."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import hf_greedy_logprobs, save_tiny_lora, save_tiny_model, tiny_llama_config, tiny_qwen3_config
from safetensors.torch import load_file, save_file

from vllmini import LLM, AsyncLLMEngine, EngineArgs, LoRARequest, SamplingParams
from vllmini.kv.block_hash import prefix_root
from vllmini.kv.block_manager import BlockManager
from vllmini.scheduler.scheduler import Scheduler, SchedulerConfig
from vllmini.scheduler.sequence import Sequence

peft = pytest.importorskip("peft")

PROMPTS = [[1, 520, 33, 4000, 77, 91, 12000], [5, 6, 7, 8, 9, 10, 11, 12, 13], [300, 301, 44, 9000], [2, 3]]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, tmp_path_factory, default_model_dir):
    """A tiny base model with SmolLM2's vocabulary and two adapters: ``a1`` (rank 8, every
    projection), ``a2`` (rank 4 with v_proj at rank 2, q/v only, rsLoRA)."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    torch.manual_seed(0)
    if request.param == "llama":
        hf = LlamaForCausalLM(tiny_llama_config(vocab_size=49152, initializer_range=0.05))
    else:
        hf = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=49152, initializer_range=0.05))
    base = save_tiny_model(hf.eval(), root / "base", default_model_dir)
    a1 = Path(save_tiny_lora(base, root / "a1", 1, r=8, lora_alpha=16))
    a2 = Path(save_tiny_lora(base, root / "a2", 2, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"],
                             rank_pattern={"v_proj": 2}))  # fmt: skip
    return base, {"a1": a1, "a2": a2}


def _peft_oracle(base: Path, adapters: dict[str, Path]):
    """transformers' model with PEFT's LoRA layers holding every adapter (PEFT's own code path)."""
    from transformers import AutoModelForCausalLM

    names = list(adapters)
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters[names[0]], names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def _expected(base: Path, adapters: dict[str, Path], which: list[str | None]) -> list[tuple[list[int], list[float]]]:
    oracle = _peft_oracle(base, adapters)
    expected = []
    for prompt, name in zip(PROMPTS, which):
        if name is None:
            with oracle.disable_adapter():
                expected.append(hf_greedy_logprobs(oracle, prompt, GREEDY.max_tokens))
        else:
            oracle.set_adapter(name)
            expected.append(hf_greedy_logprobs(oracle, prompt, GREEDY.max_tokens))
    return expected


def _requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}


def _check(outs, expected, which) -> None:
    for out, (tokens, logprobs), name in zip(outs, expected, which):
        ours = out.outputs[0]
        assert ours.token_ids == tokens, f"adapter {name}: {ours.token_ids} vs transformers+PEFT {tokens}"
        got = [entry[t] for entry, t in zip(ours.logprobs, ours.token_ids)]
        assert got == pytest.approx(logprobs, abs=2e-4), f"adapter {name}"
        assert (out.lora_request.lora_name if out.lora_request else None) == name


WHICH = ["a1", None, "a2", "a1"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_equals_transformers_peft(models, async_scheduling):
    """One generate call, one batch: the base model and two adapters side by side, each row
    equal to PEFT's output for its adapter (and the adapters do change the output)."""
    base, adapters = models
    expected = _expected(base, adapters, WHICH)
    assert expected[0][0] != _expected(base, adapters, [None])[0][0], "adapter a1 does not change the output"
    reqs = _requests(adapters)
    llm = LLM(str(base), kv_cache_memory=1 << 26, enable_lora=True, max_loras=2, max_lora_rank=8, async_scheduling=async_scheduling)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=[reqs[n] if n else None for n in WHICH])  # fmt: skip
    _check(outs, expected, WHICH)
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_max_loras_one_runs_adapters_in_turn(models, monkeypatch):
    """max_loras=1: no step ever holds two adapters, and every request still gets its own output."""
    base, adapters = models
    reqs = _requests(adapters)
    llm = LLM(str(base), kv_cache_memory=1 << 26, enable_lora=True, max_loras=1, max_lora_rank=8)
    manager = llm.llm_engine.lora_manager
    seen: list[set[int]] = []
    prepare = manager.prepare

    def spy(step_adapters, query_lens):
        seen.append({a.lora_int_id for a in step_adapters if a is not None})
        return prepare(step_adapters, query_lens)

    monkeypatch.setattr(manager, "prepare", spy)
    which = ["a1", "a2", None, "a2"]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=[reqs[n] if n else None for n in which])  # fmt: skip
    _check(outs, _expected(base, adapters, which), which)
    assert max(map(len, seen)) == 1
    assert {1, 2} <= set().union(*seen)
    # the base request was not held back behind the second adapter: it ran in the first step
    assert len(outs[2].outputs[0].token_ids) == GREEDY.max_tokens and outs[2].metrics.first_scheduled_time <= min(
        o.metrics.first_scheduled_time for o in (outs[1], outs[3])
    )


def test_prefix_cache_keeps_adapters_apart(models):
    """The same prompt under an adapter and under the base model computes different K/V: a hit
    is only taken from the same adapter's blocks."""
    base, adapters = models
    reqs = _requests(adapters)
    llm = LLM(str(base), kv_cache_memory=1 << 26, enable_lora=True, max_lora_rank=8, block_size=4)
    prompt = {"prompt_token_ids": list(range(100, 140))}
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=reqs["a1"])[0]
    plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=reqs["a2"])[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=reqs["a1"])[0]
    assert first.num_cached_tokens == plain.num_cached_tokens == other.num_cached_tokens == 0
    assert again.num_cached_tokens >= 36
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert plain.outputs[0].token_ids == llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert plain.outputs[0].token_ids != first.outputs[0].token_ids


def test_async_engine_streams_adapters_side_by_side(models):
    base, adapters = models
    reqs = _requests(adapters)
    expected = _expected(base, adapters, WHICH)

    async def run():
        args = EngineArgs(model=str(base), kv_cache_memory=1 << 26, enable_lora=True, max_loras=2, max_lora_rank=8)
        async with AsyncLLMEngine.from_engine_args(args) as engine:
            assert await engine.add_lora(reqs["a2"]) and await engine.list_loras() == {2}

            async def one(prompt, name):
                final = None
                async for out in engine.generate({"prompt_token_ids": prompt}, GREEDY,
                                                 lora_request=reqs[name] if name else None):  # fmt: skip
                    final = out
                return final

            return await asyncio.gather(*(one(p, n) for p, n in zip(PROMPTS, WHICH)))

    _check(asyncio.run(run()), expected, WHICH)


def test_chat_takes_a_lora_request(models):
    base, adapters = models
    req = _requests(adapters)["a1"]
    llm = LLM(str(base), kv_cache_memory=1 << 26, enable_lora=True, max_lora_rank=8)
    conv = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    chat = llm.chat(conv, params, use_tqdm=False, lora_request=req)[0]
    prompt = llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    plain = llm.generate(prompt, params, use_tqdm=False, lora_request=req)[0]
    assert chat.lora_request == req and chat.outputs[0].token_ids == plain.outputs[0].token_ids


# ---- bad input ---------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> Path:
    file = folder / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def lora_llm(models):
    base, _ = models
    return LLM(str(base), kv_cache_memory=1 << 26, enable_lora=True, max_lora_rank=8, max_cpu_loras=2)


def test_bad_adapters_are_refused_by_name_and_nothing_leaks(models, lora_llm, tmp_path):
    base, adapters = models
    a1 = adapters["a1"]
    bin_only = _copy(a1, tmp_path / "bin")
    (bin_only / "adapter_model.safetensors").rename(bin_only / "adapter_model.bin")
    lm_head = _copy(a1, tmp_path / "lm_head")
    weights = load_file(lm_head / "adapter_model.safetensors")
    hidden = next(t for k, t in weights.items() if "q_proj.lora_A" in k).shape[1]
    weights["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, hidden)
    weights["base_model.model.lm_head.lora_B.weight"] = torch.zeros(49152, 8)
    save_file(weights, lm_head / "adapter_model.safetensors")
    half = _copy(a1, tmp_path / "half")
    weights = load_file(half / "adapter_model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.0.self_attn.q_proj.lora_B" not in k}, half / "adapter_model.safetensors")
    wrong_shape = _copy(a1, tmp_path / "shape")
    weights = load_file(wrong_shape / "adapter_model.safetensors")
    save_file({k: v[:, :-1].contiguous() if ".lora_A." in k else v for k, v in weights.items()}, wrong_shape / "adapter_model.safetensors")
    truncated = _copy(a1, tmp_path / "truncated")  # (an interrupted download)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    rank0 = _copy(a1, tmp_path / "rank0")
    weights = load_file(rank0 / "adapter_model.safetensors")
    save_file({k: v[:0].contiguous() if ".lora_A." in k else v[:, :0].contiguous() for k, v in weights.items()},
              rank0 / "adapter_model.safetensors")  # fmt: skip
    bad = {
        "a LoRA rank must be at least 1": LoRARequest("x", 21, str(rank0)),
        "not an adapter folder": LoRARequest("x", 11, str(tmp_path / "missing")),
        "adapter_model.safetensors is not a readable safetensors file": LoRARequest("x", 20, str(truncated)),
        "no adapter_config.json": LoRARequest("x", 12, str(tmp_path)),
        "pickle: never loaded": LoRARequest("x", 13, str(bin_only)),
        "greater than max_lora_rank 8": LoRARequest("x", 14, save_tiny_lora(base, tmp_path / "r16", 3, r=16,
                                                                             target_modules=["q_proj"])),  # fmt: skip
        "DoRA is not supported": LoRARequest("x", 15, str(_edit_config(_copy(a1, tmp_path / "dora"), use_dora=True))),
        "layer_replication": LoRARequest("x", 23, str(_edit_config(_copy(a1, tmp_path / "rep"), layer_replication=[[0, 2]]))),
        "LoRA on 'lm_head' is not supported": LoRARequest("x", 16, str(lm_head)),
        "not both lora_A and lora_B": LoRARequest("x", 17, str(half)),
        "an adapter of another model": LoRARequest("x", 18, str(wrong_shape)),
        "peft_type 'IA3'": LoRARequest("x", 19, str(_edit_config(_copy(a1, tmp_path / "ia3"), peft_type="IA3"))),
        "lora_int_id 1 is already the adapter 'a1'": LoRARequest("other", 1, str(a1)),
        "lora_request must be a LoRARequest": {"lora_name": "a1"},
    }
    engine = lora_llm.llm_engine
    assert lora_llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                             lora_request=LoRARequest("a1", 1, str(a1)))  # fmt: skip
    for message, req in bad.items():
        with pytest.raises(ValueError, match=message):
            lora_llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, use_tqdm=False,
                              lora_request=[None, req])  # fmt: skip
        assert not engine.has_unfinished_requests()
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    with pytest.raises(ValueError, match="lora_request has 1 entries but there are 2 prompts"):
        lora_llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], GREEDY, lora_request=[None])
    assert engine.list_loras() == {1}  # the refused ones were never loaded
    # the engine goes on serving the adapter and the base model
    out = lora_llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False, lora_request=LoRARequest("a1", 1, str(a1)))
    assert out[0].lora_request.lora_int_id == 1 and len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_add_remove_list_and_cpu_cache(models, lora_llm):
    _, adapters = models
    engine = lora_llm.llm_engine
    for lora_id in list(engine.list_loras()):
        engine.remove_lora(lora_id)
    a1, a2 = (LoRARequest(n, i, str(adapters[n])) for i, n in ((5, "a1"), (6, "a2")))
    a3 = LoRARequest("a1-again", 7, str(adapters["a1"]))
    assert engine.add_lora(a1) and engine.add_lora(a2) and engine.list_loras() == {5, 6}
    assert engine.add_lora(a3) and engine.list_loras() == {6, 7}  # max_cpu_loras=2: the least recent goes
    assert engine.remove_lora(6) and not engine.remove_lora(6) and engine.list_loras() == {7}
    # an id freed by remove_lora may name another adapter
    assert engine.add_lora(LoRARequest("a2-now-6", 6, str(adapters["a2"])))
    outs = lora_llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False, lora_request=a3)
    same = lora_llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False, lora_request=a1)
    assert outs[0].outputs[0].token_ids == same[0].outputs[0].token_ids  # the same weights under two ids


def test_lora_request_needs_enable_lora(models):
    base, adapters = models
    llm = LLM(str(base), kv_cache_memory=1 << 26)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("a1", 1, str(adapters["a1"])))
    assert not llm.llm_engine.has_unfinished_requests()


def test_engine_args_and_request_fields_are_checked():
    for kwargs, message in [({"max_loras": 0}, "max_loras"), ({"max_lora_rank": -1}, "max_lora_rank"),
                            ({"max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras"), ({"enable_lora": 1}, "enable_lora")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EngineArgs(**kwargs).validate()
    for args, message in [(("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"), (("a", True, "/x"), "lora_int_id"),
                          (("a", 1, ""), "lora_path")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            LoRARequest(*args)


# ---- the scheduler and the block manager on their own ----------------------------------------------


class _Adapter:
    def __init__(self, key: int) -> None:
        self.key = key


def test_scheduler_passes_over_a_third_adapter_but_admits_what_follows():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(8, 64, 64, max_loras=2), bm)
    loras = [_Adapter(1), _Adapter(2), _Adapter(3), None, _Adapter(1)]
    seqs = [Sequence(i, str(i), [1, 2, 3], None, 4, lora=a) for i, a in enumerate(loras)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1, 3, 4]
    assert list(sched.waiting) == [seqs[2]]
    sched.finish(seqs[0], seqs[0].status.FINISHED_STOPPED)
    sched.finish(seqs[4], seqs[4].status.FINISHED_STOPPED)
    sched.update_computed(out)
    assert [s.seq.seq_id for s in sched.schedule().scheduled][-1] == 2  # adapter 1 gone: adapter 3 runs


def test_block_hashes_are_salted_by_adapter():
    assert prefix_root(0) != prefix_root(1) != prefix_root(2)
    bm = BlockManager(16, 4)
    tokens = list(range(13))
    assert bm.allocate("a", tokens, 13, root=prefix_root(1))
    assert bm.find_cached_prefix(tokens) == ([], 0)
    blocks, n = bm.find_cached_prefix(tokens, prefix_root(1))
    assert n == 12 and blocks == bm.block_table("a")[:3]
    assert bm.allocate("b", tokens, 1, blocks, root=prefix_root(1))
    with pytest.raises(ValueError, match="stale cached block"):
        bm.allocate("c", tokens, 1, blocks)  # hashes under another root


def test_lora_linear_adds_each_rows_own_adapter_in_any_row_order():
    """Rows of several adapters in any order (runs of one slot, base rows between them): each row
    gets base(x) + x @ A.T @ B.T of its own adapter and shard, nothing of the others'."""
    from vllmini.lora.layers import LoRALinear, LoRAStepState

    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5 + 3, bias=True)
    state = LoRAStepState(max_loras=2, max_rank=4)
    layer = LoRALinear(base, [5, 3], state, torch.float32, torch.device("cpu"))
    weights = {slot: [(torch.randn(r, 6), torch.randn(size, r)) for size, r in zip([5, 3], ranks)]
               for slot, ranks in ((0, (4, 2)), (1, (3, 3)))}  # fmt: skip
    layer.set_slot(0, weights[0])
    layer.set_slot(1, [None, weights[1][1]])  # slot 1 adapts the second shard only
    x = torch.randn(7, 6)
    seq_slots, query_lens = [0, -1, 1, 1, 0], [2, 1, 1, 2, 1]
    state.set(seq_slots, query_lens)
    assert state.runs == [(0, 0, 2), (1, 3, 6), (0, 6, 7)]
    with torch.no_grad():
        got = layer(x)
        rows = [slot for slot, n in zip(seq_slots, query_lens) for _ in range(n)]
        for row, slot in enumerate(rows):
            want = base(x[row])
            if slot >= 0:
                shards = weights[slot] if slot == 0 else [None, weights[1][1]]
                delta = [torch.zeros(5) if ab is None else ab[1] @ (ab[0] @ x[row]) for ab in shards]
                want = want + torch.cat(delta)
            torch.testing.assert_close(got[row], want)
        state.set([], [])
        torch.testing.assert_close(layer(x), base(x))


def test_an_id_reused_for_other_weights_and_a_reloaded_adapter_while_requests_run(models):
    """remove_lora frees an id that may come back as another adapter while requests of the old one
    still run: each keeps its own weights and cache blocks. An adapter evicted from the loaded set
    (max_cpu_loras) and reloaded while one of its requests runs shares that request's slot."""
    base, adapters = models
    llm = LLM(str(base), kv_cache_memory=1 << 26, enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    engine = llm.llm_engine
    a1, a2 = LoRARequest("a1", 5, str(adapters["a1"])), LoRARequest("a2", 5, str(adapters["a2"]))
    prompt = {"prompt_token_ids": PROMPTS[0]}
    alone = {r.lora_name: llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
             for r in (a1, LoRARequest("a2", 6, str(adapters["a2"])))}  # fmt: skip
    engine.remove_lora(6)
    a1_again = LoRARequest("a1", 8, str(adapters["a1"]))
    engine.add_request("old", prompt, GREEDY, lora_request=a1)
    engine.add_request("a1-first", prompt, GREEDY, lora_request=a1_again)
    engine.step()
    assert engine.remove_lora(5)
    engine.add_request("new", prompt, GREEDY, lora_request=a2)  # id 5 now names a2
    for i in range(2):  # a1 as id 8 evicted from the loaded set (max_cpu_loras=2)...
        engine.add_lora(LoRARequest(f"x{i}", 10 + i, str(adapters["a2"])))
    assert 8 not in engine.list_loras()
    engine.add_request("a1-reloaded", prompt, GREEDY, lora_request=a1_again)  # ...and asked for while it runs:
    held = engine.requests["a1-first"].seqs[0].lora
    assert engine.requests["a1-reloaded"].seqs[0].lora is held and 8 in engine.list_loras()  # not read again
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for rid in ("old", "a1-first", "a1-reloaded"):
        assert finals[rid].outputs[0].token_ids == alone["a1"], rid
    assert finals["new"].outputs[0].token_ids == alone["a2"]
    assert finals["new"].num_cached_tokens == 0  # a1's blocks under id 5 are not a2's
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_seeded_request_under_an_adapter_is_batch_invariant(models):
    """As the base model's (tests/test_sampling_engine.py): on CPU the prepacked base linears give
    a row the same bits whatever rows share its step, and so must the adapter's delta, or a seeded
    request's tokens depend on the requests of its adapter running beside it."""
    from vllmini.models.packed_linear import packing_available

    base, adapters = models
    if not packing_available(torch.device("cpu"), torch.float32):
        pytest.skip("no oneDNN: the base linears are not batch invariant either")
    req = _requests(adapters)["a1"]
    llm = LLM(str(base), kv_cache_memory=1 << 26, enable_lora=True, max_lora_rank=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=0)
    alone = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False, lora_request=req)[0].outputs[0]
    mixed = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=req)[0].outputs[0]
    assert mixed.token_ids == alone.token_ids
    assert [e[t] for e, t in zip(mixed.logprobs, mixed.token_ids)] == [e[t] for e, t in zip(alone.logprobs, alone.token_ids)]


def test_prompt_logprobs_under_an_adapter_equal_peft_logits(models):
    """The prefill path (a whole prompt's rows under one adapter, next to a base request's):
    every prompt position's logprob equals PEFT's."""
    base, adapters = models
    req = _requests(adapters)["a1"]
    llm = LLM(str(base), kv_cache_memory=1 << 26, enable_lora=True, max_lora_rank=8, block_size=4)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    prompt = list(range(200, 230))
    outs = llm.generate([{"prompt_token_ids": PROMPTS[1]}, {"prompt_token_ids": prompt}], params, use_tqdm=False,
                        lora_request=[None, req])  # fmt: skip
    oracle = _peft_oracle(base, adapters)
    oracle.set_adapter("a1")
    with torch.no_grad():
        logits = oracle(input_ids=torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = [entry[t] for entry, t in zip(outs[1].prompt_logprobs[1:], prompt[1:])]
    assert got == pytest.approx(want.tolist(), abs=2e-4)


def test_beam_search_takes_lora_requests(models):
    """vLLM's argument order (prompts, params, lora_request): width 1 is the adapter's greedy output."""
    from vllmini import BeamSearchParams

    base, adapters = models
    reqs = _requests(adapters)
    llm = LLM(str(base), kv_cache_memory=1 << 26, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    which = [reqs["a1"], None, reqs["a2"]]
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=6, ignore_eos=True), which)
    greedy = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False,
                          lora_request=which)  # fmt: skip
    for prompt, beam, out in zip(PROMPTS, beams, greedy):
        assert beam.sequences[0].tokens == prompt + out.outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_request has 1 entries but there are 3 prompts"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=2), [None])
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        llm.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=2), {"lora_name": "a1"})
