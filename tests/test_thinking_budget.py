"""vLLM's ``SamplingParams.thinking_token_budget`` with ``EngineArgs.reasoning_config``: once a
reasoning section holds the budget's tokens, the end string is forced and the model goes on
from there; a section opened by the prompt counts its prompt tokens, one opened by the output
is found there; speculative decoding, async scheduling and n > 1 give the same tokens."""
from __future__ import annotations

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_engine import assert_no_leaks
from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams
from vllmini.engine.thinking_budget import ReasoningConfig, ThinkingBudget
from vllmini.entrypoints.openai.api_server import build_app

START, END = [44, 17400, 46], [9617, 17400, 46]  # "<think>", "</think>" in SmolLM2's vocabulary
QWEN3 = {"reasoning_parser": "qwen3"}


# ---- the rule, against a state machine fed one token at a time ---------------------------------
class Reference:
    """The definition step by step: a start string opens a section (anew, count 0), an end string
    closes it (both at once: the longer one was said), any other token in a section counts; at
    the budget the end string's next token is due."""

    def __init__(self, start: list[int], end: list[int], budget: int) -> None:
        self.start, self.end, self.budget = start, end, budget
        self.tokens: list[int] = []
        self.open, self.count = False, 0

    def push(self, token: int) -> None:
        self.tokens.append(token)
        said_start = self.tokens[-len(self.start) :] == self.start
        said_end = self.tokens[-len(self.end) :] == self.end
        if said_start and said_end:
            said_start, said_end = len(self.start) >= len(self.end), len(self.end) > len(self.start)
        if said_start:
            self.open, self.count = True, 0
        elif said_end:
            self.open = False
        elif self.open:
            self.count += 1

    def due(self) -> int | None:
        if not self.open or self.count < self.budget:
            return None
        for k in range(min(len(self.end) - 1, self.count), 0, -1):
            if self.tokens[-k:] == self.end[:k]:
                return self.end[k]
        return self.end[0]


words = st.lists(st.integers(0, 4), min_size=1, max_size=3)


@settings(max_examples=400, deadline=None)
@given(words, words, st.integers(0, 6), st.lists(st.integers(0, 4), max_size=12), st.lists(st.integers(0, 4), max_size=30))
def test_the_forced_token_follows_the_definition(start, end, budget, prompt, draws):
    """Each output token is the forced one when one is due, else a draw; at every position the
    engine's rule (searching prompt + output backwards) agrees with the state machine."""
    if start == end:
        return
    rule, ref = ThinkingBudget(tuple(start), tuple(end)), Reference(start, end, budget)
    for t in prompt:
        ref.push(t)
    output: list[int] = []
    marks = None  # scanned on from the last position (as the engine does), and from scratch
    for draw in draws:
        due = ref.due()
        assert rule.forced_token(prompt, output, budget) == due, (prompt, output)
        assert rule.forced_token(prompt, output, budget, marks) == due, (prompt, output, marks)
        marks = rule.marks(prompt, output, marks)
        assert rule.marks(prompt, output[:-1], marks) == rule.marks(prompt, output[:-1])  # stale marks are ignored
        token = draw if due is None else due
        output.append(token)
        ref.push(token)


def test_a_budget_bounds_each_section():
    rule = ThinkingBudget(tuple(START), tuple(END))
    assert rule.forced_token([1, *START], [], 0) == END[0]  # opened by the prompt, budget 0
    assert rule.forced_token([1, *START, 5], [6], 2) == END[0]  # the prompt's section tokens count
    assert rule.forced_token([1, *START, 5], [6, END[0]], 2) == END[1]
    assert rule.forced_token([1, *START, 5], [6, *END], 2) is None  # closed
    assert rule.forced_token([1, *START, 5], [6, *END, *START[:2]], 0) is None  # the seam: not yet opened
    assert rule.forced_token([1, *START[:2]], [START[2], 7], 1) == END[0]  # opened across the seam
    assert rule.forced_token([1, *START, *END], [*START, 9, 9], 3) is None  # a new section, a new budget
    assert rule.forced_token([], [9] * 50, 0) is None  # never opened


