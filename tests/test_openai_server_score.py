"""``/score``, ``/rerank`` (``/v1``, ``/v2``) and ``/classify`` on a ``--runner pooling`` server:
a one-label classifier's (cross-encoder) scores and a classifier's probabilities equal
transformers', an embedding model's scores are the cosine of transformers' embeddings, rerank
results are sorted and cut to top_n, bad requests are 400s naming the field with nothing leaked,
and a generating server answers these routes 404."""
from __future__ import annotations

import re
import threading
from typing import Iterator

import httpx
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from helpers import save_tiny_classifier
from test_openai_server import wait_idle
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.entrypoints.openai.api_server import build_app

KV = 16 << 20
NAME = "tiny-pooling"
ARGS = dict(runner="pooling", kv_cache_memory=KV, max_model_len=64, max_num_batched_tokens=32, served_model_name=NAME)
QUERY = "What is the capital of France?"
DOCS = ["Bananas are yellow.", "Paris is the capital of France.", "The Eiffel Tower is in Paris, France's capital."]
TEXTS = ["The capital of France is Paris.", "Hi", "def add(a, b):\n    return a + b"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


@pytest.fixture(scope="module")
def models(tmp_path_factory, default_model_dir, tiny_dir):
    """name -> (folder, transformers model): a one-label reranker, a three-label classifier with
    named labels, and the tiny embedding model."""
    reranker = save_tiny_classifier("llama", tmp_path_factory.mktemp("srv_rerank"), default_model_dir, 1, seed=3)
    classifier = save_tiny_classifier("qwen3", tmp_path_factory.mktemp("srv_cls"), default_model_dir, 3, seed=4,
                                      id2label=LABELS, label2id={v: k for k, v in LABELS.items()})  # fmt: skip
    return {"reranker": reranker, "classifier": classifier, "embed": (tiny_dir, AutoModel.from_pretrained(tiny_dir).eval())}


def start_engines(models: dict) -> Iterator[dict[str, AsyncLLMEngine]]:
    """A pooling engine per model (name -> (folder, ...)), shut down after the module's tests."""
    engs = {name: AsyncLLMEngine.from_engine_args(EngineArgs(model=str(d), **ARGS)) for name, (d, _) in models.items()}
    yield engs
    for eng in engs.values():
        eng.shutdown()


@pytest.fixture(scope="module")
def engines(models):
    yield from start_engines(models)


def client_of(engine) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, NAME)), base_url="http://test")


