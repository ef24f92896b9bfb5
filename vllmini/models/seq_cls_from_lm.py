"""A ``*ForSequenceClassification`` whose checkpoint is a causal LM (vLLM's online conversion, as
for Qwen3-Reranker): config.json's (or ``hf_overrides``') ``classifier_from_token`` names tokens of
the model's tokenizer, and the ``score`` head is built from the lm_head rows of those tokens.

``method`` says how, as vLLM's:

- ``from_2_way_softmax`` (two tokens, e.g. ``["no", "yes"]``): one label, whose logit is
  row(second) - row(first), so that its sigmoid is the softmax of the two tokens' logits, taken
  for the second (the reranker's P("yes") over {"no", "yes"});
- ``no_post_processing``: one label per token, its logit the token's own (e.g. bge-reranker-v2-gemma,
  ``["Yes"]``).

``is_original_qwen3_reranker: true`` (read on ``Qwen3ForSequenceClassification``, as vLLM does)
means ``from_2_way_softmax`` over its two ``classifier_from_token``. Such a model scores its pairs
as one text, query then document, unless config.json sets ``use_sep_token`` (vLLM's default for
an LLM as reranker). The rows are read in float32 as the checkpoint streams by (engine memory
holds no lm_head): the lm_head's, or, when the model ties them and the checkpoint has no
lm_head, the input embeddings'.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

logger = logging.getLogger(__name__)

SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")
_FIELDS = ("classifier_from_token", "method", "is_original_qwen3_reranker")


@dataclass
class ScoreFromTokens:
    """What builds the score head: the token strings, the method, and (once the tokenizer has been
    read: ``resolve_token_ids``) their ids; the rows caught while the checkpoint loads."""

    tokens: list[str]
    method: str
    token_ids: list[int] = field(default_factory=list)
    _rows: dict[str, torch.Tensor] = field(default_factory=dict)

    def resolve_token_ids(self, tokenizer: Any, vocab_size: int) -> None:
        self.token_ids = [token_id(tokenizer, token, vocab_size) for token in self.tokens]

    def capture(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, passed on; the rows of ``token_ids`` in lm_head and in the input
        embeddings kept aside. A checkpoint with a ``score`` head of its own is refused: which head
        is meant would be a guess."""
        for name, tensor in weights:
            if name.startswith("score."):
                raise ValueError(f"classifier_from_token={self.tokens}: the checkpoint already has a classifier "
                                 f"head ({name}); drop classifier_from_token / method / is_original_qwen3_reranker "
                                 "to use it")  # fmt: skip
            key = "lm_head" if name == "lm_head.weight" else "embed" if name.removeprefix("model.") == \
                "embed_tokens.weight" else None  # fmt: skip
            if key is not None:
                self._rows[key] = tensor[self.token_ids].to(torch.float32, copy=True)
            yield name, tensor

    def score_weight(self, tied: bool) -> torch.Tensor:
        """The head's weight [num_labels, hidden], float32, from the rows ``capture`` kept."""
        rows = self._rows.get("lm_head")  # (a tied checkpoint's own lm_head wins, as in models/llama.py)
        rows = self._rows.get("embed") if rows is None and tied else rows
        if rows is None:
            raise ValueError(f"classifier_from_token={self.tokens}: the checkpoint has no "
                             f"{'input embeddings' if tied else 'lm_head.weight'} to build the score head from "
                             f"(tie_word_embeddings={tied})")  # fmt: skip
        self._rows.clear()
        if self.method == "from_2_way_softmax":
            return rows[1:2] - rows[0:1]
        return rows


def token_id(tokenizer: Any, token: str, vocab_size: int) -> int:
    """``token``'s id: the vocabulary's entry of that spelling (vLLM's lookup), else the one id the
    tokenizer encodes it to ("yes" with a leading space in a byte-level BPE); anything else is a
    ValueError naming it."""
    found = tokenizer.convert_tokens_to_ids(token)
    unknown = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(found, int) or (found == unknown and token != getattr(tokenizer, "unk_token", None)):
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"classifier_from_token: {token!r} is not a single token of the model's tokenizer "
                             f"(it encodes to {len(ids)} token ids {ids}); name tokens as its vocabulary spells them")  # fmt: skip
        found = ids[0]
    if not 0 <= found < vocab_size:
        raise ValueError(f"classifier_from_token: {token!r} is token id {found}, outside the model's vocabulary "
                         f"of {vocab_size} rows")  # fmt: skip
    return found


def resolve_score_from_tokens(config: Any) -> ScoreFromTokens | None:
    """The conversion config.json (with ``hf_overrides``) asks for, checked; None when it asks for
    none. ``config`` is updated as vLLM's is: ``num_labels`` (1 for from_2_way_softmax, else one
    per token) and ``use_sep_token`` (False unless given). Read only on a
    ``*ForSequenceClassification`` architecture; elsewhere the fields are logged as ignored."""
    from vllmini.models.registry import is_classifier_architecture, is_token_classifier_architecture

    given = [name for name in _FIELDS if getattr(config, name, None) not in (None, False)]
    if not given:
        return None
    architectures = getattr(config, "architectures", None)
    if not is_classifier_architecture(architectures) or is_token_classifier_architecture(architectures):
        logger.warning("%s ignored: read only on a *ForSequenceClassification architecture (hf_overrides' "
                       "architectures, or convert='classify'), not %s", ", ".join(given), architectures)  # fmt: skip
        return None
    tokens = getattr(config, "classifier_from_token", None)
    method = getattr(config, "method", None)
    if tokens is not None and (not isinstance(tokens, (list, tuple)) or not tokens
                               or not all(isinstance(t, str) and t for t in tokens)):  # fmt: skip
        raise ValueError(f"classifier_from_token must be a non-empty list of token strings, got {tokens!r}")
    original = getattr(config, "is_original_qwen3_reranker", False)
    if original not in (None, True, False):
        raise ValueError(f"is_original_qwen3_reranker must be true or false, got {original!r}")
    if original and architectures and "Qwen3ForSequenceClassification" in architectures:
        if tokens is None or len(tokens) != 2:
            raise ValueError("is_original_qwen3_reranker=True needs classifier_from_token with the two tokens it "
                             f"compares (the original Qwen3-Reranker's: [\"no\", \"yes\"]), got {tokens!r}")  # fmt: skip
        if method not in (None, "from_2_way_softmax"):
            raise ValueError(f"is_original_qwen3_reranker=True means method='from_2_way_softmax', but "
                             f"method={method!r} was given")  # fmt: skip
        method = config.method = "from_2_way_softmax"
    elif original:
        logger.warning("is_original_qwen3_reranker ignored: read only on Qwen3ForSequenceClassification, not %s",
                       architectures)  # fmt: skip
    if tokens is None and method is None:
        return None
    if tokens is None:
        raise ValueError(f"method={method!r} needs classifier_from_token: the tokens whose lm_head rows make the "
                         "score head")  # fmt: skip
    if method not in SEQ_CLS_METHODS:
        need = "needs method" if method is None else f"method={method!r} is not supported;"
        raise ValueError(f"classifier_from_token {need} one of {list(SEQ_CLS_METHODS)} (or "
                         "is_original_qwen3_reranker=True on Qwen3ForSequenceClassification)")  # fmt: skip
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"method='from_2_way_softmax' needs two classifier_from_token, got {len(tokens)}: {list(tokens)}")
    config.num_labels = 1 if method == "from_2_way_softmax" else len(tokens)
    if getattr(config, "use_sep_token", None) is None and getattr(config, "use_pad_token", None) is None:
        config.use_sep_token = False
    return ScoreFromTokens(list(tokens), method)
