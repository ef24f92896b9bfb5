"""The chat path against vLLM's ``LLM.chat``: how messages become a templated prompt
(``vllmini/engine/chat.py``) and the options ``LLM.chat`` takes. Most checks need only the
default model's tokenizer; the rest run a tiny random model."""
from __future__ import annotations

import io

import pytest
from tokenizers.processors import TemplateProcessing
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from vllmini import LLM, SamplingParams
from vllmini.engine.chat import render_chat

PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
LOOP = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.fixture
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), kv_cache_memory=64 << 20)


def test_a_message_without_content_renders_as_empty(tok):
    """vLLM renders a message whose content is missing or None (an assistant turn that only calls
    tools) as ""; SmolLM2's template (``'\\n' + message['content']``) failed on both."""
    want = tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
                                   tokenize=False, add_generation_prompt=True)  # fmt: skip
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for reply in ({"role": "assistant"}, {"role": "assistant", "content": None, "tool_calls": calls}):
        got = render_chat(tok, [{"role": "user", "content": "hi"}, reply], add_generation_prompt=True)
        assert got["prompt"] == want


@pytest.mark.parametrize("calls", ["x", {"type": "function", "function": {"name": "f", "arguments": "{}"}}])
def test_tool_calls_that_are_not_a_list_are_refused(tok, calls):
    """One call not wrapped in a list, or text: a template would iterate its keys or characters."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}]
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls must be a list of tool calls"):
        render_chat(tok, messages, chat_template="{% for m in messages %}{{ m.tool_calls or '' }}{% endfor %}")


def test_text_like_parts_and_the_openai_content_format(tok):
    """vLLM's text-like parts (input_text and output_text, refusal, thinking) count as text;
    content_format="openai" hands the template a list of text parts instead of one string."""
    parts = [{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"},
             {"type": "refusal", "refusal": "c"}, {"type": "thinking", "thinking": "d"}, "e"]  # fmt: skip
    got = render_chat(tok, [{"role": "user", "content": parts}], chat_template=LOOP)
    assert got["prompt"] == "[user] a\nb\nc\nd\ne\n"
    looping = "{% for m in messages %}{% for p in m['content'] %}<{{ p['type'] }}:{{ p['text'] }}>{% endfor %}{% endfor %}"
    msgs = [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "y"}, "z"]}]
    assert render_chat(tok, msgs, content_format="openai", chat_template=looping)["prompt"] == "<text:x><text:y><text:z>"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        render_chat(tok, msgs, content_format="json")


def test_a_tokenizer_without_a_chat_template_is_named(tok, llm, monkeypatch):
    """No chat template: a ValueError naming the tokenizer and chat_template= (transformers' own
    message names neither the model nor LLM.chat's option); an explicit template still works."""
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(ValueError, match=rf"tokenizer of '{tok.name_or_path}' has no chat template: pass chat_template="):
        render_chat(tok, [{"role": "user", "content": "hi"}])
    assert render_chat(tok, [{"role": "user", "content": "hi"}], chat_template=LOOP)["prompt"] == "[user] hi\n"
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], PARAMS, use_tqdm=False)


def test_chat_template_from_a_file_or_a_named_template(tok, tmp_path):
    """chat_template may be a file's path (as vLLM's --chat-template) or the name of one of the
    tokenizer's templates; a path-like string naming no file is refused, not rendered as the prompt."""
    path = tmp_path / "t.jinja"
    path.write_text(LOOP)
    assert render_chat(tok, [{"role": "user", "content": "hi"}], chat_template=str(path))["prompt"] == "[user] hi\n"
    tok.chat_template = {"default": tok.chat_template, "plain": LOOP}
    assert render_chat(tok, [{"role": "user", "content": "hi"}], chat_template="plain")["prompt"] == "[user] hi\n"
    with pytest.raises(ValueError, match="chat_template 'missing.jinja' is neither a Jinja template nor an existing file"):
        render_chat(tok, [{"role": "user", "content": "hi"}], chat_template="missing.jinja")
    with pytest.raises(ValueError, match="is neither a Jinja template nor an existing file"):
        render_chat(tok, [{"role": "user", "content": "hi"}], chat_template="x" * 300)  # too long for a path


