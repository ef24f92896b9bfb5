"""The pooling runner (``runner="pooling"``): embeddings equal transformers' ``AutoModel`` hidden states
pooled the same way (LAST / MEAN / CLS, normalized or not), through chunked prefill, batching and a
recompute; sentence-transformers files, matryoshka dimensions, headless checkpoints, bad input, no
leaks, the async engine, and the default model."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel
from transformers import Qwen3ForCausalLM as HFQwen3

from helpers import save_tiny_model, tiny_qwen3_config
from test_engine import assert_no_leaks
from vllmini import (LLM, AsyncLLMEngine, EmbeddingRequestOutput, EngineArgs, PoolerConfig, PoolingParams,
                     PoolingRequestOutput, SamplingParams)  # fmt: skip
from vllmini.scheduler.scheduler import SchedulerOutput

TOL = 1e-4
KV = 16 << 20
PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome; both are old cities with long histories.",
    "Hi",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Once upon a time, in a land far away",
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_model_dir) -> Path:
    """A tiny random Qwen3 (q/k norms, tied embeddings, head_dim apart from hidden/heads) with the
    default model's vocabulary and tokenizer, as Qwen3-Embedding is shaped."""
    torch.manual_seed(1)
    hf = HFQwen3(tiny_qwen3_config(vocab_size=49152, initializer_range=0.05)).eval()
    return save_tiny_model(hf, tmp_path_factory.mktemp("qwen3"), default_model_dir)


@pytest.fixture(scope="module")
def dirs(tiny_dir, qwen3_dir) -> dict[str, Path]:
    return {"llama": tiny_dir, "qwen3": qwen3_dir}


_BASES: dict[Path, torch.nn.Module] = {}


def hf_embedding(model_dir: Path, ids: list[int], kind: str, normalize: bool = True, dims: int | None = None):
    """The oracle: transformers' AutoModel (LlamaModel / Qwen3Model) last_hidden_state, pooled."""
    if model_dir not in _BASES:
        _BASES[model_dir] = AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        h = _BASES[model_dir](torch.tensor([ids])).last_hidden_state[0].float()
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    v = v if dims is None else v[:dims]
    return F.normalize(v, dim=-1) if normalize else v


def assert_close(got, want, what: str = "") -> None:
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err < TOL, f"{what}: max abs error {err:.2e} against transformers"


