"""The pooling runner's classify and score tasks: ``*ForSequenceClassification`` checkpoints
(Llama, Qwen3) classify as transformers' ``AutoModelForSequenceClassification`` does (softmax /
sigmoid / logits, through chunked prefill), a one-label classifier scores pairs as a cross-encoder
on the tokenizer's pair encoding, an embedding model scores by the cosine of transformers'
embeddings; vLLM's activation rules, and bad input refused naming it with nothing leaked."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from helpers import save_tiny_classifier
from test_engine import assert_no_leaks
from test_pooling import KV, PROMPTS, TOL, assert_close
from vllmini import (LLM, ClassificationRequestOutput, EngineArgs, PoolingParams, PoolingRequestOutput,
                     ScoringRequestOutput)  # fmt: skip
from vllmini.engine.classifier_activation import classifier_activation
from vllmini.engine.scoring import cross_encoder_prompts

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris, France's capital."]


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory, default_model_dir) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Three-label classifiers (Llama, Qwen3, Qwen2, Mistral) and a one-label Llama reranker
    (cross-encoder)."""
    made = {kind: save_tiny_classifier(kind, tmp_path_factory.mktemp(f"cls_{kind}"), default_model_dir, 3, seed=seed)
            for seed, kind in enumerate(["llama", "qwen3", "qwen2", "mistral"])}  # fmt: skip
    return {**made, "reranker": save_tiny_classifier("llama", tmp_path_factory.mktemp("rerank"), default_model_dir, 1, seed=9)}


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The oracle: transformers' sequence classifier (the last token's score head)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral"])
def test_classify_equals_transformers_through_chunked_prefill(classifiers, arch):
    model_dir, hf = classifiers[arch]
    llm = LLM(model=str(model_dir), runner="pooling", kv_cache_memory=KV, max_num_batched_tokens=8)
    assert llm.llm_engine.runner_type == "pooling" and llm.supported_tasks == ("classify", "score", "token_classify")
    outs = llm.classify(PROMPTS, use_tqdm=False)
    logits = llm.classify(PROMPTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    encoded = llm.encode(PROMPTS[:2], pooling_task="classify", use_tqdm=False)
    assert llm.llm_engine.scheduler.stats.num_chunked_prefills > 0
    tok = llm.get_tokenizer()
    for i, (prompt, out, raw) in enumerate(zip(PROMPTS, outs, logits)):
        ids = tok(prompt).input_ids
        want = hf_logits(hf, ids)
        assert isinstance(out, ClassificationRequestOutput) and out.finished and out.prompt_token_ids == ids
        assert out.outputs.num_classes == 3 and abs(sum(out.outputs.probs) - 1) < 1e-5
        assert_close(out.outputs.probs, want.softmax(-1), f"{arch} prompt {i} probs")
        assert_close(raw.outputs.probs, want, f"{arch} prompt {i} logits")
    for e, out in zip(encoded, outs):
        assert isinstance(e, PoolingRequestOutput) and e.outputs.data.dtype == torch.float32
        assert e.outputs.data.tolist() == out.outputs.probs
    assert_no_leaks(llm)


def test_a_one_label_cross_encoder_scores_pairs_as_transformers(classifiers):
    model_dir, hf = classifiers["reranker"]
    llm = LLM(model=str(model_dir), task="score", kv_cache_memory=KV, max_num_batched_tokens=8)
    tok = llm.get_tokenizer()
    pair_ids = [tok(text=QUERY, text_pair=d).input_ids for d in DOCS]
    want = [torch.sigmoid(hf_logits(hf, ids))[0].item() for ids in pair_ids]
    one_to_n = llm.score(QUERY, DOCS, use_tqdm=False)
    n_to_n = llm.score([QUERY] * 3, DOCS, use_tqdm=False)
    one_to_one = llm.score({"prompt_token_ids": tok(QUERY).input_ids}, DOCS[1], use_tqdm=False)  # (decoded, as vLLM)
    for outs in (one_to_n, n_to_n):
        assert [type(o) for o in outs] == [ScoringRequestOutput] * 3
        assert [o.prompt_token_ids for o in outs] == pair_ids
        assert_close([o.outputs.score for o in outs], torch.tensor(want), "cross-encoder scores")
    assert len(one_to_one) == 1 and abs(one_to_one[0].outputs.score - want[1]) < TOL
    # the logit itself, and classify on a one-label model: a sigmoid, as vLLM
    raw = llm.score(QUERY, DOCS[:1], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    assert abs(raw[0].outputs.score - hf_logits(hf, pair_ids[0])[0].item()) < TOL
    assert abs(llm.classify([pair_ids[0]], use_tqdm=False)[0].outputs.probs[0] - want[0]) < TOL
    assert_no_leaks(llm)


def test_an_embedding_model_scores_by_cosine_similarity(tiny_dir):
    llm = LLM(model=str(tiny_dir), runner="pooling", kv_cache_memory=KV)
    assert llm.supported_tasks == ("embed", "token_embed")
    tok, base = llm.get_tokenizer(), AutoModel.from_pretrained(tiny_dir).eval()

    def embedding(text: str) -> torch.Tensor:
        with torch.no_grad():
            return base(torch.tensor([tok(text).input_ids])).last_hidden_state[0, -1].float()

    q, docs = embedding(QUERY), [embedding(d) for d in DOCS]
    want = torch.stack([F.cosine_similarity(q, d, dim=0) for d in docs])
    one_to_n = llm.score(QUERY, DOCS, use_tqdm=False)
    assert_close([o.outputs.score for o in one_to_n], want, "cosine 1:N")
    n_to_n = llm.score(DOCS, [QUERY] * 3, use_tqdm=False)
    assert_close([o.outputs.score for o in n_to_n], want, "cosine N:N")
    # vLLM's pair prompt: the two prompts joined by the pad token
    assert one_to_n[0].prompt_token_ids == tok(QUERY).input_ids + [tok.pad_token_id] + tok(DOCS[0]).input_ids
    with pytest.raises(ValueError, match="Classification API is not supported by this model"):
        llm.classify(["Hi"])
    assert_no_leaks(llm)


def test_bad_input_is_refused_naming_it_and_leaks_nothing(classifiers, tiny_dir):
    llm = LLM(model=str(classifiers["llama"][0]), runner="pooling", kv_cache_memory=KV, max_model_len=64)
    for call, message in [
        (lambda: llm.score(QUERY, DOCS), r"Score API is only enabled for num_labels == 1; .*num_labels=3"),
        (lambda: llm.embed(["Hi"]), r"pooling_task='embed' is not supported by this model; supported: \['classify'"),
        (lambda: llm.classify(["Hi"], pooling_params=PoolingParams(dimensions=8)), "dimensions: the classify task"),
        (lambda: llm.classify(["Hi"], pooling_params=PoolingParams(normalize=False)), "normalize: the classify task"),
        (lambda: llm.classify(["ok", list(range(100, 180))]), "maximum context length is 64 tokens"),
        (lambda: llm.classify(["ok", ""]), "prompt is empty"),
        (lambda: llm.encode(["Hi"]), "pooling_task is required"),
        (lambda: llm.llm_engine.add_request(None, "Hi", PoolingParams(task="reward")), "pooling_task='reward'"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()
        assert_no_leaks(llm)
    reranker = LLM(model=str(classifiers["reranker"][0]), runner="pooling", kv_cache_memory=KV)
    for args, message in [(([QUERY, QUERY], DOCS), "data_1 has 2 texts and data_2 3: the input lengths must be 1:1, 1:N or N:N"),
                          (([], DOCS), "data_1 must be a string or a non-empty list"),
                          ((QUERY, ["a", ""]), r"data_2\[1\] is an empty string"),
                          ((QUERY, [3]), r"data_2\[0\] must be a string")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            reranker.score(*args)
        assert_no_leaks(reranker)
    with pytest.raises(ValueError, match=r"LLM.score\(\) is only supported for pooling models"):
        LLM(model=str(tiny_dir), kv_cache_memory=KV).score(QUERY, DOCS)
    # vLLM's task spelling: classify / score need a classifier head (vLLM's convert="classify"), embed a model without
    for model, kwargs, message in [(tiny_dir, {"task": "classify"}, "parameters: score.weight; a classifier .* needs"),
                                   (classifiers["llama"][0], {"task": "embed"}, "is a classifier"),
                                   (classifiers["llama"][0], {"runner": "generate"}, "cannot generate")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            LLM(model=str(model), kv_cache_memory=KV, **kwargs)
    EngineArgs(task="classify").validate()


def test_the_activation_follows_the_config_as_in_vllm(classifiers, tmp_path):
    logits = torch.tensor([0.5, -1.0, 2.0])
    one = torch.tensor([0.3])
    cfg = SimpleNamespace
    for config, task, x, want in [
        (cfg(problem_type=None), "classify", logits, logits.softmax(-1)),
        (cfg(problem_type="single_label_classification"), "classify", one, torch.sigmoid(one)),
        (cfg(problem_type="multi_label_classification"), "classify", logits, torch.sigmoid(logits)),
        (cfg(problem_type="regression"), "classify", logits, logits),
        (cfg(), "score", one, torch.sigmoid(one)),
        (cfg(sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"}), "score", one, one),
        (cfg(sbert_ce_default_activation_function="torch.nn.modules.activation.Tanh"), "score", one, torch.tanh(one)),
    ]:  # fmt: skip
        assert torch.allclose(classifier_activation(config, task)(x), want), (config, task)
    with pytest.raises(ValueError, match="sbert_ce_default_activation_function='os.system' is not supported"):
        classifier_activation(cfg(sbert_ce_default_activation_function="os.system"), "score")
    # through the engine: a multi-label classifier's probabilities are per-label sigmoids
    multi = tmp_path / "multi"
    shutil.copytree(classifiers["llama"][0], multi)
    config = json.loads((multi / "config.json").read_text())
    (multi / "config.json").write_text(json.dumps({**config, "problem_type": "multi_label_classification"}))
    out = LLM(model=str(multi), runner="pooling", kv_cache_memory=KV).classify([PROMPTS[0]], use_tqdm=False)[0]
    assert_close(out.outputs.probs, torch.sigmoid(hf_logits(classifiers["llama"][1], out.prompt_token_ids)), "multi-label")
    # vLLM's use_sep_token: false joins the two texts instead of the tokenizer's pair encoding
    tok = AutoTokenizer.from_pretrained(classifiers["llama"][0])
    assert cross_encoder_prompts(tok, cfg(use_sep_token=False), ["a b"], ["c"]) == [tok("a bc").input_ids]
    assert cross_encoder_prompts(tok, cfg(), ["a b"], ["c", "d"]) == [tok(text="a b", text_pair=t).input_ids for t in "cd"]