def hf_out(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf(torch.tensor([ids]))
    return (out.logits[0] if hasattr(out, "logits") else out.last_hidden_state[0, -1]).float()


def assert_scores(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) and max(abs(g - w) for g, w in zip(got, want)) < 1e-4, (got, want)


async def test_score_on_a_cross_encoder_equals_transformers(models, engines):
    tok, hf = engines["reranker"].get_tokenizer(), models["reranker"][1]
    pair_ids = [tok(text=QUERY, text_pair=d).input_ids for d in DOCS]
    want = [torch.sigmoid(hf_out(hf, ids))[0].item() for ids in pair_ids]
    async with client_of(engines["reranker"]) as http:
        body = (await http.post("/score", json={"model": NAME, "text_1": QUERY, "text_2": DOCS})).json()
        assert body["object"] == "list" and body["model"] == NAME and body["id"].startswith("score-")
        assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score"), (2, "score")]
        assert_scores([d["score"] for d in body["data"]], want)
        total = sum(map(len, pair_ids))
        assert body["usage"] == {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0,
                                 "prompt_tokens_details": None}  # fmt: skip
        # N:N under vLLM's newer names, 1:1, and the logit itself (use_activation: false)
        n_to_n = (await http.post("/v1/score", json={"queries": [QUERY] * 3, "documents": DOCS})).json()
        assert_scores([d["score"] for d in n_to_n["data"]], want)
        one = (await http.post("/score", json={"data_1": QUERY, "data_2": DOCS[2], "use_activation": False})).json()
        assert_scores([one["data"][0]["score"]], [hf_out(hf, pair_ids[2])[0].item()])
    await wait_idle(engines["reranker"])


async def test_rerank_sorts_by_relevance_and_keeps_top_n(models, engines):
    tok, hf = engines["reranker"].get_tokenizer(), models["reranker"][1]
    want = [torch.sigmoid(hf_out(hf, tok(text=QUERY, text_pair=d).input_ids))[0].item() for d in DOCS]
    order = sorted(range(3), key=lambda i: -want[i])
    async with client_of(engines["reranker"]) as http:
        bodies = [(await http.post(path, json={"model": NAME, "query": QUERY, "documents": DOCS, "top_n": 2})).json()
                  for path in ("/rerank", "/v1/rerank", "/v2/rerank")]  # fmt: skip
        for body in bodies:
            assert body["id"].startswith("rerank-") and body["model"] == NAME
            assert [r["index"] for r in body["results"]] == order[:2]
            assert [r["document"] for r in body["results"]] == [{"text": DOCS[i]} for i in order[:2]]
            assert_scores([r["relevance_score"] for r in body["results"]], [want[i] for i in order[:2]])
            assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
        for top_n in (0, 10):  # (0, the default: every document)
            every = (await http.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": top_n})).json()
            assert [r["index"] for r in every["results"]] == order
        bare = (await http.post("/rerank", json={"query": QUERY, "documents": DOCS, "return_documents": False})).json()
        assert [sorted(r) for r in bare["results"]] == [["index", "relevance_score"]] * 3
    await wait_idle(engines["reranker"])


async def test_score_and_rerank_on_an_embedding_model_are_cosine_similarities(models, engines):
    tok, hf = engines["embed"].get_tokenizer(), models["embed"][1]
    q = hf_out(hf, tok(QUERY).input_ids)
    want = [F.cosine_similarity(q, hf_out(hf, tok(d).input_ids), dim=0).item() for d in DOCS]
    async with client_of(engines["embed"]) as http:
        body = (await http.post("/score", json={"text_1": QUERY, "text_2": DOCS})).json()
        assert_scores([d["score"] for d in body["data"]], want)
        # (vLLM's pair prompt: both prompts and a pad token between them)
        assert body["usage"]["prompt_tokens"] == sum(len(tok(QUERY).input_ids) + 1 + len(tok(d).input_ids) for d in DOCS)
        ranked = (await http.post("/rerank", json={"query": QUERY, "documents": DOCS})).json()["results"]
        assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -want[i])
    await wait_idle(engines["embed"])


async def test_classify_equals_transformers_with_the_models_labels(models, engines):
    tok, hf = engines["classifier"].get_tokenizer(), models["classifier"][1]
    ids = [tok(t).input_ids for t in TEXTS]
    want = [hf_out(hf, i) for i in ids]
    async with client_of(engines["classifier"]) as http:
        for path, given in [("/classify", TEXTS), ("/v1/classify", ids)]:
            body = (await http.post(path, json={"model": NAME, "input": given})).json()
            assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == NAME
            for i, d in enumerate(body["data"]):
                assert d["index"] == i and d["num_classes"] == 3
                assert d["label"] == LABELS[int(want[i].argmax())]
                assert_scores(d["probs"], want[i].softmax(-1).tolist())
            assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
        raw = (await http.post("/classify", json={"input": TEXTS[0], "use_activation": False})).json()
        assert_scores(raw["data"][0]["probs"], want[0].tolist())
    await wait_idle(engines["classifier"])


@pytest.mark.parametrize("model, path, body, field", [
    ("reranker", "/score", {"text_1": [], "text_2": DOCS}, "text_1 must be a string or a non-empty list"),
    ("reranker", "/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "must be 1:1, 1:N or N:N"),
    ("reranker", "/score", {"text_1": QUERY}, r"text_2 is required \(with text_1\)"),
    ("reranker", "/score", {}, "set exactly one pair of text_1 and text_2"),
    ("reranker", "/score", {"text_1": QUERY, "documents": DOCS}, "set exactly one pair"),
    ("reranker", "/score", {"text_1": 5, "text_2": "a"}, r"\$.text_1"),
    ("reranker", "/v1/score", {"text_1": QUERY, "text_2": ["a", ""]}, r"text_2\[1\] is an empty string"),
    ("reranker", "/score", {"text_1": QUERY, "text_2": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("reranker", "/rerank", {"query": QUERY, "documents": []}, "documents must be a string or a non-empty list"),
    ("reranker", "/rerank", {"documents": DOCS}, "query"),
    ("reranker", "/rerank", {"query": "", "documents": DOCS}, "query is an empty string"),
    ("reranker", "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n must be >= 0"),
    ("reranker", "/v2/rerank", {"query": QUERY, "documents": DOCS, "top_n": "2"}, r"\$.top_n"),
    ("reranker", "/v2/rerank", {"query": QUERY, "documents": [1]}, r"\$.documents\[0\]"),
    ("classifier", "/classify", {"input": []}, "input must be"),
    ("classifier", "/classify", {"input": ["ok", ""]}, r"input\[1\] is an empty string"),
    ("classifier", "/v1/classify", {"model": NAME}, "input is required"),
    ("classifier", "/classify", {"input": "Hi", "use_activation": "no"}, r"\$.use_activation"),
    ("classifier", "/classify", {"input": "Hi", "use_activation": True, "softmax": False}, "disagree"),
    ("classifier", "/classify", {"input": list(range(100, 180))}, "maximum context length is 64 tokens"),
    # a model without the task
    ("classifier", "/score", {"text_1": QUERY, "text_2": DOCS}, "Score API is only enabled for num_labels == 1"),
    ("classifier", "/v1/embeddings", {"input": "Hi"}, r"pooling_task='embed' is not supported by this model"),
    ("embed", "/classify", {"input": "Hi"}, r"does not support the Classification API \(its pooling tasks: \['embed', 'token_embed'\]"),
])  # fmt: skip
async def test_bad_requests_are_400s_naming_the_field(engines, model, path, body, field):
    engine = engines[model]
    async with client_of(engine) as http:
        response = await http.post(path, json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert re.search(field, error["message"]), error["message"]
        ok = await http.post("/rerank" if model != "classifier" else "/classify",
                             json={"query": QUERY, "documents": DOCS} if model != "classifier" else {"input": "ok"})  # fmt: skip
        assert ok.status_code == 200  # (others are unaffected)
    await wait_idle(engine)  # (no KV block leaked)


async def test_inputs_are_tokenized_off_the_event_loop_once(engines, monkeypatch):
    """As the generating routes (vLLM's async tokenizer): a long input took seconds to tokenize on
    the event loop, holding every other stream meanwhile; the pooling routes tokenize on the
    tokenizer thread, each text once (twice when truncated: the text again, to keep BOS)."""
    seen: list[str] = []
    for cls in {type(engine.get_tokenizer()) for engine in engines.values()}:
        def spy(self, text=None, *args, original=cls.__call__, **kwargs):
            if "MARK" in f"{text}{kwargs.get('text_pair')}":
                seen.append(threading.current_thread().name)
            return original(self, text, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", spy)
    chat = {"messages": [{"role": "user", "content": "MARK"}]}
    for model, path, body, calls in (
        ("embed", "/v1/embeddings", {"input": "MARK"}, 1), ("embed", "/v1/embeddings", chat, 1),
        ("embed", "/v1/embeddings", {"input": ["MARK a b c", "MARK"], "truncate_prompt_tokens": 2}, 3),
        ("embed", "/v1/embeddings", {"input": "MARK", "add_special_tokens": False}, 1),
        ("embed", "/pooling", {"input": ["MARK", "MARK"]}, 2), ("embed", "/pooling", chat, 1),
        ("embed", "/score", {"text_1": "MARK", "text_2": ["MARK b", "MARK c"]}, 3),
        ("embed", "/rerank", {"query": "MARK", "documents": ["MARK b"]}, 2),
        ("reranker", "/score", {"text_1": "MARK", "text_2": ["MARK b", "MARK c"]}, 2),
        ("reranker", "/rerank", {"query": "MARK", "documents": ["MARK b"]}, 1),
        ("classifier", "/classify", {"input": ["MARK", "MARK b"]}, 2),
        ("classifier", "/classify", {"input": "MARK", "add_special_tokens": False}, 1),
    ):  # fmt: skip
        seen.clear()
        async with client_of(engines[model]) as http:
            r = await http.post(path, json=body)
        assert r.status_code == 200, r.text
        assert len(seen) == calls and all(name.startswith("vllmini-tokenize") for name in seen), (path, body, seen)
    for engine in engines.values():
        await wait_idle(engine)


async def test_a_generating_server_answers_the_pooling_routes_404(tiny_dir):
    generating = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=KV, served_model_name=NAME))
    try:
        async with client_of(generating) as http:
            for path, body in [("/score", {"text_1": "a", "text_2": "b"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                               *((p, {"query": "a", "documents": ["b"]}) for p in ("/rerank", "/v1/rerank", "/v2/rerank")),
                               ("/classify", {"input": "a"}), ("/v1/classify", {"input": "a"})]:  # fmt: skip
                response = await http.post(path, json=body)
                assert response.status_code == 404, (path, response.text)
                assert "--runner pooling" in response.json()["error"]["message"]
            assert (await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})).status_code == 200
    finally:
        await generating.shutdown()
