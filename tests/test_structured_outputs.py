"""Structured outputs (vLLM's ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``)
on the default model: every constraint is followed, greedy tokens equal transformers' with
xgrammar's own logits processor, other rows are untouched, and bad constraints are refused."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import re
import sys
import threading
import types

import msgspec
import pytest
import torch

from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams, StructuredOutputsParams
from vllmini.engine.llm_engine import LLMEngine
from vllmini.engine.structured_outputs import StructuredOutputManager, parse_grammar
from vllmini.scheduler.sequence import SequenceStatus

xgr = pytest.importorskip("xgrammar")

PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(model=str(default_model_dir), max_model_len=512)


def chat(llm: LLM, question: str) -> str:
    messages = [{"role": "user", "content": question}]
    return llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 20
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150


# (question, constraint, check of the whole output text)
CASES = {
    "json": ("Give me a person as JSON.", StructuredOutputsParams(json=PERSON), check_person),
    "json_text": ("Give me a person as JSON.", StructuredOutputsParams(json=json.dumps(PERSON)), check_person),
    "regex": ("Give me a US phone number.", StructuredOutputsParams(regex=PHONE), lambda t: re.fullmatch(PHONE, t) or pytest.fail(t)),
    "choice": (
        "What is the capital of France?",
        StructuredOutputsParams(choice=["Paris", "London", 'a "quoted"\nchoice']),
        lambda t: t in ("Paris", "London", 'a "quoted"\nchoice') or pytest.fail(t),
    ),
    "ebnf": (
        "Is the sky blue? Answer yes or no.",
        StructuredOutputsParams(grammar='root ::= answer "."\nanswer ::= "yes" | "no"'),
        lambda t: t in ("yes.", "no.") or pytest.fail(t),
    ),
    "lark": (
        "Is the sky blue? Answer yes or no.",
        StructuredOutputsParams(grammar='start: ("yes" | "no") "!"'),
        lambda t: t in ("yes!", "no!") or pytest.fail(t),
    ),
    "structural_tag": (
        "What is 2 + 2? Answer inside <answer> tags.",
        StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": {"type": "integer", "maximum": 100}},
            "end": "</answer>"}})),  # fmt: skip
        lambda t: re.fullmatch(r"<answer>\s*-?\d+\s*</answer>", t) or pytest.fail(t),
    ),
    "json_object": (
        "Give me a JSON object with a name and an age.",
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        lambda t: isinstance(json.loads(t), dict) and "\n" not in t or pytest.fail(t),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_each_constraint_is_followed_greedy_and_sampled(llm, name):
    question, constraint, check = CASES[name]
    prompt = chat(llm, question)
    greedy = SamplingParams(temperature=0, max_tokens=60, structured_outputs=constraint)
    sampled = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=60, structured_outputs=constraint)
    outs = llm.generate([prompt, prompt], [greedy, sampled], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[1].outputs) == 3
    compiled = llm.llm_engine.structured.submit(constraint).result()
    for c in [*outs[0].outputs, *outs[1].outputs]:
        if c.finish_reason == "stop":
            check(c.text)
        else:  # a sample that ran out of tokens (an unbounded JSON object): a prefix the grammar accepts
            assert c.finish_reason == "length" and xgr.GrammarMatcher(compiled).accept_string(c.text), c
    assert not llm.llm_engine.requests and llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.num_blocks


@pytest.mark.slow
def test_greedy_equals_transformers_with_xgrammar_logits_processor(llm):
    """The oracle: transformers' greedy generate with xgrammar's own HF logits processor, same
    weights, same grammar. Also checks that the constraint changed what greedy decoding says."""
    from transformers import AutoModelForCausalLM

    engine = llm.llm_engine
    hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=list(engine.eos_token_ids))
    compiler = xgr.GrammarCompiler(info)
    for question, constraint, compiled in [
        ("Give me a US phone number.", StructuredOutputsParams(regex=PHONE), compiler.compile_regex(PHONE)),
        ("Give me a person as JSON.", StructuredOutputsParams(json=PERSON), compiler.compile_json_schema(json.dumps(PERSON))),
    ]:
        prompt = chat(llm, question)
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = hf.generate(ids, logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)], do_sample=False,
                              max_new_tokens=40, pad_token_id=tok.eos_token_id)  # fmt: skip
        theirs = out[0, ids.shape[1] :].tolist()
        ours, free = llm.generate(
            [prompt, prompt],
            [SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint), SamplingParams(temperature=0, max_tokens=40)],
            use_tqdm=False,
        )  # fmt: skip
        assert list(ours.outputs[0].token_ids) == theirs
        assert ours.outputs[0].token_ids[-1] in engine.eos_token_ids
        assert free.outputs[0].token_ids != ours.outputs[0].token_ids


def test_other_rows_in_the_batch_are_untouched(llm):
    prompts = [chat(llm, "Name three fruits."), chat(llm, "Give me a US phone number."), chat(llm, "Count to five.")]
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate([prompts[0], prompts[2]], plain, use_tqdm=False)]
    regex = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=PHONE))
    mixed = llm.generate(prompts, [plain, regex, plain], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    assert re.fullmatch(PHONE, mixed[1].outputs[0].text)


def test_logprobs_are_those_of_the_masked_logits(llm):
    """As in vLLM (the bitmask is applied to the logits the sampler reads): the tokens the grammar
    refuses have logprob -inf and the allowed ones share all the probability."""
    choices = ["Paris", "London"]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=20, structured_outputs=StructuredOutputsParams(choice=choices))
    out = llm.generate(chat(llm, "What is the capital of France?"), params, use_tqdm=False)[0].outputs[0]
    assert out.text in choices
    tok = llm.get_tokenizer()
    text = ""
    for token, entry in zip(out.token_ids, out.logprobs):
        finite = {t: lp for t, lp in entry.items() if math.isfinite(lp)}
        assert math.isclose(sum(math.exp(lp) for lp in finite.values()), 1.0, abs_tol=1e-4)
        for t in finite:  # each allowed token continues the text toward a choice, or ends it
            piece = tok.decode([t])
            assert t in llm.llm_engine.eos_token_ids or any(c.startswith(text + piece) for c in choices), piece
        assert entry[token].rank == 1  # greedy: the most likely allowed token
        text += tok.decode([token]) if token not in llm.llm_engine.eos_token_ids else ""
    assert text == out.text


def test_the_grammar_wins_over_bans_and_ignore_eos_frees_the_rest(llm):
    """min_tokens bans EOS, but a complete choice allows only EOS: the grammar holds (a row with
    every token masked falls back to the grammar's mask) and its EOS ends the output. With
    ignore_eos the matcher ends at its EOS and the output runs on unconstrained, as in vLLM."""
    prompt = chat(llm, "What is the capital of France?")
    choice = StructuredOutputsParams(choice=["Paris", "London"])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, min_tokens=12, structured_outputs=choice), use_tqdm=False)
    assert out[0].outputs[0].text in ("Paris", "London") and out[0].outputs[0].finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, structured_outputs=choice), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 12
    end = next(i for i, t in enumerate(c.token_ids) if t in llm.llm_engine.eos_token_ids)
    assert llm.get_tokenizer().decode(c.token_ids[:end]) in ("Paris", "London")


BAD = [
    (dict(json=PERSON, regex="a"), "exactly one of"),
    (dict(), "exactly one of.*got none"),
    (dict(json="{not json"), r"structured_outputs\.json"),
    (dict(json={"type": 5}), r"structured_outputs\.json"),
    (dict(json=3), r"structured_outputs\.json"),
    (dict(regex="(unclosed"), r"structured_outputs\.regex"),
    (dict(regex=""), r"structured_outputs\.regex"),
    (dict(grammar="root ::= undefined_rule"), r"structured_outputs\.grammar"),
    (dict(grammar="start: undefined_rule"), r"structured_outputs\.grammar"),
    (dict(choice=[]), r"structured_outputs\.choice"),
    (dict(choice=["a", 1]), r"structured_outputs\.choice"),
    (dict(json_object=False), r"structured_outputs\.json_object"),
    (dict(json=PERSON, whitespace_pattern=r"\s*"), r"structured_outputs\.whitespace_pattern"),
    (dict(structural_tag="{"), r"structured_outputs\.structural_tag"),
]


@pytest.mark.parametrize("fields,match", BAD, ids=[m.split("\\.")[-1] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_constraints_are_refused_naming_the_field(llm, fields, match):
    prompt = chat(llm, "Hello")
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**fields)), use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.requests and not engine.structured.waiting
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("fields,why", [
    (dict(grammar="start: ("), r"Lark error at line 1, column 9: expected '\)' after group"),
    (dict(json='{\n  "type": "object",\n  "properties": {\n'), r"Failed to parse JSON: syntax error at line 4"),
])  # fmt: skip
def test_a_parse_error_says_what_is_wrong(fields, why):
    """xgrammar's message, not its last line: a Lark error's last line is a caret under the grammar
    ("        ^"), a JSON text's the last line of that text."""
    with pytest.raises(ValueError, match=r"structured_outputs\.\w+ cannot be used: .*" + why):
        parse_grammar(StructuredOutputsParams(**fields))


def test_params_round_trip_through_json_and_refuse_a_wrong_type():
    params = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json=PERSON))
    back = msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams)
    assert back.structured_outputs == params.structured_outputs
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="a+")


