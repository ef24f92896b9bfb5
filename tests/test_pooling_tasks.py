"""vLLM's token-level pooling tasks: ``token_embed`` equals transformers' per-token hidden states
(normalized by default, matryoshka-cut), ``token_classify`` equals ``AutoModelForTokenClassification``
logits (softmax by default) for Llama / Qwen2 / Qwen3 / Mistral, and a sequence classifier's head
over every token; every chunk's rows gathered through chunked prefill and a recompute; no cached
prefix read (vLLM's skip_reading_prefix_cache); ``LLM.reward``; bad input refused naming it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from helpers import save_tiny_classifier
from test_engine import assert_no_leaks
from test_pooling import KV, PROMPTS, assert_close, copy_model, preempt_once
from vllmini import LLM, PoolingParams, PoolingRequestOutput

_BODIES: dict[Path, torch.nn.Module] = {}


def hf_hidden(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """The oracle: transformers' AutoModel last_hidden_state, one row per token."""
    if model_dir not in _BODIES:
        _BODIES[model_dir] = AutoModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return _BODIES[model_dir](torch.tensor([ids])).last_hidden_state[0].float()


@pytest.fixture(scope="module")
def embedder(tiny_dir):
    """A small token budget: the longer prompts run in several chunks."""
    return LLM(model=str(tiny_dir), runner="pooling", kv_cache_memory=KV, max_num_batched_tokens=8)


def test_token_embed_equals_transformers_hidden_states_through_chunked_prefill(embedder, tiny_dir):
    assert embedder.supported_tasks == ("embed", "token_embed")
    outs = embedder.encode(PROMPTS, pooling_task="token_embed", use_tqdm=False)
    raw = embedder.encode(PROMPTS, PoolingParams(normalize=False), pooling_task="token_embed", use_tqdm=False)
    last = embedder.embed(PROMPTS, use_tqdm=False)
    assert embedder.llm_engine.scheduler.stats.num_chunked_prefills > 0
    for i, (out, r, emb) in enumerate(zip(outs, raw, last)):
        h = hf_hidden(tiny_dir, out.prompt_token_ids)
        assert isinstance(out, PoolingRequestOutput) and out.finished and out.outputs.data.dtype == torch.float32
        assert out.outputs.data.shape == (len(out.prompt_token_ids), 64)
        assert_close(out.outputs.data, F.normalize(h, dim=-1), f"prompt {i} normalized")
        assert_close(r.outputs.data, h, f"prompt {i} raw")
        assert_close(out.outputs.data[-1], torch.tensor(emb.outputs.embedding), f"prompt {i} last row vs embed")
    assert_no_leaks(embedder)


def test_token_embed_cuts_a_matryoshka_model_to_its_dimensions(tiny_dir, tmp_path):
    model_dir = copy_model(tiny_dir, tmp_path / "m", is_matryoshka=True)
    llm = LLM(model=str(model_dir), runner="pooling", kv_cache_memory=KV, max_num_batched_tokens=8)
    out = llm.encode(PROMPTS[0], PoolingParams(dimensions=16), pooling_task="token_embed", use_tqdm=False)[0]
    h = hf_hidden(tiny_dir, out.prompt_token_ids)
    assert_close(out.outputs.data, F.normalize(h[:, :16], dim=-1), "16 dimensions")
    assert_no_leaks(llm)


def test_token_tasks_read_no_cached_prefix_and_leave_theirs(embedder, tiny_dir):
    prompt = "Walruses nap " + PROMPTS[2]  # 30+ tokens not seen before: one full block to hit
    first = embedder.embed([prompt], use_tqdm=False)[0]
    tokens = embedder.encode([prompt], pooling_task="token_embed", use_tqdm=False)[0]
    assert tokens.num_cached_tokens == 0 and tokens.outputs.data.shape[0] == len(first.prompt_token_ids)
    assert_close(tokens.outputs.data, F.normalize(hf_hidden(tiny_dir, tokens.prompt_token_ids), dim=-1), "no hit")
    again = embedder.embed([prompt], use_tqdm=False)[0]  # (the cache stays on for the sequence tasks)
    assert again.num_cached_tokens >= 16 and embedder.llm_engine.block_manager.enable_prefix_caching
    assert_no_leaks(embedder)


