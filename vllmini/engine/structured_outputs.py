"""Structured outputs with xgrammar, vLLM's default backend.

``SamplingParams(structured_outputs=StructuredOutputsParams(json=... | regex=... | choice=...
| grammar=... | json_object=True | structural_tag=...))`` constrains what a request generates.
Its path, as in vLLM v1:

1. When the request is added, its constraint is parsed into an xgrammar ``Grammar`` on the
   caller's thread, so a bad schema, regex or grammar is a ValueError naming the field and
   nothing is queued.
2. The grammar is compiled against the tokenizer's vocabulary on a background thread (the
   vocabulary's ``TokenizerInfo`` is built there too, at the first such request), and the
   engine keeps the request out of the scheduler until it is ready: a slow compile holds
   back its own request only.
3. Each of its sequences gets a ``GrammarMatcher``. Every step the engine fills the
   allowed-token bitmask of those rows and masks their logits before the sampler, so, as in
   vLLM, their logprobs are those of the masked logits; a ban (``min_tokens``, bad words,
   ``allowed_token_ids``) that would leave no token gives way to the grammar. After sampling,
   each matcher takes its sequence's token. A matcher whose grammar has ended (it took an
   EOS, which it allows only once the output is complete) masks nothing more, as in vLLM.

Steps holding such a row are synchronous under async scheduling: the next mask depends on
the token just sampled.

With a reasoning model (``EngineArgs.reasoning_config``, which the server's
``--reasoning-parser`` sets), the grammar constrains the answer, not the reasoning, as vLLM's
does: a sequence is free until the last reasoning string said (prompt + output) is the end
string, and its matcher takes the tokens after that. ``StructuredOutputsConfig(
enable_in_reasoning=True)`` binds it from the first token instead.
"""
from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllmini.config_fields import config_fields
from vllmini.engine.sampling_params import StructuredOutputsParams
from vllmini.engine.thinking_budget import ThinkingBudget

INSTALL_HINT = "pip install xgrammar"
CACHE_LIMIT_BYTES = 512 * 2**20  # compiled grammars kept for reuse (vLLM's default cap too; xgrammar's has none)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's ``StructuredOutputsConfig``, the parts built here: ``backend`` ("auto" or
    "xgrammar", the one backend here), ``reasoning_parser`` (as vLLM's: a grammar then waits out
    the reasoning; it gives ``EngineArgs.reasoning_config`` when that is not set),
    ``enable_in_reasoning`` (the grammar binds the reasoning too: engine/structured_outputs.py)
    and ``disable_any_whitespace`` (every request's JSON without optional whitespace)."""

    backend: str = "auto"
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "xgrammar"):
            raise ValueError(f"structured_outputs_config.backend must be 'auto' or 'xgrammar' (the one backend "
                             f"built here), got {self.backend!r}")  # fmt: skip
        if not isinstance(self.reasoning_parser, str):
            raise ValueError(f"structured_outputs_config.reasoning_parser must be a string, got {self.reasoning_parser!r}")
        for flag in ("enable_in_reasoning", "disable_any_whitespace"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"structured_outputs_config.{flag} must be True or False, got {getattr(self, flag)!r}")

    @classmethod
    def coerce(cls, value: StructuredOutputsConfig | dict | str | None) -> StructuredOutputsConfig:
        """A StructuredOutputsConfig from itself, a dict or its JSON text (None: the defaults)."""
        if value is None or isinstance(value, StructuredOutputsConfig):
            return value or cls()
        return cls(**config_fields(value, "structured_outputs_config", cls))


def load_xgrammar() -> Any:
    """The xgrammar module, imported on first use (it takes ~1.5 s): a request without
    structured outputs never pays for it."""
    try:
        import xgrammar
    except ImportError as exc:
        raise ValueError(f"structured_outputs needs the xgrammar package ({INSTALL_HINT}): {exc}") from exc
    return xgrammar


