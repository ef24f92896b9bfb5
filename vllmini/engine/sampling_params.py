"""SamplingParams: vLLM's per-request sampling options, validated at construction.

A bad value fails here, with a message naming the field and the accepted range,
instead of surfacing as NaN logits or an index error in the middle of a batch.
The struct is a ``msgspec.Struct`` so that it round-trips through JSON (and the
same validation runs on decode).
"""
from __future__ import annotations

import copy
import enum
import logging
import math
import os
from typing import Any, Literal

import msgspec

from vllmini.engine.errors import VLLMValidationError
from vllmini.engine.repetition_detection import RepetitionDetectionParams

DEFAULT_MAX_N_SEQUENCES = 16384  # vLLM's default VLLM_MAX_N_SEQUENCES
# vLLM's cap on SamplingParams.logprob_token_ids
MAX_LOGPROB_TOKEN_IDS = 128
# vLLM's threshold: a temperature below this is treated as greedy (argmax).
SAMPLING_EPS = 1e-5
# vLLM raises a temperature in (0, MIN_TEMPERATURE) to it: dividing logits by less overflows.
MIN_TEMPERATURE = 0.01

logger = logging.getLogger("vllmini")

OutputKind = Literal["cumulative", "delta", "final"]
_OUTPUT_KINDS = ("cumulative", "delta", "final")


class RequestOutputKind(str, enum.Enum):
    """vLLM's spelling of ``output_kind``; a member is stored as its string ("delta", ...). A str
    enum, so that vLLM code comparing ``params.output_kind == RequestOutputKind.DELTA`` holds."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final"


class SamplingType(enum.IntEnum):
    """How a row draws its token; seeded greedy is still greedy."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


# The checks below are shared with the other validated options (BeamSearchParams).


def is_int(v: object) -> bool:
    """An int that is not a bool: bool is an int subclass, and True as a count or id is almost
    always a mistake."""
    return isinstance(v, int) and not isinstance(v, bool)


FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 2.0**-149  # the least positive float32: anything smaller rounds to 0 in the sampler


