"""Offline beam search (``LLM.beam_search``), the way vLLM does it: on top of ``LLM.generate``.

Why at this level: a beam is only a prompt (the original prompt plus the tokens it chose), so
the scheduler, sampler and KV cache need no beam state of their own (no block forking, nothing
left to leak). Each step sends every live beam of every prompt to ONE ``LLM.generate`` call,
one token each with the top ``2 * beam_width`` logprobs (as transformers, so that enough
non-EOS candidates remain); the prefix cache makes the beams' shared prefixes cheap. Each
candidate (a beam plus one of those tokens, its logprob added to the beam's) is ranked per
prompt and the best ``beam_width`` live on; one ending in EOS (unless ``ignore_eos``) is
completed instead. At the end, completed and live beams are ranked together by vLLM's
length-penalised score and the best ``beam_width`` returned. With ``structured_outputs`` (vLLM
0.32's) each beam is constrained by the grammar: its candidates are the allowed ones among those
tokens (a step's request also gets them as ``allowed_token_ids``, up to 1024 of them), and a beam
whose grammar has ended is completed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from tqdm.auto import tqdm

from vllmini.engine.input_processor import PromptType, as_prompt_list, per_prompt_loras
from vllmini.engine.outputs import LogprobsEntry, RequestOutput
from vllmini.engine.sampling_params import (SamplingParams, StructuredOutputsParams, bad_value, is_int,
                                            raised_temperature, real_value)  # fmt: skip
from vllmini.engine.skip_tokenizer import no_tokenizer

if TYPE_CHECKING:
    from vllmini.engine.llm import LLM
    from vllmini.engine.llm_engine import LLMEngine


MAX_ALLOWED_TOKEN_IDS = 1024  # vLLM's cap on a beam step's allowed_token_ids (more: its candidates are filtered)


class BeamSearchParams(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's beam search options (names, order and defaults), validated at construction so that
    a bad value is a ValueError naming the field, not a failure steps later. ``temperature`` 0
    ranks by the model's logprobs alone; above 0 each beam's sampled token joins its candidates
    (raw logprobs still rank them, as in vLLM). ``length_penalty``: the final score is
    ``cum_logprob / length ** length_penalty``, see ``beam_score``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # every beam's constraint (vLLM 0.32's)
    skip_special_tokens: bool = True  # (vLLM 0.32's: the text leaves out special tokens, the prompt's too)

    def __post_init__(self) -> None:
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad_value("structured_outputs", "a StructuredOutputsParams or None", self.structured_outputs)
        for name in ("beam_width", "max_tokens"):
            if not is_int(value := getattr(self, name)) or value < 1:
                raise bad_value(name, "an int >= 1", value)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(value := getattr(self, name), bool):
                raise bad_value(name, "a bool", value)
        self.temperature = raised_temperature(real_value("temperature", self.temperature, ">= 0", lambda v: v >= 0))
        self.length_penalty = real_value("length_penalty", self.length_penalty, "", lambda v: True)


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` holds the prompt and the generated ids (a final EOS included, as in
    vLLM's offline beam search), ``logprobs`` one entry per generated token (that step's top
    ``2 * beam_width``), ``text`` the decoded tokens (filled when returned)."""

    tokens: list[int]
    logprobs: list[LogprobsEntry] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length" (max_tokens or the context is full)
    stop_reason: int | None = None  # the EOS id that completed it


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score`` (transformers' score before its 2024 rewrite): the length
    counts the prompt and not a final EOS. Only completed beams differ in length, so with no EOS
    the ranking is by cumulative logprob alone, whatever the penalty."""
    length = len(beam.tokens) - (beam.finish_reason == "stop")
    return beam.cum_logprob / (length**length_penalty)


@dataclass
class _Search:
    """One prompt's state: live beams (all of one length) and the completed ones."""

    prompt_len: int
    live: list[BeamSearchSequence]
    done: list[BeamSearchSequence] = field(default_factory=list)
    lora: Any = None  # its LoRARequest
    cache_salt: str | None = None  # its prompt's: every step's requests carry it


class BeamSearch:
    """The search over a batch of prompts, apart from how a step's requests are run: ``requests``
    gives a step's (prompt, adapter) pairs, the caller runs them (``LLM.generate``, or the async
    engine: engine/async_beam_search.py) and hands their outputs to ``advance``; ``best`` ranks
    what is left. Prompts, adapters and the logprobs cap are checked when it is made."""

    def __init__(self, engine: LLMEngine, prompts: list[PromptType], params: BeamSearchParams, loras: list[Any]) -> None:
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if engine.tokenizer is None:
            raise no_tokenizer("beam search (its outputs' text)")
        if engine.sampler.logprobs_mode.endswith("logits"):  # (a beam's score sums its tokens' logprobs)
            raise ValueError(f"beam search needs logprobs: this engine's logprobs_mode is {engine.sampler.logprobs_mode!r}")
        cap = engine.input_processor.max_logprobs
        if 2 * params.beam_width > cap:  # (else the first step would name logprobs, which the caller never set)
            raise ValueError(f"beam_width={params.beam_width} needs 2 * beam_width = {2 * params.beam_width} logprobs "
                             f"per step, more than max_logprobs={cap} (an EngineArgs field; -1 lifts it)")  # fmt: skip
        self.engine, self.params = engine, params
        self.eos = frozenset() if params.ignore_eos else frozenset(engine.eos_token_ids)
        self.step_params = SamplingParams(
            max_tokens=1, temperature=params.temperature, logprobs=2 * params.beam_width, detokenize=False
        )
        # every prompt is checked as generate checks it (its length too) before any work is done: with
        # concurrency_limit, a bad prompt of a later group would otherwise fail after the earlier searches
        inputs = [engine.input_processor.process(p, self.step_params) for p in prompts]
        if any(inp.prompt_embeds is not None for inp in inputs):  # (its beams go on as token prompts)
            raise ValueError("prompt_embeds is taken by generate requests only (not by pooling or beam search)")
        self.searches = [_Search(len(inp.prompt_token_ids), [BeamSearchSequence(inp.prompt_token_ids)], lora=lora,
                                 cache_salt=inp.cache_salt) for inp, lora in zip(inputs, loras)]  # fmt: skip
        self._beams: list[tuple[_Search, BeamSearchSequence]] = []
        so = params.structured_outputs
        self.grammar = None if so is None else engine.structured.compile_now(so)  # (a bad one: ValueError now)
        self._allowed: list[set[int] | None] = []  # each of _beams' allowed next tokens (None: any)

    def requests(self, searches: list[_Search] | None = None) -> list[tuple[dict[str, Any], SamplingParams, Any]]:
        """The next step's requests, one per live beam of ``searches`` (default: all): the beam's
        tokens as a prompt (with its prompt's cache salt), its params and its adapter. Empty:
        nothing left to extend (a beam that filled the context or the KV cache, or whose grammar
        has ended, is completed first)."""
        room = self.engine.input_processor.room
        searches = self.searches if searches is None else searches
        for search in searches:
            full = [len(b.tokens) > search.prompt_len and room(len(b.tokens)) < 1 for b in search.live]
            search.done += [_finished(b, "length") for b, f in zip(search.live, full) if f]
            search.live = [b for b, f in zip(search.live, full) if not f]
        self._beams, self._allowed, params = [], [], []
        for search in searches:
            for beam in list(search.live):
                allowed = None if self.grammar is None else self.engine.structured.allowed_after(
                    self.grammar, beam.tokens[search.prompt_len :])  # fmt: skip
                if self.grammar is not None and not allowed:  # (ended: as vLLM's, completed)
                    search.live.remove(beam)
                    search.done += [_finished(beam, "stop")] if len(beam.tokens) > search.prompt_len else []
                    continue
                self._beams.append((search, beam))
                self._allowed.append(None if allowed is None else set(allowed))
                few = allowed is not None and len(allowed) <= MAX_ALLOWED_TOKEN_IDS  # (else only filtered, as vLLM)
                params.append(self.step_params.clone(allowed_token_ids=allowed) if few else self.step_params)
        return [({"prompt_token_ids": beam.tokens} | ({"cache_salt": s.cache_salt} if s.cache_salt else {}), p, s.lora)
                for (s, beam), p in zip(self._beams, params)]  # fmt: skip

    def advance(self, results: list[RequestOutput]) -> None:
        """Take the outputs of the last ``requests`` (in order): each beam's candidates are its
        tokens among the top ``2 * beam_width``; a prompt keeps its best ``beam_width`` live ones,
        and one ending in EOS (unless ``ignore_eos``) is completed instead."""
        searches = list({id(s): s for s, _ in self._beams}.values())
        candidates: dict[int, list[BeamSearchSequence]] = {id(search): [] for search in searches}
        for (search, beam), allowed, result in zip(self._beams, self._allowed, results):
            # no logprobs: the row ended without a token (invalid logits), so the beam ends here, as in vLLM
            for entry in result.outputs[0].logprobs or []:
                for token, logprob in entry.items():
                    if allowed is not None and token not in allowed:  # (raw logprobs: before the grammar's mask)
                        continue
                    cum_logprob = beam.cum_logprob + float(logprob)
                    child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry], cum_logprob)
                    if token in self.eos:
                        search.done.append(_finished(child, "stop", token))
                    else:
                        candidates[id(search)].append(child)
        for search in searches:  # (one length per prompt: this ranks by cumulative logprob, stable on ties)
            ranked = sorted(candidates[id(search)], key=lambda b: beam_score(b, self.params.length_penalty), reverse=True)
            search.live = ranked[: self.params.beam_width]

    def best(self, decode: bool = True) -> list[BeamSearchOutput]:
        """Per prompt, completed and live beams ranked together, the best ``beam_width``; with
        ``decode``, each one's ``text`` is its tokens' (prompt + output)."""
        params, outputs = self.params, []
        for search in self.searches:
            ranked = sorted(search.done + search.live, key=lambda b: beam_score(b, params.length_penalty), reverse=True)
            best = ranked[: params.beam_width]
            for beam in best:
                beam.finish_reason = beam.finish_reason or "length"
                if decode:
                    beam.text = self.text(beam.tokens, beam)
            outputs.append(BeamSearchOutput(best))
        return outputs

    def text(self, tokens: list[int], beam: BeamSearchSequence) -> str:
        """``tokens`` (the end of ``beam``'s) decoded: a final EOS only with
        include_stop_str_in_output, special tokens only without skip_special_tokens."""
        hide_eos = beam.finish_reason == "stop" and not self.params.include_stop_str_in_output
        return self.engine.tokenizer.decode(tokens[:-1] if hide_eos else tokens,
                                            skip_special_tokens=self.params.skip_special_tokens)  # fmt: skip


