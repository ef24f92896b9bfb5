"""``vllmini run-batch``: OpenAI's batch file format, offline (vLLM's ``vllm run-batch``).

The input is JSON Lines, one request per line::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ..., "messages": [...]}}

and the output one line per request, in the input's order::

    {"id": "vllm-...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "vllm-batch-...",
     "body": {...the endpoint's answer...}}, "error": null}

A refused request keeps its line: ``response.body`` null, its status code, and ``error`` the
server's error object. Each request goes through the same app ``vllmini serve`` runs
(``build_app``), called in-process over ASGI, so a batch line behaves exactly as the same POST
to the server. Endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/score`` and ``/rerank`` (``/v1/`` too). Up to ``2 * max_num_seqs`` requests are in flight,
so the engine batches them while memory stays bounded whatever the file's length.

The envelope of every line (JSON, ``custom_id`` unique, ``method`` POST, ``url``, ``body`` an
object) is checked before the model loads, and a bad line stops the run naming its number and
field: a batch job should not spend hours and then fail on line 90,000. Input and output may be
local paths or http(s) URLs (read with GET, written with PUT), as in vLLM.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
from tqdm import tqdm

logger = logging.getLogger("vllmini")

# the batch endpoints, each with the app's path that answers it
ENDPOINTS = {"/v1/chat/completions": "/v1/chat/completions", "/v1/completions": "/v1/completions",
             "/v1/embeddings": "/v1/embeddings", "/score": "/score", "/v1/score": "/score",
             "/rerank": "/rerank", "/v1/rerank": "/rerank", "/v2/rerank": "/rerank"}  # fmt: skip


class BatchRequestInput(msgspec.Struct, forbid_unknown_fields=True):
    """One line of the input file (OpenAI's ``BatchRequestInput``)."""

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def add_run_batch_args(p: argparse.ArgumentParser) -> None:
    from vllmini.entrypoints.openai.cli_args import add_chat_args

    p.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL): a path or an http(s) URL (GET)")
    p.add_argument("-o", "--output-file", required=True, help="where the results go: a path or an http(s) URL (PUT)")
    p.add_argument("--output-tmp-dir", default=None, help="where the results wait before they are PUT to a URL")
    add_chat_args(p)


def check_batch_file(path: Path) -> int:
    """The number of requests in ``path``, after checking every line's envelope; a ValueError
    names the first bad line and what is wrong with it."""
    seen: dict[str, int] = {}
    count = 0
    for number, line in _lines(path):
        try:
            request = msgspec.json.decode(line, type=BatchRequestInput)
        except msgspec.DecodeError as exc:  # (msgspec's message names the field: "... - at `$.body`")
            raise ValueError(f"{path}, line {number}: not a batch request: {exc}") from None
        if request.method != "POST":
            raise ValueError(f"{path}, line {number}: method must be POST, got {request.method!r}")
        if request.url not in ENDPOINTS:
            raise ValueError(f"{path}, line {number}: url {request.url!r} is not a batch endpoint; "
                             f"accepted: {', '.join(ENDPOINTS)}")  # fmt: skip
        if request.custom_id in seen:
            raise ValueError(f"{path}, line {number}: custom_id {request.custom_id!r} was used on line "
                             f"{seen[request.custom_id]} already; each request needs its own")  # fmt: skip
        seen[request.custom_id] = number
        count += 1
    if count == 0:
        raise ValueError(f"{path}: no requests (one JSON object per line)")
    return count


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line


