"""Prompt-lookup drafts: text that repeats (quoting the prompt, editing code, lists) is
guessed from where its last few tokens occurred before. No model, no state: a proposal is a
function of the sequence's tokens, so a stale or wrong guess costs compute, never correctness
(the target model verifies every drafted token)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k, self.min_n, self.max_n = num_speculative_tokens, min_n, max_n

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """``k`` (at most ``max_tokens``) tokens that followed the latest earlier occurrence of the
        longest suffix of ``token_ids`` of ``min_n``..``max_n`` tokens; [] when none occurs. A
        match close to the end continues as the sequence did from there (a loop goes on
        looping), so the proposal is always ``k`` long."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        # candidates: windows that end before the last token (something follows them)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            windows = sliding_window_view(tokens[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == tokens[n_tokens - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                draft: list[int] = []
                for j in range(start, start + k):  # position j of the sequence, extended by the draft
                    draft.append(int(tokens[j]) if j < n_tokens else draft[j - n_tokens])
                return draft
        return []