def test_without_xgrammar_a_request_is_refused_with_the_install_hint(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    with pytest.raises(ValueError, match="pip install xgrammar"):
        llm.generate("Hi", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a")), use_tqdm=False)
    assert not llm.llm_engine.requests


def _run_until_done(engine: LLMEngine, max_steps: int = 500) -> dict:
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("requests did not finish")


def gate_compiles(monkeypatch) -> threading.Event:
    """Grammar compiles wait (on their thread) until the returned event is set."""
    gate = threading.Event()
    compile_grammar = StructuredOutputManager._compile

    def slow_compile(self, grammar):
        assert gate.wait(30)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    return gate


def test_a_compiling_grammar_holds_back_its_request_only(llm, monkeypatch):
    """The compile runs on its own thread; while it runs, other requests are scheduled and
    finish. An abort during the compile leaves nothing behind; a compile that fails fails
    its own request."""
    engine = llm.llm_engine
    gate = gate_compiles(monkeypatch)
    regex = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=PHONE))
    plain = SamplingParams(temperature=0, max_tokens=8)
    engine.add_request("held", chat(llm, "Give me a US phone number."), regex)
    engine.add_request("aborted", chat(llm, "Give me a US phone number."), regex)
    engine.add_request("plain", chat(llm, "Count to five."), plain)
    finals = {}
    while "plain" not in finals:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    held = engine.requests["held"]
    assert held.seqs[0].status is SequenceStatus.WAITING and held.seqs[0].num_computed_tokens == 0
    assert held.seqs[0] not in engine.scheduler.waiting and len(engine.structured.waiting) == 2
    assert engine.abort_request("aborted")[0].outputs[0].finish_reason == "abort"
    gate.set()
    finals.update(_run_until_done(engine))
    assert re.fullmatch(PHONE, finals["held"].outputs[0].text) and "aborted" not in finals
    assert not engine.structured.waiting and engine.block_manager.num_free_blocks == engine.num_blocks

    def failing_compile(self, grammar):
        raise RuntimeError("compiler exploded")

    monkeypatch.setattr(StructuredOutputManager, "_compile", failing_compile)
    engine.add_request("broken", chat(llm, "Hi"), regex)
    engine.add_request("fine", chat(llm, "Hi"), plain)
    finals = _run_until_done(engine)
    assert "compiler exploded" in str(engine.failed.pop("broken")) and not engine.failed
    assert finals["fine"].outputs[0].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.num_blocks