async def _post(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` to ``path`` of the ASGI ``app``, in-process: (status, response body)."""
    answered = asyncio.Event()
    sent = False
    status, chunks = 500, []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()  # (the server watches for a hang-up until it has answered)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("run-batch", 0), "server": ("run-batch", 0)}  # fmt: skip
    await app(scope, receive, send)
    return status, b"".join(chunks)


async def _answer(app: Any, line: str) -> dict[str, Any]:
    """One output line for one input line."""
    request = msgspec.json.decode(line, type=BatchRequestInput)
    result: dict[str, Any] = {"id": f"vllm-{uuid.uuid4().hex}", "custom_id": request.custom_id}
    response: dict[str, Any] = {"status_code": 200, "request_id": f"vllm-batch-{uuid.uuid4().hex}", "body": None}
    if request.body.get("stream"):
        status, error = 400, "Request must not be sent in stream mode"
    else:
        status, raw = await _post(app, ENDPOINTS[request.url], msgspec.json.encode(request.body))
        try:
            answer = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            answer = raw.decode(errors="replace")
        error = None if status == 200 else (answer or f"HTTP {status}")
        if status == 200:
            response["body"] = answer
    response["status_code"] = status
    return {**result, "response": response, "error": error}


async def run_batch(app: Any, input_path: Path, output_path: Path, in_flight: int,
                    total: int | None = None) -> tuple[int, int]:  # fmt: skip
    """Answer every line of ``input_path`` through ``app`` into ``output_path``, in order, with at
    most ``in_flight`` requests running; returns (requests, refused). ``total``: what
    ``check_batch_file`` returned, when the caller checked the file already."""
    total = check_batch_file(input_path) if total is None else total
    done: dict[int, dict[str, Any]] = {}
    next_out, refused = 0, 0
    slots = asyncio.Semaphore(in_flight)
    encoder = msgspec.json.Encoder()

    async def one(index: int, line: str) -> None:
        try:
            done[index] = await _answer(app, line)
        finally:
            slots.release()

    with open(output_path, "wb") as out, tqdm(total=total, unit="req", desc="Running batch") as bar:
        tasks = set()

        def flush() -> None:  # write the answers that are next in order
            nonlocal next_out, refused
            while next_out in done:
                result = done.pop(next_out)
                refused += result["error"] is not None
                out.write(encoder.encode(result) + b"\n")
                next_out += 1
                bar.update()

        for index, (_, line) in enumerate(_lines(input_path)):
            await slots.acquire()
            task = asyncio.create_task(one(index, line))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            flush()
        while tasks:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            flush()
        flush()
    return total, refused


@contextlib.contextmanager
def _local_files(input_file: str, output_file: str, tmp_dir: str | None) -> Iterator[tuple[Path, Path]]:
    """Local paths for the input and output: a URL input is downloaded first (GET), a URL output
    written to a temporary file and uploaded (PUT) once complete."""
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="vllmini-batch-") as tmp:
        input_path, output_path = Path(input_file), Path(output_file)
        if _is_url(input_file):
            input_path = Path(tmp) / "input.jsonl"
            with urllib.request.urlopen(input_file) as resp, open(input_path, "wb") as f:
                shutil.copyfileobj(resp, f)
        elif not input_path.is_file():
            raise FileNotFoundError(f"--input-file {input_file!r} is not a file")
        if _is_url(output_file):
            output_path = Path(tmp) / "output.jsonl"
        elif not output_path.parent.is_dir():
            raise FileNotFoundError(f"--output-file {output_file!r}: no folder {str(output_path.parent)!r}")
        yield input_path, output_path
        if _is_url(output_file):
            data = output_path.read_bytes()
            put = urllib.request.Request(output_file, data=data, method="PUT",
                                         headers={"Content-Type": "application/jsonl"})  # fmt: skip
            with urllib.request.urlopen(put) as resp:
                if resp.status not in (200, 201, 204):
                    raise OSError(f"uploading the results to {output_file} answered HTTP {resp.status}")


async def main(ns: argparse.Namespace, engine_args: Any) -> int:
    """``vllmini run-batch``: load the engine, answer the file, shut down."""
    from vllmini import AsyncLLMEngine
    from vllmini.entrypoints.openai.api_server import build_app

    with _local_files(ns.input_file, ns.output_file, ns.output_tmp_dir) as (input_path, output_path):
        total = check_batch_file(input_path)  # (before the model loads)
        logger.info("batch: %d requests from %s", total, ns.input_file)
        engine = AsyncLLMEngine.from_engine_args(engine_args)
        try:
            app = build_app(engine, engine_args.get_served_model_name(), ns.chat_template,
                            reasoning_parser=ns.reasoning_parser, response_role=ns.response_role,
                            enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
                            trust_request_chat_template=ns.trust_request_chat_template)  # fmt: skip
            in_flight = 2 * engine.engine.args.max_num_seqs
            total, refused = await run_batch(app, input_path, output_path, in_flight, total)
        finally:
            await engine.shutdown()
    logger.info("batch: %d requests answered (%d refused) into %s", total, refused, ns.output_file)
    return 0


if __name__ == "__main__":  # python -m vllmini.entrypoints.openai.run_batch, as vLLM's module
    from vllmini.cli import main as cli_main

    raise SystemExit(cli_main(["run-batch", *sys.argv[1:]]))
