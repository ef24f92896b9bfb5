"""The command line: the default job streams every prompt concurrently and summarizes;
chat streams its replies, keeps history, and obeys /reset, /exit and end of input."""
from __future__ import annotations

import io
import re
import sys

import pytest

from vllmini.cli import main


def test_generate_streams_each_prompt_and_summarizes(tiny_dir, capsys):
    rc = main(["generate", "--model", str(tiny_dir), "--max-tokens", "5", "--ignore-eos", "first prompt", "second"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "[0] " in out and "[1] " in out
    assert "2 requests, 10 tokens" in out and "TTFT p50" in out


def test_generate_cuts_its_default_length_and_reports_a_refused_prompt_alone(tiny_dir, capsys):
    """--max-model-len 48 with no --max-tokens: the CLI's default 64 is cut to what each prompt
    leaves (as vLLM stops at max_model_len) instead of refusing every prompt. A prompt longer
    than max_model_len is refused with an error naming it; the others stream to the end."""
    too_long = " ".join(["word"] * 80)
    rc = main(["generate", "--model", str(tiny_dir), "--max-model-len", "48", "--ignore-eos", "--raw",
               "short one", too_long, "another"])  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 1
    assert "error: prompt 1: prompt has" in captured.err and "max_model_len is 48" in captured.err
    assert "prompt 0" not in captured.err and "prompt 2" not in captured.err
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    room = sum(48 - len(tok(p).input_ids) for p in ("short one", "another"))
    assert f"2 requests, {room} tokens" in captured.out and "1 refused" in captured.out  # both ran to max_model_len


def test_generate_keeps_an_explicit_max_tokens_and_names_it_when_too_long(tiny_dir, capsys):
    """An explicit --max-tokens is not cut to the KV cache: a prompt it cannot fit is refused, naming it."""
    from transformers import AutoConfig

    from test_engine import kv_bytes

    kv = str(kv_bytes(AutoConfig.from_pretrained(tiny_dir), 4))  # 64 token slots
    rc = main(["generate", "--model", str(tiny_dir), "--kv-cache-memory", kv, "--max-tokens", "100", "--raw", "hi"])
    assert rc == 1
    assert "max_tokens (100)" in capsys.readouterr().err


class RecordingStdout(io.StringIO):
    """Keeps every write, so the test can see a reply arrive in pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("ending", ["/exit\n", ""])  # /exit, or end of input (Ctrl-D)
def test_chat_streams_replies_and_handles_commands(tiny_dir, monkeypatch, ending):
    script = "hello there\n/reset\nsecond question\n" + ending
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    out = RecordingStdout()
    monkeypatch.setattr(sys, "stdout", out)
    rc = main(["chat", "--model", str(tiny_dir), "--max-tokens", "6", "--ignore-eos"])
    text = out.getvalue()
    assert rc == 0
    assert "(history cleared)" in text
    replies = [line for line in text.splitlines() if line and not line.startswith(("chat with", "(history"))]
    assert len(replies) >= 2
    # each reply arrived as several writes (one per token), not one block at the end
    pieces = [w for w in out.writes if w not in ("\n", "> ") and "history" not in w and "chat with" not in w]
    assert len(pieces) >= 2 * 4


def test_bad_option_value_is_a_clear_error(capsys):
    assert main(["generate", "--dtype", "int3", "x"]) == 2
    assert "dtype='int3'" in capsys.readouterr().err


def test_engine_options_parse_to_their_field_types():
    """Every EngineArgs field is a flag whose value has the field's type (so it validates)."""
    from vllmini.cli import _engine_args, build_parser

    ns = build_parser().parse_args(["generate", "--max-logprobs", "5", "--kv-cache-memory", "1048576",
                                    "--gpu-memory-utilization", "0.5", "--max-model-len", "64", "x"])  # fmt: skip
    args = _engine_args(ns)
    assert (args.max_logprobs, args.kv_cache_memory, args.gpu_memory_utilization, args.max_model_len) == (5, 2**20, 0.5, 64)
    args.validate()


def test_sampling_flags_over_model_defaults_over_cli_defaults():
    """An unset flag takes the model's generation config (as vLLM's CLI does), else the CLI's own
    default (greedy, 64 tokens for generate); a flag given always wins."""
    from vllmini import SamplingParams
    from vllmini.cli import _sampling_params, build_parser

    model = SamplingParams(temperature=0.7, top_k=20, max_tokens=5)
    ns = build_parser().parse_args(["generate", "x"])
    p = _sampling_params(ns, model)
    assert (p.temperature, p.top_k, p.max_tokens, p.output_kind) == (0.7, 20, 5, "delta")
    ns = build_parser().parse_args(["generate", "--temperature", "0", "--max-tokens", "9", "x"])
    p = _sampling_params(ns, model)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, 20, 9)
    p = _sampling_params(build_parser().parse_args(["generate", "x"]), SamplingParams())
    assert (p.temperature, p.top_k, p.max_tokens, p.ignore_eos) == (0.0, 0, 64, False)
    flags = ["--stop", "a b", "--stop", "\n", "--min-tokens", "2", "--repetition-penalty", "1.2",
             "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "x"]  # fmt: skip
    p = _sampling_params(build_parser().parse_args(["generate", *flags]), model)
    assert (p.stop, p.min_tokens, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (
        ["a b", "\n"], 2, 1.2, 0.5, -0.5)


def test_chat_cuts_its_default_length_and_survives_a_history_too_long(tiny_dir, monkeypatch, capsys):
    """With a small max_model_len the CLI's default reply length (256) is cut to what is left;
    once the history outgrows max_model_len, that turn fails with an error and the session goes
    on (/reset, then a new question is answered)."""
    long_line = " ".join(["word"] * 60)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"hi\n{long_line}\n{long_line}\n/reset\nhello again\n/exit\n"))
    rc = main(["chat", "--model", str(tiny_dir), "--max-model-len", "128", "--ignore-eos"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "max_model_len" in captured.err and "/reset clears the history" in captured.err
    replies = [line for line in captured.out.splitlines() if line and not line.startswith(("chat with", "(history"))]
    assert len(replies) >= 2  # the first turn and the one after /reset


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--attention-backend", "magic"], "attention_backend='magic'"),
        (["--block-size", str(2**20)], "block_size must be at most"),
        (["--top-p", "2"], "top_p"),
        (["--repetition-penalty", "0"], "repetition_penalty"),
        (["--stop", ""], "stop"),
        (["--regex", "(unclosed"], "structured_outputs.regex"),
        (["--json-schema", "{not json"], "structured_outputs.json"),
        (["--regex", "a", "--choice", "b"], "exactly one of"),
    ],
)
def test_bad_flags_fail_before_the_model_loads(flags, message, capsys, monkeypatch):
    import vllmini.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["generate", *flags, "x"]) == 2
    assert message in capsys.readouterr().err