@pytest.mark.slow
def test_async_scheduling_preemption_and_streaming_give_the_same_outputs(default_model_dir, llm):
    """Under async scheduling (a structured step is synchronous), a KV cache small enough to
    preempt, and the async engine's delta stream, the outputs equal the plain engine's."""
    questions = ["Give me a US phone number.", "Give me a person as JSON.", "Write a poem about the sea."]
    constraints = [StructuredOutputsParams(regex=PHONE), StructuredOutputsParams(json=PERSON), None]
    prompts = [chat(llm, q) for q in questions]
    params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=c) for c in constraints]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    block_bytes = llm.llm_engine.runner.kv_caches[0][0][0].numel() * 4 * 2 * len(llm.llm_engine.runner.kv_caches)
    tight = LLM(model=str(default_model_dir), max_model_len=512, async_scheduling=True, kv_cache_memory=6 * block_bytes)
    assert tight.llm_engine.num_blocks == 6
    got = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0

    async def stream() -> list[list[int]]:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(default_model_dir), max_model_len=512))

        async def one(i: int) -> list[int]:
            ids: list[int] = []
            p = params[i].clone(output_kind="delta")
            async for out in engine.generate(prompts[i], p, request_id=f"r{i}"):
                ids += out.outputs[0].token_ids
            return ids

        try:
            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        finally:
            await engine.shutdown()

    assert asyncio.run(stream()) == expected