def beam_search(
    llm: LLM, prompts: PromptType | list[PromptType], params: BeamSearchParams,
    use_tqdm: bool = False, concurrency_limit: int | None = None, lora_request: Any = None,
) -> list[BeamSearchOutput]:  # fmt: skip
    """``LLM.beam_search``: one ``BeamSearchOutput`` per prompt, in input order; each step's beams
    of every prompt go to one ``LLM.generate`` call. ``concurrency_limit``: search that many
    prompts at a time (vLLM's option); None: all."""
    if concurrency_limit is not None and (not is_int(concurrency_limit) or concurrency_limit < 1):
        raise bad_value("concurrency_limit", "an int >= 1 or None", concurrency_limit)
    prompts = as_prompt_list(prompts)
    loras = per_prompt_loras(lora_request, len(prompts))
    search = BeamSearch(llm.llm_engine, prompts, params, loras)
    for lora in loras:  # (checked up front too, as the prompts; a loaded one is only looked up)
        if lora is not None:
            llm.llm_engine.add_lora(lora)
    group = concurrency_limit or max(len(search.searches), 1)
    for start in range(0, len(search.searches), group):
        steps = tqdm(range(params.max_tokens), desc="Beam search", unit="token", disable=not use_tqdm)
        for _ in steps:
            requests = search.requests(search.searches[start : start + group])
            if not requests:
                break
            search.advance(llm.generate([p for p, _, _ in requests], [params for _, params, _ in requests],
                                        use_tqdm=False, lora_request=[lora for _, _, lora in requests]))  # fmt: skip
    return search.best()


def _finished(beam: BeamSearchSequence, reason: str, stop_reason: Any = None) -> BeamSearchSequence:
    beam.finish_reason, beam.stop_reason = reason, stop_reason
    return beam