def copy_model(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embed_equals_transformers_through_chunked_prefill(dirs, arch, kind):
    """Prompts of 1 to ~40 tokens batched in steps of 8 tokens: most are pooled over several
    chunks, several share a step; normalized (the default) and not, per request."""
    llm = LLM(model=str(dirs[arch]), runner="pooling", pooler_config={"pooling_type": kind}, kv_cache_memory=KV,
              max_num_batched_tokens=8)  # fmt: skip
    scheduler, batch_sizes = llm.llm_engine.scheduler, []
    schedule = scheduler.schedule
    scheduler.schedule = lambda: (out := schedule(), batch_sizes.append(len(out.scheduled)))[0]
    outs = llm.embed(PROMPTS, use_tqdm=False)
    raw = llm.embed(PROMPTS, pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    assert scheduler.stats.num_chunked_prefills > 0 and max(batch_sizes) >= 2
    tok = llm.get_tokenizer()
    for i, (prompt, out, unnormed) in enumerate(zip(PROMPTS, outs, raw)):
        ids = tok(prompt).input_ids
        assert isinstance(out, EmbeddingRequestOutput) and out.finished and out.prompt_token_ids == ids
        assert_close(out.outputs.embedding, hf_embedding(dirs[arch], ids, kind), f"{arch} {kind} prompt {i}")
        assert_close(unnormed.outputs.embedding, hf_embedding(dirs[arch], ids, kind, normalize=False),
                     f"{arch} {kind} prompt {i}, not normalized")  # fmt: skip
    assert abs(torch.tensor(outs[0].outputs.embedding).norm().item() - 1) < 1e-5
    assert len({o.request_id for o in outs}) == len(outs)
    # as vLLM: MEAN and CLS read positions a prefix-cache hit would skip, LAST keeps the cache
    assert llm.llm_engine.block_manager.enable_prefix_caching == (kind == "LAST")
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    """LAST pooling (the default for a decoder), a short max_model_len for the length checks."""
    return LLM(model=str(tiny_dir), runner="pooling", kv_cache_memory=KV, max_model_len=64, max_num_batched_tokens=16)


def test_encode_gives_vllm_pooling_outputs_and_needs_a_task(llm):
    enc = llm.encode(PROMPTS[:2], pooling_task="embed", use_tqdm=False)
    emb = llm.embed(PROMPTS[:2], use_tqdm=False)
    for e, m in zip(enc, emb):
        assert isinstance(e, PoolingRequestOutput) and e.finished
        assert e.outputs.data.dtype == torch.float32 and e.outputs.data.shape == (64,)
        assert e.outputs.data.tolist() == m.outputs.embedding and m.outputs.hidden_size == 64
    with pytest.raises(ValueError, match="pooling_task is required"):
        llm.encode(PROMPTS[:1])
    with pytest.raises(ValueError, match="pooling_task='classify' is not supported"):
        llm.encode(PROMPTS[:1], pooling_task="classify")
    with pytest.raises(ValueError, match="pooling_params has 1 entries but there are 2 prompts"):
        llm.embed(PROMPTS[:2], pooling_params=[PoolingParams()])
    # one PoolingParams per prompt, and the vLLM keyword for truncation
    mixed = llm.embed(PROMPTS[:2], pooling_params=[PoolingParams(normalize=False), PoolingParams()], use_tqdm=False)
    assert mixed[1].outputs.embedding == emb[1].outputs.embedding
    assert abs(torch.tensor(mixed[0].outputs.embedding).norm().item() - 1) > 1e-3
    # (the first 5: vLLM 0.32's side for pooling)
    assert llm.embed(PROMPTS[0], truncate_prompt_tokens=5, use_tqdm=False)[0].prompt_token_ids == \
        llm.get_tokenizer()(PROMPTS[0]).input_ids[:5]  # fmt: skip
    assert_no_leaks(llm)


def test_each_runner_refuses_the_other_ones_calls(llm, tiny_dir):
    with pytest.raises(ValueError, match=r"LLM.generate\(\) is only supported for generative models"):
        llm.generate(["Hi"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="requests take PoolingParams"):
        llm.llm_engine.add_request(None, "Hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="requests take PoolingParams"):
        llm.llm_engine.add_request(None, "Hi")
    gen = LLM(model=str(tiny_dir), kv_cache_memory=KV)  # runner "auto": a *ForCausalLM generates
    assert gen.llm_engine.runner_type == "generate"
    with pytest.raises(ValueError, match=r"LLM.encode\(\) is only supported for pooling models"):
        gen.embed(["Hi"])
    with pytest.raises(ValueError, match="runner='pooling'"):
        gen.llm_engine.add_request(None, "Hi", PoolingParams())
    assert_no_leaks(llm)
    assert_no_leaks(gen)
    # vLLM's older spelling, and what is refused before the model loads
    assert LLM(model=str(tiny_dir), task="embed", kv_cache_memory=KV).llm_engine.runner_type == "pooling"
    for kwargs, message in [({"runner": "embed"}, "runner must be one of"), ({"task": "reward"}, "task='reward'"),
                            ({"task": "embed", "runner": "generate"}, "task='embed' means runner='pooling'"),
                            ({"pooler_config": {"pooling_type": "MAX"}}, "pooling_type must be one of"),
                            ({"pooler_config": '{"pooling": "MEAN"}'}, "unsupported field"),
                            ({"pooler_config": {"normalize": True, "use_activation": False}}, "disagree")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(tiny_dir), **kwargs).validate()


def test_bad_input_is_refused_naming_it_and_leaks_nothing(llm):
    free = llm.llm_engine.block_manager.num_free_blocks
    long_ids = list(range(100, 180))  # 80 tokens, max_model_len is 64
    for prompt, params, message in [
        ("", None, "prompt is empty"),
        ([5, 49152], None, "outside the vocabulary"),
        (long_ids, None, "maximum context length is 64 tokens. However, you requested 80 tokens"),
        ("Hi", PoolingParams(dimensions=8), "does not support matryoshka"),
        ("Hi", PoolingParams(truncate_prompt_tokens=65), "truncate_prompt_tokens=65 exceeds max_model_len=64"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            llm.embed(["A good prompt", prompt], pooling_params=params, use_tqdm=False)
        assert_no_leaks(llm)
    for field, kwargs in [("dimensions", {"dimensions": 0}), ("truncate_prompt_tokens", {"truncate_prompt_tokens": 0}),
                          ("normalize", {"normalize": 1})]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            PoolingParams(**kwargs)
    # truncation instead: the first 64 tokens (-1: max_model_len; vLLM 0.32's side for pooling), or the
    # last with truncation_side="left", pooled as transformers pools them
    out = llm.embed([long_ids], pooling_params=PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert out.prompt_token_ids == long_ids[:64]
    assert_close(out.outputs.embedding, hf_embedding(Path(llm.llm_engine.model_dir), long_ids[:64], "LAST"))
    left = PoolingParams(truncate_prompt_tokens=-1, truncation_side="left")
    out = llm.embed([long_ids], pooling_params=left, use_tqdm=False)[0]
    assert out.prompt_token_ids == long_ids[-64:]
    assert_close(out.outputs.embedding, hf_embedding(Path(llm.llm_engine.model_dir), long_ids[-64:], "LAST"))
    assert llm.llm_engine.block_manager.num_free_blocks == free
    assert_no_leaks(llm)


def test_last_pooling_reuses_the_prefix_cache(llm):
    prompt = "Zebras graze " + PROMPTS[2]  # 30+ tokens not seen before: one full block to hit
    first, again = llm.embed([prompt, prompt + " x"], use_tqdm=False), llm.embed([prompt], use_tqdm=False)
    assert again[0].num_cached_tokens >= 16 and first[0].num_cached_tokens == 0
    assert torch.allclose(torch.tensor(again[0].outputs.embedding), torch.tensor(first[0].outputs.embedding), atol=1e-5)
    assert_no_leaks(llm)


def preempt_once(llm: LLM, monkeypatch) -> list:
    """A pooling engine's prompts never outgrow the cache together (one token budget leaves at most
    one prompt half-computed between steps), so the recompute path is forced: the scheduler preempts
    the first half-computed sequence once. Returns the list the preempted sequence lands in."""
    scheduler = llm.llm_engine.scheduler
    schedule, preempted = scheduler.schedule, []

    def schedule_with_a_preemption() -> SchedulerOutput:
        running = [s for s in scheduler.running if 0 < s.num_computed_tokens < s.num_prompt_tokens]
        if running and not preempted:
            scheduler.running.remove(running[0])
            scheduler._preempt(running[0], SchedulerOutput())
            preempted.append(running[0])
        return schedule()

    monkeypatch.setattr(scheduler, "schedule", schedule_with_a_preemption)
    return preempted


def test_a_recomputed_prompt_pools_from_its_start(tiny_dir, monkeypatch):
    """The half-pooled MEAN sequence is preempted once (preempt_once): its sum must start again."""
    llm = LLM(model=str(tiny_dir), runner="pooling", pooler_config=PoolerConfig(pooling_type="MEAN"),
              kv_cache_memory=KV, max_num_batched_tokens=8)  # fmt: skip
    scheduler = llm.llm_engine.scheduler
    preempted = preempt_once(llm, monkeypatch)
    out = llm.embed([PROMPTS[0]], use_tqdm=False)[0]
    assert preempted and preempted[0].num_preemptions == 1 and scheduler.stats.num_preemptions == 1
    assert_close(out.outputs.embedding, hf_embedding(tiny_dir, out.prompt_token_ids, "MEAN"), "after a recompute")
    assert_no_leaks(llm)


def write_st_files(model_dir: Path, modules: list[dict], pooling: dict | None = None) -> None:
    (model_dir / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (model_dir / "1_Pooling").mkdir(exist_ok=True)
        (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


ST = "sentence_transformers.models."
MODULES = [{"idx": 0, "name": "0", "path": "", "type": f"{ST}Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": f"{ST}Pooling"}]  # fmt: skip
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": f"{ST}Normalize"}


def test_sentence_transformers_files_set_the_defaults(tiny_dir, tmp_path):
    mean = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}  # fmt: skip
    st = copy_model(tiny_dir, tmp_path / "st")
    write_st_files(st, MODULES, mean)  # mean pooling, no Normalize module: not normalized
    st_llm = LLM(model=str(st), runner="pooling", kv_cache_memory=KV)
    ids = st_llm.get_tokenizer()(PROMPTS[2]).input_ids
    pooled = st_llm.embed([ids], use_tqdm=False)[0]
    assert_close(pooled.outputs.embedding, hf_embedding(tiny_dir, ids, "MEAN", normalize=False), "ST mean")
    write_st_files(st, [*MODULES, NORMALIZE], mean)  # a Normalize module: normalized; the user's config wins
    given = LLM(model=str(st), runner="pooling", kv_cache_memory=KV, pooler_config={"pooling_type": "CLS"})
    assert given.llm_engine.pooler.config == PoolerConfig("CLS", True, True, None)
    assert_close(given.embed([ids], use_tqdm=False)[0].outputs.embedding, hf_embedding(tiny_dir, ids, "CLS"))
    for modules, pooling, message in [
        (MODULES, {**mean, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}, "pooling mode"),
        (MODULES, {**mean, "pooling_mode_cls_token": True}, "pooling mode"),
        (MODULES, {**mean, "include_prompt": False}, "include_prompt"),
        ([*MODULES, {"idx": 2, "path": "2_Dense", "type": f"{ST}Dense"}], mean, "Dense"),
    ]:  # fmt: skip
        write_st_files(st, modules, pooling)
        with pytest.raises(ValueError, match=message):
            LLM(model=str(st), runner="pooling", kv_cache_memory=KV)


def test_matryoshka_dimensions_only_where_the_config_allows(tiny_dir, tmp_path):
    ids = list(range(200, 230))
    free = copy_model(tiny_dir, tmp_path / "m1", is_matryoshka=True)
    llm = LLM(model=str(free), runner="pooling", kv_cache_memory=KV)
    cut = llm.embed([ids], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)[0].outputs.embedding
    assert_close(cut, hf_embedding(tiny_dir, ids, "LAST", dims=16), "dimensions=16")  # cut, then normalized
    with pytest.raises(ValueError, match="dimensions=65 exceeds the model's hidden size 64"):
        llm.embed([ids], pooling_params=PoolingParams(dimensions=65))
    listed = copy_model(tiny_dir, tmp_path / "m2", matryoshka_dimensions=[16, 32])
    with pytest.raises(ValueError, match=r"pooler_config.dimensions=24: this model supports only .*\[16, 32\]"):
        LLM(model=str(listed), runner="pooling", kv_cache_memory=KV, pooler_config={"dimensions": 24})
    default_32 = LLM(model=str(listed), runner="pooling", kv_cache_memory=KV, pooler_config={"dimensions": 32})
    assert len(default_32.embed([ids], use_tqdm=False)[0].outputs.embedding) == 32
    assert_no_leaks(llm)


def test_a_headless_checkpoint_loads_and_only_pools(tiny_dir, tmp_path):
    """e5-mistral-style: saved from LlamaModel (no lm_head, no "model." prefix); runner "auto"
    pools it, generating is refused."""
    base = AutoModel.from_pretrained(tiny_dir)
    headless = save_tiny_model(base, tmp_path / "headless", tiny_dir)
    assert json.loads((headless / "config.json").read_text())["architectures"] == ["LlamaModel"]
    llm = LLM(model=str(headless), kv_cache_memory=KV)
    assert llm.llm_engine.runner_type == "pooling" and llm.llm_engine.model.lm_head is None
    out = llm.embed([PROMPTS[3]], use_tqdm=False)[0]
    assert_close(out.outputs.embedding, hf_embedding(tiny_dir, out.prompt_token_ids, "LAST"), "LlamaModel checkpoint")
    with pytest.raises(ValueError, match="no language-model head"):
        LLM(model=str(headless), runner="generate", kv_cache_memory=KV)


def test_lora_adapters_embed_beside_the_base_model(tiny_dir, tmp_path):
    """One batch, one prompt under a LoRA adapter and one on the base model: each equals
    transformers + PEFT (the adapted LlamaModel's last_hidden_state) or the plain model."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from helpers import save_tiny_lora
    from vllmini import LoRARequest

    adapter = save_tiny_lora(tiny_dir, tmp_path / "a1", seed=1, r=8)
    llm = LLM(model=str(tiny_dir), runner="pooling", enable_lora=True, max_loras=2, kv_cache_memory=KV,
              max_num_batched_tokens=16)  # fmt: skip
    outs = llm.embed([PROMPTS[0], PROMPTS[0]], lora_request=[LoRARequest("a1", 1, adapter), None], use_tqdm=False)
    oracle = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), adapter).eval()
    with torch.no_grad():
        h = oracle.base_model.model.model(torch.tensor([outs[0].prompt_token_ids])).last_hidden_state[0, -1]
    assert_close(outs[0].outputs.embedding, F.normalize(h, dim=-1), "under the adapter")
    assert_close(outs[1].outputs.embedding, hf_embedding(tiny_dir, outs[1].prompt_token_ids, "LAST"), "base model")
    assert (torch.tensor(outs[0].outputs.embedding) - torch.tensor(outs[1].outputs.embedding)).abs().max() > 1e-2
    assert_no_leaks(llm)


async def test_the_async_engine_encodes_as_the_offline_one(tiny_dir, llm):
    expected = llm.embed(PROMPTS, use_tqdm=False)
    args = EngineArgs(model=str(tiny_dir), runner="pooling", kv_cache_memory=KV, max_model_len=64, max_num_batched_tokens=16)
    async with AsyncLLMEngine.from_engine_args(args) as engine:

        async def one(i: int) -> PoolingRequestOutput:
            outs = [out async for out in engine.encode(PROMPTS[i], PoolingParams(), request_id=f"r{i}")]
            assert len(outs) == 1 and outs[0].finished and outs[0].request_id == f"r{i}"
            return outs[0]

        outs = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        for out, want in zip(outs, expected):
            assert torch.allclose(out.outputs.data, torch.tensor(want.outputs.embedding), atol=1e-5)
        with pytest.raises(ValueError, match="requests take PoolingParams"):
            await anext(engine.generate("Hi", SamplingParams(max_tokens=2)))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await anext(engine.encode([49152]))
        stream = await engine.add_request("left", PROMPTS[0], PoolingParams())  # closed unread: aborted
        await stream.aclose()
        assert_no_leaks(engine)


@pytest.mark.slow
def test_default_model_embeddings_equal_transformers(default_model_dir):
    llm = LLM(model="default", runner="pooling", kv_cache_memory=64 << 20, max_num_batched_tokens=32)
    for out in llm.embed(PROMPTS, use_tqdm=False):
        assert_close(out.outputs.embedding, hf_embedding(default_model_dir, out.prompt_token_ids, "LAST"), "SmolLM2")
    assert_no_leaks(llm)