def test_async_engine_refuses_a_bad_constraint_at_the_call(default_model_dir):
    """(and its shutdown stops the grammar compile thread it started)"""
    import threading

    def grammar_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("vllmini-grammar")}

    before, kept = grammar_threads(), []

    async def main() -> None:
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(default_model_dir), max_model_len=256))
        kept.append(engine)  # (still referenced after shutdown, as a server's app holds it)
        try:
            bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
            with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
                async for _ in engine.generate("Hi", bad, request_id="bad"):
                    pass
            good = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
            outs = [o async for o in engine.generate("Is water wet?", good, request_id="bad")]
            assert outs[-1].outputs[0].text in ("yes", "no") and outs[-1].finished
            assert grammar_threads() - before  # the compile thread runs...
        finally:
            await engine.shutdown()

    asyncio.run(main())
    assert not grammar_threads() - before  # ...until the engine shuts down


def test_a_compile_ending_while_ready_sorts_the_queue_is_not_lost():
    """ready() looks at each compile once: one that ended between two looks (the compile
    thread runs meanwhile) was in neither its answer nor its queue, so its request was never
    scheduled and the caller waited forever."""

    class EndsOnSecondLook(concurrent.futures.Future):
        looks = 0

        def done(self) -> bool:
            self.looks += 1
            if self.looks == 2:  # the compile thread ends it right here
                self.set_exception(RuntimeError("compiled"))
            return super().done()

    manager = StructuredOutputManager(None, 8, [0])
    state = types.SimpleNamespace(grammar=EndsOnSecondLook())
    manager.waiting.append(state)
    ended = manager.ready()
    assert [s for s, _ in ended] + manager.waiting == [state]


def test_a_compile_that_failed_before_enqueue_fails_its_request_alone(llm, monkeypatch):
    """A compile can end (here: fail) before the request is queued; that error is reported
    like a later one (the request fails at the next step) instead of escaping enqueue, which
    left the request id taken (and in the async engine failed every stream)."""
    engine = llm.llm_engine
    submit = StructuredOutputManager.submit

    def failing_compile(self, grammar):
        raise RuntimeError("compiler exploded")

    def submit_and_wait(self, params):
        future = submit(self, params)
        concurrent.futures.wait([future])
        return future

    monkeypatch.setattr(StructuredOutputManager, "_compile", failing_compile)
    monkeypatch.setattr(StructuredOutputManager, "submit", submit_and_wait)
    regex = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=PHONE))
    engine.add_request("early", chat(llm, "Hi"), regex)
    _run_until_done(engine)
    assert "compiler exploded" in str(engine.failed.pop("early")) and not engine.failed
    assert not engine.requests and not engine.structured.waiting


