"""vLLM's ``glm45`` tool-call and reasoning parsers (GLM-4.5 / 4.6: ``<think>`` blocks, then
``<tool_call>NAME`` with ``<arg_key>`` / ``<arg_value>`` pairs): whole and streamed at any split
alike, values typed as vLLM's glm4_moe_tool_parser.py types them, what is content and what is not."""
from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from test_openai_server_tools import SETTINGS, both, canonical, json_values, whole
from vllmini.engine.sampling_params import SamplingParams
from vllmini.entrypoints.openai.output_parser import ChatOutputParser
from vllmini.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from vllmini.entrypoints.openai.tool_parsers import get_tool_parser
from vllmini.entrypoints.openai.tool_parsers.glm4_moe_tool_parser import glm_value

identifiers = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.]{0,6}", fullmatch=True)
KINDS = {"string": st.text(max_size=8).filter(lambda t: "<" not in t and t.strip() == t),
         "object": st.dictionaries(st.text(max_size=4), json_values, max_size=3), "integer": st.integers(-(10**9), 10**9),
         "boolean": st.booleans(), "array": st.lists(json_values, max_size=3)}  # fmt: skip
params = st.dictionaries(identifiers, st.sampled_from(sorted(KINDS)).flatmap(lambda k: st.tuples(st.just(k), KINDS[k])),
                         max_size=3)  # fmt: skip


def glm(tools=None, reasoning: str | None = None):
    """A choice's output parser with glm45's tool parser (and its reasoning parser, set up for ``reasoning``'s prompt)."""
    cls = get_reasoning_parser("glm45")
    return lambda: ChatOutputParser(cls(in_reasoning=cls.starts_in_reasoning(reasoning)) if reasoning is not None else None,
                                    get_tool_parser("glm45")(None, tools))  # fmt: skip


def written(kind: str, value) -> str:
    """An argument as GLM-4.5's template writes it: strings as they are, the rest as JSON."""
    return value if kind == "string" else json.dumps(value, ensure_ascii=False)


@SETTINGS
@given(before=st.text(max_size=12).filter(lambda t: "<" not in t),
       calls=st.lists(st.tuples(identifiers, params), min_size=1, max_size=3), sep=st.sampled_from(["\n", "", " \n"]),
       typed=st.booleans(), after=st.sampled_from(["", " Done.", "\nok"]), data=st.data())  # fmt: skip
def test_glm45_reads_calls_whole_and_streamed(before, calls, sep, typed, after, data):
    """Each call's values as vLLM's: text where the schema says string, else JSON; with no schema a
    string that reads as JSON would become that value, so untyped strings here are words."""
    tools, blocks, expected = [], [], []
    for name, args in calls:
        props = {p: {"type": kind} for p, (kind, _) in args.items()}
        tools.append({"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": props}}})
        pairs = "".join(f"<arg_key>{p}</arg_key>{sep}<arg_value>{written(k, v)}</arg_value>{sep}" for p, (k, v) in args.items())
        blocks.append(f"<tool_call>{name}\n{pairs}</tool_call>")
        expected.append((name, canonical({p: v for p, (k, v) in args.items()})))
    if not typed:  # (no tools: a string that reads as JSON or a literal is that value, as vLLM's)
        expected = [(n, canonical({p: glm_value(written(k, v), None) for p, (k, v) in a.items()})) for n, a in calls]
    got = both(glm(tools if typed else None), before + "\n".join(blocks) + after, data)
    assert got["calls"] == expected
    assert got["content"] == (before.rstrip() or None)  # (as vLLM's: only the text before the first call)


def test_glm45_values_are_typed_as_vllm():
    assert glm_value("Paris", {"type": "string"}) == "Paris" and glm_value("42", {"type": "string"}) == "42"
    assert glm_value("42", None) == 42 and glm_value("42", {"type": "integer"}) == 42 and glm_value("Paris", {}) == "Paris"
    assert glm_value('{"a": [1, true]}', {"type": "object"}) == {"a": [1, True]}
    assert glm_value('{\\"a\\": 1}', {"type": "object"}) == {"a": 1}  # (JSON written inside a JSON string)
    assert glm_value("{'a': (1, 2)}", None) == {"a": (1, 2)} and glm_value("null", None) is None
    assert glm_value("__import__('os')", None) == "__import__('os')"  # (read, never run)


@SETTINGS
@given(data=st.data())
def test_glm45_calls_it_cannot_read_are_content(data):
    """Whole, such an output is content; streamed too while the call's name was not written yet."""
    for text in ("Hi <tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", "<tool_call><b>\n</tool_call>"):
        assert both(glm(), text, data) == {"content": text, "reasoning": None, "calls": []}, text
    for text in ("<tool_call>f\n<arg_key>a</arg_key> x <arg_value>1</arg_value></tool_call>",
                 "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value></tool_call>",
                 "<tool_call>f\n<arg_key>a</arg_key><arg_value>1"):  # (text between; a key twice; cut short)  # fmt: skip
        assert whole(glm()(), text) == {"content": text, "reasoning": None, "calls": []}, text


@SETTINGS
@given(reasoning=st.text(max_size=12).filter(lambda t: "<" not in t), content=st.text(max_size=12).filter(lambda t: "<" not in t),
       data=st.data())  # fmt: skip
def test_glm45_reasoning_then_a_call(reasoning, content, data):
    """GLM-4.5 opens ``<think>`` itself; with ``enable_thinking=False`` its template closes an empty one
    in the prompt and the output is content, ``<think>`` or not."""
    text = f"<think>{reasoning}</think>{content}<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    got = both(glm(reasoning="<|assistant|>"), text, data)
    assert got == {"reasoning": reasoning or None, "content": content.rstrip() or None,
                   "calls": [("get_weather", '{"city": "Paris"}')]}  # fmt: skip
    plain = both(glm(reasoning="<|assistant|>\n<think></think>"), f"{content}", data)
    assert plain == {"reasoning": None, "content": content or None, "calls": []}
    assert not get_reasoning_parser("glm45").starts_in_reasoning("<|assistant|>\n<think></think>")


def test_glm45_leaves_the_request_as_it_is():
    """(As vLLM's: GLM's tags are plain text, special tokens skipped as the request asks.)"""
    params = SamplingParams(max_tokens=4)
    assert get_tool_parser("glm45")().adjust_request(params) is params
    assert get_reasoning_parser("glm45").adjust_request(params) is params
