"""A causal LM run as a classifier, as vLLM runs Qwen3-Reranker: ``hf_overrides`` name the
``*ForSequenceClassification`` architecture and ``classifier_from_token``, and the score head is
built from the lm_head rows of those tokens. A tiny random Qwen3ForCausalLM with the default model's
tokenizer scores pairs (LLM.score, the server's /rerank and /score) as transformers' softmax over
the two tokens' last-position logits; vLLM's ``convert`` gets there too; bad fields are refused
naming them."""
from __future__ import annotations

import argparse
import json
import shutil

import httpx
import pytest
import torch
from transformers import Qwen3ForCausalLM

from helpers import save_tiny_classifier, save_tiny_model, tiny_qwen3_config
from test_engine import assert_no_leaks
from test_pooling import KV
from vllmini import LLM, AsyncLLMEngine, EngineArgs, PoolingParams
from vllmini.entrypoints.openai.api_server import build_app

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris, France's capital."]
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}  # fmt: skip
TOL = 1e-5  # (float32 on the CPU)


@pytest.fixture(scope="module")
def lms(tmp_path_factory, default_model_dir):
    """Tiny random Qwen3ForCausalLM checkpoints (the default model's tokenizer): "tied" (lm_head is
    the embedding, as Qwen3-Reranker-0.6B's) and "untied" (its own lm_head.weight)."""
    made = {}
    for seed, (kind, tied) in enumerate([("tied", True), ("untied", False)]):
        torch.manual_seed(seed)
        hf = Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=49152, initializer_range=0.05,
                                                tie_word_embeddings=tied)).eval()  # fmt: skip
        with torch.no_grad():  # (rows wide enough that the pairs score apart, not so wide that they saturate)
            hf.lm_head.weight.normal_(0.0, 0.15)
        made[kind] = (save_tiny_model(hf, tmp_path_factory.mktemp(kind), default_model_dir), hf)
    return made


