"""From what a caller submits to a checked request (vLLM v1's input processor).

Everything here runs before the scheduler sees a request, on the caller's thread in the async
engine, so bad input raises a ValueError naming the field right at the call and nothing is
queued: tokenization, left truncation, the checks that need the model (vocabulary,
max_model_len, KV capacity, max_logprobs), bad words as tokens, and the model's default
sampling parameters (its generation_config.json, as vLLM's ``generation_config="auto"``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllmini.engine.chat import TEXT_ONLY
from vllmini.engine.errors import VLLMValidationError
from vllmini.engine.pooling_params import PoolingParams
from vllmini.engine.prompt_embeds import PLACEHOLDER_ID, check_prompt_embeds, salted
from vllmini.engine.sampling_params import SamplingParams
from vllmini.engine.sampling_tensors import SamplingRow, banned_tokens
from vllmini.engine.skip_tokenizer import check_request, text_prompt_error

logger = logging.getLogger("vllmini")

PromptType = str | list[int] | dict[str, Any]
# vLLM's TextPrompt / TokensPrompt / EmbedsPrompt, text only
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "prompt_embeds", "cache_salt"})
_MULTI_MODAL_KEYS = frozenset({"multi_modal_data", "multi_modal_uuids", "mm_processor_kwargs"})  # vLLM's


def as_prompt_list(prompts: PromptType | Any) -> list[PromptType]:
    """One prompt (text, token ids, a dict) or an iterable of them, as a list, the way
    ``LLM.generate`` and ``LLM.beam_search`` take them."""
    token_ids = isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
    if isinstance(prompts, (str, dict)) or token_ids:
        return [prompts]
    try:
        return list(prompts)  # (a generator of prompts too)
    except TypeError:
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}") from None


# generation_config.json fields vLLM takes as default sampling parameters (max_new_tokens -> max_tokens)
_GENERATION_DEFAULTS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def load_generation_config(folder: str | Path) -> Any | None:
    """The generation_config.json in a local folder (never a hub lookup), or None when there is
    none; a file transformers cannot read is a ValueError naming it."""
    from transformers import GenerationConfig

    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from exc


def generation_overrides(value: dict | str | None) -> dict[str, Any]:
    """``EngineArgs.override_generation_config`` as SamplingParams fields (max_new_tokens ->
    max_tokens); a field vLLM does not take from a generation config, or a value SamplingParams
    refuses, is a ValueError naming it."""
    from vllmini.vllm_args import parse_json_dict

    name = "override_generation_config"
    overrides = dict(parse_json_dict(name, value, "generation config fields"))
    if unknown := [k for k in overrides if k not in _GENERATION_DEFAULTS]:
        raise ValueError(f"{name}: {', '.join(map(repr, unknown))} cannot be set; accepted: {', '.join(_GENERATION_DEFAULTS)}")
    if "max_new_tokens" in overrides:
        overrides["max_tokens"] = overrides.pop("max_new_tokens")
    try:
        SamplingParams(**overrides)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name}: {exc}") from None
    return overrides


def generation_defaults(config: Any | None) -> dict[str, Any]:
    """The sampling fields the generation config sets away from transformers' defaults; a value
    SamplingParams refuses is dropped with a warning (requests with their own params need none)."""
    if config is None:
        return {}
    diff = config.to_diff_dict()
    found = {k: diff[k] for k in _GENERATION_DEFAULTS if diff.get(k) is not None}
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    for name, value in list(found.items()):
        try:
            SamplingParams(**{name: value})
        except ValueError as exc:
            logger.warning("generation config: %s ignored (%s)", name, exc)
            del found[name]
    return found


def default_sampling_params(source: str, model_config: Any | None, overrides: dict | str | None = None) -> SamplingParams:
    """SamplingParams() updated with what EngineArgs.generation_config points at ("auto": the
    model's generation config, ``model_config``; "vllm": none; or a folder holding one), then
    with EngineArgs.override_generation_config, as vLLM."""
    defaults: dict[str, Any] = {}
    if source != "vllm":
        config = model_config if source == "auto" else load_generation_config(source)
        if config is None and source != "auto":
            raise ValueError(f"generation_config={source!r}: no generation_config.json in that folder")
        defaults = generation_defaults(config)
    defaults.update(generation_overrides(overrides))
    if defaults:
        logger.info("default sampling parameters from the generation config: %s", defaults)
    return SamplingParams(**defaults)


def cache_salt_of(prompt: PromptType) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's): a non-empty string, or None."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string if given, got {salt!r}")
    return salt


@dataclass
class ProcessedInput:
    text: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens, or what max_model_len leaves
    bad_words_token_ids: list[tuple[int, ...]]
    cache_salt: str | None = None  # the prompt dict's (vLLM's): its prefix-cache blocks are shared only with the same salt
    prompt_embeds: torch.Tensor | None = None  # the prompt as embeddings (engine/prompt_embeds.py): ids are placeholders


class InputProcessor:
    def __init__(
        self, tokenizer: Any, vocab_size: int, max_model_len: int, capacity_tokens: int, max_logprobs: int,
        default_params: SamplingParams, eos_token_ids: tuple[int, ...] = (), prompt_embeds_width: int | None = None,
        capacity_setting: str = "kv_cache_memory",
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.capacity_setting = capacity_setting  # what sets the cache's size: the field errors tell users to raise
        self.prompt_embeds_width = prompt_embeds_width  # the hidden size, when enable_prompt_embeds (else None)
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs
        self.default_params = default_params  # for requests that pass none

    def defaults(self, **replace: Any) -> SamplingParams:
        """A fresh copy of the default sampling parameters (callers may change their own)."""
        return self.default_params.clone(**replace)

    def room(self, num_prompt_tokens: int) -> int:
        """Output tokens a prompt of this length leaves before max_model_len or the whole KV cache."""
        # the last sampled token is never fed back, so the cache holds one token fewer than the sequence
        return min(self.max_model_len, self.capacity_tokens + 1) - num_prompt_tokens

    def process(self, prompt: PromptType, params: SamplingParams | None, output_kind: str | None = None) -> ProcessedInput:
        """``params`` None: the defaults (``output_kind``, if given, replacing theirs), whose
        max_tokens (the model's max_new_tokens) is cut to what max_model_len and the cache
        leave. Any max_tokens is cut to what max_model_len leaves, as vLLM's offline engine
        stops such a request there instead of refusing it; one that cannot fit the whole KV
        cache is refused (it could never finish)."""
        from_defaults = params is None
        if from_defaults:
            params = self.defaults(**({"output_kind": output_kind} if output_kind else {}))
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not from_defaults:  # (the defaults were just copied for this request)
            params = params.clone()  # the request's own copy: the caller may change theirs meanwhile
        self._check_params(params)
        if self.tokenizer is None:  # skip_tokenizer_init
            check_request(params)
        embeds = self._prompt_embeds(prompt, params)
        text, ids = (None, [PLACEHOLDER_ID] * len(embeds)) if embeds is not None else self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = self._truncate(prompt, text, ids, self.keep_tokens(params))
            embeds = None if embeds is None else embeds[len(embeds) - len(ids) :]
        if len(ids) >= self.max_model_len:
            raise VLLMValidationError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} (it must leave room for output)",
                parameter="input_tokens", value=len(ids),
            )
        room = self.room(len(ids))
        # as vLLM's offline engine: a request stops at max_model_len ("length"), whatever max_tokens says
        max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - len(ids))
        if from_defaults and room > 0:
            max_tokens = min(max_tokens, room)
        total = len(ids) + max_tokens
        if total - 1 > self.capacity_tokens:  # (the last token is never stored)
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) needs {total - 1} KV slots (the last token is "
                f"never stored), more than the whole KV cache ({self.capacity_tokens} tokens); raise "
                f"{self.capacity_setting} or lower max_tokens"
            )
        bad_words = self._bad_words_token_ids(params.bad_words or [])
        self._check_something_allowed(params, bad_words)
        salt = cache_salt_of(prompt)
        if embeds is not None:
            salt = salted(embeds, salt)
        return ProcessedInput(text, ids, params, max_tokens, bad_words, salt, embeds)

    def _prompt_embeds(self, prompt: PromptType, params: SamplingParams) -> torch.Tensor | None:
        """A prompt dict's ``prompt_embeds``, checked (None: the prompt is text or tokens)."""
        if not isinstance(prompt, dict) or "prompt_embeds" not in prompt:
            return None
        if self.prompt_embeds_width is None:
            raise ValueError("prompt_embeds needs an engine started with enable_prompt_embeds=True")
        if others := sorted(set(prompt) & {"prompt", "prompt_token_ids"}):
            raise ValueError(f"prompt_embeds cannot be given with {others}: a prompt is embeddings or tokens")
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available for a prompt given as prompt_embeds (it has no tokens)")
        return check_prompt_embeds(prompt["prompt_embeds"], self.prompt_embeds_width)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``prompt``: text, a token-id list, or ``{"prompt_token_ids": [...]}`` / ``{"prompt": "..."}``."""
        if isinstance(prompt, dict):
            if media := sorted(set(prompt) & _MULTI_MODAL_KEYS):
                raise ValueError(f"prompt[{media[0]!r}]: image, video and audio inputs are not accepted: {TEXT_ONLY}; "
                                 "pass the prompt as text or prompt_token_ids")  # fmt: skip
            if unknown := sorted(set(prompt) - _PROMPT_KEYS, key=str):
                # e.g. vLLM's multi_modal_data: ignoring it would silently change the request
                raise ValueError(f"prompt dict has unsupported key(s) {unknown}; accepted: {sorted(_PROMPT_KEYS)}")
            if "prompt_embeds" in prompt:  # (process() takes them; nothing else does)
                raise ValueError("prompt_embeds is taken by generate requests only (not by pooling or beam search)")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
            elif "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            else:
                raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'")
            text = prompt.get("prompt")
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise text_prompt_error()
            text, ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, prompt
        else:
            raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")
        ids = list(ids)
        if not ids:
            raise VLLMValidationError("prompt is empty: at least one token is needed", parameter="prompt")
        # (checked in C when all are plain ints in range: a long prompt's ids cost ~10x less)
        if not (all(type(t) is int for t in ids) and min(ids) >= 0 and max(ids) < self.vocab_size):
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        return text, ids

    def pretokenize(self, prompt: PromptType, params: SamplingParams | PoolingParams) -> PromptType:
        """A text prompt as ``{"prompt", "prompt_token_ids"}`` (its ``cache_salt`` kept), truncated as
        ``process`` (``process_pooling`` for PoolingParams) truncates it, which then has nothing left
        to do: a server runs this on its tokenizer thread (as vLLM's async tokenizer), off the event
        loop. Other prompts pass through."""
        if not isinstance(prompt, str) and not (isinstance(prompt, dict) and set(prompt) <= {"prompt", "cache_salt"}):
            return prompt
        text, ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = self._truncate(prompt, text, ids, self.keep_tokens(params), truncation_side(params))
        salt = {"cache_salt": prompt["cache_salt"]} if isinstance(prompt, dict) and "cache_salt" in prompt else {}
        return {"prompt": text, "prompt_token_ids": ids, **salt}

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: the logprobs cap and token ids in the vocabulary
        (a stop id the model can never sample is a mistake, refused as vLLM refuses it).
        A logprobs count of -1 (the whole vocabulary) becomes the vocabulary size in ``params``,
        the request's own copy."""
        for name in ("logprobs", "prompt_logprobs"):
            if (asked := getattr(params, name)) is None:
                continue
            count = self.vocab_size if asked == -1 else asked
            if count > self.max_logprobs:
                what = f"{name}=-1 (the whole vocabulary, {count})" if asked == -1 else f"{name}={asked}"
                raise VLLMValidationError(f"{what} exceeds max_logprobs={self.max_logprobs} (an EngineArgs field)",
                                          parameter=name, value=count)
            setattr(params, name, count)
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ()),
                          ("logprob_token_ids", params.logprob_token_ids or ()),
                          ("stop_token_ids", params.stop_token_ids or ())):  # fmt: skip
            if bad := [t for t in ids if t >= self.vocab_size]:
                raise VLLMValidationError(f"{name} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                                          parameter=name, value=bad[:5])

    def _check_something_allowed(self, params: SamplingParams, bad_words: list[tuple[int, ...]]) -> None:
        """Refuse allowed_token_ids that the bans leave empty: one-token bad words always, and
        while min_tokens holds, EOS and stop_token_ids too (a row with nothing left to sample
        would fall back to the raw logits and emit a token the caller excluded)."""
        if params.allowed_token_ids is None:
            return
        allowed = set(params.allowed_token_ids)
        first_step = SamplingRow(params, [], [], self.eos_token_ids, 0, bad_words)  # the sampler's own bans
        if not allowed <= set(banned_tokens(first_step, self.vocab_size)):
            return
        if allowed <= {word[0] for word in bad_words if len(word) == 1}:  # banned at every step
            raise ValueError("allowed_token_ids: every allowed token is banned by bad_words")
        raise ValueError(
            f"allowed_token_ids: every allowed token is EOS, a stop_token_id or a bad word, which "
            f"min_tokens={params.min_tokens} bans for the first tokens"
        )

    def process_pooling(self, prompt: PromptType, params: PoolingParams) -> tuple[str | None, list[int]]:
        """A pooling request's prompt (text, token ids): tokenized, truncated, and checked to fit
        max_model_len (all of it: nothing is generated) and the whole KV cache."""
        text, ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = self._truncate(prompt, text, ids, self.keep_tokens(params), truncation_side(params))
        if len(ids) > self.max_model_len:  # (vLLM's words)
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {len(ids)} tokens in the input for embedding generation. Please reduce the "
                             "length of the input (or set truncate_prompt_tokens).")  # fmt: skip
        if len(ids) > self.capacity_tokens:
            raise ValueError(f"prompt ({len(ids)} tokens) needs more KV slots than the whole KV cache holds "
                             f"({self.capacity_tokens} tokens); raise {self.capacity_setting}")  # fmt: skip
        return text, ids

    def keep_tokens(self, params: SamplingParams | PoolingParams) -> int:
        """How many prompt tokens ``truncate_prompt_tokens`` keeps (-1: as many as max_model_len
        leaves beside max_tokens; for pooling, which generates nothing, max_model_len)."""
        keep = params.truncate_prompt_tokens
        assert keep is not None
        if isinstance(params, PoolingParams):
            return self.max_model_len if keep == -1 else keep
        if keep == -1:
            keep = self.max_model_len - (params.max_tokens if params.max_tokens is not None else 1)
            if keep < 1:
                raise ValueError(f"truncate_prompt_tokens=-1 leaves no prompt: max_tokens={params.max_tokens} "
                                 f"fills max_model_len={self.max_model_len}")  # fmt: skip
        return keep

    def _truncate(
        self, prompt: PromptType, text: str | None, ids: list[int], keep: int, side: str = "left"
    ) -> list[int]:
        """vLLM's truncation to the last ``keep`` tokens (``side="right"``: the first, its pooling
        default). A prompt tokenized here from text keeps the special tokens the tokenizer adds
        around it (e.g. BOS), as the tokenizer's own truncation does; token ids given by the caller
        are cut as they are."""
        if keep > self.max_model_len:
            raise VLLMValidationError(f"truncate_prompt_tokens={keep} exceeds max_model_len={self.max_model_len}",
                                      parameter="truncate_prompt_tokens", value=keep)
        if len(ids) <= keep:
            return ids
        from_text = isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt_token_ids" not in prompt)
        if from_text and text is not None:
            body = self.tokenizer(text, add_special_tokens=False).input_ids
            added = len(ids) - len(body)  # special tokens around the text
            start = next((i for i in range(added + 1) if ids[i : i + len(body)] == body), None)
            if start is not None and 0 <= added < keep:
                kept = body[: keep - added] if side == "right" else body[len(body) - (keep - added) :]
                return ids[:start] + kept + ids[start + len(body) :]
        return ids[:keep] if side == "right" else ids[-keep:]

    def _bad_words_token_ids(self, words: list[str]) -> list[tuple[int, ...]]:
        """Each bad word as tokens, alone and after a space (how it reads mid-sentence), like vLLM."""
        seqs: dict[tuple[int, ...], None] = {}
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                if ids := tuple(self.tokenizer.encode(text, add_special_tokens=False)):
                    seqs[ids] = None
        return list(seqs)


def per_prompt_loras(lora_request: Any, num_prompts: int) -> list[Any]:
    """``lora_request`` as generate takes it (one for all, or one per prompt), one per prompt."""
    loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * num_prompts
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request has {len(loras)} entries but there are {num_prompts} prompts")
    return loras


def truncation_side(params: SamplingParams | PoolingParams) -> str:
    """Which end ``truncate_prompt_tokens`` cuts, as vLLM 0.32's tokenizers: a generated prompt's
    start ("left", its last tokens kept), a pooled one's end ("right") unless it says."""
    return "left" if isinstance(params, SamplingParams) else params.truncation_side or "right"
