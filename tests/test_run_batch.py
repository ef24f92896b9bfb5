"""``vllmini run-batch`` (vLLM's): an OpenAI batch file in, one answer per line out, in order; each
line answered as the same POST to ``vllmini serve`` is; bad lines refused before the model loads;
refused requests keep their line; URLs read with GET and written with PUT."""
from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import httpx
import pytest

from test_engine import assert_no_leaks
from vllmini import AsyncLLMEngine, EngineArgs
from vllmini.cli import main
from vllmini.entrypoints.openai import run_batch as batch_module
from vllmini.entrypoints.openai.api_server import build_app
from vllmini.entrypoints.openai.run_batch import check_batch_file, run_batch

CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_completion_tokens": 12, "temperature": 0}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 10, "temperature": 0, "ignore_eos": True}


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def write(path: Path, *lines: str) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), kv_cache_memory=16 << 20, max_num_seqs=4))
    yield eng
    eng.shutdown()


async def served(app, url: str, body: dict) -> dict:
    """The same request through the HTTP app, as a client of `vllmini serve` sends it."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        return (await c.post(url, json=body)).json()


def _content(answer: dict) -> list:
    """What a greedy answer must repeat: its choices' text and token counts (ids and times differ)."""
    return [answer["usage"], [c.get("message", {}).get("content", c.get("text")) for c in answer["choices"]]]


