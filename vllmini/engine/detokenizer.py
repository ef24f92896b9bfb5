"""Incremental detokenization: per step, decode only a small window of recent tokens.

Byte-level BPE and SentencePiece tokens do not map one-to-one to characters: a
multi-byte character can span tokens and a leading space depends on the previous
token. So each step decodes the window ``[prefix_offset:]`` and the already-emitted
part ``[prefix_offset:read_offset]`` and emits the difference, holding it back while it
ends in an incomplete UTF-8 sequence (U+FFFD). Work per step is O(window), not O(output).
"""
from __future__ import annotations

from typing import Any

_CONTEXT = 5  # prompt tokens decoded before the first output token, for correct leading spaces


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.read_offset = len(prompt_token_ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT, 0)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """Feed the sequence's full token list; returns the new text (may be empty).
        ``final`` flushes an incomplete trailing character as U+FFFD, as a full decode would."""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += delta
        return delta