def test_log_level_is_checked_and_the_environment_kept(capsys):
    import logging

    with pytest.raises(SystemExit):
        main(["generate", "--log-level", "LOUD", "x"])
    assert "invalid choice" in capsys.readouterr().err
    logger = logging.getLogger("vllmini")
    before = logger.level
    try:
        logger.setLevel("WARNING")  # as VLLMINI_LOGGING_LEVEL=WARNING sets it at import
        main(["generate", "--max-tokens", "0", "x"])  # fails before loading; the level stays
        assert logger.level == logging.WARNING
        main(["generate", "--log-level", "error", "--max-tokens", "0", "x"])
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(before)


def test_chat_turn_fits_the_kv_cache_and_skips_a_line_that_is_not_text(tiny_dir, monkeypatch, capsys):
    """The reply length is cut to what the KV cache leaves too (here 128 token slots, less than
    max_model_len and the CLI's default 256); a line of bytes that are not UTF-8 (lone
    surrogates from stdin) is refused and the next line is answered."""
    from transformers import AutoConfig

    from test_engine import kv_bytes

    kv = kv_bytes(AutoConfig.from_pretrained(tiny_dir), 8)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\udcff there\nhello\n/exit\n"))
    rc = main(["chat", "--model", str(tiny_dir), "--kv-cache-memory", str(kv), "--ignore-eos"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "not valid UTF-8" in captured.err and "exceeds" not in captured.err
    replies = [line for line in captured.out.splitlines() if line.strip("> ") and not line.startswith("chat with")]
    assert len(replies) == 1  # "hello" answered, within the cache (the default 256 tokens would not fit)


def test_a_model_without_a_chat_template_stops_chat_and_generate_at_once(tiny_dir, tmp_path, monkeypatch, capsys):
    """A tokenizer without a chat template: chat and generate (without --raw) stop before the
    first prompt with an error naming the model and what to do (every turn or prompt failed
    alike, with transformers' message and a misleading '/reset' hint); --raw still generates."""
    import json
    import shutil

    plain = tmp_path / "base"
    shutil.copytree(tiny_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert main(["chat", "--model", str(plain), "--max-tokens", "2"]) == 2
    captured = capsys.readouterr()
    assert f"error: the tokenizer of '{plain}' has no chat template; chat needs one" in captured.err
    assert "chat with the model" not in captured.out
    assert main(["generate", "--model", str(plain), "--max-tokens", "2", "hi"]) == 2
    assert "has no chat template; pass --raw" in capsys.readouterr().err
    assert main(["generate", "--model", str(plain), "--max-tokens", "2", "--raw", "hi"]) == 0


def test_structured_output_flags_constrain_the_output(tiny_dir, tmp_path, capsys):
    """--regex / --choice / --json-schema (text or a file) / --grammar / --json-object become
    SamplingParams.structured_outputs; even the tiny random model's output follows them."""
    pytest.importorskip("xgrammar")
    from vllmini.cli import _given_sampling_flags, build_parser

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}')
    ns = build_parser().parse_args(["generate", "--json-schema", str(schema), "x"])
    assert _given_sampling_flags(ns)["structured_outputs"].json == schema.read_text()
    ns = build_parser().parse_args(["generate", "--choice", "yes", "--choice", "no", "x"])
    assert _given_sampling_flags(ns)["structured_outputs"].choice == ["yes", "no"]
    rc = main(["generate", "--model", str(tiny_dir), "--raw", "--max-tokens", "12", "--regex", "[0-9]{3}", "a", "b"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert len(lines) == 2 and all(re.fullmatch(r"\[\d\] [0-9]{3}", line) for line in lines), out