async def test_lines_are_answered_in_order_as_the_server_answers_them(engine, tmp_path):
    app = build_app(engine)
    lines = [line(f"req-{i}", url, body) for i, (url, body) in
             enumerate([("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)] * 4)]  # fmt: skip
    total, refused = await run_batch(app, write(tmp_path / "in.jsonl", *lines), tmp_path / "out.jsonl", in_flight=8)
    assert (total, refused) == (8, 0)
    out = read(tmp_path / "out.jsonl")
    assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(8)]
    want = {"/v1/chat/completions": await served(app, "/v1/chat/completions", CHAT),
            "/v1/completions": await served(app, "/v1/completions", COMPLETION)}  # fmt: skip
    for o, raw in zip(out, lines):
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["id"].startswith("vllm-") and o["response"]["request_id"].startswith("vllm-batch-")
        assert _content(o["response"]["body"]) == _content(want[json.loads(raw)["url"]])
    assert out[0]["response"]["body"]["object"] == "chat.completion"
    assert out[1]["response"]["body"]["object"] == "text_completion"
    assert len({o["id"] for o in out}) == 8
    assert_no_leaks(engine)


async def test_refused_requests_keep_their_line_and_others_are_answered(engine, tmp_path):
    lines = [line("bad-temperature", "/v1/chat/completions", {**CHAT, "temperature": -1}),
             line("ok", "/v1/completions", COMPLETION),
             line("stream", "/v1/chat/completions", {**CHAT, "stream": True}),
             line("other-model", "/v1/completions", {**COMPLETION, "model": "not-served"}),
             line("not-pooling", "/v1/embeddings", {"input": "hi"})]  # fmt: skip
    total, refused = await run_batch(build_app(engine), write(tmp_path / "in.jsonl", *lines), tmp_path / "o.jsonl", 4)
    assert (total, refused) == (5, 4)
    bad, ok, stream, other, pooling = read(tmp_path / "o.jsonl")
    assert ok["error"] is None and ok["response"]["body"]["usage"]["completion_tokens"] == 10
    assert (bad["response"]["status_code"], bad["response"]["body"]) == (400, None)
    assert "temperature" in bad["error"]["error"]["message"]
    assert stream["response"]["status_code"] == 400 and stream["error"] == "Request must not be sent in stream mode"
    assert other["response"]["status_code"] == 404 and "not-served" in other["error"]["error"]["message"]
    assert pooling["response"]["status_code"] == 404 and "Embeddings" in pooling["error"]["error"]["message"]
    assert_no_leaks(engine)


async def test_requests_in_flight_are_bounded(engine, tmp_path, monkeypatch):
    """A long file does not become thousands of concurrent requests: at most ``in_flight`` run."""
    running, most = 0, 0
    answer = batch_module._answer

    async def counted(app, text):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            return await answer(app, text)
        finally:
            running -= 1

    monkeypatch.setattr(batch_module, "_answer", counted)
    lines = [line(f"r{i}", "/v1/completions", {**COMPLETION, "max_tokens": 3}) for i in range(9)]
    await run_batch(build_app(engine), write(tmp_path / "in.jsonl", *lines), tmp_path / "out.jsonl", in_flight=3)
    assert most == 3
    assert [o["custom_id"] for o in read(tmp_path / "out.jsonl")] == [f"r{i}" for i in range(9)]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", r"line 2: not a batch request: JSON is malformed"),
        (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), r"line 2: .*custom_id"),
        (line("a", "/v1/completions", COMPLETION), r"line 2: custom_id 'a' was used on line 1 already"),
        (line("b", "/v1/completions", COMPLETION, method="GET"), r"line 2: method must be POST, got 'GET'"),
        (line("c", "/v1/audio/transcriptions", {}), r"line 2: url '/v1/audio/transcriptions' is not a batch endpoint"),
        (json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": [1]}), r"line 2: .*body"),
    ],
)
def test_a_bad_line_stops_the_run_before_the_model_loads(tmp_path, monkeypatch, capsys, bad, message):
    path = write(tmp_path / "in.jsonl", line("a", "/v1/completions", COMPLETION), bad)
    with pytest.raises(ValueError, match=message):
        check_batch_file(path)
    monkeypatch.setattr(AsyncLLMEngine, "from_engine_args", lambda *a: pytest.fail("the model was loaded"))
    assert main(["run-batch", "-i", str(path), "-o", str(tmp_path / "out.jsonl")]) == 2
    assert "line 2" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


class _Files(http.server.BaseHTTPRequestHandler):
    """GET serves ``files[path]``; PUT stores the body there."""

    files: dict[str, bytes] = {}

    def do_GET(self):
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"")

    def do_PUT(self):
        self.files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_command_reads_and_writes_urls(tiny_dir, tmp_path):
    """``vllmini run-batch -i URL -o URL`` with the engine's flags, end to end."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    _Files.files["/in.jsonl"] = "\n".join([line("x", "/v1/completions", COMPLETION),
                                           line("y", "/v1/chat/completions", CHAT)]).encode()  # fmt: skip
    try:
        rc = main(["run-batch", "-i", f"{base}/in.jsonl", "-o", f"{base}/results/out.jsonl", "--model", str(tiny_dir),
                   "--kv-cache-memory", str(16 << 20), "--response-role", "helper"])  # fmt: skip
    finally:
        server.shutdown()
    assert rc == 0
    x, y = [json.loads(v) for v in _Files.files["/results/out.jsonl"].decode().splitlines()]
    assert (x["custom_id"], y["custom_id"]) == ("x", "y")
    assert x["response"]["body"]["usage"]["completion_tokens"] == 10
    assert y["response"]["body"]["choices"][0]["message"]["role"] == "helper"


async def test_pooling_lines_on_a_pooling_engine(tiny_dir, tmp_path):
    """Embeddings and score lines on an engine started with runner="pooling", answered as the server does."""
    eng = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_dir), runner="pooling", kv_cache_memory=16 << 20))
    try:
        app = build_app(eng)
        embed, score = {"input": ["a red apple", "a blue sky"]}, {"text_1": "fruit", "text_2": ["apple", "sky"]}
        lines = [line("e", "/v1/embeddings", embed), line("s", "/score", score),
                 line("g", "/v1/completions", COMPLETION)]  # fmt: skip
        assert await run_batch(app, write(tmp_path / "in.jsonl", *lines), tmp_path / "out.jsonl", 2) == (3, 1)
        e, s, g = read(tmp_path / "out.jsonl")
        want_e, want_s = await served(app, "/v1/embeddings", embed), await served(app, "/score", score)
        assert [d["embedding"] for d in e["response"]["body"]["data"]] == [d["embedding"] for d in want_e["data"]]
        assert [d["score"] for d in s["response"]["body"]["data"]] == [d["score"] for d in want_s["data"]]
        assert g["response"]["status_code"] != 200 and g["error"] is not None
    finally:
        await eng.shutdown()