def test_an_abort_while_compiling_leaves_nothing_behind_at_once(llm, monkeypatch):
    """An aborted request whose grammar is still compiling leaves the held queue at the abort
    (its compile is cancelled if not started), not at some later step that may never come:
    e.g. LLM.generate refusing its second request aborts the first and returns."""
    engine = llm.llm_engine
    gate = gate_compiles(monkeypatch)
    good = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex=PHONE))
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    try:
        with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
            llm.generate([chat(llm, "Hi"), chat(llm, "Hi")], [good, bad], use_tqdm=False)
        assert not engine.requests and not engine.structured.waiting
        engine.add_request("a", chat(llm, "Hi"), good)
        engine.add_request("b", chat(llm, "Hi"), good)
        later = engine.structured.waiting[1].grammar
        engine.abort_request(["a", "b"])
        assert not engine.requests and not engine.structured.waiting and later.cancelled()
    finally:
        gate.set()


def test_a_refused_duplicate_id_does_not_compile_its_grammar(llm, monkeypatch):
    """A request refused for a duplicate id (here while the first one's grammar compiles) has
    its compile cancelled: it would only delay the compiles queued behind it."""
    engine = llm.llm_engine
    gate = threading.Event()
    compiled: list[object] = []
    compile_grammar = StructuredOutputManager._compile

    def slow_compile(self, grammar):
        assert gate.wait(30)
        compiled.append(grammar)
        return compile_grammar(self, grammar)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    first = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    second = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}"))
    try:
        engine.add_request("dup", chat(llm, "Is water wet?"), first)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("dup", chat(llm, "Hi"), second)
    finally:
        gate.set()
    finals = _run_until_done(engine)
    engine.structured._executor.submit(lambda: None).result()  # every compile queued so far has run
    assert len(compiled) == 1 and finals["dup"].outputs[0].text in ("yes", "no")


def test_a_legacy_structural_tag_is_taken_as_vllm_takes_it(llm):
    """vLLM's xgrammar backend also takes the older structural tag form ({"structures": [...],
    "triggers": [...]}, its documented example): free text until a trigger, then the tag."""
    tag = {"type": "structural_tag", "triggers": ["<answer>"],
           "structures": [{"begin": "<answer>", "schema": {"type": "integer", "maximum": 100}, "end": "</answer>"}]}  # fmt: skip
    so = StructuredOutputsParams(structural_tag=json.dumps(tag))
    prompt = chat(llm, "What is 2 + 2? Answer inside <answer> tags.")
    out = llm.generate([prompt], [SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)], use_tqdm=False)
    for answer in re.findall(r"<answer>(.*?)</answer>", out[0].outputs[0].text, re.S):
        assert -1 < int(answer) <= 100
    compiled = llm.llm_engine.structured.submit(so).result()
    assert xgr.GrammarMatcher(compiled).accept_string("It is <answer>4</answer>")
    assert not xgr.GrammarMatcher(compiled).accept_string("It is <answer>four")
    with pytest.raises(ValueError, match=r"structured_outputs\.structural_tag"):
        llm.generate(["Hi"], [SamplingParams(structured_outputs=StructuredOutputsParams(structural_tag='{"structures": [{}]}'))])


def test_mask_covers_logits_of_any_layout(llm):
    """xgrammar masks only contiguous logits (it skips others without a word): the manager
    copies a strided tensor first, so a constraint can never be silently dropped."""
    manager = llm.llm_engine.structured
    compiled = manager.submit(StructuredOutputsParams(regex="ab")).result()
    strided = torch.zeros(manager.vocab_size, 2).t()
    masked = manager.mask(strided, [xgr.GrammarMatcher(compiled), None])
    allowed = (masked[0] > -math.inf).nonzero().flatten().tolist()
    assert allowed and all("ab".startswith(llm.get_tokenizer().decode([t])) for t in allowed)
    assert bool((masked[1] == 0).all())
