"""gpt-oss's harmony output through vLLM's ``openai_gptoss`` reasoning parser and ``openai``
tool-call parser: random harmony outputs read whole and streamed at any split alike (analysis ->
reasoning, final and preambles -> content, messages to functions -> tool calls), outputs cut
short or without tags, vLLM's examples, the special tokens kept in the text (a tokenizer with
harmony's tags as special tokens, through the incremental detokenizer), then both parsers
through the chat route by the flags' names: the tiny model made to write the text with
``structured_outputs.choice``, and a tiny model with harmony's special tokens made to write
them by a scripted logits processor."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from test_openai_server import KV, events
from test_openai_server_tools import (
    MESSAGES, NAME, PARIS, SETTINGS, TOOLS, both, calls_after_reasoning, client, forced, http, serving, streamed,
    wait_idle, whole,
)  # fmt: skip
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.engine.detokenizer import IncrementalDetokenizer
from vllmini.engine.logits_processor import AdapterLogitsProcessor
from vllmini.engine.sampling_params import SamplingParams
from vllmini.engine.thinking_budget import ReasoningConfig, ThinkingBudget
from vllmini.entrypoints.openai.output_parser import ChatOutputParser
from vllmini.entrypoints.openai.protocol import ChatCompletionRequest
from vllmini.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from vllmini.entrypoints.openai.serving_chat import OpenAIServingChat
from vllmini.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from vllmini.entrypoints.openai.tool_parsers.harmony_utils import TAGS

START, END = "<|start|>assistant", "<|end|>"
GPTOSS = {"reasoning_parser": "openai_gptoss", "enable_auto_tool_choice": True, "tool_call_parser": "openai"}  # (serve's flags)


def gptoss(reasoning: bool = True, tools: bool = True, in_reasoning: bool = False):
    """A choice's output parser as the server makes it with ``--reasoning-parser openai_gptoss``
    and/or ``--tool-call-parser openai``."""
    r, t = get_reasoning_parser("openai_gptoss"), get_tool_parser("openai")
    return lambda: ChatOutputParser(r(in_reasoning=in_reasoning) if reasoning else None, t() if tools else None)


CONFIGS = [(True, True), (True, False), (False, True)]

# -- random harmony outputs

body = st.lists(st.sampled_from(["a", "b c", " ", "\n", "é", "<", "|", ">", "<|", "|>", "to=x", '{"k": [1]}', "end"]),
                max_size=6).map("".join).filter(lambda t: not any(tag in t for tag in TAGS))  # fmt: skip
names = st.text("abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=8)
CALL_HEADERS = {  # (the recipient after the channel, with or without a content type, or after the role)
    "call_channel": "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>",
    "call_bare": "<|channel|>commentary to=functions.{}<|message|>",
    "call_role": " to=functions.{}<|channel|>commentary json<|message|>",
    "call_analysis": "<|channel|>analysis to=functions.{}<|message|>",
}
HEADERS = {"analysis": "<|channel|>analysis<|message|>", "final": "<|channel|>final<|message|>",
           "preamble": "<|channel|>commentary<|message|>",  # (commentary to no one: shown to the user)
           "python": "<|channel|>analysis to=python code<|message|>",  # (a built-in tool's call: reasoning, as vLLM)
           "browser": "<|channel|>commentary to=browser.search <|constrain|>json<|message|>"}  # (dropped)  # fmt: skip
message = st.one_of(
    st.tuples(st.sampled_from(sorted(HEADERS)), body),
    st.tuples(st.sampled_from(sorted(CALL_HEADERS)), st.tuples(names, body)),
)


def render(messages, ended: bool) -> tuple[str, list[str]]:
    """The output text (the prompt wrote the first ``<|start|>assistant``; ``ended``: the last
    message's end tag is in the text, though an EOS usually is not) and each message's text."""
    parts = []
    for i, (kind, value) in enumerate(messages):
        header = CALL_HEADERS[kind].format(value[0]) if kind in CALL_HEADERS else HEADERS[kind]
        text = value[1] if kind in CALL_HEADERS else value
        header = START + header if i else header  # (the prompt wrote the first one's role)
        tag = "<|call|>" if kind in CALL_HEADERS else "<|return|>" if kind == "final" and i == len(messages) - 1 else END
        parts.append(header + text + (tag if ended or i < len(messages) - 1 else ""))
    return "".join(parts), parts


def expected(messages, reasoning: bool = True, tools: bool = True) -> dict:
    def joined(kinds):
        return "\n".join(v for k, v in messages if k in kinds and v) or None

    calls = [tuple(v) for k, v in messages if k in CALL_HEADERS] if tools else []
    return {"reasoning": joined({"analysis", "python"}) if reasoning else None,
            "content": joined({"final", "preamble"}), "calls": calls}  # fmt: skip


@SETTINGS
@given(messages=st.lists(message, min_size=1, max_size=5), ended=st.booleans(), data=st.data())
def test_harmony_messages_are_read_whole_and_streamed_alike(messages, ended, data):
    text, parts = render(messages, ended)
    for reasoning, tools in CONFIGS:
        got = both(gptoss(reasoning, tools), text, data)
        if reasoning:  # (without a tool parser a call is dropped, as vLLM's)
            assert got == expected(messages, reasoning, tools)
        else:  # the tool parser alone: all but the calls is content as written (as a <think> section would be)
            rest = "".join(part for part, (kind, _) in zip(parts, messages) if kind not in CALL_HEADERS)
            assert got == {"reasoning": None, "content": rest or None, "calls": expected(messages)["calls"]}


@SETTINGS
@given(messages=st.lists(message, min_size=1, max_size=4), data=st.data())
def test_an_output_cut_anywhere_reads_whole_and_streamed_alike(messages, data):
    """max_tokens may end the output inside a header, a tag or a body: a header cut short is
    dropped, a body keeps its text (a call its arguments so far, as a stream has sent them)."""
    text, _ = render(messages, True)
    cut_text = text[: data.draw(st.integers(0, len(text)))]
    called = [name for name, _ in expected(messages)["calls"]]
    for reasoning, tools in CONFIGS:
        got = both(gptoss(reasoning, tools), cut_text, data)
        if tools:  # (the calls whose header was whole)
            assert [name for name, _ in got["calls"]] == called[: len(got["calls"])]


@SETTINGS
@given(text=st.text(max_size=30).filter(lambda t: "<|" not in t), data=st.data())
def test_text_without_harmony_tags_is_content(text, data):
    for reasoning, tools in CONFIGS:
        assert both(gptoss(reasoning, tools), text, data) == {"reasoning": None, "content": text or None, "calls": []}


FRAGMENTS = [*TAGS, "assistant", "analysis", "final", "commentary", " to=functions.f", " to=python", " json", "x", "{}", " ",
             "\n", "<|", "<", "|>"]  # fmt: skip


@SETTINGS
@given(pieces=st.lists(st.sampled_from(FRAGMENTS), max_size=25), data=st.data())
def test_any_output_reads_whole_and_streamed_alike(pieces, data):
    for reasoning, tools in CONFIGS:
        both(gptoss(reasoning, tools), "".join(pieces), data)


@SETTINGS
@given(reasoning=body, final=body, data=st.data())
def test_a_prompt_that_opens_the_analysis_message_starts_in_reasoning(reasoning, final, data):
    cls = get_reasoning_parser("openai_gptoss")
    prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    assert not cls.starts_in_reasoning(prompt) and cls.starts_in_reasoning(prompt + "<|channel|>analysis<|message|>")
    text = reasoning + END + START + "<|channel|>final<|message|>" + final
    got = both(gptoss(tools=False, in_reasoning=True), text, data)
    assert got == {"reasoning": reasoning or None, "content": final or None, "calls": []}


def test_vllms_examples_and_the_edges():
    analysis = 'User asks: "What is the weather in Tokyo?" We need to use get_current_weather tool.'
    call = '<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>'
    text = ("<|channel|>analysis<|message|>" + analysis + END + call.format("get_current_weather", '{"location": "Tokyo"}')
            + call.format("no_args", "") + START + "<|channel|>final<|message|>This tool call will get the weather.")  # fmt: skip
    assert whole(gptoss()(), text) == {"reasoning": analysis, "content": "This tool call will get the weather.",
                                       "calls": [("get_current_weather", '{"location": "Tokyo"}'), ("no_args", "")]}  # fmt: skip
    # no final message (cut while reasoning), several analysis messages, a preamble
    assert whole(gptoss()(), "<|channel|>analysis<|message|>Thinking") == {"reasoning": "Thinking", "content": None, "calls": []}
    text = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
    assert whole(gptoss()(), text + START + "<|channel|>commentary<|message|>Checking.") == \
        {"reasoning": "a\nb", "content": "Checking.", "calls": []}  # fmt: skip
    # a header cut short is dropped; a message that ends without <|end|> ends where the next starts
    assert whole(gptoss()(), text + START + "<|channel|>fin")["content"] is None
    forced_end = "<|channel|>analysis<|message|>long" + START + "<|channel|>final<|message|>ok"
    assert whole(gptoss()(), forced_end) == {"reasoning": "long", "content": "ok", "calls": []}


def test_calls_end_the_stream_with_finish_reason_and_only_the_first_without_parallel_tool_calls():
    text = "".join(f"{START}<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{{}}<|call|>" for n in "ab")
    r, t = get_reasoning_parser("openai_gptoss"), get_tool_parser("openai")
    parser = ChatOutputParser(r(), t(), parallel_tool_calls=False)
    assert [c.function.name for c in parser.parse(text)[2]] == ["a"] and parser.tools_called
    assert streamed(ChatOutputParser(r(), t(), parallel_tool_calls=False), [text[:50], text[50:]])["calls"] == [("a", "{}")]


# -- the special tokens, the names, the strings


def test_both_keep_the_special_tokens_and_are_registered_by_vllms_names():
    params = SamplingParams(max_tokens=4)
    assert get_reasoning_parser("openai_gptoss").adjust_request(params).skip_special_tokens is False
    assert get_tool_parser("openai")().adjust_request(params).skip_special_tokens is False
    assert REASONING_PARSERS["openai_gptoss"] is get_reasoning_parser("openai_gptoss")
    assert TOOL_PARSERS["openai"] is get_tool_parser("openai")
    assert ReasoningConfig.coerce({"reasoning_parser": "openai_gptoss"}).strings() == \
        ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>")  # fmt: skip


def test_serve_flags_take_vllms_names():
    from vllmini.cli import _serve_engine_args, build_parser

    ns = build_parser().parse_args(["serve", "--reasoning-parser", "openai_gptoss", "--enable-auto-tool-choice",
                                    "--tool-call-parser", "openai"])  # fmt: skip
    assert (ns.reasoning_parser, ns.tool_call_parser) == ("openai_gptoss", "openai")
    assert ReasoningConfig.coerce(_serve_engine_args(ns).reasoning_config).reasoning_parser == "openai_gptoss"


HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory, tiny_dir):
    """The tiny model with harmony's tags as special tokens (ids past the default vocabulary, the
    model's widened to hold them) and gpt-oss's EOS ids: <|return|>, <|call|> and its own."""
    import torch
    from transformers import LlamaForCausalLM

    from helpers import save_tiny_model, tiny_llama_config

    torch.manual_seed(0)
    hf = LlamaForCausalLM(tiny_llama_config(vocab_size=49152 + 64, initializer_range=0.05)).eval()
    out = save_tiny_model(hf, tmp_path_factory.mktemp("harmony"), tiny_dir)
    tok = json.loads((out / "tokenizer.json").read_text())
    ids = {tag: 49152 + i for i, tag in enumerate(HARMONY_TOKENS)}
    tok["added_tokens"] += [{"id": i, "content": tag, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for tag, i in ids.items()]  # fmt: skip
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((out / "generation_config.json").read_text()) if (out / "generation_config.json").exists() else {}
    own = config.get("eos_token_id", 0)
    config["eos_token_id"] = [ids["<|return|>"], ids["<|call|>"], *(own if isinstance(own, list) else [own])]
    (out / "generation_config.json").write_text(json.dumps(config))
    return out


OUTPUT = ("<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
          'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "unit": "celsius"}<|call|>')  # fmt: skip


def test_the_detokenized_tags_are_read_only_when_special_tokens_are_kept(harmony_dir):
    """Harmony's tags are special tokens: as the request comes (skip_special_tokens) they vanish
    from the text and nothing can be read; the parsers' adjust_request keeps them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(harmony_dir))
    ids = tok.encode(OUTPUT, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids("<|channel|>")) == 2
    prompt = tok.encode("Hi", add_special_tokens=False)
    for params in (SamplingParams(), get_tool_parser("openai")().adjust_request(SamplingParams())):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=params.skip_special_tokens)
        deltas = [detok.step(prompt + ids[:i]) for i in range(1, len(ids) + 1)]
        got = streamed(gptoss()(), deltas)
        if params.skip_special_tokens:
            assert got["calls"] == [] and "<|" not in got["content"]
        else:
            assert got == {"reasoning": "Need the weather tool.", "content": None,
                           "calls": [("get_weather", json.dumps(PARIS))]}  # fmt: skip
    rule = ThinkingBudget.from_config(ReasoningConfig.coerce({"reasoning_parser": "openai_gptoss"}), tok, len(tok))
    assert rule.start_ids == tuple(ids[:3]) and tok.decode(rule.end_ids) == END + START + "<|channel|>final<|message|>"


