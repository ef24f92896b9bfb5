"""vLLM's ``skip_tokenizer_init``: an engine that loads no tokenizer, for token-id pipelines
(RL and training frameworks) that never want text.

Prompts are token ids (``{"prompt_token_ids": [...]}`` or a list of ids); outputs carry token
ids, their ``text`` is "" and logprobs' ``decoded_token`` None (the shape of
``SamplingParams(detokenize=False)``, which every request gets here). EOS comes from the model's
generation_config.json and config.json. Whatever needs the tokenizer (text prompts, stop
strings, bad_words, structured outputs, chat templates, a reasoning config, beam search,
``get_tokenizer``) is refused with a ValueError naming it, before anything is queued.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllmini.config import EngineArgs
    from vllmini.engine.sampling_params import SamplingParams

SKIPPED = "this engine was started with skip_tokenizer_init=True and has no tokenizer"


def no_tokenizer(what: str) -> ValueError:
    """The error for ``what`` (a field, an option, a call) that needs the tokenizer."""
    return ValueError(f"{what} needs a tokenizer, but {SKIPPED}; send token ids (prompt_token_ids) "
                      "and stop with stop_token_ids")  # fmt: skip


def text_prompt_error() -> ValueError:
    """vLLM's words for a text prompt, and what to pass instead."""
    return ValueError("You cannot pass text prompts when `skip_tokenizer_init` is True: give the prompt as "
                      "token ids ({'prompt_token_ids': [...]} or a list of ints)")  # fmt: skip


def tokenizer_or_raise(tokenizer: Any) -> Any:
    """``get_tokenizer()``: the tokenizer, or vLLM's ValueError when none was loaded."""
    if tokenizer is None:
        raise ValueError("Unable to get tokenizer because skip_tokenizer_init is True")
    return tokenizer


def check_engine_args(args: EngineArgs) -> None:
    """Start-up options that need the tokenizer, refused by name (``EngineArgs.validate``)."""
    if not isinstance(args.skip_tokenizer_init, bool):
        raise ValueError(f"skip_tokenizer_init must be True or False, got {args.skip_tokenizer_init!r}")
    if args.skip_tokenizer_init and args.resolved_reasoning_config() is not None:
        raise no_tokenizer("reasoning_config (its start and end strings are tokenized)")


def check_request(params: SamplingParams) -> None:
    """A request's own copy of its params on an engine without a tokenizer: the fields that need
    one refused by name; ``detokenize`` off (text "", decoded_token None), as vLLM answers."""
    if params.stop:
        raise no_tokenizer(f"stop={params.stop!r} (stop strings are matched in the text)")
    if params.bad_words:
        raise no_tokenizer(f"bad_words={params.bad_words!r} (the words are tokenized)")
    if params.structured_outputs is not None:
        raise no_tokenizer("structured_outputs (a grammar is compiled against the tokenizer's vocabulary)")
    params.detokenize = False


class NoDetokenizer:
    """The detokenizer of a request on an engine without a tokenizer: its text stays ""."""

    text = ""

    def step(self, token_ids: list[int], final: bool = False) -> str:
        return ""


def eos_token_ids(tokenizer: Any, generation_config: Any, hf_config: Any) -> tuple[int, ...]:
    """The tokenizer's EOS plus any the generation config lists (e.g. Llama 3's <|eot_id|>);
    without a tokenizer, config.json's ``eos_token_id`` in its place (vLLM reads the generation
    config, which transformers builds from config.json when the folder has none)."""
    ids: set[int] = set()
    for source in (tokenizer if tokenizer is not None else hf_config, generation_config):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    return tuple(sorted(ids))
