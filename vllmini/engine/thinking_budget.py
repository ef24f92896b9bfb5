"""vLLM's thinking token budget: ``SamplingParams.thinking_token_budget`` caps the tokens a
request spends inside a reasoning section, the text between the reasoning start and end
strings of ``EngineArgs.reasoning_config`` (``{"reasoning_parser": "qwen3"}``, or the two
strings: ``{"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}``; the server's
``--reasoning-parser`` sets it). Once a section holds that many tokens, the end string's
tokens are forced, one a step, and the output goes on as the model continues it.

The state is a function of the tokens alone (``ThinkingBudget.forced_token``): the last start
and the last end in prompt + output say whether the sequence is inside a section and for how
many tokens. Nothing needs carrying through preemption, forks (n > 1) or speculative drafts
(each draft's row sees the drafts before it, so a forced token refuses a draft that differs).
A prompt that ends inside a section (templates that open ``<think>`` for the model) counts
the section's prompt tokens too, as vLLM; a new section after an end gets the budget anew.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from vllmini.config_fields import config_fields


@dataclass(frozen=True)
class ReasoningConfig:
    """vLLM's ``ReasoningConfig``: a reasoning parser's name (its strings are the defaults) and/or
    the strings that open and close a reasoning section."""

    reasoning_parser: str = ""
    reasoning_start_str: str = ""
    reasoning_end_str: str = ""

    @classmethod
    def coerce(cls, value: ReasoningConfig | dict | str | None) -> ReasoningConfig | None:
        """A ReasoningConfig from itself, a dict or its JSON text (the CLI's); errors name the field."""
        if value is None:
            return None
        config = value if isinstance(value, ReasoningConfig) else cls(**config_fields(value, "reasoning_config", cls))
        config._check()
        return config

    def _check(self) -> None:
        from vllmini.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

        for f in fields(self):
            if not isinstance(getattr(self, f.name), str):
                raise ValueError(f"reasoning_config.{f.name} must be a string, got {getattr(self, f.name)!r}")
        if self.reasoning_parser and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_config.reasoning_parser={self.reasoning_parser!r} is not one of "
                             f"{list(REASONING_PARSERS)}")  # fmt: skip
        start, end = self.strings()
        if not start or not end:
            raise ValueError("reasoning_config needs a reasoning_parser, or both reasoning_start_str and reasoning_end_str")
        if start == end:
            raise ValueError(f"reasoning_config: reasoning_start_str and reasoning_end_str must differ (both {start!r})")

    def strings(self) -> tuple[str, str]:
        """(start, end): the ones given, else the parser's."""
        from vllmini.entrypoints.openai.reasoning_parsers import REASONING_PARSERS

        parser = REASONING_PARSERS.get(self.reasoning_parser) if self.reasoning_parser else None
        start = self.reasoning_start_str or (parser.START if parser else "")
        end = self.reasoning_end_str or (parser.END if parser else "")
        return start, end


def _rfind(tokens: list[int], pattern: tuple[int, ...]) -> int:
    """Where the last occurrence of ``pattern`` in ``tokens`` starts, -1 when none (candidates
    found by list.index, at C speed)."""
    n, first, last, i = len(pattern), pattern[0], -1, 0
    while True:
        try:
            i = tokens.index(first, i)
        except ValueError:
            return last
        if tuple(tokens[i : i + n]) == pattern:
            last = i
        i += 1


def _window(prompt: Sequence[int], output: Sequence[int], lo: int, hi: int) -> list[int]:
    """(prompt + output)[lo:hi] without joining the two."""
    p = len(prompt)
    return [*prompt[lo:min(hi, p)], *output[max(lo - p, 0) : max(hi - p, 0)]]


@dataclass(frozen=True)
class Marks:
    """Where the last start and end strings ended (the index after them, -1: none) within the
    first ``upto`` tokens of prompt + output: kept per sequence, so that a step scans only its
    new tokens."""

    upto: int = 0
    start: int = -1
    end: int = -1


@dataclass(frozen=True)
class ThinkingBudget:
    """The reasoning strings' token ids, and the token a budget forces next (if any)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def from_config(cls, config: ReasoningConfig | None, tokenizer: Any, vocab_size: int) -> ThinkingBudget | None:
        """The strings tokenized (as vLLM's, without special tokens); each must give tokens the
        model can sample (ids below ``vocab_size``)."""
        if config is None:
            return None
        start, end = config.strings()
        ids = []
        for name, text in (("reasoning_start_str", start), ("reasoning_end_str", end)):
            tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not tokens or max(tokens) >= vocab_size:
                raise ValueError(f"reasoning_config.{name}={text!r} encodes to {list(tokens)} with this model's tokenizer: "
                                 f"it must give one token or more, each below the vocabulary size {vocab_size}")  # fmt: skip
            ids.append(tokens)
        if ids[0] == ids[1]:
            raise ValueError("reasoning_config: the start and end strings encode to the same tokens")
        return cls(ids[0], ids[1])

    def marks(self, prompt: Sequence[int], output: Sequence[int], since: Marks | None = None) -> Marks:
        """The Marks of all of prompt + output, scanning on from ``since`` (the same tokens'
        Marks at an earlier length; ignored if longer than they are now)."""
        total = len(prompt) + len(output)
        since = since if since is not None and since.upto <= total else Marks()
        if since.upto == total:
            return since
        base = max(since.upto - max(len(self.start_ids), len(self.end_ids)) + 1, 0)  # (a string across the old end)
        region = _window(prompt, output, base, total)
        found = [_rfind(region, ids) for ids in (self.start_ids, self.end_ids)]
        start, end = (max(old, base + i + len(ids)) if i >= 0 else old
                      for i, ids, old in zip(found, (self.start_ids, self.end_ids), (since.start, since.end)))  # fmt: skip
        return Marks(total, start, end)

    def ended(self, marks: Marks) -> bool:
        """Whether the last reasoning string said is the end (when both end at one token, the
        longer string is the one that was said): vLLM's ``is_reasoning_end``."""
        return marks.end > marks.start or (marks.end == marks.start >= 0 and len(self.end_ids) > len(self.start_ids))

    def seq_marks(self, seq: Any, cache: dict[int, Marks]) -> Marks:
        """The Marks of a sequence's own tokens (prompt + output), scanned on from the ones
        ``cache`` (a request's, by sequence index) kept at its last look, and kept there."""
        marks = cache[seq.index] = self.marks(seq.known_prompt_ids, seq.output_token_ids, cache.get(seq.index))
        return marks

    def forced_token(self, prompt: Sequence[int], output: Sequence[int], budget: int, since: Marks | None = None) -> int | None:
        """The token the next position must be: the end string's next token once the open
        section holds ``budget`` tokens or more (forced ones count: the end string goes on until
        it is whole), else None. A section is open when the last start string ended after the
        last end string (when both end at one token, the longer string is the one that was said).
        ``since``: Marks of these tokens at an earlier length, to scan from."""
        marks = self.marks(prompt, output, since)
        if marks.start < 0 or self.ended(marks):
            return None  # never opened, or closed since
        count = marks.upto - marks.start  # the section's tokens so far
        if count < budget:
            return None
        end = self.end_ids
        for k in range(min(len(end) - 1, count), 0, -1):  # the end string begun already (forced or not)
            if tuple(_window(prompt, output, marks.upto - k, marks.upto)) == end[:k]:
                return end[k]
        return end[0]
