"""The OpenAI API's request bodies, as msgspec structs with vLLM's extra fields, and their
translation into ``SamplingParams``.

msgspec checks the JSON types and names the field at fault (``Expected `int`, got `str` - at
`$.n```); ``SamplingParams`` then checks the values, naming the field too. A field left out
(None here) takes the model's default sampling parameters (its generation_config.json, as
vLLM's server does), then ``SamplingParams``' own.
"""
from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal

import msgspec

from vllmini.engine.beam_search import BeamSearchParams
from vllmini.engine.errors import VLLMValidationError
from vllmini.engine.sampling_params import SamplingParams, StructuredOutputsParams, is_int
from vllmini.entrypoints.openai.tool_choice import ToolChoice, resolve_tool_choice


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False  # a last chunk with the whole request's usage (and no choices)
    continuous_usage_stats: bool = False  # usage so far in every chunk


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# (request field, SamplingParams field) pairs taken as they are, when given
_PASSED = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens",
    "allowed_token_ids", "bad_words", "prompt_logprobs", "logprob_token_ids", "thinking_token_budget",
)  # fmt: skip
# fields the model's generation config may set a default for (vLLM's default_sampling_params)
_MODEL_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# a seed must fit a signed 64-bit int, as vLLM's server checks (a 400 naming `seed` otherwise)
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class SamplingRequest(msgspec.Struct, kw_only=True):
    """The fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    priority: int = 0
    request_id: str | None = None
    # vLLM's: arguments for custom logits processors (SamplingParams.extra_args)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    repetition_detection: dict[str, Any] | None = None  # vLLM's RepetitionDetectionParams fields
    logprob_token_ids: list[int] | None = None  # vLLM's: these tokens' logprobs at each position (top_logprobs)
    thinking_token_budget: int | None = None  # vLLM's: reasoning tokens before the end is forced (--reasoning-parser)
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among requests with the same salt
    return_token_ids: bool | None = None  # vLLM's: the output's (and prompt's) token ids in the response
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>"
    # vLLM's beam search (engine/async_beam_search.py): n beams; sampling-only fields are not used
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def sampling_params(self, defaults: SamplingParams, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams (streamed as deltas when ``stream``); ValueError names a bad field."""
        if self.stream_options is not None and not self.stream:
            # (as vLLM: it would be ignored otherwise)
            raise VLLMValidationError("stream_options needs stream=true", parameter="stream_options")
        if self.stream and self.prompt_logprobs not in (None, 0):  # (0, the prompt's tokens only: vLLM takes it)
            raise VLLMValidationError("prompt_logprobs are not available with stream=true (as in vLLM)",
                                      parameter="prompt_logprobs")
        given: dict[str, Any] = {name: getattr(defaults, name) for name in _MODEL_DEFAULTS}
        given.update({name: v for name in _PASSED if (v := getattr(self, name)) is not None})
        if self.use_beam_search:  # (n is the beam width: beam_search_params)
            given["n"] = 1
        if self.logit_bias is not None:
            given["logit_bias"] = _token_id_keys(self.logit_bias)
        structured = self._structured_outputs()
        if self.logprob_token_ids:  # (vLLM's server: the ids alone name the entries; logprobs only switches them on)
            logprobs = None
        return SamplingParams(
            **given, max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured,
            output_kind="delta" if self.stream else "final", extra_args=self.vllm_xargs,
            repetition_detection=self.repetition_detection,
        )  # fmt: skip

    def beam_search_params(self, max_tokens: int, max_logprobs: int) -> BeamSearchParams | None:
        """With ``use_beam_search``, vLLM's mapping: n beams, the request's max_tokens, ignore_eos,
        temperature (0 when not given), length_penalty and include_stop_str_in_output. Each step
        reads the top 2n logprobs, which the server's ``max_logprobs`` bounds."""
        if not self.use_beam_search:
            return None
        if not is_int(self.n) or not 1 <= 2 * self.n <= max_logprobs:
            raise ValueError(f"n (the beam width with use_beam_search) must be an int in [1, {max_logprobs // 2}] (each "
                             f"step reads 2n logprobs; the server's max_logprobs is {max_logprobs}), got {self.n!r}")  # fmt: skip
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=bool(self.ignore_eos),
                                temperature=self.temperature or 0.0, length_penalty=self.length_penalty,
                                include_stop_str_in_output=bool(self.include_stop_str_in_output))  # fmt: skip

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return self.structured_outputs
        if self.structured_outputs is not None:
            raise ValueError("set response_format or structured_outputs, not both")
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise VLLMValidationError("response_format.json_schema.schema is required when response_format.type is "
                                      "'json_schema'", parameter="response_format")
        return StructuredOutputsParams(json=fmt.json_schema.schema)


