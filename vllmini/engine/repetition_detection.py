"""vLLM's ``SamplingParams.repetition_detection``: end a sequence whose output has fallen into
a loop, instead of letting it run to ``max_tokens``.

After each token (once ``min_tokens`` are out, after the EOS, stop-id, stop-string and length
checks), the output's tail is tested: for each pattern size k from ``min_pattern_size`` (0
means 1) to ``max_pattern_size``, are its last ``k * min_count`` tokens one k-token pattern
repeated ``min_count`` times? The first hit finishes the sequence with finish_reason
"repetition" and stop_reason "repetition_detected", as vLLM's scheduler does. A tail of
``k * c`` tokens is a repetition of its first k exactly when it equals itself shifted by k,
one list comparison per size (made only for sizes whose last two periods end alike).
"""
from __future__ import annotations

from collections.abc import Sequence

import msgspec

# The longest pattern a request may ask to look for: the check costs up to
# (max - min + 1) * max * min_count comparisons per token.
MAX_PATTERN_SIZE = 1024


def _bad(field: str, accepted: str, value: object) -> ValueError:
    return ValueError(f"repetition_detection.{field} must be {accepted}, got {value!r}")


class RepetitionDetectionParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``max_pattern_size`` 0 turns detection off; otherwise ``min_count`` >= 2 and
    ``min_pattern_size`` <= ``max_pattern_size`` (0: 1)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise _bad(name, "an int >= 0", value)
        if self.max_pattern_size > MAX_PATTERN_SIZE:
            raise _bad("max_pattern_size", f"at most {MAX_PATTERN_SIZE}", self.max_pattern_size)
        if self.min_pattern_size > self.max_pattern_size:
            raise _bad("min_pattern_size", f"<= max_pattern_size ({self.max_pattern_size})", self.min_pattern_size)
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise _bad("min_count", ">= 2 when max_pattern_size > 0 (0 turns detection off)", self.min_count)

    def detects(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` ends in some pattern of an allowed size repeated ``min_count`` times."""
        count, n = self.min_count, len(token_ids)
        for size in range(max(1, self.min_pattern_size), self.max_pattern_size + 1):
            span = size * count
            if span > n:
                return False
            if token_ids[n - 1] != token_ids[n - 1 - size]:
                continue  # (the cheap test that rules out most sizes)
            tail = token_ids[n - span :]
            if tail[size:] == tail[:-size]:
                return True
        return False