# ---- the engine ---------------------------------------------------------------------------------
def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir))


@pytest.fixture(scope="module")
def budgeted(tiny_dir):
    return LLM(str(tiny_dir), reasoning_config=QWEN3)


def expected(plain: LLM, rule: ThinkingBudget, prompt: list[int], budget: int, n: int) -> list[int]:
    """Plain greedy decoding, one token at a time, with the rule's forced tokens put in."""
    out: list[int] = []
    while len(out) < n:
        due = rule.forced_token(prompt, out, budget)
        if due is None:
            due = plain.generate({"prompt_token_ids": prompt + out}, greedy(1), use_tqdm=False)[0].outputs[0].token_ids[0]
        out.append(due)
    return out


def test_a_section_opened_by_the_prompt_ends_at_the_budget(plain, budgeted):
    """One batch: budgets 0, 1 and 5 and a request without one; each output is the model's own
    up to the budget, then "</think>", then the model's continuation of that."""
    prompt = [504, 3108, 30, *START]
    budgets = [0, 1, 5, None]
    outs = budgeted.generate([{"prompt_token_ids": prompt}] * 4, [greedy(14, thinking_token_budget=b) for b in budgets],
                             use_tqdm=False)  # fmt: skip
    got = [o.outputs[0].token_ids for o in outs]
    free = plain.generate({"prompt_token_ids": prompt}, greedy(14), use_tqdm=False)[0].outputs[0].token_ids
    assert got[3] == free and END[0] not in free[:8]
    rule = budgeted.llm_engine.thinking
    assert (rule.start_ids, rule.end_ids) == (tuple(START), tuple(END))
    for b, tokens in zip(budgets, got):
        if b is not None:
            assert tokens[:b] == free[:b] and tokens[b : b + 3] == END
            assert tokens == expected(plain, rule, prompt, b, 14)
    assert_no_leaks(budgeted)


def test_a_section_opened_by_the_output_is_found_there(tiny_dir, plain):
    """The start string is a token the model says by itself (its 3rd): 4 tokens later the end
    string comes, and a later start opens a new section with a new budget."""
    prompt = [504, 3108, 30]
    free = plain.generate({"prompt_token_ids": prompt}, greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    tok = plain.get_tokenizer()
    marker = next(t for t in free[2:] if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    where = free.index(marker)
    llm = LLM(str(tiny_dir), reasoning_config={"reasoning_start_str": tok.decode([marker]), "reasoning_end_str": "</think>"})
    got = llm.generate({"prompt_token_ids": prompt}, greedy(30, thinking_token_budget=4), use_tqdm=False)[0].outputs[0].token_ids
    assert got[: where + 5] == free[: where + 5] and got[where + 5 : where + 8] == END
    assert got == expected(plain, llm.llm_engine.thinking, prompt, 4, 30)


def test_speculation_async_scheduling_and_n_give_the_same_tokens(tiny_dir, budgeted):
    prompts = [{"prompt_token_ids": [504, 3108, 30, *START]}, {"prompt_token_ids": [7, *START, 9, 9, 9]},
               {"prompt_token_ids": [12, 13, 14]}]  # fmt: skip
    params = [greedy(16, thinking_token_budget=b) for b in (2, 6, 3)]
    want = [o.outputs[0].token_ids for o in budgeted.generate(prompts, params, use_tqdm=False)]
    spec = LLM(str(tiny_dir), reasoning_config=QWEN3,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})  # fmt: skip
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.llm_engine.spec_stats.num_draft_tokens > 0
    assert_no_leaks(spec)
    del spec
    async_llm = LLM(str(tiny_dir), reasoning_config=QWEN3, async_scheduling=True)
    assert [o.outputs[0].token_ids for o in async_llm.generate(prompts, params, use_tqdm=False)] == want
    del async_llm
    sampled = budgeted.generate(prompts[0], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True,
                                                           thinking_token_budget=2), use_tqdm=False)[0]  # fmt: skip
    assert all(c.token_ids[2:5] == END for c in sampled.outputs) and len({tuple(c.token_ids[:2]) for c in sampled.outputs}) > 1


