"""Structured outputs on a reasoning engine (vLLM's reasoning-aware structured outputs): with
``reasoning_config`` set, a grammar waits out the reasoning and constrains what follows its end
string; ``structured_outputs_config={"enable_in_reasoning": True}`` binds it from the start.
The oracle is the engine without a reasoning config, whose grammar binds from the first output
token: given the prompt plus the free reasoning tokens, it must continue exactly as the
reasoning engine does after them."""
from __future__ import annotations

import json

import httpx
import pytest

from test_engine import assert_no_leaks
from vllmini import LLM, AsyncLLMEngine, EngineArgs, SamplingParams, StructuredOutputsParams
from vllmini.config import StructuredOutputsConfig
from vllmini.entrypoints.openai.api_server import build_app

START, END = [44, 17400, 46], [9617, 17400, 46]  # "<think>", "</think>" in SmolLM2's vocabulary
QWEN3 = {"reasoning_parser": "qwen3"}
CHOICE = StructuredOutputsParams(choice=["yes", "no", "maybe"])
REGEX = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")


def params(max_tokens: int = 24, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **extra)


def ids(llm: LLM, prompts, sampling) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sampling, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir))


@pytest.fixture(scope="module")
def reasoning(tiny_dir):
    return LLM(str(tiny_dir), reasoning_config=QWEN3)


def bound_after(plain: LLM, prompt: list[int], free: list[int], constraint: StructuredOutputsParams) -> list[int]:
    """``free`` then what the grammar-from-the-start engine writes after prompt + free."""
    return free + ids(plain, {"prompt_token_ids": prompt + free}, params(structured_outputs=constraint))[0]


