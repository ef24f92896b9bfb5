"""Speculative decoding counters, vLLM's: how many drafts were verified, how many of their
tokens, and how many of those the target model accepted (in total and per draft position)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verifications: one per sequence per step that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at position j

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for j in range(num_accepted):
            self.num_accepted_tokens_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification, the bonus token included (vLLM's "mean acceptance length")."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