def test_a_failing_template_is_a_value_error(tok):
    """As vLLM, a template's own error (raise_exception, a syntax error) is a ValueError, which the
    CLI's chat and generate report for that turn or prompt instead of stopping."""
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    with pytest.raises(ValueError, match="chat template failed: TemplateError: no system role"):
        render_chat(tok, [{"role": "system", "content": "s"}], chat_template=strict)
    with pytest.raises(ValueError, match="chat template failed: TemplateSyntaxError"):
        render_chat(tok, [{"role": "user", "content": "hi"}], chat_template="{% for %}")


def test_a_template_that_writes_bos_gets_no_second_one(tok):
    """The templated text is tokenized without special tokens (as vLLM), so a tokenizer that adds
    BOS does not double the one the template writes."""
    bos = tok.convert_tokens_to_ids(tok.bos_token)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)])
    assert tok("hi").input_ids[0] == bos  # this tokenizer adds BOS
    ids = render_chat(tok, [{"role": "user", "content": "hi"}], chat_template="{{ bos_token }}" + LOOP)["prompt_token_ids"]
    assert ids[0] == bos and ids[1] != bos


def test_llm_chat_takes_vllms_options(llm):
    """tools reach the template; an empty list is an empty batch (vLLM: no conversations); a bad
    conversation in a batch is named; use_tqdm may be a tqdm factory, as in vLLM."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    template = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}" + LOOP
    out = llm.chat([{"role": "user", "content": "hi"}], PARAMS, use_tqdm=False, chat_template=template, tools=tools)
    assert out[0].prompt == "get_weather;[user] hi\n"
    assert llm.chat([], PARAMS, use_tqdm=False) == []
    with pytest.raises(ValueError, match=r"conversation 1: messages\[0\] must be a dict with a string 'role'"):
        llm.chat([[{"role": "user", "content": "a"}], [{"content": "b"}]], PARAMS, use_tqdm=False)
    bars: list[tqdm] = []

    def factory(**kw):
        bars.append(tqdm(**kw, file=io.StringIO()))
        return bars[-1]

    outs = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], PARAMS, use_tqdm=factory)
    assert len(outs) == 2 and [(b.total, b.n) for b in bars] == [(2, 2)]


def test_vllm_032_call_shapes(llm):
    """vLLM 0.32's LLM.chat order (messages, sampling_params, use_tqdm, lora_request, priority, ...),
    an int priority for every prompt, and tokenization_kwargs={"truncate_prompt_tokens": k}, its
    way to truncate a prompt offline (the last k tokens, as vLLM keeps them)."""
    hi = [{"role": "user", "content": "hi"}]
    (positional,) = llm.chat(hi, PARAMS, False, None)  # (lora_request None: the generation prompt stays)
    assert positional.prompt.endswith("<|im_start|>assistant\n")
    (full,) = llm.chat(hi, PARAMS, use_tqdm=False, priority=0)
    (cut,) = llm.chat(hi, PARAMS, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 4})
    assert positional.prompt_token_ids == full.prompt_token_ids and cut.prompt_token_ids == full.prompt_token_ids[-4:]
    ids = llm.get_tokenizer().encode("The capital of France is")
    outs = llm.generate(["The capital of France is", {"prompt_token_ids": ids}], None, use_tqdm=False, priority=0,
                        tokenization_kwargs={"truncate_prompt_tokens": 2})  # fmt: skip
    assert [o.prompt_token_ids for o in outs] == [ids[-2:]] * 2
    assert len(outs[0].outputs[0].token_ids) == llm.get_default_sampling_params().max_tokens
    for kwargs, message in (({"add_special_tokens": False}, r"tokenization_kwargs: \['add_special_tokens'\] not supported"),
                            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be"),
                            ([("truncate_prompt_tokens", 2)], "tokenization_kwargs must be a dict")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            llm.generate("hi", PARAMS, use_tqdm=False, tokenization_kwargs=kwargs)
    with pytest.raises(ValueError, match="priority must be an int"):
        llm.generate("hi", PARAMS, use_tqdm=False, priority=True)