class CompletionRequest(SamplingRequest, kw_only=True):
    """``POST /v1/completions``."""

    prompt: str | list
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # the top-N alternatives per token (OpenAI's legacy format)
    echo: bool = False  # the prompt comes back before the completion
    suffix: str | None = None  # refused: no insertion models here
    best_of: int | None = None  # vLLM's V1 engine keeps only best_of == n
    add_special_tokens: bool = True  # vLLM's: false tokenizes a text prompt without the tokenizer's BOS/EOS

    def __post_init__(self) -> None:
        if self.max_tokens is None:  # (vLLM's: null is the default, not the end of the context)
            self.max_tokens = 16

    @property
    def echo_only(self) -> bool:
        """vLLM's ``echo`` with ``max_tokens=0``: the prompt comes back alone (one token is
        generated, and counted in usage, but not returned)."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one string or token-id list, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(map(is_int, p)):
            return [p]
        ok = p and all(isinstance(s, str) for s in p) or p and all(isinstance(s, list) and s and all(map(is_int, s)) for s in p)
        if not ok:
            raise VLLMValidationError("prompt must be a string, a list of strings, a list of token ids or a list of "
                                      "non-empty token-id lists, and not empty", parameter="prompt")  # fmt: skip
        return list(p)

    def check(self) -> None:
        if self.suffix is not None:
            raise VLLMValidationError("suffix is not supported", parameter="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n (vLLM's V1 engine has no best_of), got best_of={self.best_of}")
        if self.logprob_token_ids and self.logprobs is None:
            raise VLLMValidationError("when using logprob_token_ids, logprobs must be set", parameter="logprob_token_ids")
        if self.logprob_token_ids and self.echo_only:  # (no output token to give them for)
            raise VLLMValidationError("logprob_token_ids is not supported with echo=true and max_tokens=0",
                                      parameter="logprob_token_ids")


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None  # handed to the chat template (tool_choice.py checks them)
    tool_choice: str | dict | None = None  # left out: "auto" with tools, else "none" (as vLLM)
    parallel_tool_calls: bool | None = None  # false: only the first call is kept (as vLLM)
    echo: bool = False  # the last message's content comes first, when it is the assistant's
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # false: the reasoning parser's reasoning is left out of the response
    # vLLM's: handed to the chat template (RAG templates read ``documents``; some read ``reasoning_effort``)
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    add_special_tokens: bool = False  # the template writes them; true: the tokenizer adds its own too (vLLM's)

    def check(self) -> None:
        self.resolved_tool_choice()
        if self.top_logprobs and not self.logprobs:
            raise VLLMValidationError("top_logprobs needs logprobs=true", parameter="top_logprobs")
        if self.logprob_token_ids and not self.logprobs:
            raise VLLMValidationError("logprob_token_ids needs logprobs=true", parameter="logprob_token_ids")
        # checked here by their own names (SamplingParams would name max_tokens and logprobs)
        for name in ("max_tokens", "max_completion_tokens"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise VLLMValidationError(f"{name} must be an int >= 1 or None, got {value}", parameter=name, value=value)
        if self.top_logprobs is not None and self.top_logprobs < -1:
            raise VLLMValidationError(f"top_logprobs must be an int >= 0, -1 (the whole vocabulary) or None, got "
                                      f"{self.top_logprobs}", parameter="top_logprobs", value=self.top_logprobs)
        check_chat_options(self)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def resolved_tool_choice(self) -> ToolChoice:
        """The tool choice (tool_choice.py), checked with the tools; ValueError names the field."""
        fmt = self.response_format
        structured = self.structured_outputs is not None or (fmt is not None and fmt.type != "text")
        return resolve_tool_choice(self.tools, self.tool_choice, structured)


def check_chat_options(request: ChatCompletionRequest | TokenizeRequest) -> None:
    """What render_chat cannot take from a request's chat fields; and, as vLLM's server (its pydantic
    types), a ``content`` null (or not text nor parts) unless an assistant's or a function's."""
    for i, msg in enumerate(request.messages or ()):
        content = msg.get("content", "") if isinstance(msg, dict) else ""  # (no content at all: "", as vLLM)
        if isinstance(content, (str, list)) or (content is None and msg.get("role") in ("assistant", "function")):
            continue
        raise VLLMValidationError(f"messages[{i}].content must be a string or a list of content parts in a "
                                  f"{msg.get('role')!r} message, got {type(content).__name__.replace('NoneType', 'null')}",
                                  parameter=f"body.messages.{i}.ChatCompletionDeveloperMessageParam.content")
    if request.continue_final_message and request.add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    # render_chat's own arguments: as template variables they would be a TypeError (a 500)
    if clash := sorted({"tokenizer", "messages"} & set(request.chat_template_kwargs or {})):
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(clash)}")


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template writes them)
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("set exactly one of prompt and messages")
        check_chat_options(self)


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/load_lora_adapter``: the name clients will send as ``model``, and the adapter."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's ``POST /v1/unload_lora_adapter``."""

    lora_name: str