def token_logits(hf, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """The oracle: transformers' causal LM's last-position logits of ``tokens``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1, tokens].float()


def assert_close(got, want, what: str) -> None:
    err = (torch.as_tensor(got, dtype=torch.float32) - want).abs().max().item()
    assert err < TOL, f"{what}: max abs error {err:.2e} against transformers"


@pytest.mark.parametrize("kind", ["tied", "untied"])
def test_qwen3_reranker_scores_are_transformers_yes_no_softmax(lms, kind):
    model_dir, hf = lms[kind]
    llm = LLM(model=str(model_dir), runner="pooling", hf_overrides=RERANKER, kv_cache_memory=KV,
              max_num_batched_tokens=8)  # fmt: skip
    assert llm.supported_tasks == ("classify", "score", "token_classify") and llm.llm_engine.convert_type == "none"
    tok = llm.get_tokenizer()
    no_yes = [tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")]
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    # (an LLM as reranker reads the pair as one text: no separator, as vLLM's use_sep_token default)
    assert [o.prompt_token_ids for o in outs] == [tok(QUERY + d).input_ids for d in DOCS]
    pair = llm.score("a", "b", use_tqdm=False)[0].prompt_token_ids  # ("ab" is one token, "a" "b" two)
    assert pair == tok("ab").input_ids != tok(text="a", text_pair="b").input_ids
    want = torch.stack([token_logits(hf, o.prompt_token_ids, no_yes).softmax(-1)[1] for o in outs])
    assert_close([o.outputs.score for o in outs], want, f"{kind} scores")
    assert len(set(round(w, 3) for w in want.tolist())) == 3  # (the check means something)
    logits = llm.classify([QUERY + DOCS[0]], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
    yes_minus_no = token_logits(hf, outs[0].prompt_token_ids, no_yes) @ torch.tensor([-1.0, 1.0])
    assert_close(logits[0].outputs.probs, yes_minus_no.reshape(1), f"{kind} logit")
    assert_no_leaks(llm)


def test_no_post_processing_gives_one_label_per_token(lms):
    model_dir, hf = lms["untied"]
    tokens = ["no", "yes", "Paris"]
    llm = LLM(model=str(model_dir), runner="pooling", kv_cache_memory=KV, hf_overrides={
        "architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": tokens,
        "method": "no_post_processing"})  # fmt: skip
    tok = llm.get_tokenizer()
    ids = [tok.convert_tokens_to_ids(t) for t in tokens]
    prompt = tok(QUERY).input_ids
    want = token_logits(hf, prompt, ids)
    out = llm.classify([{"prompt_token_ids": prompt}], use_tqdm=False)[0]
    raw = llm.classify([{"prompt_token_ids": prompt}], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert out.outputs.num_classes == 3
    assert_close(out.outputs.probs, want.softmax(-1), "probs")
    assert_close(raw.outputs.probs, want, "logits")
    with pytest.raises(ValueError, match="num_labels == 1"):  # (three labels: no pair score)
        llm.score(QUERY, DOCS)


def test_convert_classify_and_embed_on_a_causal_lm(lms):
    model_dir, hf = lms["tied"]
    fields = {"classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"}
    converted = LLM(model=str(model_dir), convert="classify", hf_overrides=fields, kv_cache_memory=KV)
    assert (converted.llm_engine.runner_type, converted.llm_engine.convert_type) == ("pooling", "classify")
    assert converted.llm_engine.hf_config.architectures == ["Qwen3ForSequenceClassification"]
    want = torch.tensor([o.outputs.score for o in LLM(model=str(model_dir), runner="pooling", hf_overrides=RERANKER,
                                                      kv_cache_memory=KV).score(QUERY, DOCS, use_tqdm=False)])  # fmt: skip
    for llm in (converted, LLM(model=str(model_dir), task="score", hf_overrides=fields, kv_cache_memory=KV)):
        assert_close([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)], want, "converted")
    # convert="embed": the runner="pooling" default for a causal LM (its lm_head dropped)
    embed = LLM(model=str(model_dir), convert="embed", kv_cache_memory=KV)
    plain = LLM(model=str(model_dir), runner="pooling", kv_cache_memory=KV)
    assert embed.supported_tasks == plain.supported_tasks == ("embed", "token_embed")
    assert embed.llm_engine.convert_type == plain.llm_engine.convert_type == "embed"
    assert embed.embed(["Hi"], use_tqdm=False)[0].outputs.embedding == plain.embed(["Hi"], use_tqdm=False)[0].outputs.embedding


async def test_rerank_and_score_routes_on_the_original_qwen3_reranker(lms):
    model_dir, hf = lms["untied"]
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), runner="pooling", hf_overrides=json.dumps(RERANKER), kv_cache_memory=KV,
        max_model_len=64, served_model_name="rr"))  # fmt: skip
    try:
        tok = engine.get_tokenizer()
        no_yes = [tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")]
        want = [token_logits(hf, tok(QUERY + d).input_ids, no_yes).softmax(-1)[1].item() for d in DOCS]
        order = sorted(range(3), key=lambda i: -want[i])
        transport = httpx.ASGITransport(app=build_app(engine, "rr"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            ranked = (await http.post("/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS})).json()
            assert [r["index"] for r in ranked["results"]] == order
            assert_close([r["relevance_score"] for r in ranked["results"]], torch.tensor([want[i] for i in order]),
                         "rerank")  # fmt: skip
            scored = (await http.post("/score", json={"text_1": QUERY, "text_2": DOCS})).json()
            assert_close([d["score"] for d in scored["data"]], torch.tensor(want), "score")
    finally:
        engine.shutdown()


def test_bad_fields_are_refused_naming_them(lms, tmp_path, default_model_dir):
    model_dir = str(lms["tied"][0])
    arch = {"architectures": ["Qwen3ForSequenceClassification"]}
    two = {**arch, "classifier_from_token": ["no", "yes"]}
    classifier_dir, _ = save_tiny_classifier("qwen3", tmp_path / "cls", default_model_dir, 1)
    for model, kwargs, message in [
        (model_dir, {"hf_overrides": {**RERANKER, "classifier_from_token": ["no", "antidisestablishmentarianism"]}},
         r"classifier_from_token: 'antidisestablishmentarianism' is not a single token .* encodes to 5 token ids"),
        (model_dir, {"hf_overrides": {**RERANKER, "classifier_from_token": ["no", "zzqx"]}}, r"'zzqx' is not a single token"),
        (model_dir, {"hf_overrides": {**two, "method": "from_3_way"}}, r"method='from_3_way' is not supported; one of "
                                                                       r"\['from_2_way_softmax', 'no_post_processing'\]"),
        (model_dir, {"hf_overrides": two}, r"classifier_from_token needs method one of"),
        (model_dir, {"hf_overrides": {**arch, "method": "no_post_processing"}}, r"method='no_post_processing' needs "
                                                                                 r"classifier_from_token"),
        (model_dir, {"hf_overrides": {**RERANKER, "classifier_from_token": ["yes"]}},
         r"is_original_qwen3_reranker=True needs classifier_from_token with the two tokens"),
        (model_dir, {"hf_overrides": {**two, "classifier_from_token": ["a", "b", "c"], "method": "from_2_way_softmax"}},
         r"method='from_2_way_softmax' needs two classifier_from_token, got 3"),
        (model_dir, {"hf_overrides": {**two, "classifier_from_token": "yes", "method": "no_post_processing"}},
         r"classifier_from_token must be a non-empty list of token strings"),
        (model_dir, {"hf_overrides": {**RERANKER, "method": "no_post_processing"}},
         r"is_original_qwen3_reranker=True means method='from_2_way_softmax'"),
        (str(classifier_dir), {"hf_overrides": RERANKER}, r"the checkpoint already has a classifier head \(score.weight\)"),
        (model_dir, {"hf_overrides": arch, "runner": "pooling"}, r"does not provide these parameters: score.weight.*"
                                                                 r"classifier_from_token and method"),
        (model_dir, {"convert": "classify"}, r"score.weight.*classifier_from_token and method"),
        (model_dir, {"runner": "pooling", "convert": "none"}, r"is a causal LM, not a pooling model.*convert='embed'"),
        (str(classifier_dir), {"convert": "embed"}, r"convert='embed': architecture .* is a classifier"),
        (model_dir, {"convert": "classify", "runner": "generate"}, r"convert='classify' adapts a model to runner='pooling'"),
        (model_dir, {"convert": "reward"}, r"convert must be one of \['auto', 'none', 'embed', 'classify'\]"),
        (model_dir, {"task": "embed", "convert": "classify"}, r"task='embed' and convert='classify' disagree"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            LLM(model=model, kv_cache_memory=KV, **kwargs)
    # the fields are read only on a sequence classifier: a generating engine ignores them
    gen = LLM(model=model_dir, hf_overrides={"classifier_from_token": ["no", "yes"]}, kv_cache_memory=KV)
    assert gen.llm_engine.runner_type == "generate"


def test_a_phi3_causal_lm_has_no_classifier_to_convert_to(tmp_path, tiny_dir):
    phi = shutil.copytree(tiny_dir, tmp_path / "phi")
    config = json.loads((phi / "config.json").read_text())
    (phi / "config.json").write_text(json.dumps({**config, "architectures": ["Phi3ForCausalLM"]}))
    with pytest.raises(ValueError, match=r"convert='classify' is not built for architecture \['Phi3ForCausalLM'\]"):
        LLM(model=str(phi), convert="classify", kv_cache_memory=KV)


def test_convert_is_a_command_line_flag():
    from vllmini.cli_args import _add_engine_args, _engine_args

    parser = argparse.ArgumentParser()
    _add_engine_args(parser)
    args = _engine_args(parser.parse_args(["--convert", "classify", "--hf-overrides", json.dumps(RERANKER)]))
    assert args.convert == "classify" and json.loads(args.hf_overrides) == RERANKER


def test_skip_tokenizer_init_still_reads_the_tokens_with_the_tokenizer(lms):
    model_dir, hf = lms["untied"]
    llm = LLM(model=str(model_dir), runner="pooling", hf_overrides=RERANKER, skip_tokenizer_init=True, kv_cache_memory=KV)
    assert llm.llm_engine.tokenizer is None
    prompt = list(range(100, 120))
    out = llm.classify([{"prompt_token_ids": prompt}], use_tqdm=False)[0]
    assert_close(out.outputs.probs, token_logits(hf, prompt, [4607, 10407]).softmax(-1)[1:], "token-id prompt")
