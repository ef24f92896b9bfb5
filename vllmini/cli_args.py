"""The command line's flags and what they become: EngineArgs (one flag per field) and
SamplingParams (the flags given, over the model's generation config, over the CLI's defaults).
Bad sampling or structured-output flags fail here, before any model loads."""
from __future__ import annotations

import argparse
import dataclasses


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from vllmini.config import EngineArgs

    defaults = EngineArgs()
    p.add_argument("--log-level", type=str.upper, default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="logging level (default: $VLLMINI_LOGGING_LEVEL, else INFO: load and KV cache sizes)")
    for f in sorted(dataclasses.fields(EngineArgs), key=lambda f: f.kw_only):  # (vllm_args.py's last)
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            annotated = {t.strip() for t in str(f.type).split("|")}  # e.g. "int | None"
            kind = int if "int" in annotated else float if "float" in annotated else str
            p.add_argument(flag, type=kind, default=default, help=f"EngineArgs.{f.name} (default: {default})")


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    # unset flags take the model's generation config (EngineArgs.generation_config), else these
    p.set_defaults(cli_sampling_defaults={"max_tokens": max_tokens, "temperature": 0.0})
    p.add_argument("--max-tokens", type=int, default=None, help=f"(default: the model's, else {max_tokens})")
    p.add_argument("--temperature", type=float, default=None, help="(default: the model's, else 0: greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--sampling-seed", type=int, default=None, help="SamplingParams.seed")
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeat the flag for several)")
    for penalty in ("repetition", "presence", "frequency"):
        p.add_argument(f"--{penalty}-penalty", type=float, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    so = p.add_argument_group("structured outputs (at most one; SamplingParams.structured_outputs, needs xgrammar)")
    so.add_argument("--json-schema", default=None, help="a JSON schema the output follows: its text or a file's path")
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", default=None, help="a regular expression the whole output matches")
    so.add_argument("--choice", action="append", default=None, help="the output is one of these (repeat the flag)")
    so.add_argument("--grammar", default=None, help="an EBNF (root ::= ...) or Lark (start: ...) grammar: its text or a file's path")


def _engine_args(ns: argparse.Namespace):
    from vllmini.config import EngineArgs

    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def _serve_engine_args(ns: argparse.Namespace):
    """``serve``'s EngineArgs: as vLLM's, ``--reasoning-parser`` also gives the reasoning_config
    (the parser's strings bound SamplingParams.thinking_token_budget) unless one is given."""
    args = _engine_args(ns)
    if ns.reasoning_parser and args.reasoning_config is None:
        args.reasoning_config = {"reasoning_parser": ns.reasoning_parser}
    return args


def _given_sampling_flags(ns: argparse.Namespace) -> dict:
    """The sampling flags given on the command line, checked (a bad value fails before the model loads)."""
    from vllmini import SamplingParams

    given = {"max_tokens": ns.max_tokens, "temperature": ns.temperature, "top_p": ns.top_p, "top_k": ns.top_k,
             "min_p": ns.min_p, "seed": ns.sampling_seed, "min_tokens": ns.min_tokens, "stop": ns.stop,
             "repetition_penalty": ns.repetition_penalty, "presence_penalty": ns.presence_penalty,
             "frequency_penalty": ns.frequency_penalty, "ignore_eos": ns.ignore_eos or None}  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    if (structured := _structured_outputs(ns)) is not None:
        given["structured_outputs"] = structured
    SamplingParams(**given)
    return given


def _structured_outputs(ns: argparse.Namespace):
    """The structured-output flags as StructuredOutputsParams (None: none given), checked with
    xgrammar now, so that a bad schema or regex fails before the model loads."""
    from vllmini import StructuredOutputsParams
    from vllmini.engine.structured_outputs import parse_grammar
    from vllmini.files import read_if_file

    def text(value: str | None) -> str | None:  # a file's path stands for its text
        if value is None or (text := read_if_file(value)) is None:
            return value
        return text

    flags = {"json": text(ns.json_schema), "json_object": ns.json_object or None, "regex": ns.regex,
             "choice": ns.choice, "grammar": text(ns.grammar)}  # fmt: skip
    flags = {k: v for k, v in flags.items() if v is not None}
    if not flags:
        return None
    params = StructuredOutputsParams(**flags)
    parse_grammar(params)
    return params


def _sampling_params(ns: argparse.Namespace, model_defaults):
    """The flags given, over what the model's generation config sets, over the CLI's defaults."""
    from vllmini import SamplingParams

    plain = SamplingParams()
    from_model = {f: getattr(model_defaults, f) for f in model_defaults.__struct_fields__
                  if getattr(model_defaults, f) != getattr(plain, f)}  # fmt: skip
    given = _given_sampling_flags(ns)
    return SamplingParams(**{**ns.cli_sampling_defaults, **from_model, **given, "output_kind": "delta"})
