"""Incremental detokenization: per step, decode only a small window of recent tokens.

Byte-level BPE and SentencePiece tokens do not map one-to-one to characters: a
multi-byte character can span tokens and a leading space depends on the previous
token. So each step decodes the window ``[prefix_offset:]`` and the already-emitted
part ``[prefix_offset:read_offset]`` and emits the difference. While the window ends in
U+FFFD (maybe an incomplete UTF-8 sequence that the next token completes), only the text
up to the latest token boundary that later tokens can no longer change is emitted, so a
run of invalid bytes neither stalls the stream nor grows the window. Work per step is
O(window + new tokens), not O(output).
"""
from __future__ import annotations

from typing import Any

_CONTEXT = 5  # prompt tokens decoded before the first output token, for correct leading spaces
UTF8_MAX_BYTES = 4  # a UTF-8 character has <= 4 bytes: the token boundaries tried behind a trailing U+FFFD
_MAX_WINDOW = 16  # tokens decoded to no new text (skipped special tokens) stop keeping the window start
FFFD = "\ufffd"  # what decode gives for bytes that are not (yet) a whole character


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A fast tokenizer's decode (without clean-up) is its Rust backend's decode behind ~2.5 us
        # of Python per call; two calls per sequence per step make that worth skipping.
        self._backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        self.read_offset = len(prompt_token_ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT, 0)
        if self._decode(prompt_token_ids[self.prefix_offset :]).endswith(FFFD):
            # The prompt may end inside a character: decode the output on its own, as
            # ``decode(output_ids)`` does, rather than joining its first bytes to the prompt's.
            self.prefix_offset = self.read_offset
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """Feed the sequence's full token list; returns the new text (may be empty).
        ``final`` flushes an incomplete trailing character as U+FFFD, as a full decode would
        (the tests compare with one so; a request ends without it, leaving the pieces out as vLLM)."""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        end, text = len(token_ids), self._decode(token_ids[self.prefix_offset :])
        if text.endswith(FFFD) and not final:
            end, text = self._stable_end(token_ids, text)
        if end == self.read_offset:
            return ""
        delta = text[len(prefix) :]  # prefix ends on a stable boundary, so text starts with it
        if delta or end - self.prefix_offset > _MAX_WINDOW:
            self.prefix_offset, self.read_offset = self.read_offset, end
        self.text += delta
        return delta

    def _stable_end(self, token_ids: list[int], text: str) -> tuple[int, str]:
        """The latest token boundary ``m`` (of the last few) whose text can no longer change, and
        the window's text up to it: decoding ``[:m]`` and ``[m:]`` apart gives the same text as
        together, and ``[m:]`` has text, so any bytes pending at ``m`` are already resolved."""
        n = len(token_ids)
        for m in range(n - 1, max(self.read_offset, n - 1 - UTF8_MAX_BYTES), -1):
            head, tail = self._decode(token_ids[self.prefix_offset : m]), self._decode(token_ids[m:])
            if tail and head + tail == text:
                return m, head
        return self.read_offset, ""