def test_the_grammar_starts_after_a_forced_end(plain, reasoning):
    """A prompt that opens <think>, a thinking budget of 4: four free tokens (the model's own,
    which the grammar would not allow), the forced end, then the grammar's answer; with the
    choice constraint the answer is one of the choices and the request ends on EOS."""
    prompt = [504, 3108, 30, *START]
    for constraint in (CHOICE, REGEX):
        got = ids(reasoning, {"prompt_token_ids": prompt}, params(structured_outputs=constraint, thinking_token_budget=4))[0]
        free = ids(plain, {"prompt_token_ids": prompt}, params(4))[0]
        assert got[:7] == free + END
        assert got == bound_after(plain, prompt, got[:7], constraint)
        assert free != ids(plain, {"prompt_token_ids": prompt}, params(4, structured_outputs=constraint))[0]  # (free indeed)
    out = reasoning.generate({"prompt_token_ids": prompt}, params(structured_outputs=CHOICE, thinking_token_budget=4),
                             use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "stop" and reasoning.get_tokenizer().decode(out.token_ids[7:], skip_special_tokens=True) in CHOICE.choice
    assert_no_leaks(reasoning)


def test_where_the_reasoning_stands_in_the_prompt(plain, reasoning):
    """Ended in the prompt: bound from the first token, as without reasoning. Never opened, or
    still open: the output is free (the model never says the end here), as in vLLM, whose
    grammar waits for the end string."""
    ended = {"prompt_token_ids": [504, 3108, *START, 30, *END]}
    never = {"prompt_token_ids": [504, 3108, 30]}
    still = {"prompt_token_ids": [504, *START, 30, *END, 7, *START, 9]}  # (a later section is open)
    sampling = params(16, structured_outputs=REGEX, ignore_eos=True)
    got = ids(reasoning, [ended, never, still], sampling)
    want = ids(plain, [ended, never, still], sampling)
    assert got[0] == want[0]
    free = ids(plain, [never, still], params(16, ignore_eos=True))
    assert got[1:] == free and free != want[1:]
    assert not any(END[0] in g for g in got[1:])


def test_preemption_keeps_each_sequence_where_its_grammar_began(tiny_dir, reasoning):
    """Eight requests (budgets 1 to 8, some prompts past their end already) in a KV cache of 10
    blocks of 16 tokens: preempted and recomputed, each gives the tokens it gives alone."""
    prompts = [{"prompt_token_ids": [500 + i, 3108, *START, *([30] * (i % 3))] + (END if i % 4 == 3 else [])} for i in range(8)]
    sampling = [params(40, structured_outputs=CHOICE if i % 2 else REGEX, thinking_token_budget=i + 1, ignore_eos=True)
                for i in range(8)]  # fmt: skip
    want = [ids(reasoning, p, s)[0] for p, s in zip(prompts, sampling)]
    block_bytes = sum(k.numel() + v.numel() for k, v in reasoning.llm_engine.runner.kv_caches) * 4 // reasoning.llm_engine.num_blocks
    tight = LLM(str(tiny_dir), reasoning_config=QWEN3, kv_cache_memory=10 * block_bytes)
    assert tight.llm_engine.num_blocks == 10
    assert ids(tight, prompts, sampling) == want
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0
    assert_no_leaks(tight)


def test_enable_in_reasoning_binds_from_the_start(tiny_dir, plain):
    llm = LLM(str(tiny_dir), reasoning_config=QWEN3, structured_outputs_config={"enable_in_reasoning": True})
    prompt = {"prompt_token_ids": [504, 3108, 30, *START]}
    assert ids(llm, prompt, params(structured_outputs=REGEX)) == ids(plain, prompt, params(structured_outputs=REGEX))


@pytest.fixture(scope="module")
def said_end(tiny_dir, plain):
    """An end string the model says by itself (a one-token word of its greedy output, its 3rd
    to 5th token: inside the first verified run of 4 drafts, which holds tokens 2 to 6) and a
    start string in the prompt: the prompt, the free output up to and including the end, and
    the reasoning config."""
    prompt = [504, 3108, 30]
    free = ids(plain, {"prompt_token_ids": prompt}, params(40, ignore_eos=True))[0]
    tok = plain.get_tokenizer()
    end = next(t for t in free[2:5] if t not in prompt and tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    start = prompt[1]
    config = {"reasoning_start_str": tok.decode([start]), "reasoning_end_str": tok.decode([end])}
    return prompt, free[: free.index(end) + 1], config


def test_an_end_the_model_says_inside_accepted_drafts(tiny_dir, plain, said_end):
    """The model says the end itself, with a draft model (the target as its own draft: its
    drafts agree until the grammar binds), async scheduling and n=2: each gives the tokens of
    the plain engine; with drafts the end comes inside a verified run, whose tokens after the
    end were sampled free and are dropped for the grammar's."""
    prompt, free, config = said_end
    want = bound_after(plain, prompt, free, REGEX)
    sampling = params(len(free) + 12, structured_outputs=REGEX)
    base = LLM(str(tiny_dir), reasoning_config=config)
    assert ids(base, {"prompt_token_ids": prompt}, sampling) == [want]
    del base
    spec = LLM(str(tiny_dir), reasoning_config=config, speculative_config={"model": str(tiny_dir), "num_speculative_tokens": 4})
    assert ids(spec, {"prompt_token_ids": prompt}, sampling) == [want]
    assert spec.llm_engine.spec_stats.num_accepted_tokens > len(free) // 2
    assert_no_leaks(spec)
    del spec
    ngram = LLM(str(tiny_dir), reasoning_config=config,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})  # fmt: skip
    assert ids(ngram, {"prompt_token_ids": prompt}, sampling) == [want]
    del ngram
    async_llm = LLM(str(tiny_dir), reasoning_config=config, async_scheduling=True)
    assert ids(async_llm, {"prompt_token_ids": prompt}, sampling) == [want]
    seeded = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=30, structured_outputs=CHOICE, thinking_token_budget=3)
    start_prompt = {"prompt_token_ids": [504, 3108, 30, *START]}
    qwen = LLM(str(tiny_dir), reasoning_config=QWEN3)
    for c in qwen.generate(start_prompt, seeded, use_tqdm=False)[0].outputs:  # each sequence's grammar on its own
        assert c.token_ids[3:6] == END and c.finish_reason == "stop"
        assert qwen.get_tokenizer().decode(c.token_ids[6:], skip_special_tokens=True) in CHOICE.choice
    assert_no_leaks(qwen)