def parse_grammar(params: StructuredOutputsParams, disable_any_whitespace: bool = False) -> Any:
    """The constraint as an xgrammar ``Grammar``; a ValueError naming the field when xgrammar
    cannot read it. Needs no vocabulary, so it is quick enough for the caller's thread.
    ``disable_any_whitespace``: the engine's default (StructuredOutputsConfig), or'd with the request's."""
    xgr = load_xgrammar()
    try:
        return _grammar(xgr, params, not (params.disable_any_whitespace or disable_any_whitespace))
    except Exception as exc:  # xgrammar reports every parse error as RuntimeError (or ValueError)
        # the first line says what is wrong; a Lark error's next lines quote the grammar with a caret under
        # the fault, and a JSON text's error ends with the text itself, lines of it that say nothing alone
        detail = str(exc).strip().splitlines()
        raise ValueError(f"structured_outputs.{params.kind} cannot be used: {detail[0] if detail else repr(exc)}") from exc


def _grammar(xgr: Any, params: StructuredOutputsParams, any_whitespace: bool) -> Any:
    if params.json is not None:
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace)
    if params.json_object:
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace)
    if params.regex is not None:
        return xgr.Grammar.from_regex(params.regex)
    if params.choice is not None:  # one EBNF alternative per choice; JSON's string escapes are EBNF's
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
    if params.grammar is not None:
        # EBNF rules read "name ::= ..."; anything else is taken as Lark ("start: ..."), as vLLM does
        if "::=" in params.grammar:
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_lark(params.grammar)
    return structural_tag_grammar(xgr, params.structural_tag)


def structural_tag_grammar(xgr: Any, text: str) -> Any:
    """xgrammar's structural tag; as vLLM, also its older form ``{"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}`` (vLLM's documented example), which xgrammar now
    takes only as Python objects."""
    tag = json.loads(text)
    if not (isinstance(tag, dict) and "structures" in tag):
        return xgr.Grammar.from_structural_tag(text)
    items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
             for s in tag["structures"]]  # fmt: skip
    return xgr.Grammar.from_structural_tag(items, tag["triggers"])