def test_bad_budgets_and_configs_are_refused_naming_the_field(plain, tiny_dir):
    with pytest.raises(ValueError, match="thinking_token_budget is set but reasoning_config"):
        plain.generate("hi", greedy(2, thinking_token_budget=3), use_tqdm=False)
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="thinking_token_budget"):
            SamplingParams(thinking_token_budget=bad)
    for config, message in [
        ({"reasoning_parser": "nope"}, "reasoning_config.reasoning_parser"),
        ({"start": "<a>"}, "unknown or unsupported field"),
        ({"reasoning_start_str": "<a>"}, "needs a reasoning_parser, or both"),
        ({"reasoning_start_str": "<a>", "reasoning_end_str": "<a>"}, "must differ"),
        ({"reasoning_start_str": 3, "reasoning_end_str": "<a>"}, "reasoning_start_str must be a string"),
        ("{not json", "reasoning_config is not valid JSON"),
        ([1], "reasoning_config must be a ReasoningConfig"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(tiny_dir), reasoning_config=config).validate()
    assert ReasoningConfig.coerce('{"reasoning_parser": "deepseek_r1"}').strings() == ("<think>", "</think>")
    tok = plain.get_tokenizer()
    with pytest.raises(ValueError, match=r"reasoning_start_str='<think>' encodes to \[44, 17400, 46\] .* below the vocabulary size 100"):
        ThinkingBudget.from_config(ReasoningConfig("qwen3"), tok, 100)  # (ids past the model's vocabulary)
    assert ThinkingBudget.from_config(ReasoningConfig("qwen3"), tok, 49152) == ThinkingBudget(tuple(START), tuple(END))
    assert plain.generate("hi", greedy(2), use_tqdm=False)[0].outputs[0].finish_reason == "length"  # still serving


async def test_the_server_takes_thinking_token_budget(tiny_dir, budgeted):
    """Chat continuing an assistant message that opened <think> (the qwen3 parser reads the
    reasoning): the reasoning is the budget's 3 tokens, then the content; without a reasoning
    config the field is a 400 naming it."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>"}]
    chat_args = {"continue_final_message": True, "add_generation_prompt": False}
    want = budgeted.chat(messages, greedy(10, thinking_token_budget=3), use_tqdm=False, **chat_args)[0].outputs[0]
    assert want.token_ids[3:6] == END
    tok = budgeted.get_tokenizer()
    for config, status in ((QWEN3, 200), (None, 400)):
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny", reasoning_config=config))
        try:
            app = build_app(engine, reasoning_parser="qwen3")
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                body = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                        "thinking_token_budget": 3, **chat_args}  # fmt: skip
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == status, r.text
                if status == 400:
                    assert "thinking_token_budget" in r.json()["error"]["message"]
                    continue
                message = r.json()["choices"][0]["message"]
                assert message["reasoning_content"] == tok.decode(want.token_ids[:3])
                assert message["content"] == tok.decode(want.token_ids[6:])
        finally:
            await engine.shutdown()


def test_serve_flags_give_the_reasoning_config():
    """``vllmini serve --reasoning-parser qwen3`` bounds budgets with the parser's strings (as
    vLLM's); ``--reasoning-config`` (JSON) wins over it."""
    from vllmini.cli import _serve_engine_args, build_parser

    parse = build_parser().parse_args
    assert _serve_engine_args(parse(["serve", "--reasoning-parser", "qwen3"])).reasoning_config == QWEN3
    assert _serve_engine_args(parse(["serve"])).reasoning_config is None
    given = '{"reasoning_start_str": "<r>", "reasoning_end_str": "</r>"}'
    args = _serve_engine_args(parse(["serve", "--reasoning-parser", "qwen3", "--reasoning-config", given]))
    assert ReasoningConfig.coerce(args.reasoning_config).strings() == ("<r>", "</r>")
