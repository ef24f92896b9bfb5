"""``vllmini serve``'s uvicorn flags, with vLLM's names: --root-path, --uvicorn-log-level,
--disable-uvicorn-access-log, --ssl-keyfile / --ssl-certfile."""
from __future__ import annotations

import shutil
import subprocess

import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient

from helpers import vllmini_serve
from vllmini.cli import main

KV = str(16 << 20)


def test_the_flags_reach_uvicorn_and_the_app_answers_under_its_root_path(tiny_dir, monkeypatch):
    seen: dict = {}

    def fake_run(app, **settings):  # runs the app's lifespan (the engine's shutdown) as uvicorn would
        seen.update(settings)
        with TestClient(app, root_path=settings["root_path"]) as c:
            seen["status"] = c.get("/api/v1/models").status_code

    monkeypatch.setattr(uvicorn, "run", fake_run)
    argv = ["serve", str(tiny_dir), "--kv-cache-memory", KV, "--root-path", "/api", "--uvicorn-log-level", "warning",
            "--disable-uvicorn-access-log"]  # fmt: skip
    assert main(argv) == 0
    assert seen["root_path"] == "/api" and seen["log_level"] == "warning" and seen["access_log"] is False
    assert seen["ssl_keyfile"] is None and seen["ssl_certfile"] is None and seen["status"] == 200


@pytest.mark.parametrize("flags, message", [
    (["--ssl-keyfile", __file__], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/nonexistent/key.pem", "--ssl-certfile", __file__], "--ssl-keyfile '/nonexistent/key.pem' is not a file"),
    (["--root-path", "api/"], "--root-path must start with '/'"),
])  # fmt: skip
def test_bad_flags_are_refused_before_the_model_loads(flags, message, capsys):
    assert main(["serve", "/nonexistent/model", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_with_a_self_signed_certificate(tiny_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    with vllmini_serve(str(tiny_dir), "--kv-cache-memory", KV, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)) as url:
        assert url.startswith("https://")
        with httpx.Client(verify=str(cert)) as c:
            body = {"prompt": "hi", "max_tokens": 2}
            assert c.post(f"{url}/v1/completions", json=body, timeout=30).json()["usage"]["completion_tokens"] == 2