def test_a_recomputed_token_request_gathers_its_rows_from_the_start(tiny_dir, monkeypatch):
    """The half-gathered prompt is preempted once (test_pooling.preempt_once): its rows start again."""
    llm = LLM(model=str(tiny_dir), runner="pooling", kv_cache_memory=KV, max_num_batched_tokens=8)
    preempted = preempt_once(llm, monkeypatch)
    out = llm.encode([PROMPTS[0]], pooling_task="token_embed", use_tqdm=False)[0]
    assert preempted and llm.llm_engine.scheduler.stats.num_preemptions == 1
    assert_close(out.outputs.data, F.normalize(hf_hidden(tiny_dir, out.prompt_token_ids), dim=-1), "after a recompute")
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def token_classifiers(tmp_path_factory, default_model_dir) -> dict[str, tuple[Path, torch.nn.Module]]:
    return {kind: save_tiny_classifier(kind, tmp_path_factory.mktemp(f"tok_{kind}"), default_model_dir, 3, seed=seed,
                                       head="Token")
            for seed, kind in enumerate(["llama", "qwen3", "qwen2", "mistral"])}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_token_classify_equals_transformers_token_classification(token_classifiers, arch):
    model_dir, hf = token_classifiers[arch]
    llm = LLM(model=str(model_dir), kv_cache_memory=KV, max_num_batched_tokens=8)  # (runner "auto": pooling)
    assert llm.llm_engine.runner_type == "pooling" and llm.supported_tasks == ("token_classify",)
    probs = llm.encode(PROMPTS, pooling_task="token_classify", use_tqdm=False)
    logits = llm.encode(PROMPTS[:2], PoolingParams(use_activation=False), pooling_task="token_classify", use_tqdm=False)
    assert llm.llm_engine.scheduler.stats.num_chunked_prefills > 0
    for i, out in enumerate(probs):
        with torch.no_grad():
            want = hf(torch.tensor([out.prompt_token_ids])).logits[0].float()
        assert out.outputs.data.shape == (len(out.prompt_token_ids), 3)
        assert_close(out.outputs.data, want.softmax(-1), f"{arch} prompt {i} probs")
        if i < len(logits):
            assert_close(logits[i].outputs.data, want, f"{arch} prompt {i} logits")
    if arch == "llama":  # vLLM's deprecated LLM.reward: the token rewards
        with pytest.warns(DeprecationWarning, match="LLM.reward is deprecated"):
            rewards = llm.reward(PROMPTS[:2], use_tqdm=False)
        assert [r.outputs.data.tolist() for r in rewards] == [p.outputs.data.tolist() for p in probs[:2]]
    assert_no_leaks(llm)


def test_a_sequence_classifier_classifies_each_token_too(tmp_path, default_model_dir):
    model_dir, hf = save_tiny_classifier("qwen3", tmp_path / "seq", default_model_dir, 3, seed=5)
    llm = LLM(model=str(model_dir), runner="pooling", kv_cache_memory=KV, max_num_batched_tokens=8)
    assert llm.supported_tasks == ("classify", "score", "token_classify")
    out = llm.encode(PROMPTS[0], pooling_task="token_classify", use_tqdm=False)[0]
    seq = llm.classify(PROMPTS[0], use_tqdm=False)[0]
    with torch.no_grad():
        h = hf.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0].float()
    assert_close(out.outputs.data, hf.score(h).softmax(-1), "each token's probabilities")
    assert_close(out.outputs.data[-1], torch.tensor(seq.outputs.probs), "the last token's is classify's")
    assert_no_leaks(llm)


def test_bad_token_task_requests_are_refused_naming_the_field(token_classifiers, embedder):
    llm = LLM(model=str(token_classifiers["llama"][0]), kv_cache_memory=KV)
    for params, message in [(PoolingParams(dimensions=8), "dimensions: the token_classify task does not take it"),
                            (PoolingParams(normalize=False), "normalize: the token_classify task")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            llm.encode(["A good prompt", "Hi"], params, pooling_task="token_classify", use_tqdm=False)
        assert_no_leaks(llm)
    for task in ("classify", "embed", "token_embed"):
        with pytest.raises(ValueError, match=rf"pooling_task='{task}' is not supported by this model"):
            llm.encode(["Hi"], pooling_task=task, use_tqdm=False)
    with pytest.raises(ValueError, match="Classification API is not supported"):
        llm.classify(["Hi"], use_tqdm=False)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        embedder.encode(["Hi"], PoolingParams(dimensions=8), pooling_task="token_embed", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task='token_classify' is not supported"):
        embedder.reward(["Hi"], use_tqdm=False)
    assert_no_leaks(llm)
    assert_no_leaks(embedder)