# -- through the server


@pytest.fixture(scope="module")
def engine(tiny_dir):
    with serving(tiny_dir) as eng:
        yield eng


async def test_both_keep_special_tokens_in_the_request(engine):
    request = ChatCompletionRequest(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=4)
    serving_chat = OpenAIServingChat(engine, NAME, enable_auto_tools=True, tool_parser="openai",
                                     reasoning_parser="openai_gptoss")  # fmt: skip
    assert (await serving_chat.prepare(request)).params.skip_special_tokens is False


async def test_reasoning_and_calls_through_the_chat_route_whole_and_streamed(engine):
    """(The tiny model's tokenizer has no harmony tokens: the forced tags are plain text.)"""
    assert await calls_after_reasoning(engine, GPTOSS, forced(OUTPUT)) == \
        ("Need the weather tool.", [("get_weather", json.dumps(PARIS))])  # fmt: skip


async def test_reasoning_and_final_content_through_the_chat_route(engine):
    text = "<|channel|>analysis<|message|>Sunny, I think.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny."
    body = {"messages": MESSAGES, "max_tokens": 300, **forced(text)}
    async with http(engine, reasoning_parser="openai_gptoss") as h:
        choice = (await h.post("/v1/chat/completions", json=body)).json()["choices"][0]
        chunks = events((await h.post("/v1/chat/completions", json={**body, "stream": True})).text)
    assert (choice["message"]["reasoning"], choice["message"]["content"]) == ("Sunny, I think.", "It is sunny.")
    assert choice["finish_reason"] == "stop"
    deltas = [ch["delta"] for chunk in chunks for ch in chunk["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == "Sunny, I think."
    assert "".join(d.get("content") or "" for d in deltas) == "It is sunny."
    await wait_idle(engine)


class ScriptedTokens(AdapterLogitsProcessor):
    """Makes a request with ``extra_args={"script": [ids]}`` write those token ids, one a step."""

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        script = (params.extra_args or {}).get("script")
        if not script:
            return None

        def force(output_ids, row):
            token = script[min(len(output_ids), len(script) - 1)]
            row[:] = float("-inf")
            row[token] = 0.0
            return row

        return force


async def test_special_tokens_written_by_the_model_are_read_through_the_chat_route(harmony_dir):
    """gpt-oss's case for real: the tags are special tokens the model samples and <|call|> is an
    EOS (left out of the text); the parsers' skip_special_tokens=False keeps the tags readable."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(harmony_dir)).encode(OUTPUT, add_special_tokens=False)
    args = EngineArgs(model=str(harmony_dir), kv_cache_memory=KV, served_model_name=NAME, logits_processors=[ScriptedTokens])
    eng = AsyncLLMEngine.from_engine_args(args)
    try:
        script = {"vllm_xargs": {"script": ids}}
        assert await calls_after_reasoning(eng, GPTOSS, script) == \
            ("Need the weather tool.", [("get_weather", json.dumps(PARIS))])  # fmt: skip
        plain = (await client(eng).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=300,
                                                          extra_body=script)).choices[0]  # fmt: skip
        assert "<|" not in plain.message.content and plain.message.content.startswith("analysis")  # (no parser: skipped)
        await wait_idle(eng)
    finally:
        eng.shutdown()
