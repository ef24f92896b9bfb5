"""vLLM's score task: a relevance score per (text_1, text_2) pair, shared by ``LLM.score`` and the
server's ``/score`` and ``/rerank``. The pairs are 1:1, 1:N (the one text_1 against every text_2)
or N:N, as vLLM takes them.

- An embedding model scores a pair by the cosine similarity of the two texts' embeddings (each
  text is embedded once: text_1's one text is not embedded N times).
- A classifier with one label (a cross-encoder / reranker, e.g. a ``*ForSequenceClassification``
  reranker) reads the pair as one input, tokenized as a pair (``tokenizer(text, text_pair)``,
  vLLM's default for cross-encoders; ``use_sep_token: false`` in config.json: the two texts joined
  into one), and the score is its head's logit through the score activation (a sigmoid unless
  config.json names another: engine/classifier_activation.py).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vllmini.engine.outputs import PoolingOutput, PoolingRequestOutput


def score_texts(data: Any, field: str, tokenizer: Any) -> list[str]:
    """One side of the pairs as a list of strings: a string, a ``{"prompt": ...}`` or
    ``{"prompt_token_ids": [...]}`` prompt (decoded, as vLLM's LLM.score does), or a list of them."""
    items = [data] if isinstance(data, (str, dict)) else data
    if not isinstance(items, (list, tuple)) or not items:
        raise ValueError(f"{field} must be a string or a non-empty list of strings")
    texts = []
    for i, item in enumerate(items):
        where = field if isinstance(data, (str, dict)) else f"{field}[{i}]"
        if isinstance(item, dict) and isinstance(item.get("prompt_token_ids"), list):
            item = tokenizer.decode(item["prompt_token_ids"])
        elif isinstance(item, dict) and "prompt" in item:
            item = item["prompt"]
        if not isinstance(item, str):
            raise ValueError(f"{where} must be a string (or a text or token-ids prompt), got {type(item).__name__}")
        if not item:
            raise ValueError(f"{where} is an empty string")
        texts.append(item)
    return texts


def check_pairing(texts_1: list[str], texts_2: list[str], fields: tuple[str, str] = ("text_1", "text_2")) -> None:
    """vLLM's rule: 1:1, 1:N or N:N."""
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise ValueError(f"{fields[0]} has {len(texts_1)} texts and {fields[1]} {len(texts_2)}: the input lengths must "
                         "be 1:1, 1:N or N:N")  # fmt: skip


def check_cross_encoder(hf_config: Any) -> None:
    """A classifier scores pairs only with one label (its relevance logit), as in vLLM."""
    if getattr(hf_config, "num_labels", 0) != 1:
        raise ValueError(f"Score API is only enabled for num_labels == 1; this classifier has "
                         f"num_labels={getattr(hf_config, 'num_labels', None)} (use classify)")  # fmt: skip


def cross_encoder_prompts(tokenizer: Any, hf_config: Any, texts_1: list[str], texts_2: list[str]) -> list[list[int]]:
    """The token ids of each pair as one cross-encoder input (text_1's one text repeated for 1:N)."""
    if len(texts_1) == 1:
        texts_1 = texts_1 * len(texts_2)
    use_pad = getattr(hf_config, "use_pad_token", None)  # (vLLM's older name)
    use_sep = use_pad if use_pad is not None else getattr(hf_config, "use_sep_token", True)
    if use_sep:
        return [tokenizer(text=q, text_pair=d).input_ids for q, d in zip(texts_1, texts_2)]
    return [tokenizer(q + d).input_ids for q, d in zip(texts_1, texts_2)]


def score_prompts(tasks: tuple[str, ...], tokenizer: Any, hf_config: Any, texts_1: list[str], texts_2: list[str],
                  fields: tuple[str, str]) -> tuple[list[Any], str]:  # fmt: skip
    """What to pool for the pairs, and the task to pool it with: a cross-encoder's pair inputs
    ("score"), else every text once ("embed": text_1's texts, then text_2's)."""
    check_pairing(texts_1, texts_2, fields)
    if "score" in tasks:
        check_cross_encoder(hf_config)
        return cross_encoder_prompts(tokenizer, hf_config, texts_1, texts_2), "score"
    return texts_1 + texts_2, "embed"


def pair_scores(outs: list[PoolingRequestOutput], task: str, num_texts_1: int,
                pad_token_id: int | None) -> list[PoolingRequestOutput]:  # fmt: skip
    """One output per pair from what ``score_prompts``' inputs pooled to: a cross-encoder's as they
    are, embeddings through their cosine similarity."""
    if task == "score":
        return outs
    return cosine_scores(outs[:num_texts_1], outs[num_texts_1:], pad_token_id)


def cosine_scores(outs_1: list[PoolingRequestOutput], outs_2: list[PoolingRequestOutput],
                  pad_token_id: int | None) -> list[PoolingRequestOutput]:  # fmt: skip
    """Each pair's cosine similarity (a 0-d float32 tensor); its prompt is the two prompts joined
    by the pad token when the tokenizer has one (what vLLM counts as the pair's prompt tokens)."""
    if len(outs_1) == 1:
        outs_1 = outs_1 * len(outs_2)
    pad = [] if pad_token_id is None else [pad_token_id]
    scores = []
    for a, b in zip(outs_1, outs_2):
        score = F.cosine_similarity(a.outputs.data.float(), b.outputs.data.float(), dim=0)
        scores.append(PoolingRequestOutput(f"{a.request_id}_{b.request_id}", PoolingOutput(score.to(torch.float32)),
                                           a.prompt_token_ids + pad + b.prompt_token_ids,
                                           a.num_cached_tokens + b.num_cached_tokens))  # fmt: skip
    return scores