class StructuredOutputManager:
    """Compiles grammars in the background, holds the requests waiting for theirs, and masks
    and advances their sequences' matchers. Requests are the engine's ``RequestState``s; this
    class reads and writes their ``grammar`` and ``matchers`` fields only."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], reasoning: ThinkingBudget | None = None,
        disable_any_whitespace: bool = False,
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.reasoning = reasoning  # the reasoning strings a grammar waits out (None: it binds from the start)
        self.disable_any_whitespace = disable_any_whitespace  # every JSON grammar without optional whitespace
        self.vocab_size = vocab_size  # the logits' width: tokens past the tokenizer's are never allowed
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None  # built on the compile thread at the first request
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._filler: Any = None  # xgrammar's BatchGrammarMatcher: fills the rows' masks on its own threads
        self.waiting: list[Any] = []  # RequestStates whose grammar is still compiling

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """Check the constraint now (ValueError naming the field), compile it in the background."""
        grammar = parse_grammar(params, self.disable_any_whitespace)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllmini-grammar")
        return self._executor.submit(self._compile, grammar)

    def close(self) -> None:
        """Stop the compile thread (a grammar compiling now is waited for; a later ``submit``
        starts a new thread)."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _compile(self, grammar: Any) -> Any:
        if self._compiler is None:
            xgr = load_xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
        return self._compiler.compile_grammar(grammar)

    def hold(self, state: Any) -> bool:
        """Keep a request whose grammar is not compiled yet out of the scheduler (True), or give
        its sequences their matchers now (False: it may be scheduled). A compile that has failed
        already is held too: ``ready`` reports it, as it does a later failure."""
        if not state.grammar.done() or state.grammar.exception() is not None:
            self.waiting.append(state)
            return True
        self._start(state)
        return False

    def drop(self, state: Any) -> None:
        """Forget an aborted request held for its grammar now (not at a later step, which may
        never come), cancelling its compile if it has not started."""
        held = len(self.waiting)
        self.waiting = [s for s in self.waiting if s is not state]  # (by identity: a dataclass compares fields)
        if len(self.waiting) < held:
            state.grammar.cancel()

    def _start(self, state: Any) -> None:
        xgr = load_xgrammar()
        compiled = state.grammar.result()
        state.matchers = [xgr.GrammarMatcher(compiled) for _ in state.seqs]

    def matcher(self, state: Any, seq: Any) -> Any | None:
        """The matcher that constrains the sequence's next token: None without a grammar, or
        while its reasoning goes on. Once the reasoning has ended it stays bound (an answer
        may say the strings again); the matcher has taken exactly the tokens after the end,
        since sample_step cuts a step's tokens at the end string."""
        if state.matchers is None:
            return None
        if self.reasoning is not None and seq.index not in state.reasoning_ended:
            if not self.reasoning.ended(self.reasoning.seq_marks(seq, state.thinking_marks)):
                return None
            state.reasoning_ended.add(seq.index)
        return state.matchers[seq.index]

    def ready(self, wait: float = 0.0) -> list[tuple[Any, BaseException | None]]:
        """The held requests whose compile has ended, with its error (None: their matchers are
        set, schedule them). ``wait``: seconds to wait for one when none has ended yet."""
        if not self.waiting:
            return []
        if wait > 0 and not any(s.grammar.done() for s in self.waiting):
            concurrent.futures.wait([s.grammar for s in self.waiting], wait, concurrent.futures.FIRST_COMPLETED)
        # one look per compile: one ending between two looks would be in neither list
        ended = [s.grammar.done() for s in self.waiting]
        done = [s for s, e in zip(self.waiting, ended) if e]
        self.waiting = [s for s, e in zip(self.waiting, ended) if not e]
        out: list[tuple[Any, BaseException | None]] = []
        for state in done:
            error = state.grammar.exception()
            if error is None:
                self._start(state)
            out.append((state, error))
        return out

    def mask(
        self, logits: torch.Tensor, matchers: Sequence[Any | None], drafts: dict[int, list[int]] | None = None
    ) -> torch.Tensor:
        """``logits`` with each row's tokens that its matcher (None: no grammar) does not allow
        masked, in place when the tensor is contiguous (xgrammar skips other layouts silently,
        so those are copied first). ``drafts`` (speculative decoding: first row -> drafts, the
        next rows holding the same matcher): a draft's row is masked in the state after the
        drafts before it, which the matcher takes and then gives back (``rollback``)."""
        later = {first + j for first, d in (drafts or {}).items() if matchers[first] is not None
                 for j in range(1, len(d) + 1)}  # fmt: skip
        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated() and i not in later]
        if not rows and not later:
            return logits
        if not logits.is_contiguous():
            logits = logits.contiguous()
        xgr = load_xgrammar()
        if self._filler is None:
            self._filler = xgr.BatchGrammarMatcher()
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        if rows:
            self._filler.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, indices=rows)
        for first, d in (drafts or {}).items():
            if (matcher := matchers[first]) is None:
                continue
            taken = 0
            for j, token in enumerate(d, 1):  # (drafts are cut to what the grammar takes: see valid_prefix)
                if matcher.is_terminated() or not matcher.accept_token(token):
                    break
                taken += 1
                if not matcher.is_terminated():  # (after the grammar's end the row's token is never kept)
                    matcher.fill_next_token_bitmask(bitmask, first + j)
                    rows.append(first + j)
            if taken:
                matcher.rollback(taken)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)
        return logits

    def compile_now(self, params: StructuredOutputsParams) -> Any:
        """The constraint compiled on the caller's thread (beam search's: its beams replay it)."""
        return self.submit(params).result()

    def allowed_after(self, compiled: Any, tokens: list[int]) -> list[int] | None:
        """The token ids the grammar allows after ``tokens`` (a fresh matcher replays them, as vLLM's
        beam search does: a matcher cannot be copied); None once it has ended or refuses them."""
        xgr = load_xgrammar()
        matcher = xgr.GrammarMatcher(compiled)
        if not all(matcher.accept_token(t) for t in tokens) or matcher.is_terminated():
            return None
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        ids = torch.arange(self.vocab_size)
        return ids[((bitmask[0][ids >> 5] >> (ids & 31)) & 1).bool()].tolist()

    @staticmethod
    def valid_prefix(matcher: Any, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar takes from the matcher's state (up to its
        end, the EOS it ends on included); the matcher is left as it was."""
        taken = 0
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            taken += 1
        if taken:
            matcher.rollback(taken)
        return tokens[:taken]

    @staticmethod
    def accept(matcher: Any, token: int) -> bool:
        """Advance ``matcher`` by ``token``; False when its grammar refuses the token (which the
        mask prevents: the sequence is then ended with an error)."""
        return matcher.is_terminated() or bool(matcher.accept_token(token))