def is_real(v: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def max_n_sequences() -> int:
    """The largest ``n`` a request may ask for: each of its sequences is made when the request is
    added, so an unbounded one would let one request stall the engine. vLLM's
    ``VLLM_MAX_N_SEQUENCES`` and its default; here ``$VLLMINI_MAX_N_SEQUENCES``."""
    value = os.environ.get("VLLMINI_MAX_N_SEQUENCES", "")
    return int(value) if value.strip().isdigit() else DEFAULT_MAX_N_SEQUENCES


def bad_value(field: str, accepted: str, value: object) -> ValueError:
    """The error for a bad option: it names the field (also as its ``parameter``, the server's
    ``error.param``), what is accepted and what was given."""
    return VLLMValidationError(f"{field} must be {accepted}, got {value!r}", parameter=field, value=value)


def check_truncate_prompt_tokens(value: object) -> None:
    """vLLM's ``truncate_prompt_tokens`` (of SamplingParams and PoolingParams): keep the prompt's
    last k tokens, -1 for as many as max_model_len allows, None for all."""
    if value is not None and (not is_int(value) or not (value >= 1 or value == -1)):
        raise bad_value("truncate_prompt_tokens", "an int >= 1, -1 (max_model_len) or None", value)


def real_value(field: str, value: object, accepted: str, ok) -> float:
    """``value`` as a float: a real number, finite in float32 (the sampler's precision), for which
    ``ok`` holds; else the error naming ``field``."""
    if not is_real(value) or not abs(value) <= FLOAT32_MAX or not ok(value):
        raise bad_value(field, f"a finite float32 number {accepted}".rstrip(), value)
    return float(value)


def raised_temperature(temperature: object) -> object:
    """vLLM raises a temperature in (0, MIN_TEMPERATURE) to it, with a warning (dividing logits by
    less overflows); anything else is returned as it is (validated elsewhere)."""
    if is_real(temperature) and 0 < temperature < MIN_TEMPERATURE:
        logger.warning("temperature %s is below %s, which overflows the logits: raised to %s, as vLLM does",
                       temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)  # fmt: skip
        return MIN_TEMPERATURE
    return temperature


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's structured outputs: exactly one constraint that the output must follow.

    ``json``: a JSON schema (a dict, its JSON text, or a pydantic model class); ``regex``: a
    regular expression the whole output matches; ``choice``: the output is one of these strings;
    ``grammar``: an EBNF grammar (``root ::= ...``, xgrammar's / llama.cpp's GBNF syntax) or, as in
    vLLM, a Lark grammar (``start: ...``); ``json_object=True``: any JSON object;
    ``structural_tag``: xgrammar's structural tag, as JSON text. ``disable_any_whitespace``: JSON
    without optional whitespace. ``disable_additional_properties``: accepted as in vLLM; xgrammar's
    strict mode already leaves out properties a schema does not name. The grammar itself is
    checked by the engine (engine/structured_outputs.py), which needs the xgrammar package."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None  # vLLM's outlines option: refused by the xgrammar backend

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()  # a pydantic model, as vLLM takes it
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(_CONSTRAINTS)}; got {', '.join(given) if given else 'none'}"
            )
        name = self.kind
        value = getattr(self, name)
        if name == "json" and not isinstance(value, (str, dict)):
            raise bad_value("structured_outputs.json", "a JSON schema (dict or JSON text)", value)
        if name in ("regex", "grammar", "structural_tag") and not (isinstance(value, str) and value):
            raise bad_value(f"structured_outputs.{name}", "a non-empty string", value)
        if name == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise bad_value("structured_outputs.choice", "a non-empty list of strings", value)
            self.choice = list(value)
        if name == "json_object" and value is not True:
            raise bad_value("structured_outputs.json_object", "True (or None)", value)
        for flag in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, flag), bool):
                raise bad_value(f"structured_outputs.{flag}", "a bool", getattr(self, flag))
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend; "
                "use disable_any_whitespace=True for JSON without optional whitespace"
            )

    @property
    def kind(self) -> str:
        """The constraint's field name ("json", "regex", ...): the one that is set."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) is not None)


def _from_dict(field: str, cls: type, value: object) -> object:
    """``cls(**value)`` for a dict (an unknown key is a ValueError naming the field), else ``value``."""
    if not isinstance(value, dict):
        return value
    try:
        return cls(**value)
    except TypeError as exc:
        raise ValueError(f"{field}: {exc}") from None


_CONTAINERS = ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words", "logprob_token_ids")  # (of immutable items)


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Sampling options for one request (field names and defaults follow vLLM).

    ``temperature`` 0 means greedy decoding; as in vLLM, one in (0, 0.01) is raised to 0.01
    (with a warning) and ``seed=-1`` means no seed. Numbers must fit float32, as the sampler
    computes in it. ``top_k`` 0 or -1 disables top-k; ``top_p`` 1.0 and ``min_p`` 0.0 disable
    theirs. ``max_tokens=None`` generates until the model's context is full.
    ``stop`` may be a string or a list of strings; it is stored as a list.
    ``logit_bias`` adds {token id: bias} to the logits, ``allowed_token_ids`` keeps only those
    tokens, ``bad_words`` bans each word's last token where the output already ends with the rest
    of it (a one-token word is always banned), each word taken with and without a leading space.
    ``logprobs=N`` returns the chosen token's logprob plus the top-N per step;
    ``prompt_logprobs=N`` the same for every prompt token after the first
    (``RequestOutput.prompt_logprobs``); -1 means the whole vocabulary. Both are capped by
    ``EngineArgs.max_logprobs``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = msgspec.field(default_factory=list)
    stop_token_ids: list[int] | None = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None  # these tokens' logprobs at each position, instead of the top-N
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's field; accepted for compatibility. Fast tokenizers (the only detokenizer path here and
    # vLLM's DecodeStream path) put no spaces between special tokens either way.
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    detokenize: bool = True  # False: token ids only, text stays "" (saves the per-step decode)
    output_kind: OutputKind = "cumulative"
    stream_interval: int | None = None  # stream every this many new tokens (None: EngineArgs.stream_interval; never below it)
    structured_outputs: StructuredOutputsParams | None = None  # the output follows a JSON schema, regex, ...
    extra_args: dict[str, Any] | None = None  # for custom logits processors (engine/logits_processor.py), as vLLM's
    # end the output early when it loops (engine/repetition_detection.py), as vLLM's
    repetition_detection: RepetitionDetectionParams | None = None
    # at most this many tokens in a reasoning section, then its end is forced (EngineArgs.reasoning_config;
    # engine/thinking_budget.py), as vLLM's
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._validate()

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with its own containers and ``changes`` applied, validated again (a value changed
        after construction is checked here). The engine keeps a clone of each request's params, as
        vLLM does, so that a caller may reuse and change its object while the request runs."""
        own = {name: copy.copy(value) for name in _CONTAINERS if (value := getattr(self, name)) is not None}
        if self.extra_args is not None:  # (its values may be containers too)
            own["extra_args"] = copy.deepcopy(self.extra_args)
        # (a dict or a bad value set since construction is left to __post_init__, which takes or refuses it)
        if isinstance(self.repetition_detection, RepetitionDetectionParams):
            own["repetition_detection"] = msgspec.structs.replace(self.repetition_detection)
        return msgspec.structs.replace(self, **{**own, **changes})

    def _normalize(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = self.output_kind.value
        if self.top_k == -1:  # vLLM's other spelling of "off"
            self.top_k = 0
        if self.seed == -1 and is_int(self.seed):  # vLLM's spelling of "no seed"
            self.seed = None
        self.temperature = raised_temperature(self.temperature)
        # nested params given as dicts (as msgspec decodes them from JSON, or a caller writes them)
        self.structured_outputs = _from_dict("structured_outputs", StructuredOutputsParams, self.structured_outputs)
        self.repetition_detection = _from_dict("repetition_detection", RepetitionDetectionParams, self.repetition_detection)

    def _validate(self) -> None:
        cap = max_n_sequences()
        if not is_int(self.n) or not 1 <= self.n <= cap:
            raise bad_value("n", f"an int in [1, {cap}] ($VLLMINI_MAX_N_SEQUENCES)", self.n)
        self.temperature = self._real("temperature", ">= 0", lambda v: v >= 0)
        if self.n > 1 and self.is_greedy:  # (n copies of one answer; vLLM refuses them too)
            raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), got n={self.n}")
        self.top_p = self._real("top_p", "in (0, 1]", lambda v: 0 < v <= 1)
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad_value("top_k", "an int >= 1, or 0 / -1 to disable", self.top_k)
        self.min_p = self._real("min_p", "in [0, 1]", lambda v: 0 <= v <= 1)
        if self.seed is not None and not is_int(self.seed):
            raise bad_value("seed", "an int or None", self.seed)
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad_value("max_tokens", "an int >= 1 or None", self.max_tokens)
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad_value("min_tokens", "an int >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise VLLMValidationError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}", parameter="min_tokens"
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad_value("stop", "a non-empty string or a list of non-empty strings", self.stop)
        if not isinstance(self.stop_token_ids, list) or not all(
            is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad_value("stop_token_ids", "a list of ints >= 0", self.stop_token_ids)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise bad_value(name, "a bool", getattr(self, name))
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings need detokenize=True (the text is matched), got stop={self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < -1):
                raise bad_value(name, "an int >= 0, -1 (the whole vocabulary) or None", value)
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.logprob_token_ids is not None:
            ids = self.logprob_token_ids
            if not isinstance(ids, (list, tuple)) or not 0 < len(ids) <= MAX_LOGPROB_TOKEN_IDS or not all(is_int(t) and t >= 0 for t in ids):
                raise bad_value("logprob_token_ids", f"a list of 1 to {MAX_LOGPROB_TOKEN_IDS} ints >= 0, or None", ids)
            if self.logprobs is not None and self.logprobs != len(ids):  # (vLLM 0.32's rule: no silent choice)
                raise VLLMValidationError(f"logprob_token_ids: when logprobs is also set it must equal "
                                          f"len(logprob_token_ids)={len(ids)}, got logprobs={self.logprobs}",
                                          parameter="logprob_token_ids", value=self.logprobs)  # fmt: skip
            self.logprob_token_ids = list(dict.fromkeys(ids))  # (one entry per token in the output's dict)
        if self.stream_interval is not None and (not is_int(self.stream_interval) or self.stream_interval < 1):
            raise bad_value("stream_interval", "an int >= 1 or None", self.stream_interval)
        budget = self.thinking_token_budget
        if budget is not None and (not is_int(budget) or budget < 0):
            raise bad_value("thinking_token_budget", "an int >= 0 or None", budget)
        self._validate_logit_controls()
        self.repetition_penalty = self._real("repetition_penalty", "> 0", lambda v: v >= _FLOAT32_TINY)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, self._real(name, "in [-2, 2]", lambda v: -2 <= v <= 2))
        if self.output_kind not in _OUTPUT_KINDS:
            raise bad_value("output_kind", f"one of {_OUTPUT_KINDS}", self.output_kind)
        if self.extra_args is not None and not (isinstance(self.extra_args, dict) and all(isinstance(k, str) for k in self.extra_args)):
            raise bad_value("extra_args", "a dict with string keys or None", self.extra_args)
        if self.repetition_detection is not None and not isinstance(self.repetition_detection, RepetitionDetectionParams):
            accepted = "a RepetitionDetectionParams (or a dict of its fields) or None"
            raise bad_value("repetition_detection", accepted, self.repetition_detection)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            accepted = "a StructuredOutputsParams (or a dict of its fields) or None"
            raise bad_value("structured_outputs", accepted, self.structured_outputs)

    def _validate_logit_controls(self) -> None:
        """logit_bias / allowed_token_ids / bad_words; token ids are checked against the
        vocabulary by the engine, which knows it."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad_value("logit_bias", "a dict {token id: bias} or None", self.logit_bias)
            for token, bias in self.logit_bias.items():
                ok = is_int(token) and token >= 0 and is_real(bias) and abs(bias) <= FLOAT32_MAX  # no overflow
                if not ok or not math.isfinite(bias):
                    accepted = "a dict of int token ids >= 0 to finite float32 numbers"
                    raise bad_value("logit_bias", accepted, {token: bias})
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(is_int(t) and t >= 0 for t in ids):
                raise bad_value("allowed_token_ids", "a non-empty list of ints >= 0 or None", ids)
            self.allowed_token_ids = list(ids)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise bad_value("bad_words", "a list of strings that are not blank, or None", words)
            self.bad_words = list(words)

    def _real(self, name: str, accepted: str, ok) -> float:
        """A real number, finite in float32 (the sampler's precision), for which ``ok`` holds,
        returned as float."""
        return real_value(name, getattr(self, name), accepted, ok)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