def make_tool_call_id() -> str:
    """vLLM's tool call ids."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI's


class ToolCall(msgspec.Struct, kw_only=True):
    """A tool call of a whole response's message."""

    id: str = msgspec.field(default_factory=make_tool_call_id)
    type: str = "function"
    function: FunctionCall


class ExtractedToolCallInformation(msgspec.Struct, kw_only=True):
    """What a tool parser read in a whole output: the calls and the text outside them."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed tool call: the first has its id, type and name, later ones more arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed chunk's ``delta`` (fields left unset are left out, as in vLLM's). ``reasoning``
    is current vLLM's name for the reasoning text, ``reasoning_content`` its older one: both
    are sent, for clients of either."""

    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = []


def _token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as strings."""
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise VLLMValidationError(f"logit_bias keys must be token ids, got {list(bias)!r}", parameter="logit_bias") from None


# numbers past float64's range read as +-inf, as Python's json (vLLM's server) reads them
_WIDE_FLOATS = msgspec.json.Decoder(float_hook=float)


def decode_json(body: bytes) -> Any:
    """A request body's JSON; ValueError when it is not JSON. A number past float64's range (1e999)
    is +-inf, as in vLLM's server, which its field then refuses naming itself (msgspec's own
    "Number out of range - at `$[...]`" named none); the slower decoder reads only such bodies."""
    try:
        try:
            return msgspec.json.decode(body)
        except msgspec.ValidationError:  # (the only one untyped decoding raises: a number out of range)
            return _WIDE_FLOATS.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:  # (RecursionError: nested too deeply, a 500 otherwise)
        raise VLLMValidationError(f"the request body is not valid JSON: {exc}", parameter="body") from None


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> tuple[Any, list[str]]:
    """The request and the names of the fields it carried that this server ignores (vLLM warns
    of them, as here, rather than refusing). A body that is not a JSON object of the right
    types is a ValueError naming the field."""
    raw = decode_json(body)
    if not isinstance(raw, dict):
        raise VLLMValidationError("the request body must be a JSON object", parameter="body")
    try:
        request = msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise VLLMValidationError(str(exc), parameter=body_param(str(exc))) from None
    return request, sorted(set(raw) - set(kind.__struct_fields__))


def body_param(message: str) -> str:
    """The field a msgspec error names, as vLLM's server names a pydantic error's ``param``:
    ``Expected `int`, got `str` - at `$.tools[0].type``` -> ``body.tools.0.type`` (a missing
    field's name after its object's path)."""
    path = message.rpartition(" - at `$")[2].rstrip("`") if " - at `$" in message else ""
    parts = ["body", *re.findall(r"[^.\[\]]+", path)]
    if missing := re.match(r"Object missing required field `([^`]+)`", message):
        parts.append(missing[1])
    return ".".join(parts)