def test_the_engine_wide_disable_any_whitespace(tiny_dir, plain):
    """``structured_outputs_config={"disable_any_whitespace": True}`` (vLLM's) gives every request
    the JSON a request's own flag gives: the random model, left to it, writes whitespace."""
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"]}
    prompt = {"prompt_token_ids": [504, 3108, 30]}
    llm = LLM(str(tiny_dir), structured_outputs_config={"disable_any_whitespace": True})
    got = llm.generate(prompt, params(30, structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)[0].outputs[0]
    tight = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert got.token_ids == ids(plain, prompt, params(30, structured_outputs=tight))[0]
    assert json.loads(got.text)["a"] in (1, 2, 3) and got.finish_reason == "stop"
    assert got.token_ids != ids(plain, prompt, params(30, structured_outputs=StructuredOutputsParams(json=schema)))[0]


def test_configs_are_checked_and_the_parser_gives_the_strings(tiny_dir):
    for config, message in [
        ({"backend": "guidance"}, "structured_outputs_config.backend"),
        ({"enable_in_reasoning": 1}, "structured_outputs_config.enable_in_reasoning"),
        ({"disable_any_whitespace": "yes"}, "structured_outputs_config.disable_any_whitespace"),
        ({"reasoning_parser": "nope"}, "reasoning_config.reasoning_parser"),
        ({"reasoning": "qwen3"}, "unknown or unsupported field"),
        ("{", "structured_outputs_config is not valid JSON"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            EngineArgs(model=str(tiny_dir), structured_outputs_config=config).validate()
    args = EngineArgs(structured_outputs_config='{"reasoning_parser": "deepseek_r1"}')
    assert args.resolved_reasoning_config().strings() == ("<think>", "</think>")
    given = {"reasoning_start_str": "<r>", "reasoning_end_str": "</r>"}
    assert EngineArgs(reasoning_config=given, structured_outputs_config=args.structured_outputs_config).resolved_reasoning_config().strings() == ("<r>", "</r>")
    assert StructuredOutputsConfig.coerce(None) == StructuredOutputsConfig()
    from vllmini.cli import _serve_engine_args, build_parser

    ns = build_parser().parse_args(["serve", "--structured-outputs-config", '{"enable_in_reasoning": true}'])
    assert StructuredOutputsConfig.coerce(_serve_engine_args(ns).structured_outputs_config).enable_in_reasoning


async def test_the_server_answers_after_the_reasoning(tiny_dir, reasoning):
    """``vllmini serve --reasoning-parser qwen3``: a chat request with a response_format and a
    thinking budget gets the budget's reasoning in ``reasoning_content`` and the grammar's JSON
    answer in ``content``."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>"}]
    chat_args = {"continue_final_message": True, "add_generation_prompt": False}
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"], "additionalProperties": False}
    constraint = {"json": schema, "disable_any_whitespace": True}  # (else the random model writes whitespace)
    sampling = params(40, thinking_token_budget=3, structured_outputs=StructuredOutputsParams(**constraint))
    want = reasoning.chat(messages, sampling, use_tqdm=False, **chat_args)[0].outputs[0]
    tok = reasoning.get_tokenizer()
    assert want.token_ids[3:6] == END and want.finish_reason == "stop"
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), served_model_name="tiny", reasoning_config=QWEN3))
    try:
        app = build_app(engine, reasoning_parser="qwen3")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body = {"model": "tiny", "messages": messages, "max_tokens": 40, "temperature": 0, "thinking_token_budget": 3,
                    "structured_outputs": constraint, **chat_args}  # fmt: skip
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert message["reasoning_content"] == tok.decode(want.token_ids[:3])
            assert json.loads(message["content"])["a"] in (1, 2, 3)
            assert message["content"] == tok.decode(want.token_ids[6:], skip_special_tokens=True)
    finally:
        await engine.shutdown()


async def test_a_forced_tool_call_comes_after_the_reasoning(default_model_dir):
    """A named tool choice is a grammar too: on a reasoning engine the model reasons (here a
    budget of 4 tokens, the prompt opening <think>), then writes the call's arguments, which
    the response parses as the call; the reasoning goes to ``reasoning_content``."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 12}}}}}]  # fmt: skip
    messages = [{"role": "user", "content": "What is the weather in Paris?"}, {"role": "assistant", "content": "<think>"}]
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(default_model_dir), served_model_name="m", reasoning_config=QWEN3))
    try:
        app = build_app(engine, reasoning_parser="qwen3")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body = {"model": "m", "messages": messages, "max_tokens": 60, "temperature": 0, "thinking_token_budget": 4,
                    "continue_final_message": True, "add_generation_prompt": False, "tools": tools,
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}  # fmt: skip
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            assert message["reasoning_content"] and "</think>" not in message["reasoning_content"]
            [call] = message["tool_calls"]
            assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    finally:
        await engine.shutdown()
